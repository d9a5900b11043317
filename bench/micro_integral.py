# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The integral of one attention layer alone, in two parts:

- `--part tail` (the default, CPU): from the signal and noise outputs of the attention call to the head-normed output
  in the model's dtype. Per shape and dtype, interleaved rounds (the order rotating) of DINT with the fused CPU kernel
  (`modeling_dint/integral_cpu_kernel.py`), DINT's eager ops (what runs without the kernel, and in training), and
  transformers' DiffLlama tail (`attn1 - lambda * attn2`, its `DiffLlamaRMSNorm` group norm, `* (1 - lambda_init)`),
  under `torch.no_grad()`: the median per call by the thread's CPU time (and by wall time) and the ratios to DiffLlama.
- `--part running-sum`: the running sum over the query rows, forward and forward+backward: the package's
  `segmented_running_sum` (one document, and packed documents) against the scans it chooses between (blocked matrix
  multiplies on a CPU, a cumsum with the rows last elsewhere) and a cumsum along the rows in place, with each one's
  largest error against an fp64 cumsum. Medians over `--rounds` calls: the process's CPU time on a CPU, wall time with
  the device synchronized on CUDA.

    python bench/micro_integral.py --rounds 40                 # the tail at SmolLM2-135M's heads: 9 x 128 channels
    python bench/micro_integral.py --heads 16 --rows 1x2048 8x128 8x1
    python bench/micro_integral.py --part running-sum --rows 1x128 1x2048 1x8192
    python bench/micro_integral.py --part running-sum --device cuda --rows 1x2048 1x8192 1x32768 --heads 8

Tensors are `[B, T, heads, channels]` as the fast path's O1 (`heads` = H/2 differential heads, `channels` = 2 *
head_dim), one torch thread on a CPU. `--write` files the table under `bench/results/micro_integral/<machine kind>/`.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402


def tails(batch_size, rows, heads, channels, dtype):
    """The three callables on the same attention output `[B, T, 2 heads, C]`."""
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaRMSNorm

    import modeling_dint.integral_cpu_kernel as kernel_module
    from modeling_dint.integral_dint import DintIntegral, DintIntegralLayout, plan_integral
    from modeling_dint.modeling_dint import DintHeadRMSNorm

    generator = torch.Generator().manual_seed(0)
    attention_output = torch.randn(batch_size, rows, 2 * heads, channels, generator=generator).to(dtype)
    signal_output, noise_output = attention_output.chunk(2, dim=2)
    lambda_ = torch.tensor(0.37)

    def planned(kernel_variable: str) -> DintIntegralLayout:  # the plan a forward makes with DINT_INTEGRAL_KERNEL
        layout = DintIntegralLayout.build(None, None, None, batch_size, rows, "cpu", False)
        saved = os.environ.get("DINT_INTEGRAL_KERNEL")
        os.environ["DINT_INTEGRAL_KERNEL"] = kernel_variable
        try:
            with torch.no_grad():
                return plan_integral(layout, None, torch.device("cpu"), dtype, signal_output.numel(), False, False)
        finally:
            os.environ.pop("DINT_INTEGRAL_KERNEL") if saved is None else os.environ.update(DINT_INTEGRAL_KERNEL=saved)

    kernel_layout, eager_layout = planned("auto"), planned("eager")
    integral = DintIntegral("mean", 0)
    head_norm = DintHeadRMSNorm(channels, eps=1e-5).to(dtype)
    group_norm = DiffLlamaRMSNorm(channels, eps=1e-5).to(dtype)
    kernel = kernel_module.integral_kernel()
    if kernel is None:
        raise SystemExit("the fused CPU integral kernel is not built here (see the warning above)")

    def dint_kernel():
        return integral(signal_output, noise_output, lambda_, kernel_layout, head_norm)

    def dint_eager():
        return integral(signal_output, noise_output, lambda_, eager_layout, head_norm)

    def diffllama():  # transformers' DiffLlamaAttention after its two attention calls
        lambda_full = lambda_.to(dtype)
        output = signal_output - lambda_full * noise_output
        return (1 - 0.2) * group_norm(output)

    return {"dint_kernel": dint_kernel, "dint_eager": dint_eager, "diffllama": diffllama}


def time_tails(args) -> tuple[list[str], list[dict]]:
    """The tail's table (median ms per call by CPU time, wall time in parentheses) and its rows."""
    lines = [f"The integral's tail, heads {args.heads} x channels {args.channels}; median ms per call by CPU time "
             f"(wall time), {args.rounds} interleaved rounds",
             "| B x T | dtype | DINT kernel | DINT eager | DiffLlama | kernel / DiffLlama | eager / DiffLlama |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = []
    with torch.no_grad():
        for shape in args.rows:
            batch_size, length = (int(part) for part in shape.split("x"))
            for dtype_name in args.dtypes:
                calls = tails(batch_size, length, args.heads, args.channels, bench_common.DTYPES[dtype_name])
                cpu = {name: [] for name in calls}
                wall = {name: [] for name in calls}
                for call in calls.values():  # warm-up
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
                rows.append({"shape": shape, "dtype": dtype_name, "cpu_ms": median, "wall_ms": median_wall})
                cells = [f"{median[name]:.3f} ({median_wall[name]:.3f})" for name in calls]
                lines.append(f"| {shape} | {dtype_name} | " + " | ".join(cells)
                             + f" | {median['dint_kernel'] / median['diffllama']:.2f} | "
                             f"{median['dint_eager'] / median['diffllama']:.2f} |")
                print(lines[-1], flush=True)
    return lines, rows


def in_place_cumsum(rows):
    """torch's cumsum along dim 1 (T, whose stride is heads * channels): the CPU scan before the blocked sum."""
    return rows.cumsum(dim=1)


def rows_last_cumsum(rows):
    """The same prefix sum over a copy with T innermost and contiguous: what the package runs on CUDA."""
    return rows.movedim(1, -1).contiguous().cumsum(dim=-1).movedim(-1, 1)


def blocked_running_sum(rows):
    """The package's CPU path alone: blocks of `SCAN_BLOCK_ROWS` rows summed by a lower-triangular matrix."""
    from modeling_dint.integral_cpu_kernel import blocked_running_sum as package_blocked_running_sum

    return package_blocked_running_sum(rows, None)


_LAYOUTS = {}


def package_running_sum(rows, documents: int = 1):
    """The package's `segmented_running_sum` with the layout a forward builds (once per forward, shared by the layers:
    built once here too): one document per row (no caller's position ids), or `documents` packed documents."""
    from modeling_dint import DintIntegralLayout, segmented_running_sum

    batch, length = rows.shape[:2]
    key = (batch, length, documents, rows.device)
    if key not in _LAYOUTS:
        document_start = None
        if documents > 1:
            document_start = torch.zeros(batch, length, dtype=torch.bool, device=rows.device)
            document_start[:, :: max(length // documents, 1)] = True
        _LAYOUTS[key] = DintIntegralLayout.build(None, document_start, None, batch, length, rows.device)
    return segmented_running_sum(rows, _LAYOUTS[key], query_dim=1)


RUNNING_SUMS = {
    "segmented_running_sum, 1 document": package_running_sum,
    "segmented_running_sum, 4 documents": lambda rows: package_running_sum(rows, documents=4),
    "blocked matmuls (the CPU path)": blocked_running_sum,
    "cumsum along T in place": in_place_cumsum,
    "cumsum with T innermost (CUDA)": rows_last_cumsum,
}


def median_ms(function, device: str, rounds: int) -> float:
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    samples = []
    for index in range(rounds + 2):  # two warm-up calls
        bench_common.synchronize(device)
        started = clock()
        function()
        bench_common.synchronize(device)
        if index >= 2:
            samples.append(1e3 * (clock() - started))
    return statistics.median(samples)


def time_running_sums(args) -> tuple[list[str], list[dict]]:
    """The running sum's table (median ms, forward and forward+backward, error against fp64) and its rows."""
    clock = "wall" if args.device.startswith("cuda") else "CPU"
    lines = [f"The running sum, heads {args.heads} x channels {args.channels}, fp32 on {args.device}; median ms "
             f"({clock} time) of {args.rounds} calls",
             "| variant | B x T | forward | forward+backward | max error against fp64 |", "| --- | --- | --- | --- | --- |"]
    rows = []
    torch.backends.cuda.matmul.allow_tf32 = False
    for shape in args.rows:
        batch_size, length = (int(part) for part in shape.split("x"))
        values = torch.randn(batch_size, length, args.heads, args.channels, device=args.device)
        reference = values.double().cumsum(dim=1)
        for name, function in RUNNING_SUMS.items():
            leaf = values.clone().requires_grad_(True)

            def forward_backward():
                leaf.grad = None
                function(leaf).sum().backward()

            forward = median_ms(lambda: function(values), args.device, args.rounds)
            both = median_ms(forward_backward, args.device, args.rounds)
            error = None if "documents" in name else (function(values).double() - reference).abs().max().item()
            rows.append({"variant": name, "shape": shape, "forward_ms": forward, "forward_backward_ms": both,
                         "max_error": error})
            lines.append(f"| {name} | {shape} | {forward:.3f} | {both:.3f} | "
                         + ("" if error is None else f"{error:.1e}") + " |")
            print(lines[-1], flush=True)
    return lines, rows


PARTS = {"tail": (time_tails, ["1x2048", "8x128", "8x1"]), "running-sum": (time_running_sums, ["1x2048", "1x8192"])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="tail", choices=sorted(PARTS))
    parser.add_argument("--device", default="cpu", help="running-sum only: the tail times the CPU kernel")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--rows", nargs="+", default=None, help="BATCHxROWS per shape (default: per part)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], help="tail only (the running sum is fp32)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="file the table under bench/results/micro_integral/")
    args = parser.parse_args(argv)
    if args.part == "tail" and args.device != "cpu":
        parser.error(f"--device {args.device}: the tail part times the CPU kernel; use --device cpu")
    measure, default_rows = PARTS[args.part]
    args.rows = args.rows or default_rows
    torch.set_num_threads(1)
    machine = bench_common.machine_info(args.device)
    lines, rows = measure(args)
    machine["load_average_at_start"], machine["load_average_1_5_15"] = machine["load_average_1_5_15"], bench_common.load_average()
    if args.write:
        output = os.path.join(bench_common.results_dir("micro_integral", args.device), f"{args.part}.json")
        bench_common.write_result({"machine": machine, "settings": vars(args), "rows": rows}, output, "\n".join(lines) + "\n")
    else:
        print(bench_common.run_header(machine))


if __name__ == "__main__":
    main()
