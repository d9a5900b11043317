"""The fused CPU integral kernel (`modeling_dint/integral_cpu_kernel.py`) against the eager ops it replaces: the same
outputs and the same carried state, for every layout of rows (padding, documents, a carried cache), both head layouts,
each head norm, fp32 and bf16; taken only where it may be (no gradient wanted, eager, no per-row state wanted); and
the eager ops when it cannot be built."""

import copy
import os
import shutil

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import modeling_dint.integral_cpu_kernel as kernel_module
from dint_testing import LAYOUTS, cache_of, tiny_model, with_cache
from modeling_dint.cache_dint import SIGNAL_SUM
from modeling_dint.integral_dint import (
    CacheIntegralState,
    DintIntegral,
    DintIntegralLayout,
    document_starts,
    packed_requests_kernel,
)


HAS_TOOLCHAIN = shutil.which("c++") is not None and shutil.which("ninja") is not None


@pytest.fixture
def eager_integral():
    """A context in which the integral runs as eager torch ops (the kernel counts as not built)."""

    class Eager:
        def __enter__(self):
            self.saved = dict(kernel_module._state)
            kernel_module._state.update(tried=True, op=None)

        def __exit__(self, *exc):
            kernel_module._state.update(self.saved)

    return Eager()


class KernelCalls(list):
    """The input shape of each kernel call; `with_state_table`: whether each call read and stored a state table
    (packed requests)."""

    def __init__(self):
        super().__init__()
        self.with_state_table = []


def kernel_calls(monkeypatch) -> KernelCalls:
    """Counts the calls of the built kernel (fails the test where it was not built)."""
    op = kernel_module.integral_kernel()
    assert op is not None, "the fused CPU integral kernel was not built on a machine with a C++ compiler and ninja"
    calls = KernelCalls()

    def counted(*args):
        calls.append(args[0].shape)
        calls.with_state_table.append(len(args) > 9 and args[9] is not None)
        return op(*args)

    monkeypatch.setitem(kernel_module._state, "op", counted)
    return calls


requires_toolchain = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler or ninja: the kernel cannot build")


@requires_toolchain
def test_the_kernel_builds_on_a_machine_with_a_compiler():
    assert kernel_module.integral_kernel() is getattr(torch.ops, kernel_module.NAMESPACE).integral_forward
    assert kernel_module.extension_name().startswith("dint_cpu_integral_")


@requires_toolchain
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row_lambda", [False, True])
@pytest.mark.parametrize("head_norm", ["affine", "no weight", "none"])
@pytest.mark.parametrize("rows", ["plain", "padding and documents", "row 0 restarts in some rows"])
def test_kernel_matches_the_eager_integral(dtype, per_row_lambda, head_norm, rows, eager_integral, monkeypatch):
    """`DintIntegral` with the kernel against the eager ops, from a carried state: output and stored state. The
    signal and noise outputs are strided views (the two halves of one attention output), as the attention gives them."""
    generator = torch.Generator().manual_seed(7)
    batch_size, length, heads, channels = 3, 37, 2, 16
    attention_output = torch.randn(batch_size, length, 2 * heads, channels, generator=generator).to(dtype)
    signal_output, noise_output = attention_output.chunk(2, dim=2)
    lambda_ = (
        torch.rand(batch_size, length, heads, 1, generator=generator) if per_row_lambda else torch.tensor(0.37)
    )
    query_valid, position_ids, carry_kept = None, None, True
    if rows == "padding and documents":
        query_valid = torch.rand(batch_size, length, generator=generator) > 0.25
        padding = ~query_valid[:, :, None, None]
        signal_output = torch.where(padding, float("nan"), signal_output)  # a padding row may hold anything
        position_ids = torch.arange(length).repeat(batch_size, 1) + 5
        position_ids[1, 10:] -= 15  # a document starts at row 10 of batch row 1
        position_ids[2, 20:] -= 25
    elif rows == "row 0 restarts in some rows":
        carry_kept = torch.tensor([True, False, True])
    document_start = document_starts(query_valid, position_ids, batch_size, length)
    past_count = torch.tensor([3.0, 1.0, 4.0])
    layout = DintIntegralLayout.build(query_valid, document_start, past_count, batch_size, length, "cpu", carry_kept)
    norm = {
        "affine": nn.RMSNorm(channels, eps=1e-5),
        "no weight": nn.RMSNorm(channels, eps=1e-5, elementwise_affine=False),
        "none": nn.Identity(),
    }[head_norm]
    if head_norm == "affine":
        nn.init.uniform_(norm.weight, 0.5, 1.5)
    cache = DynamicCache(config=tiny_model().config)
    cache.update_recurrent_state(torch.randn(batch_size, heads, channels, generator=generator), 0, state_idx=SIGNAL_SUM)
    integral = DintIntegral("mean", layer_idx=0)

    with torch.no_grad():  # each call plans its own copy of the layout (the first call of a forward would)
        with eager_integral:
            eager_cache = copy.deepcopy(cache)
            expected = integral(
                signal_output, noise_output, lambda_, copy.copy(layout), norm, CacheIntegralState(eager_cache)
            )
        calls = kernel_calls(monkeypatch)
        actual = integral(signal_output, noise_output, lambda_, copy.copy(layout), norm, CacheIntegralState(cache))

    assert len(calls) == 1
    assert actual.dtype == dtype and actual.shape == expected.shape and actual.is_contiguous()
    state, eager_state = cache.layers[0].signal_sum, eager_cache.layers[0].signal_sum
    torch.testing.assert_close(state, eager_state, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(state).all()
    valid = slice(None) if query_valid is None else query_valid  # padding rows combine their own (NaN) outputs
    assert torch.isfinite(actual[valid]).all()
    if dtype == torch.float32:
        torch.testing.assert_close(actual[valid], expected[valid], atol=1e-5, rtol=1e-5)
    else:  # both round one fp32 value to bf16: at most one unit in the last place apart
        torch.testing.assert_close(actual[valid].float(), expected[valid].float(), atol=0.0, rtol=2**-7)


@requires_toolchain
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_gives_the_eager_tokens_and_logits(layout, dtype, eager_integral, monkeypatch):
    """A left-padded batch through prefill, a chunk continuing the cache and greedy generate(): the kernel gives the
    eager integral's logits (fp32 tightly; bf16 within its rounding) and tokens."""
    model = tiny_model(dtype=dtype, **layout)
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 128, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0

    def run():
        with torch.no_grad():
            prefill = model(input_ids[:, :8], attention_mask=attention_mask[:, :8], use_cache=True)
            chunk = model(input_ids[:, 8:], attention_mask=attention_mask, **with_cache(cache_of(prefill)))
            generated = model.generate(
                input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0
            )
        return prefill.logits.float(), chunk.logits.float(), generated

    with eager_integral:
        expected = run()
    calls = kernel_calls(monkeypatch)
    actual = run()
    assert len(calls) >= 2 * model.config.num_hidden_layers
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(actual[0], expected[0], **tolerance)
    torch.testing.assert_close(actual[1], expected[1], **tolerance)
    if dtype == torch.float32:
        assert torch.equal(actual[2], expected[2])


@requires_toolchain
def test_kernel_is_not_taken_where_it_may_not_be(monkeypatch):
    """Training (a gradient wanted), a cache recording every row for assisted decoding's crop, and a head norm the
    kernel does not know run the eager ops."""
    model = tiny_model(integral="mean")
    input_ids = torch.randint(3, 128, (1, 10))
    calls = kernel_calls(monkeypatch)

    model.train()
    model(input_ids, labels=input_ids).loss.backward()
    assert calls == []

    model.eval()
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        layer.activate_past_recording() if hasattr(layer, "activate_past_recording") else None
    with torch.no_grad():
        model(input_ids, **with_cache(cache))
    assert calls == []

    attention = model.model.layers[0].self_attn
    seen = []
    handle = attention.head_norm.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    assert len(seen) == 1 and len(calls) == model.config.num_hidden_layers - 1  # a hooked head norm runs its module

    calls.clear()
    monkeypatch.setattr(attention, "head_norm", nn.LayerNorm(attention.head_norm.normalized_shape))
    with torch.no_grad():
        model(input_ids)
    assert len(calls) == model.config.num_hidden_layers - 1  # layer 0 took the eager ops


def test_without_a_toolchain_it_warns_once_and_the_eager_ops_run(monkeypatch, caplog, eager_integral):
    """A failed build (here: no compiler) warns with the reason and returns None; the model then runs the eager ops."""
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    with caplog.at_level("WARNING"):
        assert kernel_module._compile() is None
    assert "could not be built (RuntimeError: c++: command not found)" in caplog.text
    with eager_integral, torch.no_grad():
        assert torch.isfinite(tiny_model()(torch.randint(3, 128, (1, 6))).logits).all()


@pytest.mark.parametrize("raw", ["0", "false", "OFF", "No", " off "])
def test_dint_cpu_kernel_off_spellings_turn_it_off(raw, monkeypatch):
    """Every usual spelling of "off" turns the kernel off, before anything is built."""
    monkeypatch.setenv("DINT_CPU_KERNEL", raw)
    monkeypatch.setattr(kernel_module, "_state", {"op": None, "tried": False})
    assert kernel_module.cpu_kernel_enabled() is False
    assert kernel_module.integral_kernel() is None
    assert kernel_module._state == {"op": None, "tried": False}  # not built, not even tried


@pytest.mark.parametrize("raw", ["1", "true", "On", "YES", "", None])
def test_dint_cpu_kernel_on_spellings_and_unset_leave_it_on(raw, monkeypatch):
    if raw is None:
        monkeypatch.delenv("DINT_CPU_KERNEL", raising=False)
    else:
        monkeypatch.setenv("DINT_CPU_KERNEL", raw)
    assert kernel_module.cpu_kernel_enabled() is True


@pytest.mark.parametrize("raw", ["2", "enable", "disabled", "tru", "0n"])
def test_dint_cpu_kernel_refuses_other_values_naming_the_variable_and_the_spellings(raw, monkeypatch):
    monkeypatch.setenv("DINT_CPU_KERNEL", raw)
    with pytest.raises(ValueError) as error:
        kernel_module.cpu_kernel_enabled()
    message = str(error.value)
    assert f"DINT_CPU_KERNEL={raw!r}" in message
    assert all(spelling in message for spelling in ("0", "1", "false", "true", "off", "on", "no", "yes"))


@requires_toolchain
def test_dint_cpu_kernel_is_read_at_every_forward(monkeypatch):
    """A test or benchmark can switch the kernel between forwards; the outputs stay the eager ops' (the same to
    rounding)."""
    calls = kernel_calls(monkeypatch)
    model = tiny_model()
    input_ids = torch.randint(3, 128, (2, 9))
    logits = {}
    for raw, enabled in [("off", False), ("1", True), ("False", False), ("ON", True)]:
        monkeypatch.setenv("DINT_CPU_KERNEL", raw)
        calls.clear()
        with torch.no_grad():
            logits[raw] = model(input_ids).logits
        assert len(calls) == (model.config.num_hidden_layers if enabled else 0), raw
    torch.testing.assert_close(logits["1"], logits["off"], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits["off"], logits["False"]) and torch.equal(logits["1"], logits["ON"])


def test_the_first_build_says_so_and_where_it_caches(monkeypatch, tmp_path, caplog):
    """Before compiling, `_compile` warns (the default log level shows warnings) that it builds and where; with the
    cached library there it says nothing. torch's `load_inline` is replaced by one that writes the library file (a
    real build takes tens of seconds: `test_a_real_first_build_prints_the_message_once`, marked slow)."""
    import logging

    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = kernel_module.extension_name()
    library = tmp_path / name / f"{name}.so"
    builds = []

    def load_inline(name, **kwargs):
        builds.append(name)
        library.write_bytes(b"")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", load_inline)
    message = kernel_module.build_message(name)
    assert "building the fused CPU integral kernel" in message and str(tmp_path / name) in message
    with caplog.at_level(logging.WARNING):
        kernel_module._compile()
    assert builds == [name]
    assert [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING][:1] == [message]
    caplog.clear()
    assert kernel_module.build_message(name) is None
    with caplog.at_level(logging.WARNING):
        kernel_module._compile()
    assert "building the fused CPU integral kernel" not in caplog.text


@requires_toolchain
@pytest.mark.slow
def test_a_real_first_build_prints_the_message_once(tmp_path):
    """A real build into an empty extensions folder, in a fresh process at the default log level: its stderr says it
    is building and where; a second process loads the cached build silently."""
    import subprocess
    import sys

    script = "from modeling_dint.integral_cpu_kernel import integral_kernel; assert integral_kernel() is not None"
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    environment.pop("DINT_CPU_KERNEL", None)
    runs = [subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                           timeout=1800) for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    name = kernel_module.extension_name()
    assert runs[0].stderr.count("DINT: building the fused CPU integral kernel") == 1, runs[0].stderr
    assert str(tmp_path / name) in runs[0].stderr
    assert "building the fused CPU integral kernel" not in runs[1].stderr
    assert (tmp_path / name / f"{name}.so").exists()


def test_a_stale_build_lock_is_removed(monkeypatch, tmp_path, caplog):
    """A build killed midway leaves torch's lock, on which every later build would wait: one older than
    STALE_LOCK_SECONDS goes, with a warning; a fresh one (a build running now) stays."""
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "stale").mkdir()
    (tmp_path / "fresh").mkdir()
    stale, fresh = tmp_path / "stale" / "lock", tmp_path / "fresh" / "lock"
    stale.touch()
    fresh.touch()
    old = time.time() - kernel_module.STALE_LOCK_SECONDS - 60
    os.utime(stale, (old, old))
    with caplog.at_level("WARNING"):
        kernel_module._remove_stale_lock("stale")
        kernel_module._remove_stale_lock("fresh")
    assert not stale.exists() and fresh.exists()
    assert "left" in caplog.text and "stale" in caplog.text


def first_difference(tokens: list, other: list) -> int:
    """The index of the first token where two generations differ (their length where none does)."""
    return next((index for index, (a, b) in enumerate(zip(tokens, other)) if a != b), min(len(tokens), len(other)))


def assert_same_generations(actual: list, expected: list, dtype: torch.dtype) -> None:
    """fp32: the same tokens and log-probabilities to 1e-5; bf16: the log-probabilities of every step before the first
    token that differs within bf16's rounding (later steps follow their own tokens)."""
    for got, want in zip(actual, expected, strict=True):
        assert got.prompt_ids == want.prompt_ids
        if dtype == torch.float32:
            assert got.generated_tokens == want.generated_tokens
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=1e-5)
        else:
            same = first_difference(got.generated_tokens, want.generated_tokens) + 1  # the first differing step too
            torch.testing.assert_close(
                torch.tensor(got.logprobs[:same]), torch.tensor(want.logprobs[:same]), atol=5e-2, rtol=5e-2
            )


@requires_toolchain
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_continuous_batching_reads_and_stores_each_requests_state_in_place(layout, dtype, eager_integral, monkeypatch):
    """Packed requests (transformers' continuous batching): prompts prefilled in chunks, requests waiting then joining
    while others decode. The kernel reads each continuing request's sum from its previous block and stores into its
    blocks in place (`DintPagedStep.state_table`): the eager integral's tokens (fp32) and log-probabilities."""
    serving_tests = pytest.importorskip("test_serving")  # skipped below transformers 5.24, as continuous batching
    model = serving_tests.serving_model("mean", dtype=dtype, **layout)
    prompts = serving_tests.random_prompts()

    def run():
        outputs = model.generate_batch(
            inputs=prompts, generation_config=serving_tests.greedy_config(),
            continuous_batching_config=serving_tests.small_cache(),
        )
        return [outputs[request_id] for request_id in sorted(outputs)]

    with eager_integral:
        expected = run()
    calls = kernel_calls(monkeypatch)
    actual = run()
    assert len(calls) >= model.config.num_hidden_layers * (len(prompts) + serving_tests.NEW_TOKENS)
    assert all(calls.with_state_table)  # every call: the requests packed into one row, their states in the table
    assert_same_generations(actual, expected, dtype)


@requires_toolchain
@pytest.mark.parametrize("layout", LAYOUTS)
def test_continuous_batching_stores_the_sum_at_each_block_end(layout, eager_integral, monkeypatch):
    """A prompt prefilled in one chunk that completes three blocks stores the sum after each block's last token, not
    only after its last row; a second request sharing those blocks (prefix sharing) starts from the third block's
    sum. Kernel and eager ops: the same tokens, log-probabilities and per-block state table (trash block aside)."""
    serving_tests = pytest.importorskip("test_serving")
    model = serving_tests.serving_model("mean", **layout)
    shared_prefix = serving_tests.random_prompts(lengths=(27,))[0]
    prompts = [shared_prefix + [5, 6, 7], shared_prefix + [9, 10]]

    def run():
        manager = model.init_continuous_batching(
            generation_config=serving_tests.greedy_config(),
            continuous_batching_config=serving_tests.small_cache(max_batch_tokens=64),  # the prompt in one chunk
        )
        manager.start()
        try:
            results = []
            for prompt in prompts:  # one after the other: the second finds the first one's complete blocks
                request_id = manager.add_request(prompt, max_new_tokens=serving_tests.NEW_TOKENS)
                results.append(manager.get_result(request_id=request_id, timeout=60))
            cache = manager.batch_processor.cache
            assert cache.search_prefix_match("probe", prompts[1]) == 24  # three complete pages of 8 tokens
            allocator = cache.dint_allocator
            sums = allocator.integral_sums.clone()
            trash_block = int(allocator.write_trash_index) // allocator.block_physical_stride
        finally:
            manager.stop(block=True, timeout=30)
        return results, torch.cat([sums[:trash_block], sums[trash_block + 1 :]])

    with eager_integral:
        expected, expected_sums = run()
    calls = kernel_calls(monkeypatch)
    actual, actual_sums = run()
    assert calls and all(calls.with_state_table)
    assert_same_generations(actual, expected, torch.float32)
    assert expected_sums.abs().sum() > 0
    # sums of up to 37 rows of O(1) values, added in another order (the eager blocked scan): 1e-4
    torch.testing.assert_close(actual_sums, expected_sums, atol=1e-4, rtol=1e-4)


@requires_toolchain
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_requests_without_a_batch_dimension_write_in_place(dtype):
    """vLLM's op calls the kernel with `[T, heads, C]` rows, per-row arguments `[T]`, lambda a scalar (v1) or
    `[T, heads, 1]` (v2), and its own output buffer: the same output and state table, bit for bit (the same code on the
    same machine), as the batched call `[1, T, heads, C]` with a new output."""
    torch.manual_seed(0)
    rows, heads, channels, slots = 7, 3, 16, 5
    signal, noise = torch.randn(rows, heads, channels, dtype=dtype), torch.randn(rows, heads, channels, dtype=dtype)
    inverse_count = 1.0 / torch.arange(3, 3 + rows, dtype=torch.float32)
    row_flags = torch.tensor([3, 1, 1, 3, 1, 1, 1], dtype=torch.uint8)
    carry_slot = torch.tensor([2, -1, -1, -1, -1, -1, -1])
    store_slot = torch.tensor([-1, -1, 2, -1, -1, 4, 3])
    head_norm = torch.nn.RMSNorm(channels, eps=1e-6)
    with torch.no_grad():
        head_norm.weight.uniform_(0.5, 1.5)
    for lambda_ in (torch.tensor(0.4), torch.rand(rows, heads, 1)):
        table = torch.randn(slots, heads, channels)
        initial_table, expected_table = table.clone(), table.clone()
        batched_lambda = lambda_ if lambda_.dim() == 0 else lambda_[None]
        with torch.no_grad():
            expected = packed_requests_kernel(
                signal[None], noise[None], batched_lambda, inverse_count[None], row_flags[None], expected_table,
                carry_slot[None], store_slot[None], head_norm,
            )[0]
            output = torch.full_like(signal, float("nan"))
            returned = packed_requests_kernel(
                signal, noise, lambda_, inverse_count, row_flags, table, carry_slot, store_slot, head_norm, output
            )
        assert returned is output
        assert torch.equal(output, expected)
        assert torch.equal(table, expected_table)
        assert torch.equal(table[[0, 1]], initial_table[[0, 1]])  # the slots no row stores in
        assert all(not torch.equal(table[slot], initial_table[slot]) for slot in (2, 3, 4))
        with torch.no_grad():  # without `out`: a new output of O1's shape
            assert packed_requests_kernel(
                signal, noise, lambda_, inverse_count, row_flags, table.clone(), carry_slot, store_slot, head_norm
            ).shape == signal.shape
    with pytest.raises(RuntimeError, match="lambda: a scalar, or one per row and head"):
        packed_requests_kernel(signal, noise, torch.rand(heads, 1), inverse_count, row_flags, table,
                                        carry_slot, store_slot, head_norm)
