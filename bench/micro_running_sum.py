# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The running sum over query rows in isolation: the package's `segmented_running_sum` (one document, and packed
documents) against the scans it chooses between, forward and forward+backward.

    python bench/micro_running_sum.py --seq-lens 128,2048,8192 --heads 9 --channels 128      # CPU (issue 31)
    python bench/micro_running_sum.py --device cuda --seq-lens 2048,8192,32768 --heads 8 --channels 128

The tensor is `[B, T, heads, channels]` fp32, as the fast path's O1 (`heads` = H/2 differential heads, `channels` =
2 * head_dim). On a CPU the package sums in blocks of matrix multiplies (`integral_cpu_kernel.blocked_running_sum`);
on CUDA it scans with the rows last (`integral_triton_kernel.rows_last_running_sum`): the scan the plan of the eager ops
gives the layout. Times are medians over `--repeats` calls, in milliseconds: CPU time of this process on a CPU (the
steadier measure where other work shares the cores; run with `--threads 1`), wall time with the device synchronized on
CUDA.
"""

import argparse
import os
import statistics
import time

import torch


def in_place_cumsum(rows):
    """torch's cumsum along dim 1 (T, whose stride is heads * channels): the CPU scan before issue 31."""
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
    """The package's `segmented_running_sum` with the layout a forward of the eager ops builds and plans (once per
    forward, shared by the layers: once here too), its scan tuned for the device: one document per row (no caller's
    position ids), or `documents` packed documents."""
    from modeling_dint.integral_dint import DintIntegralLayout, plan_integral, segmented_running_sum

    batch, length = rows.shape[:2]
    key = (batch, length, documents, rows.device)
    if key not in _LAYOUTS:
        document_start = None
        if documents > 1:
            document_start = torch.zeros(batch, length, dtype=torch.bool, device=rows.device)
            document_start[:, :: max(length // documents, 1)] = True
        layout = DintIntegralLayout.build(None, document_start, None, batch, length, rows.device)
        saved = os.environ.get("DINT_INTEGRAL_KERNEL")
        os.environ["DINT_INTEGRAL_KERNEL"] = "eager"  # the eager ops' plan, whatever the device, mode and length
        try:
            _LAYOUTS[key] = plan_integral(layout, None, rows.device, rows.dtype, rows.numel(), True, False)
        finally:
            if saved is None:
                del os.environ["DINT_INTEGRAL_KERNEL"]
            else:
                os.environ["DINT_INTEGRAL_KERNEL"] = saved
    layout = _LAYOUTS[key]
    return segmented_running_sum(rows, layout, running_sum=layout.running_sum, query_dim=1)


VARIANTS = {
    "segmented_running_sum, 1 document": package_running_sum,
    "segmented_running_sum, 4 documents": lambda rows: package_running_sum(rows, documents=4),
    "blocked matmuls (the CPU path)": blocked_running_sum,
    "cumsum along T in place": in_place_cumsum,
    "cumsum with T innermost (CUDA)": rows_last_cumsum,
}


def time_ms(function, device: str, repeats: int) -> float:
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    samples = []
    for index in range(repeats + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = clock()
        function()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if index >= 2:
            samples.append(1e3 * (clock() - started))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-lens", default="2048,8192")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False

    print(f"device={args.device} batch={args.batch_size} heads={args.heads} channels={args.channels} threads="
          f"{torch.get_num_threads()}; ms ({'wall' if args.device.startswith('cuda') else 'CPU'} time), median")
    print(f"{'variant':<38} {'T':>7} {'forward':>10} {'fwd+bwd':>10} {'max |err| vs fp64':>18}")
    for length in (int(n) for n in args.seq_lens.split(",")):
        rows = torch.randn(args.batch_size, length, args.heads, args.channels, device=args.device)
        reference = rows.double().cumsum(dim=1)
        for name, function in VARIANTS.items():
            leaf = rows.clone().requires_grad_(True)
            forward = time_ms(lambda: function(rows), args.device, args.repeats)

            def forward_backward():
                leaf.grad = None
                function(leaf).sum().backward()

            both = time_ms(forward_backward, args.device, args.repeats)
            error = "" if "documents" in name else f"{(function(rows).double() - reference).abs().max().item():.1e}"
            print(f"{name:<38} {length:>7} {forward:>10.3f} {both:>10.3f} {error:>18}")


if __name__ == "__main__":
    main()
