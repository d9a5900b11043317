# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The integral's tail of one attention layer alone, next to DiffLlama's: from the signal and noise outputs of the
attention call to the head-normed output in the model's dtype.

    python bench/micro_integral.py                       # SmolLM2-135M's heads: 9 x 128 channels, fp32 and bf16
    python bench/micro_integral.py --heads 16 --channels 128 --rows 1x2048 8x128 8x1

Per shape and dtype, interleaved rounds of: DINT with the fused CPU kernel (`modeling_dint/integral_cpu_kernel.py`),
DINT's eager ops (what runs without the kernel, and in training), and transformers' DiffLlama tail (`attn1 - lambda *
attn2`, its `DiffLlamaRMSNorm` group norm, `* (1 - lambda_init)`), under `torch.no_grad()`, one torch thread. Prints
the median per call (by the thread's CPU time and by wall time) and the ratios to DiffLlama, with the CPU model and
the load average before and after.
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
import modeling_dint.integral_cpu_kernel as kernel_module  # noqa: E402
from modeling_dint.integral_dint import CPU_KERNEL, EAGER, DintIntegral, DintIntegralLayout, plan_integral  # noqa: E402
from modeling_dint.modeling_dint import DintHeadRMSNorm  # noqa: E402


def tails(batch_size, rows, heads, channels, dtype):
    """The three callables on the same attention output `[B, T, 2 heads, C]`."""
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaRMSNorm

    generator = torch.Generator().manual_seed(0)
    attention_output = torch.randn(batch_size, rows, 2 * heads, channels, generator=generator).to(dtype)
    signal_output, noise_output = attention_output.chunk(2, dim=2)
    lambda_ = torch.tensor(0.37)
    layout = DintIntegralLayout.build(None, None, None, batch_size, rows, "cpu", False)
    integral = DintIntegral("mean", 0)
    head_norm = DintHeadRMSNorm(channels, eps=1e-5).to(dtype)
    group_norm = DiffLlamaRMSNorm(channels, eps=1e-5).to(dtype)
    kernel = kernel_module.integral_kernel()

    def planned() -> DintIntegralLayout:  # as a forward without gradient plans it, once for all layers
        with torch.no_grad():
            return plan_integral(
                copy.copy(layout), None, torch.device("cpu"), dtype, signal_output.numel(), False, False
            )

    kernel_layout = planned()
    kernel_module._state["op"] = None  # the plan where the kernel is not built: the eager ops
    try:
        eager_layout = planned()
    finally:
        kernel_module._state["op"] = kernel
    assert (kernel_layout.implementation, eager_layout.implementation) == (CPU_KERNEL, EAGER)

    def dint_kernel():
        return integral(signal_output, noise_output, lambda_, kernel_layout, head_norm)

    def dint_eager():
        return integral(signal_output, noise_output, lambda_, eager_layout, head_norm)

    def diffllama():  # transformers' DiffLlamaAttention after its two attention calls
        lambda_full = lambda_.to(dtype)
        output = signal_output - lambda_full * noise_output
        return (1 - 0.2) * group_norm(output)

    return {"dint_kernel": dint_kernel, "dint_eager": dint_eager, "diffllama": diffllama}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--rows", nargs="+", default=["1x2048", "8x128", "8x1"], help="BATCHxROWS per shape")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if kernel_module.integral_kernel() is None:
        raise SystemExit("the fused CPU integral kernel is not built here (see the warning above)")
    info = bench_common.machine_info("cpu")
    print(f"CPU: {info['processor']}; {info['cpu_count']} CPUs, torch threads 1, torch {info['torch']}, commit {info['git_commit']}; load average before: {bench_common.load_average()}")
    print(f"heads {args.heads} x channels {args.channels}; median ms per call by CPU time (wall time)")
    print("| B x T | dtype | DINT kernel | DINT eager | DiffLlama | kernel / DiffLlama | eager / DiffLlama |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with torch.no_grad():
        for shape in args.rows:
            batch_size, rows = (int(part) for part in shape.split("x"))
            for dtype_name in args.dtypes:
                calls = tails(batch_size, rows, args.heads, args.channels, bench_common.DTYPES[dtype_name])
                cpu = {name: [] for name in calls}
                wall = {name: [] for name in calls}
                for name, call in calls.items():  # warm-up
                    call()
                for round_index in range(args.rounds):
                    names = list(calls)
                    names = names[round_index % len(names):] + names[: round_index % len(names)]  # rotate the order
                    for name in names:
                        started, started_cpu = time.perf_counter(), time.thread_time()
                        calls[name]()
                        cpu[name].append(time.thread_time() - started_cpu)
                        wall[name].append(time.perf_counter() - started)
                median = {name: statistics.median(values) * 1e3 for name, values in cpu.items()}
                median_wall = {name: statistics.median(values) * 1e3 for name, values in wall.items()}
                cells = [f"{median[name]:.3f} ({median_wall[name]:.3f})" for name in calls]
                print(f"| {shape} | {dtype_name} | " + " | ".join(cells)
                      + f" | {median['dint_kernel'] / median['diffllama']:.2f} | "
                      f"{median['dint_eager'] / median['diffllama']:.2f} |", flush=True)
    print(f"load average after: {bench_common.load_average()}")


if __name__ == "__main__":
    main()
