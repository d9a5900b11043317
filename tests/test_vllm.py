"""DINT on vLLM (modeling_dint/integrations/vllm/): vLLM's greedy tokens and log-probabilities equal transformers'
`generate()` and one transformers forward, through decoding, chunked prefill, prefix caching, preemption and tensor
parallel 2; the negative control (the integral state dropped) differs; bf16 runs; integral "softmax" is refused at load;
the OpenAI server answers the official `openai` client.

These tests need vLLM in the python that runs them: `.ci/vllm_env.py` builds (once) and prints the virtualenv with
vLLM's CPU build, and `.ci/run`'s vLLM stage runs this file with it. Elsewhere (the default suite) they are skipped.
The model: random weights, head_dim 32 (vLLM's CPU attention takes head sizes 32, 64, 80, ...; DINT's cache heads are
2*head_dim wide), the repository's tokenizer, built here.
"""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest


if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this python: `python .ci/vllm_env.py` builds the cached virtualenv with vLLM's CPU "
        "build and prints its python; run `<that python> -m pytest tests/test_vllm.py` (.ci/run's vLLM stage does)",
        allow_module_level=True,
    )

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from modeling_dint import DintConfig, DintForCausalLM  # noqa: E402


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(REPO_ROOT, "examples", "data", "tokenizer")
PROMPTS_FILE = os.path.join(REPO_ROOT, "examples", "data", "shakespeare_heldout.txt")
WORKER = os.path.join(REPO_ROOT, "tests", "vllm_worker.py")
PROMPT_LENGTHS = (3, 5, 8, 12, 17, 23, 30, 38, 47, 57, 68, 80, 93, 107, 122, 138)
MAX_TOKENS = 16
LOGPROBS = 5  # vLLM returns the top-5 log-probabilities of each step (and the chosen token's)
LOGPROB_TOLERANCE = 5e-5  # fp32; measured differences are ~4e-6
CHUNK_TOKENS = 32  # max_num_batched_tokens of the chunked-prefill run: every prompt longer than it is split
BLOCK_SIZE = 32  # tokens per KV block (the CPU kernel's multiple) in the prefix-caching and preemption runs
SHARED_PREFIX_TOKENS = 4 * BLOCK_SIZE + 5  # several full blocks, then a partial one
PREEMPTION_BLOCKS = 24  # KV blocks of the preemption run (~700 tokens): the 16 requests need ~1100 at once
ENGINE = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "enable_prefix_caching": False}
LLAMA_RUN = "llama"  # vLLM's Llama of the test model's shape, the KV-capacity baseline
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def build_checkpoint(directory: str, **overrides) -> str:
    """A tiny DINT (3 layers, 8 softmax maps over 4 KV heads: GQA with 2 KV head pairs, head_dim 32) with random
    weights large enough for clear argmaxes, saved with the repository's tokenizer. No eos in the config: greedy
    generation runs the full length in transformers as with vLLM's `ignore_eos`."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    torch.manual_seed(0)
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=1024, initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
    )
    config = DintConfig(**{**fields, **overrides})
    DintForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def text_prompts(count: int, lengths) -> list[list[int]]:
    """`count` prompts of the given token lengths, cut from consecutive lines of the held-out text."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    with open(PROMPTS_FILE, encoding="utf-8") as file:
        token_ids = tokenizer(file.read()[20000:60000], add_special_tokens=False)["input_ids"]
    prompts, offset = [], 0
    for length in lengths[:count]:
        prompts.append(token_ids[offset : offset + length])
        offset += length + 7
    return prompts


def generate_reference(model: DintForCausalLM, prompts: list[list[int]]) -> list[dict]:
    """transformers' greedy `generate()` per prompt, and the log-probabilities of one forward over prompt + output."""
    references = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            output = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            log_probs = model(output).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        references.append({"token_ids": output[0, len(prompt) :].tolist(), "log_probs": log_probs})
    return references


def run_worker(model_dir: str, runs: list[dict], tmp_path, env_overrides: dict | None = None) -> dict:
    """Runs `tests/vllm_worker.py` over `runs` (one LLM each, in one process) and returns its results."""
    runs_path, out_path = tmp_path / "runs.json", tmp_path / "out.json"
    runs_path.write_text(json.dumps({"model": model_dir, "runs": runs}))
    env = {**os.environ, **VLLM_ENV, **(env_overrides or {})}
    completed = subprocess.run(
        [sys.executable, WORKER, str(runs_path), str(out_path)], env=env, capture_output=True, text=True, timeout=900
    )
    if completed.returncode != 0:
        raise AssertionError(f"vLLM worker failed ({completed.returncode}):\n{completed.stderr[-6000:]}")
    return json.loads(out_path.read_text())


def assert_tokens_equal(requests: list[dict], references: list[dict], what: str) -> None:
    mismatches = [
        (index, request["token_ids"], reference["token_ids"])
        for index, (request, reference) in enumerate(zip(requests, references, strict=True))
        if request["token_ids"] != reference["token_ids"]
    ]
    assert not mismatches, f"{what}: {len(mismatches)} of {len(references)} prompts differ from generate(): {mismatches[:3]}"


def max_logprob_difference(requests: list[dict], references: list[dict]) -> float:
    """The largest |vLLM - transformers| over every returned log-probability of every step of every request."""
    largest = 0.0
    for request, reference in zip(requests, references, strict=True):
        for step, entries in enumerate(request["logprobs"]):
            for token, logprob in entries.items():
                largest = max(largest, abs(logprob - reference["log_probs"][step, int(token)].item()))
    return largest


# ------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("dint_vllm")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return text_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def shared_prefix_prompts() -> list[list[list[int]]]:
    """Two batches of 4 prompts that share one prefix of several blocks: the second hits the prefix cache."""
    prefix = text_prompts(1, (SHARED_PREFIX_TOKENS,))[0]
    suffixes = text_prompts(9, (3, 6, 9, 12, 4, 7, 10, 13, 5))[1:]
    return [[prefix + suffix for suffix in suffixes[:4]], [prefix + suffix for suffix in suffixes[4:]]]


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> str:
    """transformers' Llama of the test model's shape (hidden 128, 3 layers, 8 heads over 4 KV heads of 32): the
    KV-capacity baseline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dint = DintConfig.from_pretrained(build_checkpoint(str(tmp_path_factory.mktemp("dint_shape"))))
    config = LlamaConfig(
        vocab_size=dint.vocab_size, hidden_size=dint.hidden_size, intermediate_size=dint.intermediate_size,
        num_hidden_layers=dint.num_hidden_layers, num_attention_heads=dint.num_attention_heads,
        num_key_value_heads=dint.num_key_value_heads, head_dim=dint.head_dim, max_position_embeddings=1024,
    )
    directory = str(tmp_path_factory.mktemp("llama_vllm"))
    LlamaForCausalLM(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference_model(checkpoint) -> DintForCausalLM:
    return DintForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(reference_model, prompts) -> list[dict]:
    return generate_reference(reference_model, prompts)


@pytest.fixture(scope="module")
def vllm_results(checkpoint, llama_checkpoint, prompts, shared_prefix_prompts, tmp_path_factory) -> dict:
    """Every single-process vLLM run of this file, in one worker process (vLLM's import and startup once)."""
    prefix_engine = {**ENGINE, "enable_prefix_caching": True, "block_size": BLOCK_SIZE}
    runs = [
        {"name": "default", "engine": ENGINE, "batches": [prompts]},
        # the eager integral (gather, running sum, scatter), what vLLM runs off CPU; the other runs take the CPU kernel
        {"name": "chunked", "engine": {**ENGINE, "max_num_batched_tokens": CHUNK_TOKENS}, "batches": [prompts],
         "eager_integral": True},
        {"name": "prefix", "engine": prefix_engine, "batches": shared_prefix_prompts},
        # the eager ops gather every carry before any store: they are right only if the waves are
        {"name": "prefix_eager", "engine": prefix_engine, "batches": shared_prefix_prompts, "eager_integral": True},
        {
            "name": "preemption",
            "engine": {**ENGINE, "block_size": BLOCK_SIZE, "num_gpu_blocks_override": PREEMPTION_BLOCKS},
            "batches": [prompts],
            "eager_integral": True,
        },
        {"name": "dropped_state", "engine": ENGINE, "batches": [prompts], "drop_integral_state": True},
        {"name": "bf16", "engine": {**ENGINE, "dtype": "bfloat16"}, "batches": [prompts]},
        {"name": LLAMA_RUN, "model": llama_checkpoint, "engine": ENGINE, "batches": []},  # KV capacity only
    ]
    for run in runs:
        run.update(max_tokens=MAX_TOKENS, logprobs=LOGPROBS)
    return run_worker(checkpoint, runs, tmp_path_factory.mktemp("vllm_runs"))


# ---------------------------------------------------------------------------------------------------------- tests
def test_greedy_tokens_equal_generate(vllm_results, reference, prompts):
    assert len(prompts) >= 16 and len(set(map(len, prompts))) == len(prompts)
    assert_tokens_equal(vllm_results["default"]["requests"][0], reference, "decoding")


def test_logprobs_equal_one_transformers_forward(vllm_results, reference):
    difference = max_logprob_difference(vllm_results["default"]["requests"][0], reference)
    assert difference < LOGPROB_TOLERANCE, f"largest log-probability difference {difference:.2e}"


def test_chunked_prefill_equal(vllm_results, reference, prompts):
    assert sum(len(prompt) > CHUNK_TOKENS for prompt in prompts) >= 8  # these prompts are prefilled in chunks
    requests = vllm_results["chunked"]["requests"][0]
    assert_tokens_equal(requests, reference, f"chunked prefill (max_num_batched_tokens={CHUNK_TOKENS})")
    assert max_logprob_difference(requests, reference) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("run", ["prefix", "prefix_eager"])
def test_prefix_caching_hits_and_equal(vllm_results, reference_model, shared_prefix_prompts, run):
    batches = vllm_results[run]["requests"]
    cached = [request["num_cached_tokens"] for request in batches[1]]
    # The second batch finds the shared prefix's full blocks in the cache (the state at the last one's end with them)
    assert min(cached) >= BLOCK_SIZE, f"prefix-cache hits per request of the second batch: {cached}"
    for requests, prompts in zip(batches, shared_prefix_prompts, strict=True):
        references = generate_reference(reference_model, prompts)
        assert_tokens_equal(requests, references, f"prefix caching ({run})")
        assert max_logprob_difference(requests, references) < LOGPROB_TOLERANCE


def test_same_step_prefix_hits_run_in_waves(vllm_results):
    """The first batch's four prompts share a prefix and arrive together: vLLM caches a block as soon as a step will
    fill it, so a request scheduled after the one computing the prefix hits its blocks in the same step, and DINT runs
    that step's integral in waves (writers first); the equality above covers those requests, on the kernel (which
    reads in row order) and on the eager ops (which gather every carry before any store: wrong without the waves)."""
    for run in ("prefix", "prefix_eager"):
        first_batch = vllm_results[run]["requests"][0]
        assert max(request["num_cached_tokens"] for request in first_batch) >= BLOCK_SIZE, run
        assert vllm_results[run]["wave_steps"] > 0, run


def test_kv_capacity_is_llamas_less_the_state_in_each_page(vllm_results, checkpoint):
    """The integral state lives in the tail of each KV page (no state pool of its own): DINT's capacity in tokens is
    that of vLLM's Llama of the same shape times page / (page + state), one block's K/V against one (H/2, 2d) fp32
    sum per layer."""
    config = DintConfig.from_pretrained(checkpoint)
    dint_tokens, llama_tokens = vllm_results["default"]["kv_cache_tokens"], vllm_results[LLAMA_RUN]["kv_cache_tokens"]
    block_size = vllm_results["default"]["block_size"]
    page_bytes = block_size * 2 * config.num_key_value_heads * config.head_dim * 4  # fp32 K and V of a block
    state_bytes = config.num_differential_heads * config.differential_head_dim * 4
    expected = page_bytes / (page_bytes + state_bytes)
    assert abs(dint_tokens / llama_tokens - expected) < 2e-3, (dint_tokens, llama_tokens, block_size, expected)
    assert dint_tokens / llama_tokens > 0.99


def test_waves_read_what_the_earlier_wave_stored():
    """A step where request B (first in the packed row) continues from the block request A completes in the same
    step: with waves, B's output is that of B's whole sequence (A's first block, then B's rows), on the kernel and on
    the eager ops; without them (one pass in row order) B reads the block's stale tail and differs."""
    from types import SimpleNamespace

    from torch import nn

    from modeling_dint import integral_cpu_kernel
    from modeling_dint.integral_dint import DintIntegral
    from modeling_dint.integrations.vllm.modeling_dint_vllm import VllmStepRows, step_integral

    torch.manual_seed(0)
    block_size, heads, channels = 4, 2, 8
    # B: positions 4..6 (block 12), after A's first block (block 10); A: positions 0..7 (blocks 10, 11)
    positions = torch.tensor([4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 7])
    cu_seq_lens_q = torch.tensor([0, 3, 11])
    row_blocks = torch.tensor([12, 12, 12, 10, 10, 10, 10, 11, 11, 11, 11])
    previous_blocks = torch.tensor([10, 0])
    signal, noise = torch.randn(11, heads, channels), torch.randn(11, heads, channels)
    lambda_ = torch.tensor(0.7)
    a_sums = signal[3:].cumsum(0)
    b_sums = a_sums[3] + signal[:3].cumsum(0)
    sums = torch.cat([b_sums, a_sums])
    expected = signal - lambda_ * (noise - sums / (positions + 1).float()[:, None, None])

    def run(split_waves: bool) -> torch.Tensor:
        table = torch.full((16, heads, channels), 1000.0)  # stale tails
        layer = SimpleNamespace(integral=DintIntegral("mean", layer_idx=0), head_norm=nn.Identity(),
                                attention=SimpleNamespace(integral_state_table=table))
        step_rows = VllmStepRows(positions, cu_seq_lens_q, row_blocks, previous_blocks, block_size, split_waves)
        output = torch.empty_like(signal)
        with torch.no_grad():
            step_integral(layer, signal, noise, lambda_, step_rows, output)
        if split_waves:  # each block's tail: the sum after its last token (A's two blocks, B's partial one)
            torch.testing.assert_close(table[[10, 11, 12]], torch.stack([a_sums[3], a_sums[7], b_sums[2]]))
        return output

    # One row per request (the decoding shortcut's shape): B's one-token prefill at position 4 hits block 10, which A's
    # last prefill row (position 3) completes in the same step; the shortcut must see it and take the waves
    one_row = dict(positions=torch.tensor([4, 3]), cu_seq_lens_q=torch.tensor([0, 1, 2]), row_blocks=torch.tensor([12, 10]),
                   previous_blocks=torch.tensor([10, 10]))
    one_row_carry = torch.randn(heads, channels)
    one_row_expected = torch.stack([
        signal[0] - lambda_ * (noise[0] - (one_row_carry + signal[1] + signal[0]) / 5),
        signal[1] - lambda_ * (noise[1] - (one_row_carry + signal[1]) / 4),
    ])

    def run_one_row() -> torch.Tensor:
        table = torch.full((16, heads, channels), 1000.0)
        table[10] = one_row_carry  # A's sum through position 2, stored by its previous chunk in block 10's tail
        layer = SimpleNamespace(integral=DintIntegral("mean", layer_idx=0), head_norm=nn.Identity(),
                                attention=SimpleNamespace(integral_state_table=table))
        step_rows = VllmStepRows(**one_row, block_size=block_size, one_row_each=True)
        assert step_rows.waves is not None
        output = torch.empty(2, heads, channels)
        with torch.no_grad():
            step_integral(layer, signal[:2], noise[:2], lambda_, step_rows, output)
        return output

    op = integral_cpu_kernel.integral_kernel()
    for kernel in ([None, op] if op is not None else [None]):
        integral_cpu_kernel._state["op"] = kernel
        try:
            torch.testing.assert_close(run(split_waves=True), expected, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(run(split_waves=False)[:3], expected[:3], atol=1e-2)
            torch.testing.assert_close(run_one_row(), one_row_expected, rtol=1e-5, atol=1e-5)
        finally:
            integral_cpu_kernel._state["op"] = op


HAS_TOOLCHAIN = shutil.which("c++") is not None and shutil.which("ninja") is not None


def torch_step_rows(positions, query_start_loc, slot_mapping, block_table, block_size, one_row_each=False):
    """`VllmStepRows` from vLLM's metadata, as `vllm_step_rows` builds them off CPU."""
    from modeling_dint.integrations.vllm.modeling_dint_vllm import VllmStepRows

    cu_seq_lens_q = query_start_loc.long()
    first_positions = positions[cu_seq_lens_q[:-1].clamp(max=positions.shape[0] - 1)]
    previous_blocks = block_table[torch.arange(len(cu_seq_lens_q) - 1), (first_positions - 1).clamp(min=0) // block_size]
    row_blocks = slot_mapping[: positions.shape[0]] // block_size
    return VllmStepRows(positions, cu_seq_lens_q, row_blocks, previous_blocks, block_size, one_row_each=one_row_each)


def assert_prepared_rows_equal(prepared, expected, num_rows):
    inverse_count, row_flags, carry_slot, store_slot = prepared.kernel_rows
    assert torch.equal(inverse_count[None], expected.layout.inverse_query_count[:, :, 0, 0])
    assert torch.equal(row_flags[None], expected.layout.row_flags())
    assert all(torch.equal(a, b) for a, b in zip(prepared.kernel_slots(), expected.kernel_slots()))
    for field in ("restart_row", "in_carried_document", "running_query_count", "inverse_query_count"):
        assert torch.equal(getattr(prepared.layout, field), getattr(expected.layout, field)), field
    assert torch.equal(prepared.store_rows, expected.store_rows)
    assert torch.equal(prepared.store_blocks, expected.store_blocks)
    continuing = expected.layout.in_carried_document[0]
    assert torch.equal(prepared.carry_blocks[continuing], expected.carry_blocks[continuing])


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler or ninja: the CPU kernel cannot build")
def test_prepared_step_rows_equal_the_torch_rows():
    """The rows a step prepares in one call of the CPU op (`PreparedStepRows`, what the vLLM op runs on CPU) equal
    those the torch ops build (`VllmStepRows`, every device): per row the kernel's inverse count, flags, carry and store
    slots, and the eager path's layout, stores and carried blocks, over random steps of prefills, chunks and decodes
    (block table in vLLM's int32), and rows past the last request; a step with a same-step writer (random steps over a
    small pool of shared blocks) is left to the torch rows and their waves, exactly where those have waves."""
    from modeling_dint.integrations.vllm.modeling_dint_vllm import PreparedStepRows, VllmStepRows

    generator = torch.Generator().manual_seed(0)
    block_size, blocks_per_request = 4, 6
    waves_seen = 0
    for trial in range(400):
        shared_blocks = trial >= 200  # blocks drawn from a pool smaller than the requests need: same-step writers
        num_requests = int(torch.randint(1, 6, (), generator=generator))
        lengths = torch.ones(num_requests, dtype=torch.long) if trial % 3 == 0 else torch.randint(1, 9, (num_requests,), generator=generator)
        first_positions = torch.randint(0, 12, (num_requests,), generator=generator)
        positions = torch.cat([torch.arange(f, f + n) for f, n in zip(first_positions.tolist(), lengths.tolist())])
        query_start_loc = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).int()
        if shared_blocks:
            block_table = torch.randint(0, 2 * num_requests, (num_requests, blocks_per_request), generator=generator).int()
        else:
            block_table = (torch.randperm(num_requests * blocks_per_request + 8, generator=generator)
                           [: num_requests * blocks_per_request].reshape(num_requests, blocks_per_request).int())
        row_request = torch.repeat_interleave(torch.arange(num_requests), lengths)
        slot_mapping = block_table[row_request, positions // block_size].long() * block_size + positions % block_size
        prepared = PreparedStepRows.prepare(positions, query_start_loc, slot_mapping, block_table, block_size)
        try:
            expected = torch_step_rows(positions, query_start_loc, slot_mapping, block_table, block_size,
                                       one_row_each=trial % 3 == 0 and not shared_blocks)
        except RuntimeError:  # two requests store one block (or read each other's in a cycle): no vLLM step does
            assert prepared is None
            continue
        assert (prepared is None) == (expected.waves is not None)
        waves_seen += prepared is None
        if prepared is not None:
            assert_prepared_rows_equal(prepared, expected, positions.shape[0])
    assert waves_seen > 10

    # Rows past the last request join it (its last row by the offsets still stores), as `packed_request_rows` has it
    positions, query_start_loc = torch.tensor([0, 1, 5, 6]), torch.tensor([0, 2, 3], dtype=torch.int32)
    block_table = torch.tensor([[10, 11], [20, 21]], dtype=torch.int32)
    slot_mapping = torch.tensor([40, 41, 85, 86])
    prepared = PreparedStepRows.prepare(positions, query_start_loc, slot_mapping, block_table, block_size)
    assert_prepared_rows_equal(prepared, torch_step_rows(positions, query_start_loc, slot_mapping, block_table, block_size), 4)

    # The waves step of `test_waves_read_what_the_earlier_wave_stored`: B continues from block 10, which A completes
    positions = torch.tensor([4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 7])
    block_table = torch.tensor([[10, 12], [10, 11]], dtype=torch.int32)
    slot_mapping = torch.tensor([12, 12, 12, 10, 10, 10, 10, 11, 11, 11, 11]) * block_size + positions % block_size
    query_start_loc = torch.tensor([0, 3, 11], dtype=torch.int32)
    assert PreparedStepRows.prepare(positions, query_start_loc, slot_mapping, block_table, block_size) is None
    assert VllmStepRows(positions, query_start_loc.long(), slot_mapping // block_size, torch.tensor([10, 10]),
                        block_size).waves is not None
    # Without the writer (A's first block is 13, not the block B continues from) the same step needs no waves
    slot_mapping[3:7] = 13 * block_size + positions[3:7]
    block_table[1, 0] = 13
    assert PreparedStepRows.prepare(positions, query_start_loc, slot_mapping, block_table, block_size) is not None


EAGER_RUNS = ("chunked", "prefix_eager", "preemption")
"""The runs on the eager integral (gather, running sum, scatter: what vLLM runs off CPU); the others take the kernel."""


def assert_the_kernel_served_every_run_but_the_eager_ones(results: dict) -> None:
    """On CPU the integral op runs the fused kernel, each request's state read and stored in its slot in place (a call
    with the state table), over the rows the step prepared (`PreparedStepRows`: a call with vLLM's output buffer), so
    the equalities of this file hold for it; `EAGER_RUNS` keep the eager ops covered. The dropped-state control runs it
    without a table."""
    for name, result in results.items():
        if name == LLAMA_RUN:
            continue
        assert result["kernel_built"], "the fused CPU integral kernel was not built in vLLM's process"
        if name in EAGER_RUNS:
            assert result["kernel_calls"] == 0, name
        elif name == "dropped_state":
            assert result["kernel_calls"] > 0 and result["kernel_table_calls"] == 0, name
        else:  # on CPU the step's rows are prepared in C++ and each layer writes vLLM's output buffer in place
            assert result["kernel_table_calls"] > 0 and result["kernel_prepared_calls"] > 0, name


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler or ninja: the CPU kernel cannot build")
def test_the_cpu_kernel_computes_the_integral_of_every_run_but_the_eager_ones(vllm_results):
    assert_the_kernel_served_every_run_but_the_eager_ones(vllm_results)


def test_preemption_equal(vllm_results, reference):
    run = vllm_results["preemption"]
    assert run["preemptions"] > 0, f"no request was preempted with {PREEMPTION_BLOCKS} KV blocks"
    assert_tokens_equal(run["requests"][0], reference, f"preemption ({run['preemptions']} preemptions)")


def test_dropping_the_integral_state_changes_the_output(vllm_results, reference):
    """Negative control: the same engine without the carried state (each step's running sum restarts) differs, so the
    tests above do see the state."""
    requests = vllm_results["dropped_state"]["requests"][0]
    differing = sum(request["token_ids"] != ref["token_ids"] for request, ref in zip(requests, reference, strict=True))
    assert differing >= len(reference) // 2, f"only {differing} of {len(reference)} prompts changed"
    assert max_logprob_difference(requests, reference) > 0.1


def test_bf16_runs(vllm_results, checkpoint, prompts):
    """bf16 runs end to end; its first tokens match transformers' bf16 model where the fp32 argmax is not a near tie."""
    requests = vllm_results["bf16"]["requests"][0]
    assert all(len(request["token_ids"]) == MAX_TOKENS for request in requests)
    model = DintForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    references = generate_reference(model, prompts)
    first_tokens_equal = sum(request["token_ids"][0] == ref["token_ids"][0] for request, ref in zip(requests, references))
    assert first_tokens_equal >= len(prompts) - 2, f"first tokens equal for {first_tokens_equal} of {len(prompts)}"
    difference = max(abs(lp - ref["log_probs"][0, int(t)].item()) for request, ref in zip(requests, references)
                     for t, lp in request["logprobs"][0].items())
    assert difference < 0.1, f"first-step log-probabilities differ by up to {difference:.3f} in bf16"


def test_integral_none_equals_generate(prompts, tmp_path_factory):
    """integral="none" (DIFF attention) serves too, without a state to carry."""
    directory = build_checkpoint(str(tmp_path_factory.mktemp("dint_none")), integral="none")
    model = DintForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = prompts[::4]
    runs = [{"name": "none", "engine": ENGINE, "batches": [prompts], "max_tokens": MAX_TOKENS, "logprobs": LOGPROBS}]
    requests = run_worker(directory, runs, tmp_path_factory.mktemp("vllm_none"))["none"]["requests"][0]
    references = generate_reference(model, prompts)
    assert_tokens_equal(requests, references, 'integral="none"')
    assert max_logprob_difference(requests, references) < LOGPROB_TOLERANCE


def test_integral_softmax_refused_at_load(tmp_path_factory):
    directory = build_checkpoint(str(tmp_path_factory.mktemp("dint_softmax")), integral="softmax")
    runs = [{"name": "softmax", "engine": ENGINE, "batches": [], "max_tokens": 1}]
    with pytest.raises(AssertionError) as failure:
        run_worker(directory, runs, tmp_path_factory.mktemp("vllm_softmax"))
    message = str(failure.value)
    assert "integral='softmax'" in message and "column sums" in message, message[-2000:]


def test_tensor_parallel_2_equals_tensor_parallel_1(checkpoint, prompts, reference, vllm_results, tmp_path_factory):
    """Two ranks (vLLM's multiprocess executor, one core each), each with one of the two KV head pairs and its four
    signal and four noise maps: the tokens and log-probabilities of one rank."""
    runs = [{"name": "tp2", "engine": {**ENGINE, "tensor_parallel_size": 2}, "batches": [prompts],
             "max_tokens": MAX_TOKENS, "logprobs": LOGPROBS}]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    requests = run_worker(checkpoint, runs, tmp_path_factory.mktemp("vllm_tp2"), env)["tp2"]["requests"][0]
    assert_tokens_equal(requests, reference, "tensor parallel 2")
    single_rank = vllm_results["default"]["requests"][0]
    assert [request["token_ids"] for request in requests] == [request["token_ids"] for request in single_rank]
    assert max_logprob_difference(requests, reference) < LOGPROB_TOLERANCE


# ------------------------------------------------------------------------------ v2: DIFF V2's layout on vLLM
V2_LAYOUT = {"differential_attention": "v2", "num_key_value_heads": 2}
"""8 query heads (4 differential heads) over 2 KV heads of 32: an ordinary attention layer, Llama's KV cache."""


@pytest.fixture(scope="module")
def v2_checkpoint(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("dint_v2_vllm")), **V2_LAYOUT)


@pytest.fixture(scope="module")
def v2_reference(v2_checkpoint, prompts) -> list[dict]:
    return generate_reference(DintForCausalLM.from_pretrained(v2_checkpoint, dtype=torch.float32).eval(), prompts)


@pytest.fixture(scope="module")
def v2_results(v2_checkpoint, prompts, shared_prefix_prompts, tmp_path_factory) -> dict:
    runs = [
        {"name": "default", "engine": ENGINE, "batches": [prompts]},
        # the eager integral (gather, running sum, scatter), what vLLM runs off CPU; the other runs take the CPU kernel
        {"name": "chunked", "engine": {**ENGINE, "max_num_batched_tokens": CHUNK_TOKENS}, "batches": [prompts],
         "eager_integral": True},
        {"name": "prefix", "engine": {**ENGINE, "enable_prefix_caching": True, "block_size": BLOCK_SIZE},
         "batches": shared_prefix_prompts},
        {"name": "preemption",
         "engine": {**ENGINE, "block_size": BLOCK_SIZE, "num_gpu_blocks_override": PREEMPTION_BLOCKS},
         "batches": [prompts], "eager_integral": True},
        {"name": "dropped_state", "engine": ENGINE, "batches": [prompts], "drop_integral_state": True},
    ]
    for run in runs:
        run.update(max_tokens=MAX_TOKENS, logprobs=LOGPROBS)
    return run_worker(v2_checkpoint, runs, tmp_path_factory.mktemp("vllm_v2_runs"))


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler or ninja: the CPU kernel cannot build")
def test_v2_the_cpu_kernel_computes_the_integral_of_every_run_but_the_eager_ones(v2_results):
    assert_the_kernel_served_every_run_but_the_eager_ones(v2_results)


def test_v2_decoding_chunked_prefill_and_preemption_equal_generate(v2_results, v2_reference):
    for name in ("default", "chunked", "preemption"):
        requests = v2_results[name]["requests"][0]
        assert_tokens_equal(requests, v2_reference, f"v2 {name}")
        assert max_logprob_difference(requests, v2_reference) < LOGPROB_TOLERANCE, name
    assert v2_results["preemption"]["preemptions"] > 0, f"no request was preempted with {PREEMPTION_BLOCKS} KV blocks"


def test_v2_prefix_caching_equal(v2_results, v2_checkpoint, shared_prefix_prompts):
    model = DintForCausalLM.from_pretrained(v2_checkpoint, dtype=torch.float32).eval()
    batches = v2_results["prefix"]["requests"]
    assert min(request["num_cached_tokens"] for request in batches[1]) >= BLOCK_SIZE
    for requests, prompts in zip(batches, shared_prefix_prompts, strict=True):
        references = generate_reference(model, prompts)
        assert_tokens_equal(requests, references, "v2 prefix caching")
        assert max_logprob_difference(requests, references) < LOGPROB_TOLERANCE


def test_v2_dropping_the_integral_state_changes_the_output(v2_results, v2_reference):
    requests = v2_results["dropped_state"]["requests"][0]
    assert max_logprob_difference(requests, v2_reference) > 0.1


def test_v2_tensor_parallel_2_equals_generate(v2_checkpoint, prompts, v2_reference, tmp_path_factory):
    """Two ranks, each with one KV head and its 4 query heads (2 differential heads) and their lambda rows."""
    runs = [{"name": "tp2", "engine": {**ENGINE, "tensor_parallel_size": 2}, "batches": [prompts[::2]],
             "max_tokens": MAX_TOKENS, "logprobs": LOGPROBS}]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    requests = run_worker(v2_checkpoint, runs, tmp_path_factory.mktemp("vllm_v2_tp2"), env)["tp2"]["requests"][0]
    assert_tokens_equal(requests, v2_reference[::2], "v2 tensor parallel 2")
    assert max_logprob_difference(requests, v2_reference[::2]) < LOGPROB_TOLERANCE


@pytest.fixture(scope="module")
def v2_gated_checkpoint(tmp_path_factory) -> str:
    """The v2 checkpoint with `lambda_gate` (the Llama-family converter's layout) and gates of every sign, 0 included,
    so that a path that drops or misloads the gate gives other log-probabilities."""
    directory = build_checkpoint(str(tmp_path_factory.mktemp("dint_v2_gated_vllm")), **V2_LAYOUT, lambda_gate=True)
    model = DintForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        for layer_idx, layer in enumerate(model.model.layers):
            layer.self_attn.lambda_gate.weight.copy_(torch.tensor([0.0, -0.8, 1.5, 0.3]) * (layer_idx + 1))
    model.save_pretrained(directory)
    return directory


def test_v2_lambda_gate_is_read_on_one_rank_and_sharded_on_two(v2_gated_checkpoint, prompts, tmp_path_factory):
    """vLLM multiplies lambda by the checkpoint's gate per head (`lambda_gate`), on one rank and with each of two
    ranks holding its own heads' gates (as their lambda_proj rows): the log-probabilities of transformers' model."""
    reference = generate_reference(DintForCausalLM.from_pretrained(v2_gated_checkpoint, dtype=torch.float32).eval(),
                                   prompts[::2])
    single = [{"name": "default", "engine": ENGINE, "batches": [prompts[::2]], "max_tokens": MAX_TOKENS,
               "logprobs": LOGPROBS}]
    requests = run_worker(v2_gated_checkpoint, single, tmp_path_factory.mktemp("vllm_v2_gated"))["default"]
    assert_tokens_equal(requests["requests"][0], reference, "v2 lambda gate")
    assert max_logprob_difference(requests["requests"][0], reference) < LOGPROB_TOLERANCE
    runs = [{**single[0], "name": "tp2", "engine": {**ENGINE, "tensor_parallel_size": 2}}]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    requests = run_worker(v2_gated_checkpoint, runs, tmp_path_factory.mktemp("vllm_v2_gated_tp2"), env)["tp2"]
    assert_tokens_equal(requests["requests"][0], reference, "v2 lambda gate, tensor parallel 2")
    assert max_logprob_difference(requests["requests"][0], reference) < LOGPROB_TOLERANCE


# ------------------------------------------------------------------------------------------ the OpenAI server
SERVED_MODEL_NAME = "dint-tiny"
SERVER_STARTUP_SECONDS = 600
CHAT_MESSAGES = [{"role": "user", "content": "When shall we three meet again, in thunder, lightning, or in rain?"}]
COMPLETION_PROMPT = "Fair is foul, and foul is fair: hover through the fog and filthy air."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def openai_server(checkpoint, tmp_path_factory):
    """vLLM's OpenAI-compatible server on 127.0.0.1, started as docs/vllm.md says (`python -m
    vllm.entrypoints.openai.api_server`: the `vllm` console script looks for a distribution named `vllm`, and the CPU
    build's is `vllm-cpu`). Yields the base URL."""
    import urllib.request

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm_server") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
        "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the vLLM server exited ({process.returncode}):\n{log_path.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the vLLM server did not start in {SERVER_STARTUP_SECONDS} s")
            time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def openai_client(openai_server):
    from openai import OpenAI

    return OpenAI(base_url=openai_server, api_key="unused", timeout=300)


def reference_text(model, tokenizer, prompt_ids: list[int]) -> str:
    return tokenizer.decode(generate_reference(model, [prompt_ids])[0]["token_ids"], skip_special_tokens=True)


def test_openai_completion(openai_client, reference_model, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    response = openai_client.completions.create(
        model=SERVED_MODEL_NAME, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = tokenizer(COMPLETION_PROMPT)["input_ids"]
    assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == MAX_TOKENS
    assert response.choices[0].text == reference_text(reference_model, tokenizer, prompt_ids)


def test_openai_chat_and_streaming(openai_client, reference_model, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    request = {"model": SERVED_MODEL_NAME, "messages": CHAT_MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    response = openai_client.chat.completions.create(**request)
    prompt_ids = tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, return_dict=False)
    expected = reference_text(reference_model, tokenizer, list(prompt_ids))
    assert response.choices[0].message.content == expected

    chunks = openai_client.chat.completions.create(**request, stream=True)
    deltas = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == expected
