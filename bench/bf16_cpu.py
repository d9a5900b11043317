# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Is bf16 the faster dtype for inference on this machine's CPU? DINT, DiffLlama and Llama in fp32 and in bf16, all
in one interleaved run (issue 31).

Every model runs in both dtypes (six models, the weights of each dtype shared by its three models); the timed steps
are `run_benchmark.py`'s, round-robin over the six: `--steps` (prefill by default) at `--seq-lens`, per-token decode
after `--prompt-lens`, and batched `generate()` with `--generate-rounds`. Ratios are medians of the per-round ratios
(bf16 over fp32 for one model; DINT over DiffLlama within one dtype), by wall time and by CPU time. bf16 keeps DINT's
lambda vectors and integral statistics in fp32 (`from_pretrained(dtype=torch.bfloat16)` gives the same).

    python bench/bf16_cpu.py --size smollm2-135m --seq-lens 512,2048 --prompt-lens 128 --generate-rounds 3

Writes `<size>.json` and `<size>.md` to `--output-dir` (default `bench/results/bf16_cpu/cpu/`). Any
`run_benchmark.py` flag is accepted (`--threads`, `--repeats`, `--decode-blocks`, ...); `--dtype` and
`--models` name what is compared here: `--dtypes` (default fp32,bf16) and `--models` (default dint_fast,diffllama,
llama).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
import run_benchmark  # noqa: E402
from report import _paired_ratio  # noqa: E402



def parse_args(argv=None):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--models", default="dint_fast,diffllama,llama")
    parser.add_argument("--output-dir", default=None)
    own, rest = parser.parse_known_args(argv)
    rest = ["--no-memory", "--models", own.models] + rest
    if not any(arg.startswith("--steps") for arg in rest):
        rest += ["--steps", "prefill"]
    if not any(arg.startswith("--seq-lens") for arg in rest):
        rest += ["--seq-lens", "512,2048"]
    if not any(arg.startswith("--prompt-lens") for arg in rest):
        rest += ["--prompt-lens", "128"]
    args = run_benchmark.parse_args(rest + ["--output-dir", "unused"])
    args.dtypes = own.dtypes.split(",")
    args.output_dir = own.output_dir or bench_common.results_dir("bf16_cpu", "cpu")
    return args


def label(name: str, dtype: str) -> str:
    return f"{name}@{dtype}"


def samples_of(results: dict) -> dict:
    """`{(kind, length, label): (wall samples, cpu samples)}` from the measured entries."""
    samples = {}
    for entry in results["steps"]:
        if "time_s" in entry:
            key = (entry["mode"], entry["seq_len"], entry["model"])
            samples[key] = (entry["time_s"]["samples"], entry["cpu_time_s"]["samples"])
    for entry in results["decode"]:
        if "per_token_s" in entry:
            key = ("decode", entry["prompt_len"], entry["model"])
            samples[key] = (entry["per_token_s"]["samples"], entry["per_token_cpu_s"]["samples"])
    for entry in results["generate"]:
        samples[("generate", entry["prompt_len"], entry["model"])] = (
            entry["time_s"]["samples"], entry["cpu_time_s"]["samples"]
        )
    return samples


def render(results: dict, args) -> str:
    samples = samples_of(results)
    machine = results["machine"]
    names, dtypes = args.models, args.dtypes
    steps = sorted({(kind, length) for kind, length, _ in samples}, key=lambda item: (item[0], item[1]))
    lines = [
        f"# bf16 against fp32 on this CPU ({args.size})",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Machine: {machine['processor']}, {machine['cpu_count']} CPUs, {machine['torch_threads']} torch threads, torch "
        f"{machine['torch']} (CPU capability {results['cpu_capability']}), transformers {machine['transformers']}, "
        f"commit {machine['git_commit']}, {machine['date_utc']}; load average (1, 5, 15 min) before "
        f"{results['load_before']}, after {results['load_after']}; {results['wall_s'] / 60:.1f} min.",
        "",
        f"Model: {results['model_config']}; batch {args.batch_size} (generate: {args.generate_batch} prompts of "
        f"{args.generate_prompt_len} tokens, {args.generate_new_tokens} new tokens).",
        "",
        "Median seconds (decode: per token) [wall | CPU time]:",
        "",
        "| step | " + " | ".join(label(n, d) for d in dtypes for n in names) + " |",
        "| --- |" + " --- |" * (len(names) * len(dtypes)),
    ]
    for kind, length in steps:
        cells = []
        for dtype in dtypes:
            for name in names:
                wall_cpu = samples.get((kind, length, label(name, dtype)))
                cells.append("–" if wall_cpu is None else
                             f"{statistics.median(wall_cpu[0]):.4f} \\| {statistics.median(wall_cpu[1]):.4f}")  # fmt: skip
        lines.append(f"| {kind} {length} | " + " | ".join(cells) + " |")

    def ratio(kind, length, first, second, clock):
        a, b = samples.get((kind, length, first)), samples.get((kind, length, second))
        return None if a is None or b is None else _paired_ratio(a[clock], b[clock])

    def fmt(value):
        return "–" if value is None else f"{value:.3f}"

    lines += ["", "Paired ratios, wall time (CPU time):", ""]
    header = [f"{n} bf16/fp32" for n in names if len(dtypes) == 2]
    header += [f"DINT/DiffLlama {d}" for d in dtypes] + [f"DiffLlama/Llama {d}" for d in dtypes]
    lines += ["| step | " + " | ".join(header) + " |", "| --- |" + " --- |" * len(header)]
    for kind, length in steps:
        cells = []
        if len(dtypes) == 2:
            for name in names:
                pair = (kind, length, label(name, dtypes[1]), label(name, dtypes[0]))
                cells.append(f"{fmt(ratio(*pair, 0))} ({fmt(ratio(*pair, 1))})")
        for first, second in (("dint_fast", "diffllama"), ("diffllama", "llama")):
            for dtype in dtypes:
                pair = (kind, length, label(first, dtype), label(second, dtype))
                cells.append(f"{fmt(ratio(*pair, 0))} ({fmt(ratio(*pair, 1))})")
        lines.append(f"| {kind} {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.output_dir, exist_ok=True)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    size_kwargs = bench_common.model_size_kwargs(args)
    load_before = bench_common.load_average()
    models = {}
    for dtype in args.dtypes:
        built = bench_common.build_models(
            {label(n, dtype): (n, args.attn) for n in args.models}, size_kwargs, bench_common.DTYPES[dtype], "cpu"
        )
        models.update(built)
    log(f"{list(models)} at {args.size} {size_kwargs}, {torch.get_num_threads()} threads, load {load_before}")
    skips = run_benchmark.Skips(args)
    step_results = run_benchmark.measure_steps(args, models, skips, log) if args.seq_lens else []
    decode_results = run_benchmark.measure_decode(args, models, skips, log) if args.prompt_lens else []
    generate_results = run_benchmark.measure_generate(args, models, log) if args.generate_rounds > 0 else []
    command = "python bench/bf16_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {
        "command": command,
        "machine": bench_common.machine_info("cpu"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_before": load_before,
        "load_after": bench_common.load_average(),
        "model_config": size_kwargs,
        "settings": {key: value for key, value in vars(args).items() if key != "output_dir"},
        "steps": step_results,
        "decode": decode_results,
        "generate": generate_results,
        "wall_s": time.perf_counter() - started,
    }
    bench_common.write_result(results, os.path.join(args.output_dir, f"{args.size}.json"), render(results, args))


if __name__ == "__main__":
    main()
