# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The running sum over query rows in isolation: the package's `segmented_running_sum` against the ops it is made of
and against other ways of computing the same prefix sum, forward and forward+backward.

    python bench/micro_running_sum.py --device cuda --seq-lens 2048,8192,32768 --heads 8 --channels 128

The tensor is `[B, heads, T, channels]` fp32, as the fast path's O1 (`heads` = H/2 differential heads, `channels` =
2 * head_dim). Times are medians over `--repeats` calls, in milliseconds, with the device synchronized.
"""

import argparse
import statistics
import time

import torch


def outer_dim_cumsum(rows):
    """What the package does: a scan along dim -2 (T), whose stride is `channels`."""
    return rows.cumsum(dim=-2)


def inner_dim_cumsum(rows):
    """The same prefix sum with T made the innermost, contiguous dim first."""
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


def gather_at_document_start(rows):
    """The gather the package uses to subtract the sum before each row's document start (one document: index 0)."""
    start_index = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.long, device=rows.device)
    return rows.gather(-2, start_index[:, None, :, None].expand_as(rows))


def package_running_sum(rows):
    from modeling_dint import segmented_running_sum

    batch, _, length, _ = rows.shape
    query_valid = torch.ones(batch, length, dtype=torch.bool, device=rows.device)
    document_start = torch.zeros(batch, length, dtype=torch.bool, device=rows.device)
    document_start[:, 0] = True
    return segmented_running_sum(rows, query_valid, document_start)


VARIANTS = {
    "segmented_running_sum (package)": package_running_sum,
    "  its cumsum along T (dim -2)": outer_dim_cumsum,
    "  its gather at the document start": gather_at_document_start,
    "cumsum with T innermost": inner_dim_cumsum,
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
            error = "" if "gather" in name else f"{(function(rows).double() - reference).abs().max().item():.1e}"
            print(f"{name:<38} {length:>7} {forward:>10.3f} {both:>10.3f} {error:>18}")


if __name__ == "__main__":
    main()
