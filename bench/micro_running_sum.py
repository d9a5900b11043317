# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The running sum over query rows in isolation: the package's `segmented_running_sum` (one document, and packed
documents) against the scans it chooses between and a blocked-matmul scan, forward and forward+backward.

    python bench/micro_running_sum.py --device cuda --seq-lens 2048,8192,32768 --heads 8 --channels 128

The tensor is `[B, heads, T, channels]` fp32, as the fast path's O1 (`heads` = H/2 differential heads, `channels` =
2 * head_dim). Times are medians over `--repeats` calls, in milliseconds, with the device synchronized.
"""

import argparse
import statistics
import time

import torch


def in_place_cumsum(rows):
    """A scan along dim -2 (T), whose stride is `channels`: what the package runs on CPU."""
    return rows.cumsum(dim=-2)


def rows_last_cumsum(rows):
    """The same prefix sum over a copy with T innermost and contiguous: what the package runs on CUDA."""
    return rows.transpose(-1, -2).contiguous().cumsum(dim=-1).transpose(-1, -2)


def blocked_cumsum(rows, block: int = 128):
    """Prefix sum as a matmul with a lower-triangular block of ones inside each block of rows, plus the exclusive
    prefix of the block totals (a short scan over T / block blocks)."""
    batch, heads, length, channels = rows.shape
    padded = -length % block
    if padded:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, padded))
    blocks = rows.view(batch, heads, -1, block, channels)
    lower = torch.ones(block, block, device=rows.device, dtype=rows.dtype).tril()
    within = torch.matmul(lower, blocks)
    totals = within[..., -1, :]
    offsets = totals.cumsum(dim=-2) - totals
    return (within + offsets[..., None, :]).view(batch, heads, -1, channels)[:, :, :length]


_LAYOUTS = {}


def package_running_sum(rows, documents: int = 1):
    """The package's `segmented_running_sum` with the layout a forward builds (once per forward, shared by the layers:
    built once here too): one document per row (no caller's position ids: a scan and nothing else), or `documents`
    packed documents (the scan plus a gather)."""
    from modeling_dint import DintIntegralLayout, segmented_running_sum

    batch, _, length, _ = rows.shape
    key = (batch, length, documents, rows.device)
    if key not in _LAYOUTS:
        document_start = None
        if documents > 1:
            document_start = torch.zeros(batch, length, dtype=torch.bool, device=rows.device)
            document_start[:, :: max(length // documents, 1)] = True
        _LAYOUTS[key] = DintIntegralLayout.build(None, document_start, None, batch, length, rows.device)
    return segmented_running_sum(rows, _LAYOUTS[key], query_dim=2)


VARIANTS = {
    "segmented_running_sum, 1 document": package_running_sum,
    "segmented_running_sum, 4 documents": lambda rows: package_running_sum(rows, documents=4),
    "cumsum along T in place (CPU)": in_place_cumsum,
    "cumsum with T innermost (CUDA)": rows_last_cumsum,
    "blocked matmul scan (block 128)": blocked_cumsum,
}


def time_ms(function, device: str, repeats: int) -> float:
    samples = []
    for index in range(repeats + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        function()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if index >= 2:
            samples.append(1e3 * (time.perf_counter() - started))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-lens", default="2048,8192")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the blocked scan must stay fp32-exact enough to compare

    print(f"device={args.device} batch={args.batch_size} heads={args.heads} channels={args.channels}; ms, median")
    print(f"{'variant':<38} {'T':>7} {'forward':>10} {'fwd+bwd':>10} {'max |err| vs fp64':>18}")
    for length in (int(n) for n in args.seq_lens.split(",")):
        rows = torch.randn(args.batch_size, args.heads, length, args.channels, device=args.device)
        reference = rows.double().cumsum(dim=-2)
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
