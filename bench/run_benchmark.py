# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT at the cost of DIFF, measured (issue 7).

Builds four causal LMs of one size with copied weights (see `bench_common.py`): DINT fast path, DINT eager reference,
transformers' DiffLlama and Llama, and measures in one run:

1. peak memory of a forward pass and of a forward+backward pass at each sequence length (CPU: each model in a fresh
   subprocess, `probe_memory.py`; GPU: `torch.cuda.max_memory_allocated` in this process);
2. time of a forward pass (no gradient) and of forward+backward (LM loss), interleaved: inside each repetition the
   models run round-robin (the order rotates every repetition), after a warm-up, so that a machine's drift or a
   neighbour's load falls on all models alike;
3. decode: the prompt fills a cache, then greedy tokens one at a time, round-robin over the models; per-token latency,
   the cache's bytes and the integral state's bytes per layer (every tensor of a cache layer beside keys/values);
4. batched `generate()` (with `--generate-rounds`): a batch of prompts, greedy new tokens, one whole call per model
   and round, round-robin (issue 31);
5. the tensor ops each model dispatches per step (`count_ops.py`): what a launch-bound GPU pays per op.

`--steps` picks the whole-sequence steps of 2: `forward`, `forward_backward` (the default pair) and `prefill` (no
gradient, a fresh cache, the last position's logits: what generate() does first). `--size` picks a model size of
`bench_common.SIZE_PRESETS` (SmolLM2-135M's and a 1B shape among them; random weights, nothing downloaded); the models
share one copy of the weights.

Writes `<name>.json` (raw samples, machine, versions, command), `<name>.md` (ratio and absolute tables) and, with
`--plot`, `<name>.png` to `--output-dir` (default `bench/results/run_benchmark/<machine kind>/`, the committed results;
with `--quick`, `outputs/bench/run_benchmark_quick/`); `--name` defaults to `<size>_<dtype>`. Run `python bench/run_benchmark.py --quick` for a one-to-two-minute smoke
run; `--help` lists the knobs.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
import count_ops  # noqa: E402
import report  # noqa: E402


BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--dtype", default=None, choices=sorted(bench_common.DTYPES), help="fp32 on CPU, bf16 on GPU")
    parser.add_argument(
        "--attn", default="sdpa", help="backend of dint_fast, diffllama and llama (sdpa, flash_attention_2, ...)"
    )
    parser.add_argument("--models", default=",".join(bench_common.MODEL_NAMES), help="comma-separated subset")
    parser.add_argument("--seq-lens", default=None, help="lengths of the --steps, comma-separated")
    parser.add_argument(
        "--steps", default="forward,forward_backward", help="comma-separated: forward, forward_backward, prefill"
    )
    parser.add_argument("--prompt-lens", default=None, help="decode prompt lengths, comma-separated")
    bench_common.add_model_size_arguments(parser)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per model and length")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per model and length")
    parser.add_argument("--decode-warmup", type=int, default=2, help="untimed decode samples (blocks)")
    parser.add_argument("--decode-blocks", type=int, default=16, help="timed decode samples per model and prompt")
    parser.add_argument("--decode-block", type=int, default=4, help="consecutive tokens per decode sample")
    parser.add_argument("--generate-rounds", type=int, default=0, help="timed generate() rounds (0: no generate phase)")
    parser.add_argument("--generate-warmup", type=int, default=1, help="untimed generate() rounds")
    parser.add_argument("--generate-batch", type=int, default=8, help="prompts per generate() call")
    parser.add_argument("--generate-prompt-len", type=int, default=128, help="tokens per generate() prompt")
    parser.add_argument("--generate-new-tokens", type=int, default=32, help="greedy tokens each prompt gets")
    parser.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="largest peak memory one step may need (CPU default 10, GPU default 80%% of the card); a step whose "
        "extrapolated need exceeds it is skipped with a note",
    )
    parser.add_argument(
        "--eager-max-len",
        type=int,
        default=None,
        help="longest sequence for the O(N^2) eager reference (CPU default 4096: time; GPU default none)",
    )
    parser.add_argument(
        "--cudnn-sdpa",
        action="store_true",
        help="let sdpa pick its cuDNN backend on CUDA (off by default: cuDNN builds an execution plan for every new "
        "key length, i.e. every decode step, and in one process only the model that meets a length first pays)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--quick", action="store_true", help="small lengths, 1 repetition: a 1-2 minute smoke run")
    parser.add_argument("--output-dir", default=None,
                        help="default: bench/results/run_benchmark/<machine kind>; with --quick outputs/bench/run_benchmark_quick")
    parser.add_argument("--name", default=None, help="the result files' name (default: <size>_<dtype>)")
    parser.add_argument("--plot", action="store_true", help="also write <name>.png (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    is_cuda = args.device.startswith("cuda")
    if args.dtype is None:
        args.dtype = "bf16" if is_cuda else "fp32"
    if args.quick:
        args.seq_lens = args.seq_lens or "256,512,1024"
        args.prompt_lens = args.prompt_lens or "128,512"
        args.warmup, args.repeats = 1, 2
        args.decode_warmup, args.decode_blocks = 1, 3
    default_lens = "1024,2048,4096,8192,16384,32768" if is_cuda else "512,1024,2048,4096,8192"
    args.seq_lens = [int(n) for n in (args.seq_lens or default_lens).split(",")]
    args.prompt_lens = [int(n) for n in (args.prompt_lens or "128,512,2048,4096,8192").split(",")]
    args.models = [name.strip() for name in args.models.split(",")]
    args.steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown_steps = [step for step in args.steps if step not in STEPS]
    if unknown_steps:
        parser.error(f"--steps: {unknown_steps} not among {list(STEPS)}")
    unknown = [name for name in args.models if name not in bench_common.MODEL_NAMES]
    if unknown:
        parser.error(f"--models: {unknown} not among {bench_common.MODEL_NAMES}")
    if args.memory_budget_gb is None:
        if is_cuda:
            args.memory_budget_gb = 0.8 * torch.cuda.get_device_properties(args.device).total_memory / 2**30
        else:
            args.memory_budget_gb = 10.0
    if args.eager_max_len is None:
        args.eager_max_len = 0 if is_cuda else 4096
    args.max_positions = max(
        args.seq_lens
        + [p + (args.decode_warmup + args.decode_blocks) * args.decode_block + 1 for p in args.prompt_lens]
        + [args.generate_prompt_len + args.generate_new_tokens]
    )
    args.name = args.name or f"{args.size}_{args.dtype}"
    if args.output_dir is None:
        # --quick (a smoke run) must not overwrite the committed results the READMEs link: outputs/ is git-ignored.
        args.output_dir = (
            os.path.join("outputs", "bench", "run_benchmark_quick") if args.quick
            else bench_common.results_dir("run_benchmark", args.device)
        )
    return args


@contextlib.contextmanager
def timed_region(device: str):
    """Wall time of the block (`seconds`), the device synchronized on both ends, and the CPU time this process spent
    in it (`cpu_seconds`, all its threads), Python's cyclic garbage collector off inside (a full collection over four
    models' objects takes tens of milliseconds and would land on whichever model runs when it triggers).

    The CPU time leaves out the time other processes held the cores, so on a shared machine it is the steadier
    measure with one torch thread (`--threads 1`); with several, it also counts the threads' spin-waits."""
    timer = {"seconds": None, "cpu_seconds": None}
    collector_was_enabled = gc.isenabled()
    gc.disable()
    try:
        bench_common.synchronize(device)
        started, cpu_started = time.perf_counter(), time.process_time()
        yield timer
        bench_common.synchronize(device)
        timer["seconds"] = time.perf_counter() - started
        timer["cpu_seconds"] = time.process_time() - cpu_started
    finally:
        if collector_was_enabled:
            gc.enable()


def summarize(samples: list[float]) -> dict:
    ordered = sorted(samples)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {
        "samples": samples,
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "iqr": quartiles[2] - quartiles[0],
    }


class Skips:
    """Decides which (model, length, step) to skip, and records why."""

    def __init__(self, args):
        self.args = args
        self.reasons: dict[tuple, str] = {}
        self.peaks: dict[tuple, list[tuple[int, int]]] = {}  # (model, mode) -> [(seq_len, peak_bytes)]

    def record_peak(self, model: str, mode: str, seq_len: int, peak_bytes: int | None) -> None:
        if peak_bytes:
            self.peaks.setdefault((model, mode), []).append((seq_len, peak_bytes))

    def mark(self, model: str, mode: str, seq_len: int, reason: str) -> None:
        self.reasons[(model, mode, seq_len)] = reason

    def reason(self, model: str, mode: str, seq_len: int) -> str | None:
        """Why the step is skipped, or None. `mode`: forward, forward_backward, prefill or decode (a prefill, and
        decode's, is a forward of the prompt)."""
        if (model, mode, seq_len) in self.reasons:
            return self.reasons[(model, mode, seq_len)]
        if model == "dint_eager" and self.args.eager_max_len and seq_len > self.args.eager_max_len:
            return f"eager reference capped at {self.args.eager_max_len} tokens (--eager-max-len; O(N^2) time)"
        memory_mode = "forward" if mode in ("decode", "prefill") else mode  # a prefill is a forward of the prompt
        if (model, memory_mode, seq_len) in self.reasons:
            return self.reasons[(model, memory_mode, seq_len)]
        measured = [(n, peak) for n, peak in self.peaks.get((model, memory_mode), []) if n < seq_len]
        if measured:
            known_len, known_peak = max(measured)
            # The eager reference materializes N x N maps (quadratic); the other models keep O(N) activations.
            exponent = 2 if model == "dint_eager" else 1
            predicted = known_peak * (seq_len / known_len) ** exponent
            if predicted > self.args.memory_budget_gb * 2**30:
                return (
                    f"predicted peak {predicted / 2**30:.1f} GiB (from {known_peak / 2**30:.2f} GiB at {known_len}) "
                    f"over the {self.args.memory_budget_gb:.0f} GiB budget (--memory-budget-gb)"
                )
        return None


def measure_cpu_memory(args, size_kwargs: dict, skips: Skips, log) -> list[dict]:
    """Peak memory per model and length, each in a fresh process (see `probe_memory.py`)."""
    results = []
    for seq_len in args.seq_lens:
        for model in args.models:
            modes = [m for m in ("forward", "forward_backward") if skips.reason(model, m, seq_len) is None]
            for mode in ("forward", "forward_backward"):
                if mode not in modes:
                    reason = skips.reason(model, mode, seq_len)
                    skips.mark(model, mode, seq_len, reason)
                    results.append({"model": model, "seq_len": seq_len, "mode": mode, "status": "skipped",
                                    "peak_bytes": None, "note": reason})
            if not modes:
                continue
            command = [
                bench_common.python_executable(), os.path.join(BENCH_DIR, "probe_memory.py"),
                "--model", model, "--seq-len", str(seq_len), "--steps", ",".join(modes),
                "--size-json", json.dumps(size_kwargs), "--attn", args.attn, "--dtype", args.dtype,
                "--batch-size", str(args.batch_size), "--budget-gb", str(args.memory_budget_gb),
                "--seed", str(args.seed),
            ]  # fmt: skip
            if args.threads:
                command += ["--threads", str(args.threads)]
            started = time.perf_counter()
            completed = subprocess.run(command, capture_output=True, text=True)
            lines = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
            if completed.returncode != 0 and len(lines) < len(modes):
                error = (completed.stderr.strip().splitlines() or ["?"])[-1]
                if completed.returncode < 0:
                    error = f"killed by signal {-completed.returncode} (memory?)"
                for mode in modes[len(lines):]:
                    lines.append({"model": model, "seq_len": seq_len, "mode": mode, "status": "failed",
                                  "peak_bytes": None, "note": error[:300]})  # fmt: skip
            for line in lines:
                results.append(line)
                if line["status"] == "ok":
                    skips.record_peak(model, line["mode"], seq_len, line["peak_bytes"])
                else:
                    skips.mark(model, line["mode"], seq_len, f"memory probe: {line['status']} ({line.get('note') or line.get('method')})")
            log(
                f"memory N={seq_len:>6} {model:<10} "
                + " ".join(f"{l['mode']}={_gib(l['peak_bytes'])}" for l in lines)
                + f"  ({time.perf_counter() - started:.0f}s)"
            )
    return results


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}GiB"


STEPS = {
    "forward": bench_common.forward_step,
    "forward_backward": bench_common.train_step,
    "prefill": bench_common.prefill,
}
"""The whole-sequence steps `--steps` picks from."""


def measure_steps(args, models: dict, skips: Skips, log) -> list[dict]:
    """Interleaved timing of the `--steps` (and GPU peak memory)."""
    device, results = args.device, []
    is_cuda = device.startswith("cuda")
    for seq_len in args.seq_lens:
        input_ids = bench_common.make_input_ids(seq_len, args.batch_size, args.vocab_size, device)
        for mode in args.steps:
            step = STEPS[mode]
            if mode == "forward_backward":
                for model in models.values():
                    model.train()
            active = []
            for name in models:
                reason = skips.reason(name, mode, seq_len)
                if reason is None:
                    active.append(name)
                else:
                    results.append({"model": name, "seq_len": seq_len, "mode": mode, "skipped": reason})
            samples = {name: [] for name in active}
            cpu_samples = {name: [] for name in active}
            peaks = {name: 0 for name in active}
            failed = {}
            for repetition in range(args.warmup + args.repeats):
                shift = repetition % max(len(active), 1)
                for name in active[shift:] + active[:shift]:
                    if name in failed:
                        continue
                    gc.collect()  # outside the timed region; the collector stays off inside it (see `timed_region`)
                    if is_cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                        allocated_before = torch.cuda.memory_allocated(device)
                    try:
                        with timed_region(device) as timer:
                            step(models[name], input_ids)
                        elapsed = timer["seconds"]
                    except torch.OutOfMemoryError as error:
                        failed[name] = f"out of memory: {str(error).splitlines()[0][:200]}"
                        models[name].zero_grad(set_to_none=True)
                        bench_common.collect_garbage(device)
                        continue
                    if is_cuda:
                        peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) - allocated_before)
                    if repetition >= args.warmup:
                        samples[name].append(elapsed)
                        cpu_samples[name].append(timer["cpu_seconds"])
                for name in active:
                    models[name].zero_grad(set_to_none=True)
            for model in models.values():
                model.eval()
            for name in active:
                if name in failed:
                    skips.mark(name, mode, seq_len, failed[name])
                    results.append({"model": name, "seq_len": seq_len, "mode": mode, "skipped": failed[name]})
                    continue
                entry = {"model": name, "seq_len": seq_len, "mode": mode, "time_s": summarize(samples[name]),
                         "cpu_time_s": summarize(cpu_samples[name])}  # fmt: skip
                if is_cuda:
                    entry["peak_bytes"] = peaks[name]
                    skips.record_peak(name, mode, seq_len, peaks[name])
                results.append(entry)
            log(
                f"time   N={seq_len:>6} {mode:<16} "
                + " ".join(
                    f"{name}={statistics.median(samples[name]):.3f}s" for name in active if name not in failed
                )
            )
    return results


def measure_decode(args, models: dict, skips: Skips, log) -> list[dict]:
    """Per-token decode latency after each prompt, round-robin over the models, plus cache bytes."""
    device, results = args.device, []
    for prompt_len in args.prompt_lens:
        prompt_ids = bench_common.make_input_ids(prompt_len, args.batch_size, args.vocab_size, device, seed=2)
        states, active = {}, []
        for name in models:
            reason = skips.reason(name, "decode", prompt_len)
            if reason is not None:
                results.append({"model": name, "prompt_len": prompt_len, "skipped": reason})
                continue
            bench_common.collect_garbage(device)
            try:
                cache, next_token = bench_common.prefill(models[name], prompt_ids)
            except torch.OutOfMemoryError as error:
                results.append({"model": name, "prompt_len": prompt_len, "skipped": f"prefill out of memory: {error}"})
                continue
            states[name] = {
                "cache": cache,
                "next_token": next_token,
                "layers_after_prefill": bench_common.cache_layer_bytes(cache),
                "samples": [],
                "cpu_samples": [],
            }
            active.append(name)
        # Each sample times `--decode-block` consecutive tokens of one model (a hiccup of the host then spreads over
        # the models instead of landing on whichever model a periodic one falls on); blocks run round-robin.
        for block_index in range(args.decode_warmup + args.decode_blocks):
            shift = block_index % max(len(active), 1)
            for name in active[shift:] + active[:shift]:
                state = states[name]
                with timed_region(device) as timer:
                    for _ in range(args.decode_block):
                        state["next_token"] = bench_common.decode_step(models[name], state["cache"], state["next_token"])
                if block_index >= args.decode_warmup:
                    state["samples"].append(timer["seconds"] / args.decode_block)
                    state["cpu_samples"].append(timer["cpu_seconds"] / args.decode_block)
        for name in active:
            state = states[name]
            layers_after_decode = bench_common.cache_layer_bytes(state["cache"])
            results.append(
                {
                    "model": name,
                    "prompt_len": prompt_len,
                    "decoded_tokens": (args.decode_warmup + args.decode_blocks) * args.decode_block,
                    "per_token_s": summarize(state["samples"]),
                    "per_token_cpu_s": summarize(state["cpu_samples"]),
                    "cache_bytes_after_prefill": sum(l["kv_bytes"] + l["integral_bytes"] for l in state["layers_after_prefill"]),
                    "kv_bytes_after_prefill": sum(l["kv_bytes"] for l in state["layers_after_prefill"]),
                    "integral_bytes_per_layer_after_prefill": [l["integral_bytes"] for l in state["layers_after_prefill"]],
                    "integral_bytes_per_layer_after_decode": [l["integral_bytes"] for l in layers_after_decode],
                }
            )  # fmt: skip
        log(
            f"decode P={prompt_len:>6} "
            + " ".join(f"{name}={1e3 * statistics.median(states[name]['samples']):.2f}ms" for name in active)
            + "  integral B/layer: "
            + " ".join(f"{name}={states[name]['layers_after_prefill'][0]['integral_bytes']}" for name in active)
        )
        del states
        bench_common.collect_garbage(device)
    return results


def measure_generate(args, models: dict, log) -> list[dict]:
    """Batched greedy `generate()`: `--generate-batch` prompts of `--generate-prompt-len` tokens (no padding), exactly
    `--generate-new-tokens` new tokens each; one whole call per model and round, round-robin with the order rotated
    every round, after `--generate-warmup` untimed rounds."""
    from transformers import GenerationConfig

    device = args.device
    prompt_ids = bench_common.make_input_ids(
        args.generate_prompt_len, args.generate_batch, args.vocab_size, device, seed=5
    )
    attention_mask = torch.ones_like(prompt_ids)
    generation_config = GenerationConfig(
        max_new_tokens=args.generate_new_tokens,
        min_new_tokens=args.generate_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    names = list(models)
    samples = {name: [] for name in names}
    cpu_samples = {name: [] for name in names}
    for round_index in range(args.generate_warmup + args.generate_rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            with torch.no_grad(), timed_region(device) as timer:
                output = models[name].generate(
                    prompt_ids, attention_mask=attention_mask, generation_config=generation_config
                )
            if output.shape != (args.generate_batch, args.generate_prompt_len + args.generate_new_tokens):
                raise RuntimeError(f"{name}: generate() returned {tuple(output.shape)}")
            if round_index >= args.generate_warmup:
                samples[name].append(timer["seconds"])
                cpu_samples[name].append(timer["cpu_seconds"])
    log(
        f"generate B={args.generate_batch} prompt={args.generate_prompt_len} new={args.generate_new_tokens} "
        + " ".join(f"{name}={statistics.median(samples[name]):.3f}s" for name in names)
        + f"  load={bench_common.load_average()}"
    )
    return [
        {
            "model": name,
            "batch_size": args.generate_batch,
            "prompt_len": args.generate_prompt_len,
            "new_tokens": args.generate_new_tokens,
            "time_s": summarize(samples[name]),
            "cpu_time_s": summarize(cpu_samples[name]),
        }
        for name in names
    ]


def sanity_checks(models: dict, args) -> dict:
    """The comparison is only meaningful if the models compute what they claim: DINT fast == DINT eager."""
    checks = {}
    input_ids = bench_common.make_input_ids(64, 1, args.vocab_size, args.device, seed=3)
    with torch.no_grad():
        logits = {name: model(input_ids=input_ids, use_cache=False).logits.float() for name, model in models.items()}
    if "dint_fast" in logits and "dint_eager" in logits:
        checks["max_abs_logit_diff_dint_fast_vs_eager"] = (logits["dint_fast"] - logits["dint_eager"]).abs().max().item()
    return checks


def count_tensor_ops(models: dict, args) -> dict:
    """Non-view aten ops per forward, decode step and (where `--steps` times it) forward+backward of each model (a
    64-token sequence; the counts do not depend on the length)."""
    input_ids = bench_common.make_input_ids(64, args.batch_size, args.vocab_size, args.device, seed=4)
    steps = [step for step in count_ops.STEPS if step != "forward_backward" or step in args.steps]
    return {
        name: {
            step: sum(counter.values()) for step, counter in count_ops.count_model_ops(model, input_ids, steps).items()
        }
        for name, model in models.items()
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    os.makedirs(args.output_dir, exist_ok=True)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    size_kwargs = bench_common.model_size_kwargs(args)
    dtype = bench_common.DTYPES[args.dtype]
    log(
        f"models {args.models} at {args.size} {size_kwargs}, {args.dtype}, attn={args.attn}, device={args.device}, "
        f"{torch.get_num_threads()} threads, load {bench_common.load_average()}"
    )
    skips = Skips(args)
    load_at_start = bench_common.load_average()
    if load_at_start and load_at_start[0] > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load_at_start} on {os.cpu_count()} CPUs: other work will add noise to the timings")

    memory_results = []
    if not args.device.startswith("cuda") and not args.no_memory:
        memory_results = measure_cpu_memory(args, size_kwargs, skips, log)

    models = bench_common.build_models(
        {name: (name, args.attn) for name in args.models}, size_kwargs, dtype, args.device, seed=args.seed
    )
    checks = sanity_checks(models, args)
    log(f"sanity {checks}")
    op_counts = count_tensor_ops(models, args)
    log(f"tensor ops per step {op_counts}")
    step_results = measure_steps(args, models, skips, log)
    decode_results = measure_decode(args, models, skips, log)
    generate_results = measure_generate(args, models, log) if args.generate_rounds > 0 else []

    results = {
        "machine": {**bench_common.machine_info(args.device), "load_average_at_start": load_at_start},
        "settings": {
            key: value for key, value in vars(args).items() if key not in ("output_dir",)
        },
        "model_config": size_kwargs,
        "parameters": {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()},
        "sanity": checks,
        "op_counts": op_counts,
        "memory": memory_results,
        "steps": step_results,
        "decode": decode_results,
        "generate": generate_results,
        "wall_s": time.perf_counter() - started,
    }
    json_path = os.path.join(args.output_dir, f"{args.name}.json")
    with open(json_path, "w") as handle:
        json.dump(results, handle, indent=1)
    written = report.write_report(results, os.path.join(args.output_dir, args.name), plot=args.plot)
    log(f"wrote {json_path}, {', '.join(written)}")
    print(open(written[0]).read())


if __name__ == "__main__":
    main()
