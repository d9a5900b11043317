# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""How many tensor ops each model dispatches per step: the device-independent side of the cost.

A GPU runs a small or mid-sized model launch-bound: every op costs a kernel launch plus the Python and dispatcher
work in front of it, whatever its size. This script counts, with a `TorchDispatchMode`, the aten ops that are not
views (each is one or more kernels on a GPU) in one forward, one forward+backward and one decode step, per model,
and prints what DINT fast adds over DiffLlama per layer.

    python bench/count_ops.py                       # default model, N=512, prompt 512
    python bench/count_ops.py --by-op               # which ops DINT adds, by name

It runs on the CPU in seconds; `run_benchmark.py` records the same counts on its own device (the scan over the query
rows takes one more copy on GPUs, see `_cumsum_over_rows`). The counts do not depend on the sequence length.
"""

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402


class CountOps(TorchDispatchMode):
    """Counts the aten ops that are not views (a view launches no kernel)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


STEPS = ("forward", "forward_backward", "decode")


def count_model_ops(model, input_ids: torch.Tensor, steps=STEPS) -> dict[str, collections.Counter]:
    """Non-view aten ops, by name, of one forward, one forward+backward and one decode step (after a prompt of
    `input_ids`) of `model`, or of the `steps` among them; a warm-up step first, so that lazy initializations are not
    counted."""
    if "forward_backward" in steps:
        bench_common.train_step(model, input_ids)
    cache, next_token = bench_common.prefill(model, input_ids)
    runs = {
        "forward": lambda: bench_common.forward_step(model, input_ids),
        "forward_backward": lambda: bench_common.train_step(model, input_ids),
        "decode": lambda: bench_common.decode_step(model, cache, next_token),
    }
    counts = {}
    for step in steps:
        with CountOps() as counter:
            runs[step]()
        counts[step] = counter.counts
    model.zero_grad(set_to_none=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="dint_fast,diffllama,llama")
    parser.add_argument("--seq-len", type=int, default=512, help="sequence length, and the prompt length for decode")
    parser.add_argument("--attn", default="sdpa")
    bench_common.add_model_size_arguments(parser)
    parser.add_argument("--by-op", action="store_true", help="list the ops whose count differs from DiffLlama's")
    args = parser.parse_args()
    args.max_positions = args.seq_len + 8
    size_kwargs = bench_common.model_size_kwargs(args)

    input_ids = bench_common.make_input_ids(args.seq_len, args.batch_size, args.vocab_size, "cpu")
    counts = {}
    for name in args.models.split(","):
        model = bench_common.build_model(name, size_kwargs, args.attn, torch.float32, "cpu")
        counts[name] = count_model_ops(model, input_ids)

    layers = args.num_layers
    print(f"non-view aten ops per step ({layers} layers; last column: DINT fast minus DiffLlama, per layer)")
    print(f"{'step':<18}" + "".join(f"{name:>12}" for name in counts) + f"{'DINT-Diff / layer':>20}")
    for step in STEPS:
        totals = {name: sum(counts[name][step].values()) for name in counts}
        extra = ""
        if "dint_fast" in totals and "diffllama" in totals:
            extra = f"{(totals['dint_fast'] - totals['diffllama']) / layers:>20.1f}"
        print(f"{step:<18}" + "".join(f"{totals[name]:>12}" for name in counts) + extra)
    if args.by_op and "dint_fast" in counts and "diffllama" in counts:
        for step in STEPS:
            dint, diff = counts["dint_fast"][step], counts["diffllama"][step]
            rows = sorted(((dint[op] - diff[op], op) for op in set(dint) | set(diff) if dint[op] != diff[op]), reverse=True)
            print(f"\n{step}: op, DINT fast minus DiffLlama (whole step)")
            for difference, op in rows:
                print(f"  {op:<40} {difference:+d}")


if __name__ == "__main__":
    main()
