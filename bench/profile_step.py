# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Where DINT's time goes, next to DiffLlama's: torch.profiler over one step of each, op by op.

    python bench/profile_step.py --step forward_backward --seq-len 2048
    python bench/profile_step.py --step decode --seq-len 2048      # one token after a 2048-token prompt
    python bench/profile_step.py --size mid --step generate --batch-size 8 --seq-len 128 --new-tokens 32

Prints, per model, the ops by self time (CPU, or CUDA with --device cuda), then the ops whose summed self time
differs most between DINT fast and DiffLlama: the extra cost of the integral term, op by op. `--export-trace` writes a
Chrome trace per model (open in chrome://tracing or Perfetto).
"""

import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402


def make_step(model, args):
    """A closure running one step of `args.step` on `model` (decode: one token, the cache grows by one each call;
    generate: one whole greedy `generate()` call of `--new-tokens` tokens on the `--seq-len` prompts)."""
    input_ids = bench_common.make_input_ids(args.seq_len, args.batch_size, args.vocab_size, args.device)
    if args.step == "forward":
        return lambda: bench_common.forward_step(model, input_ids)
    if args.step == "forward_backward":
        return lambda: bench_common.train_step(model, input_ids)
    if args.step == "prefill":
        return lambda: bench_common.prefill(model, input_ids)
    if args.step == "generate":
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
        )
        attention_mask = torch.ones_like(input_ids)

        def generate():
            with torch.no_grad():
                model.generate(input_ids, attention_mask=attention_mask, generation_config=config)

        return generate
    cache, next_token = bench_common.prefill(model, input_ids)
    state = {"token": next_token}

    def decode_one_token():
        state["token"] = bench_common.decode_step(model, cache, state["token"])

    return decode_one_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--step", default="forward_backward", choices=["forward", "forward_backward", "prefill", "decode", "generate"]
    )
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length, or prompt length for decode")
    parser.add_argument("--models", default="dint_fast,diffllama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=sorted(bench_common.DTYPES))
    parser.add_argument("--attn", default="sdpa")
    bench_common.add_model_size_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=32, help="generate: greedy new tokens per prompt")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=3, help="profiled steps (after one warm-up)")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--export-trace", default=None, help="folder for Chrome traces")
    args = parser.parse_args()
    args.max_positions = args.seq_len + max(2 * args.repeats, args.new_tokens) + 8
    if args.threads:
        torch.set_num_threads(args.threads)
    size_kwargs = bench_common.model_size_kwargs(args)
    is_cuda = args.device.startswith("cuda")
    if is_cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # as run_benchmark.py (see its --cudnn-sdpa)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    sort_key = "self_cuda_time_total" if is_cuda else "self_cpu_time_total"

    # Build and warm up every model before profiling any: the first steps of a process pay for fresh memory pages
    # (page faults inside whatever op first touches them), which would land on the first model profiled.
    names = args.models.split(",")
    models = bench_common.build_models(
        {name: (name, args.attn) for name in names}, size_kwargs, bench_common.DTYPES[args.dtype], args.device
    )
    print(f"size {args.size} {size_kwargs}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"load {bench_common.load_average()}")  # fmt: skip
    steps = {}
    for name in names:
        steps[name] = make_step(models[name], args)
        steps[name]()
    for name in steps:
        steps[name]()
    bench_common.synchronize(args.device)

    # Profiled round-robin, one step per model and round, the order rotated every round (as run_benchmark.py times):
    # a drift of the shared machine falls on both models alike. Per op: self time and calls summed over the rounds.
    self_times = {name: {} for name in steps}
    wall_times = {name: [] for name in steps}
    tables = {}
    for round_index in range(args.repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            with profile(activities=activities) as profiler:
                started = time.perf_counter()
                steps[name]()
                bench_common.synchronize(args.device)
                wall_times[name].append(time.perf_counter() - started)
            averages = profiler.key_averages()
            tables[name] = averages
            attribute = "self_device_time_total" if is_cuda else "self_cpu_time_total"
            for event in averages:
                total, count = self_times[name].get(event.key, (0.0, 0))
                self_times[name][event.key] = (total + getattr(event, attribute), count + event.count)
            if args.export_trace and round_index == args.repeats - 1:
                os.makedirs(args.export_trace, exist_ok=True)
                profiler.export_chrome_trace(os.path.join(args.export_trace, f"{name}_{args.step}_{args.seq_len}.json"))
    for name in names:
        print(f"\n=== {name}: {args.step}, N={args.seq_len}, batch {args.batch_size}, the last of {args.repeats} "
              "profiled steps ===")  # fmt: skip
        print(tables[name].table(sort_by=sort_key, row_limit=args.rows))
    print(f"\nload average after: {bench_common.load_average()}")
    print("wall time per profiled step, ms, median [min-max] (the profiler adds a few us per op): " + ", ".join(
        f"{name} {1e3 * statistics.median(wall_times[name]):.2f} [{1e3 * min(wall_times[name]):.2f}-"
        f"{1e3 * max(wall_times[name]):.2f}]" for name in names))  # fmt: skip
    if len(names) == 2:
        ratios = [a / b for a, b in zip(wall_times[names[0]], wall_times[names[1]])]
        print(f"paired wall-time ratio {names[0]} / {names[1]}: median {statistics.median(ratios):.3f} over "
              f"{len(ratios)} rounds")  # fmt: skip

    names = list(self_times)
    if len(names) == 2:
        first, second = names
        keys = set(self_times[first]) | set(self_times[second])
        rows = []
        for key in keys:
            time_first, count_first = self_times[first].get(key, (0.0, 0))
            time_second, count_second = self_times[second].get(key, (0.0, 0))
            rows.append((time_first - time_second, key, time_first, time_second, count_first, count_second))
        rows.sort(reverse=True)
        total_first = sum(t for t, _ in self_times[first].values())
        total_second = sum(t for t, _ in self_times[second].values())
        per_step = 1e3 * args.repeats
        print(f"\n=== self time of the ops per step, ms: {first} {total_first / per_step:.2f}, {second} "
              f"{total_second / per_step:.2f} (ratio {total_first / max(total_second, 1e-9):.3f}); wall time minus "
              "the ops' self time (Python between the ops, the profiler): "
              + ", ".join(f"{name} {1e3 * statistics.mean(wall_times[name]) - sum(t for t, _ in self_times[name].values()) / per_step:.2f}"
                          for name in names) + " (mean wall time per step minus the mean op time) ===")  # fmt: skip
        print(f"{'op':<48} {'extra ms/step':>13} {first + ' ms':>14} {second + ' ms':>14} {'calls':>13}")
        for difference, key, time_first, time_second, count_first, count_second in rows[: args.rows]:
            print(
                f"{key[:48]:<48} {difference / per_step:>13.3f} {time_first / per_step:>14.3f} "
                f"{time_second / per_step:>14.3f} {count_first // args.repeats:>6}/{count_second // args.repeats:<6}"
            )


if __name__ == "__main__":
    main()
