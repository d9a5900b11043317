# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT on a lent GPU, in one prepared run (issue 49): the GPU tests, then bf16 timings at the 1B shape, DINT-V1
against DiffLlama and DINT-V2 against DIFF-V2 and Llama, with the issue's targets met or not.

    python bench/gpu_bf16.py --output-dir "$OUT/gpu_bf16"                       # a lent H100 / H200: about 9 min
    python bench/gpu_bf16.py --device cpu --smoke --output-dir runs/gpu_smoke   # every path on CPU, tiny shapes

The models (random weights, bf16, sdpa, `--layers` each, vocab 32000; nothing is downloaded):
- `dint_v1`, `diffllama`: hidden 2048, 32 softmax maps of 64 (16 differential heads over a 128-wide V), 8 KV heads,
  MLP 8192 (DIFF V1's layout; DINT with its Triton integral);
- `dint_v2`, `diff_v2` (`integral="none"`), `llama_2h`: hidden 2048, 32 query heads of 128 (v2: h = 16 differential
  heads, `head_dim` d = hidden / h), 8 KV heads, MLP 8192; `llama_h`: the same Llama with 16 heads;
- `dint_v1_eager_ops`, `dint_v2_eager_ops`: the DINT models with `DINT_INTEGRAL_KERNEL=eager` (what the kernel replaces),
  in the training and prefill stages only: a decoding step runs the eager ops unforced too
  (`integral_dint.TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT`).

Stages, in this order (by priority); each rewrites `results.json` and `results.md` when it ends (a run stopped by its
limit keeps what it measured), and one that would pass `--budget` seconds is skipped and says so:
1. `tests`: `tests/test_gpu.py` and the Triton kernel's tests (`GPU_KERNEL_TESTS`), on CUDA, for `--tests-seconds`;
2. `integral`: `DintIntegral` alone per call, the Triton kernel against the eager ops: a decoding step's launch cost
   (one row, batch 1 and 8), 4096 and 32768 rows forward and 4096 with backward (the backward kernel also at 16 tile
   elements per thread, the warps it had before its registers were read), at both layouts' shapes, each also as the
   GPU's time alone (replayed from a CUDA graph);
3. `train`: a training step (LM loss, forward and backward) at `TRAIN_LENGTHS` tokens: time, tokens/s, peak memory;
4. `prefill`: a forward without gradient at `PREFILL_LENGTHS` tokens (the last position's logits);
5. `compiled_decode`: per token with a static cache and `torch.compile` in CUDA-graph mode ("reduce-overhead"), per
   group of `COMPILED_GROUPS` (compiling is most of its time; a group starts with `COMPILE_SECONDS_PER_MODEL` per
   model left, from `torch._dynamo.reset()`);
6. `decode`: per decoded token with the dynamic cache after prompts of `DECODE_PROMPTS` tokens (eager), and the
   integral state's bytes per layer;
7. `batched_generate`: `generate()` of a batch of 8 prompts of 128 tokens, 32 new tokens (eager).
A stage's part that fails (an error, out of memory) is recorded with its traceback and the run goes on.

Timing: after a warm-up step per model, `--rounds` rounds in which the models of a group run one after the other
(the order rotates each round); a ratio is the median over the rounds of the per-round ratios (paired median).
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch._dynamo


BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, REPO_ROOT)
import bench_common  # noqa: E402


TRAIN_LENGTHS = (4096, 16384)
PREFILL_LENGTHS = (2048, 8192, 32768)
DECODE_PROMPTS = (2048, 32768)
SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "vocab_size": 32000, "num_key_value_heads": 8}
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 256, "num_key_value_heads": 2}
GPU_KERNEL_TESTS = "(not matches_the_eager or 90 or fp16) and not without_the_interpreter"
"""The Triton kernel tests run on the GPU (`-k`): all but the unit tests' shorter lengths, which the interpreter covers
(each compiles kernel variants of its own; CI's Triton stage runs them all), and the one about CPU tensors."""

V1_GROUP = ("dint_v1", "diffllama", "dint_v1_eager_ops")
V2_GROUP = ("dint_v2", "diff_v2", "llama_2h", "llama_h", "dint_v2_eager_ops")
EAGER_OPS = {"dint_v1_eager_ops": "dint_v1", "dint_v2_eager_ops": "dint_v2"}
"""Variants that run a model of the group with the integral's eager ops: `{variant: model}`."""
GRAPHED = ", GPU time in a CUDA graph"
"""The `integral` stage's cases also give each variant's GPU time alone (`triton.testing.do_bench_cudagraph`: the
calls, with their backward where the case has one, replayed from a CUDA graph, the host's launch cost left out)."""
TRITON_BACKWARD_AT_16 = "triton, backward at 16 elements per thread"
"""The `integral` stage's third timing of a call with a backward (the backward's warps it had first)."""
COMPILED_GROUPS = (("dint_v2", "diff_v2", "llama_2h"), ("diffllama", "dint_v1"))
"""Each group's models compile and are timed in one tree of CUDA graphs. On the first H200 run (commit 16dfe23)
DiffLlama's first compiled call, right after DINT-V1's in the same tree, failed cudagraph_trees' check of its memory pool
("These storage data ptrs are not allocated in pool (0, 1) but should be", 16 of them: one per layer), while Llama's
after DINT-V2's ran; DiffLlama now compiles first, so that a failure names the model that leaves the stray storages."""
COMPILE_SECONDS_PER_MODEL = 50
"""A group's compiles and timing start only with this much of the budget left per model (on the H200 a 1B model's
decode step compiled in CUDA-graph mode in 17 to 29 s, and a group of two took about 100 s with its timing)."""

TARGETS = [
    # (group of stages, numerator, denominator, bound, what)
    (("train", "prefill"), "dint_v2", "llama_2h", 1.03, "DINT-V2 / Llama (2h query heads), training step and prefill"),
    (("train", "prefill", "decode", "compiled_decode"), "dint_v2", "diff_v2", 1.02, "DINT-V2 / DIFF-V2 (the integral)"),
    (("decode",), "dint_v2", "llama_2h", 1.05, "DINT-V2 / Llama (2h), decode per token, eager"),
    (("compiled_decode",), "dint_v2", "llama_2h", 1.02, "DINT-V2 / Llama (2h), decode per token, compiled"),
    (("train", "prefill", "decode"), "dint_v1", "diffllama", 1.05, "DINT-V1 / DiffLlama, training step, prefill, decode"),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of every model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=16, help="decoded tokens timed per round")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (stages past it skip)")
    parser.add_argument("--tests-seconds", type=float, default=120.0, help="the tests stage's limit")
    parser.add_argument("--stages", default="tests,integral,train,prefill,decode,batched_generate,compiled_decode")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and lengths: the code paths, not timings")
    parser.add_argument("--output-dir", default=os.path.join("runs", "gpu_bf16"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.rounds, args.decode_tokens = 2, 2, 4
    return args


def model_configs(args) -> dict:
    """`{name: config}` of every model (the variants share their model's)."""
    from transformers import DiffLlamaConfig, LlamaConfig

    from modeling_dint import DintConfig

    shape = dict(SMOKE_SHAPE if args.smoke else SHAPE, num_hidden_layers=args.layers, max_position_embeddings=40000)
    hidden = shape["hidden_size"]
    maps = 4 if args.smoke else 32  # softmax maps: v1 32 of 64, v2 32 query heads of 128 (h = 16)
    v1 = dict(shape, num_attention_heads=maps, head_dim=hidden // maps)
    v2 = dict(shape, num_attention_heads=maps, head_dim=2 * hidden // maps)
    return {
        "dint_v1": DintConfig(**v1),
        "diffllama": DiffLlamaConfig(**v1),
        "dint_v2": DintConfig(**v2, differential_attention="v2"),
        "diff_v2": DintConfig(**v2, differential_attention="v2", integral="none"),
        "llama_2h": LlamaConfig(**v2),
        "llama_h": LlamaConfig(**dict(v2, num_attention_heads=maps // 2)),
    }


def build_models(args, names) -> dict:
    """The models `names` (variants map to their model), bf16 on the device, random weights from seed 0."""
    from transformers import DiffLlamaForCausalLM, LlamaForCausalLM

    from modeling_dint import DintForCausalLM

    classes = {"dint_v1": DintForCausalLM, "diffllama": DiffLlamaForCausalLM, "dint_v2": DintForCausalLM,
               "diff_v2": DintForCausalLM, "llama_2h": LlamaForCausalLM, "llama_h": LlamaForCausalLM}
    configs = model_configs(args)
    models = {}
    for name in names:
        base = EAGER_OPS.get(name, name)
        if base not in models:
            torch.manual_seed(0)
            with torch.device(args.device):
                model = classes[base]._from_config(configs[base], attn_implementation="sdpa", dtype=torch.bfloat16)
            models[base] = model.eval()
        models[name] = models[base]
    return models


@contextlib.contextmanager
def integral_kernel_for(name: str):
    """`DINT_INTEGRAL_KERNEL=eager` while a `*_eager_ops` variant runs."""
    saved = os.environ.get("DINT_INTEGRAL_KERNEL")
    if name in EAGER_OPS:
        os.environ["DINT_INTEGRAL_KERNEL"] = "eager"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DINT_INTEGRAL_KERNEL", None)
        else:
            os.environ["DINT_INTEGRAL_KERNEL"] = saved


class KernelCalls:
    """Counts the Triton integral's forward launches (a DINT model timed without them would measure the eager ops)."""

    def __init__(self):
        import modeling_dint.integral_triton_kernel as triton_kernel

        self.module, self.count = triton_kernel, 0
        forward = triton_kernel.integral_forward

        def counted(*arguments, **keywords):
            self.count += 1
            return forward(*arguments, **keywords)

        triton_kernel.integral_forward = counted


def timed(device: str, step) -> float:
    bench_common.synchronize(device)
    started = time.perf_counter()
    step()
    bench_common.synchronize(device)
    return time.perf_counter() - started


def peak_bytes(device: str, step) -> int | None:
    """Peak memory a step allocates above what was allocated before it (CUDA), None elsewhere."""
    if not device.startswith("cuda"):
        step()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def paired_rounds(device: str, steps: dict, rounds: int, kernel_calls=None, launches=None) -> tuple[dict, dict]:
    """A warm-up (with its peak memory, and the Triton integral's launches in it counted into `launches` by name), then
    `rounds` rounds of every step in a rotating order: `({name: seconds per round}, {name: peak bytes of the
    warm-up})`. A step is `() -> None` or `() -> seconds` (it times itself)."""
    names = list(steps)
    peaks, samples = {}, {name: [] for name in names}
    for name in names:
        with integral_kernel_for(name):
            before = kernel_calls.count if kernel_calls is not None else 0
            peaks[name] = peak_bytes(device, steps[name])
            if launches is not None:
                launches[name] = kernel_calls.count - before
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            with integral_kernel_for(name):
                seconds = None

                def step():
                    nonlocal seconds
                    seconds = steps[name]()

                elapsed = timed(device, step)
            samples[name].append(seconds if seconds is not None else elapsed)
    return samples, peaks


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def input_ids(args, batch_size: int, length: int, vocab_size: int) -> torch.Tensor:
    return bench_common.make_input_ids(length, batch_size, vocab_size, args.device)


def train_steps(models, args, length):
    ids = {name: input_ids(args, 1, length, model.config.vocab_size) for name, model in models.items()}

    def step(name):
        def run():
            model = models[name]
            model.zero_grad(set_to_none=True)
            model(input_ids=ids[name], labels=ids[name], use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    return {name: step(name) for name in models}


def prefill_steps(models, args, length):
    ids = {name: input_ids(args, 1, length, model.config.vocab_size) for name, model in models.items()}

    def step(name):
        def run():
            with torch.no_grad():
                models[name](input_ids=ids[name], use_cache=False, logits_to_keep=1)
        return run

    return {name: step(name) for name in models}


def decode_steps(models, args, prompt_length, state_bytes):
    """Per round: a prompt fills a fresh dynamic cache, then `--decode-tokens` greedy tokens, each timed; the step
    returns the median seconds per token (the prefill is not timed)."""
    ids = {name: input_ids(args, 1, prompt_length, model.config.vocab_size) for name, model in models.items()}

    def step(name):
        def run():
            cache, token = bench_common.prefill(models[name], ids[name])
            per_token = []
            for _ in range(args.decode_tokens):
                bench_common.synchronize(args.device)
                started = time.perf_counter()
                token = bench_common.decode_step(models[name], cache, token)
                bench_common.synchronize(args.device)
                per_token.append(time.perf_counter() - started)
            state_bytes[name] = [layer["integral_bytes"] for layer in bench_common.cache_layer_bytes(cache)]
            return statistics.median(per_token)
        return run

    return {name: step(name) for name in models}


def batched_generate_steps(models, args):
    batch_size, prompt, new_tokens = (8, 128, 32) if not args.smoke else (2, 16, 4)
    ids = {name: input_ids(args, batch_size, prompt, model.config.vocab_size) for name, model in models.items()}

    def step(name):
        def run():
            with torch.no_grad():
                models[name].generate(ids[name], attention_mask=torch.ones_like(ids[name]), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return run

    return {name: step(name) for name in models}


def compiled_decode(models, args, groups, deadline, result) -> None:
    """Per group: each model compiles its decode step (static cache, CUDA graphs), then paired rounds of generate(),
    the median interval between decoding steps per token, for each prompt length."""
    from transformers import StaticCache

    from compiled_decode import StepClock, compiled_generate

    prompts = DECODE_PROMPTS if not args.smoke else (16, 32)
    entry = result.setdefault("compiled_decode", {"seconds": {}, "compile_seconds": {}, "graphs": {}})
    for group in groups:
        if time.time() > deadline - COMPILE_SECONDS_PER_MODEL * len(group):
            entry.setdefault("skipped", []).append(f"{group}: the budget")
            continue
        torch._dynamo.reset()  # a tree of CUDA graphs, and compiled code, of this group's models alone
        caches = {name: StaticCache(config=models[name].config, max_cache_len=max(prompts) + args.decode_tokens + 4)
                  for name in group}
        ids = {prompt: input_ids(args, 1, prompt, models[group[0]].config.vocab_size) for prompt in prompts}
        mask = {prompt: torch.ones_like(ids[prompt]) for prompt in prompts}
        for name in group:
            torch._dynamo.utils.counters.clear()
            started = time.time()
            compiled_generate(models[name], ids[prompts[0]], mask[prompts[0]], caches[name], 4)
            entry["compile_seconds"][name] = round(time.time() - started, 1)
            entry["graphs"][name] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            write(result, args)
        torch._dynamo.utils.counters.clear()
        for prompt in prompts:
            steps = {}
            for name in group:
                def run(name=name, prompt=prompt):
                    clock = StepClock()
                    compiled_generate(models[name], ids[prompt], mask[prompt], caches[name], args.decode_tokens + 2,
                                      clock)
                    return clock.median_step_seconds()
                steps[name] = run
            samples, _ = paired_rounds(args.device, steps, max(2, args.rounds - 2))
            for name in group:
                entry["seconds"].setdefault(name, {})[str(prompt)] = samples[name]
            write(result, args)
        entry.setdefault("graphs_compiled_while_timing", {})[" / ".join(group)] = (
            torch._dynamo.utils.counters["stats"]["unique_graphs"]
        )


def integral_calls(args) -> dict:
    """The integral alone, per call (`DintIntegral.__call__`), the Triton kernel against the eager ops, at a decoding
    step (batch 1 and 8, one row: what a launch costs), at 4096 and 32768 rows forward, and at 4096 forward with
    backward (also packed documents of 64 rows, each a restart of the running sums), both layouts' shapes (v1: 16
    heads of 128 channels, a scalar lambda, the head norm; v2: 16 of 128, lambda per row), each case also as the GPU's
    time alone (`GRAPHED`): `{case: {kernel: [seconds per call, per round]}}`."""
    from torch import nn

    import modeling_dint.integral_triton_kernel as triton_kernel
    from modeling_dint.integral_dint import DintIntegral, DintIntegralLayout, plan_integral

    heads, channels = (2, 16) if args.smoke else (16, 128)
    integral = DintIntegral("mean", layer_idx=0)
    calls = {}
    for layout_name in ("v1", "v2"):
        cases = ((1, 1, False, None), (8, 1, False, None), (1, 4096, False, None), (1, 32768, False, None),
                 (1, 4096, True, None), (1, 4096, True, 64))  # (batch, rows, backward, rows per packed document)
        for batch_size, rows, backward, document_rows in cases:
            rows = min(rows, 64) if args.smoke else rows
            attention_output = torch.randn(batch_size, rows, 2 * heads, channels, device=args.device,
                                           dtype=torch.bfloat16, requires_grad=backward)
            if layout_name == "v1":
                signal, noise = attention_output.chunk(2, dim=2)
                lambda_ = torch.tensor(0.5, device=args.device, requires_grad=backward)
                head_norm = nn.RMSNorm(channels, eps=1e-5, device=args.device)
            else:
                signal, noise = attention_output[:, :, 0::2], attention_output[:, :, 1::2]
                lambda_ = torch.rand(batch_size, rows, heads, 1, device=args.device, requires_grad=backward)
                head_norm = nn.Identity()
            document_start = None
            if document_rows:  # packed documents: the running sums restart every `document_rows` rows
                document_start = (torch.arange(rows, device=args.device) % document_rows == 0)[None]
            layout = DintIntegralLayout.build(None, document_start, None, batch_size, rows, torch.device(args.device))
            planned = None  # the layout as each variant's forward plans it, once, before the timing (below)

            def call():  # the gradients returned, not accumulated: a CUDA graph replays it as it was captured
                with torch.set_grad_enabled(backward):
                    output = integral(signal, noise, lambda_, planned, head_norm)
                    if backward:
                        torch.autograd.grad(output.float().sum(), (attention_output, lambda_))

            repeat = 3 if args.smoke else (200 if rows == 1 else 20)
            case = (f"{layout_name} B={batch_size} T={rows}{' +backward' if backward else ''}"
                    f"{f' documents of {document_rows}' if document_rows else ''}")
            calls[case] = {}
            # With a backward, also the backward kernel at the forward's warps (16 tile elements per thread, what it
            # had before its registers were read off the cubins: triton_kernel.BACKWARD_ELEMENTS_PER_THREAD)
            variants = ("triton", "eager", TRITON_BACKWARD_AT_16) if backward else ("triton", "eager")
            for variant in variants:
                kernel = "eager" if variant == "eager" or not args.device.startswith("cuda") else "triton"
                os.environ["DINT_INTEGRAL_KERNEL"] = kernel
                with torch.set_grad_enabled(backward):
                    planned = plan_integral(copy.copy(layout), None, torch.device(args.device), torch.bfloat16,
                                            signal.numel(), backward, False)
                elements_per_thread = triton_kernel.BACKWARD_ELEMENTS_PER_THREAD
                if variant == TRITON_BACKWARD_AT_16:
                    triton_kernel.BACKWARD_ELEMENTS_PER_THREAD = 16
                try:
                    call()
                    samples = [timed(args.device, lambda: [call() for _ in range(repeat)]) / repeat for _ in range(3)]
                    if args.device.startswith("cuda"):
                        import triton.testing

                        try:  # its own failure: the case's host-side timings are kept
                            graphed_ms = triton.testing.do_bench_cudagraph(call, rep=20,
                                                                           return_mode="median")
                            calls[case][variant + GRAPHED] = [graphed_ms * 1e-3]
                        except Exception:  # noqa: BLE001 (recorded; the stage goes on)
                            calls.setdefault("errors", []).append(traceback.format_exc())
                finally:
                    os.environ.pop("DINT_INTEGRAL_KERNEL", None)
                    triton_kernel.BACKWARD_ELEMENTS_PER_THREAD = elements_per_thread
                calls[case][variant] = samples
    return calls


def run_tests(args, seconds: float) -> dict:
    """The GPU tests in a subprocess, stopped after `seconds` (what it printed by then is kept)."""
    command = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "tests/test_integral_triton_kernel.py", "-q",
               "--tb=short", "-p", "no:cacheprovider", "-k", GPU_KERNEL_TESTS]
    started = time.time()
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=seconds)
        returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
    except subprocess.TimeoutExpired as timeout:
        returncode = "timed out"
        stdout, stderr = (text.decode() if isinstance(text, bytes) else text or "" for text in (timeout.stdout,
                                                                                              timeout.stderr))
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "tests.log"), "w") as file:  # every traceback, whole
        file.write(stdout + stderr)
    lines = stdout.strip().splitlines()
    return {"command": " ".join(command[1:]), "returncode": returncode, "seconds": round(time.time() - started),
            "summary": (lines[-1] if lines else stderr[-2000:]) if returncode != "timed out" else "timed out",
            "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:40],
            "tail": stdout[-4000:] + stderr[-2000:]}


def machine(args) -> dict:
    info = bench_common.machine_info(args.device)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def ratios_of(result: dict, stage: str, numerator: str, denominator: str) -> dict:
    """`{length: paired median ratio}` of two models in a stage of `result`."""
    seconds = result.get(stage, {}).get("seconds", {})
    if numerator not in seconds or denominator not in seconds:
        return {}
    return {length: round(paired_ratio(seconds[numerator][length], seconds[denominator][length]), 3)
            for length in seconds[numerator] if length in seconds[denominator]}


def markdown(result: dict, args) -> str:
    info = result["machine"]
    lines = [
        "# DINT on a GPU, bf16 (issue 49)", "",
        f"Device: {info.get('gpu', info['device'])}; torch {info['torch']}, CUDA {info.get('cuda')}, transformers "
        f"{info['transformers']}, triton {info.get('triton')}; commit {info['git_commit']}; {info['date_utc']}.",
        f"Command: `python bench/gpu_bf16.py {' '.join(result['argv'])}`; {args.layers} layers per model, "
        f"{args.rounds} rounds, paired medians.", "",
    ]
    tests = result.get("tests")
    if tests:
        lines += [f"Tests: `{tests['command']}`: {tests['summary']} ({tests['seconds']} s)", ""]
        lines += [f"- {failure}" for failure in tests["failures"]]
    lines += ["## Targets", "", "| target | bound | measured (paired median ratio per length) | met |", "| --- | --- | --- | --- |"]
    for stages, numerator, denominator, bound, what in TARGETS:
        measured, met = [], True
        for stage in stages:
            for length, ratio in ratios_of(result, stage, numerator, denominator).items():
                measured.append(f"{stage} {length}: {ratio}")
                met = met and ratio <= bound
        lines.append(f"| {what} | <= {bound} | {'; '.join(measured) or 'not measured'} | "
                     f"{('yes' if met else '**no**') if measured else '-'} |")
    for numerator, denominator in (("dint_v1", "diffllama"), ("dint_v2", "diff_v2"), ("dint_v2", "llama_2h")):
        peaks = result.get("train", {}).get("peak_bytes", {})
        if numerator in peaks and denominator in peaks:
            cells = [f"{length}: {peaks[numerator][length] / peaks[denominator][length]:.3f}"
                     for length in peaks[numerator] if peaks[numerator][length] and peaks[denominator].get(length)]
            lines.append(f"| training peak memory {numerator} / {denominator} | <= 1.05 | {'; '.join(cells)} | "
                         f"{'yes' if cells and all(float(c.split(': ')[1]) <= 1.05 for c in cells) else '-'} |")
    state = result.get("decode", {}).get("integral_state_bytes", {})
    if state:
        lines.append("| integral state per layer constant in the length | - | "
                     + "; ".join(f"{name} {prompt}: {sorted(set(values))}" for name, by_prompt in state.items()
                                 for prompt, values in by_prompt.items() if name.startswith("dint")) + " | |")
    if result.get("integral_calls"):
        lines += ["", "## integral", "", "`DintIntegral` alone, microseconds per call (median of 3 rounds)", "",
                  "| case | Triton kernel | eager ops | kernel / eager | kernel, backward at 16 elements per thread "
                  "| GPU time in a CUDA graph: kernel, eager ops |", "| --- | --- | --- | --- | --- | --- |"]
        for case, by_kernel in result["integral_calls"].items():
            if case == "errors":
                continue
            triton_us, eager_us = (statistics.median(by_kernel[kernel]) * 1e6 for kernel in ("triton", "eager"))
            at_16 = by_kernel.get(TRITON_BACKWARD_AT_16)
            at_16_us = f"{statistics.median(at_16) * 1e6:.1f}" if at_16 else "-"
            graphed = [by_kernel.get(kernel + GRAPHED) for kernel in ("triton", "eager")]
            graphed_us = ", ".join(f"{values[0] * 1e6:.1f}" for values in graphed) if all(graphed) else "-"
            lines.append(f"| {case} | {triton_us:.1f} | {eager_us:.1f} | {triton_us / eager_us:.3f} | {at_16_us} "
                         f"| {graphed_us} |")
    for stage in ("tests", "integral_calls", "train", "prefill", "decode", "batched_generate", "compiled_decode"):
        for error in (result.get(stage) or {}).get("errors", []) if isinstance(result.get(stage), dict) else []:
            lines += ["", f"{stage}: error", "", "```", error.strip(), "```"]
    for stage in ("train", "prefill", "decode", "batched_generate", "compiled_decode"):
        entry = result.get(stage)
        if not entry or not entry.get("seconds"):
            if entry and entry.get("skipped"):
                lines += ["", f"## {stage}", "", f"skipped: {entry['skipped']}"]
            continue
        lines += ["", f"## {stage}", "", "median seconds per " + ("token" if "decode" in stage else "step"), "",
                  "| model | " + " | ".join(f"{length}" for length in next(iter(entry["seconds"].values()))) + " |",
                  "| --- |" + " --- |" * len(next(iter(entry["seconds"].values())))]
        for name, by_length in entry["seconds"].items():
            lines.append(f"| {name} | " + " | ".join(f"{statistics.median(values):.4f}" for values in by_length.values())
                         + " |")
        if stage == "train":  # tokens per second and the peak memory above the weights, per model and length
            lines += ["", "tokens/s; peak GB of the step", ""]
            for name, by_length in entry["seconds"].items():
                cells = []
                for length, values in by_length.items():
                    peak = entry["peak_bytes"].get(name, {}).get(length)
                    cells.append(f"{int(length) / statistics.median(values):,.0f}; "
                                 f"{peak / 2**30:.2f}" if peak else f"{int(length) / statistics.median(values):,.0f}")
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        untaken = [f"{name} {length}" for name, by_length in entry.get("kernel_launches_in_warm_up", {}).items()
                   for length, count in by_length.items()
                   if name in ("dint_v1", "dint_v2") and count == 0 and kernel_expected(stage, length, args)]
        if untaken and info["device"].startswith("cuda"):
            lines.append(f"\n**The Triton integral was not taken** (its eager ops were timed): {untaken}")
        for key in ("skipped", "compile_seconds", "graphs", "graphs_compiled_while_timing",
                    "kernel_launches_in_warm_up"):
            if entry.get(key):
                lines.append(f"\n{key}: {entry[key]}")
    return "\n".join(lines) + "\n"


def kernel_expected(stage: str, length: str, args) -> bool:
    """Whether the DINT models' integral takes the Triton kernel unforced in a stage at a length: with a gradient, or
    a prefill from `TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT` elements of O1 per call (O1 holds `hidden_size` elements per
    token in both layouts of `model_configs`: at the 1B shape 16 differential heads of 128 channels)."""
    from modeling_dint.integral_dint import TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT

    if stage != "prefill":  # (the other stages' lengths are not token counts: batched generate's "8x128+32")
        return stage == "train"
    elements_per_token = (SMOKE_SHAPE if args.smoke else SHAPE)["hidden_size"]
    return int(length) * elements_per_token >= TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT


def write(result: dict, args) -> None:
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as file:
        json.dump(result, file, indent=1)
    with open(os.path.join(args.output_dir, "results.md"), "w") as file:
        file.write(markdown(result, args))


def guarded(result: dict, key: str, args, function) -> None:
    """Runs one stage's part; an exception (a kernel that does not compile, out of memory) is recorded under
    `result[key]["errors"]` and the run goes on with the next part."""
    try:
        function()
    except Exception:  # noqa: BLE001 (any failure is a result of the one GPU run; the next stages still run)
        result.setdefault(key, {}).setdefault("errors", []).append(traceback.format_exc())  # whole: where it broke
        print(result[key]["errors"][-1], flush=True)
        bench_common.collect_garbage(args.device)
    write(result, args)


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.time()
    deadline = started + args.budget
    stages = args.stages.split(",")
    result = {"argv": sys.argv[1:] if argv is None else argv, "machine": machine(args)}
    write(result, args)
    if "tests" in stages and args.device.startswith("cuda"):
        def tests():
            result["tests"] = run_tests(args, seconds=args.tests_seconds)
            print(result["tests"]["summary"], flush=True)
        guarded(result, "tests", args, tests)
    if "integral" in stages:
        guarded(result, "integral_calls", args, lambda: result.__setitem__("integral_calls", integral_calls(args)))
    kernel_calls = KernelCalls()
    models = build_models(args, V1_GROUP + V2_GROUP)
    lengths = {
        "train": (64, 128) if args.smoke else TRAIN_LENGTHS,
        "prefill": (32, 64, 128) if args.smoke else PREFILL_LENGTHS,
        "decode": (16, 32) if args.smoke else DECODE_PROMPTS,
    }
    for stage in ("train", "prefill", "compiled_decode", "decode", "batched_generate"):  # by priority
        if stage not in stages:
            continue
        if stage == "compiled_decode":
            guarded(result, stage, args, lambda: compiled_decode(models, args, COMPILED_GROUPS, deadline - 30, result))
            continue
        entry = result.setdefault(stage, {"seconds": {}, "peak_bytes": {}})
        for group in (V1_GROUP, V2_GROUP):
            for length in lengths.get(stage, ("8x128+32",)):
                if time.time() > deadline - 60:
                    entry.setdefault("skipped", []).append(f"{group[0]} group at {length}: the budget")
                    continue
                guarded(result, stage, args, lambda: measure(stage, group, length, models, args, entry, kernel_calls))
        print(f"{stage} done at {time.time() - started:.0f} s", flush=True)
    result["seconds"] = round(time.time() - started)
    write(result, args)
    print(markdown(result, args))


def measure(stage, group, length, models, args, entry, kernel_calls) -> None:
    """One group of models at one length of a stage, into `entry`."""
    if stage not in ("train", "prefill"):  # the eager ops' variants: where unforced calls take the kernel
        group = tuple(name for name in group if name not in EAGER_OPS)
    group_models = {name: models[name] for name in group}
    state_bytes = {}
    if stage == "train":
        steps = train_steps(group_models, args, length)
    elif stage == "prefill":
        steps = prefill_steps(group_models, args, length)
    elif stage == "decode":
        steps = decode_steps(group_models, args, length, state_bytes)
    else:
        steps = batched_generate_steps(group_models, args)
    launches = {}
    samples, peaks = paired_rounds(args.device, steps, args.rounds, kernel_calls, launches)
    for name in group:
        entry["seconds"].setdefault(name, {})[str(length)] = samples[name]
        entry["peak_bytes"].setdefault(name, {})[str(length)] = peaks[name]
        entry.setdefault("kernel_launches_in_warm_up", {}).setdefault(name, {})[str(length)] = launches[name]
    for name, values in state_bytes.items():
        entry.setdefault("integral_state_bytes", {}).setdefault(name, {})[str(length)] = values
    bench_common.collect_garbage(args.device)


if __name__ == "__main__":
    main()
