# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""How many tensor ops each model dispatches per step: the device-independent side of the cost.

A GPU runs a small or mid-sized model launch-bound: every op costs a kernel launch plus the Python and dispatcher
work in front of it, whatever its size. This script counts, with a `TorchDispatchMode`, the aten ops that are not
views (each is one or more kernels on a GPU) in one forward, one forward+backward and one decode step, per model, on
the CPU, and prints what DINT adds over its DIFF twin per layer.

    python bench/count_ops.py                       # the default model (4 KV heads, so DINT-V2 has its twins), N=512
    python bench/count_ops.py --by-op               # which ops DINT adds, by name
    python bench/count_ops.py --write               # re-record bench/results/count_ops/cpu/ (both settings below)

`--write` counts twice, each in a fresh process: with the package's defaults (where no gradient is wanted, the CPU
integral is one C++ op) and with `DINT_CPU_KERNEL=0` (the eager ops, what CUDA runs for short calls). The docs quote
that record (`--write` also rewrites the tables between the `op-counts` markers of docs/performance.md) and
`tests/test_op_counts.py` recounts it, so a change of the model's ops fails there until re-recorded.
The blocked running sum of the eager ops adds a level per factor of 16 rows: counts depend on the length a little.
"""

import argparse
import collections
import json
import os
import re
import subprocess
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
MODELS = ("dint_fast", "diffllama", "llama", "dint_v2", "diff_v2")
PAIRS = (("dint_fast", "diffllama"), ("dint_v2", "diff_v2"), ("dint_v2", "llama"), ("diff_v2", "llama"))
"""(model, baseline): DINT-V1 / DiffLlama, DINT-V2 / DIFF-V2, DINT-V2 / Llama (2h query heads), DIFF-V2 / Llama."""
LABELS = {"dint_fast": "DINT-V1", "diffllama": "DiffLlama", "llama": "Llama (2h)", "dint_v2": "DINT-V2",
          "diff_v2": "DIFF-V2"}
SETTINGS = {"default": {}, "DINT_CPU_KERNEL=0": {"DINT_CPU_KERNEL": "0"}}
"""The environments `--write` records: the package's defaults, and the CPU integral kernel off (the eager ops)."""
RECORD = os.path.join(bench_common.results_dir("count_ops", "cpu"), "results.json")
DOCUMENT = os.path.join(bench_common.REPO_ROOT, "docs", "performance.md")
REGION = re.compile(r"(<!-- op-counts: begin.*?-->)(.*?)(<!-- op-counts: end -->)", re.DOTALL)


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seq-len", type=int, default=512, help="sequence length, and the prompt length for decode")
    parser.add_argument("--attn", default="sdpa")
    bench_common.add_model_size_arguments(parser)
    parser.add_argument("--by-op", action="store_true", help="list the ops whose count differs from the twin's")
    parser.add_argument("--json", action="store_true", help="print the counts by op as JSON (what --write reads)")
    parser.add_argument("--write", action="store_true", help=f"count in both SETTINGS and write {RECORD}")
    args = parser.parse_args(argv)
    if args.size == "default" and args.num_kv_heads is None:
        args.num_kv_heads = 4  # DINT-V2 needs the KV heads to divide its 4 differential heads
    args.max_positions = args.seq_len + 8
    return args


def count(args) -> dict[str, dict[str, dict[str, int]]]:
    """`{model: {step: {op: count}}}` in this process's environment."""
    size_kwargs = bench_common.model_size_kwargs(args)
    input_ids = bench_common.make_input_ids(args.seq_len, args.batch_size, args.vocab_size, "cpu")
    counts = {}
    for name in args.models.split(","):
        model = bench_common.build_model(name, size_kwargs, args.attn, torch.float32, "cpu")
        counts[name] = {step: dict(sorted(ops.items())) for step, ops in count_model_ops(model, input_ids).items()}
    return counts


def count_in_settings(argv: list[str]) -> dict[str, dict]:
    """`count` in a fresh process per environment of `SETTINGS`, run side by side (`DINT_CPU_KERNEL` is read once per
    process), one thread each: a count does not depend on threads, and two processes of two threads on two cores took
    twice as long."""
    children = {
        setting: subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv, "--json"],
            env={**os.environ, **environment, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=bench_common.REPO_ROOT,
        )
        for setting, environment in SETTINGS.items()
    }
    counts = {}
    for setting, child in children.items():
        stdout, stderr = child.communicate()
        if child.returncode:
            raise RuntimeError(f"count_ops.py --json with {setting} failed:\n{stderr}")
        counts[setting] = json.loads(stdout.strip().splitlines()[-1])
    return counts


def totals(counts: dict) -> dict[str, dict[str, int]]:
    """`{model: {step: all ops}}` from `count`'s result."""
    return {name: {step: sum(ops.values()) for step, ops in steps.items()} for name, steps in counts.items()}


def table(counts: dict, layers: int) -> list[str]:
    """Markdown: the ops per step of each model, and each pair's difference per layer."""
    total = totals(counts)
    names = list(total)
    pairs = [(model, base) for model, base in PAIRS if model in total and base in total]
    lines = ["| step | " + " | ".join(LABELS.get(name, name) for name in names) + " | "
             + " | ".join(f"{LABELS.get(m, m)} - {LABELS.get(b, b)} per layer" for m, b in pairs) + " |",
             "| --- " * (1 + len(names) + len(pairs)) + "|"]
    for step in STEPS:
        cells = [str(total[name][step]) for name in names]
        cells += [f"{(total[m][step] - total[b][step]) / layers:+.2f}" for m, b in pairs]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def write_record(args, argv: list[str]) -> None:
    counts = count_in_settings([argument for argument in argv if argument != "--write"])
    settings = {"models": args.models, "seq_len": args.seq_len, "attn": args.attn, "batch_size": args.batch_size,
                **bench_common.model_size_kwargs(args)}
    result = {"machine": bench_common.machine_info("cpu"), "settings": settings, "counts": counts}
    lines = [f"Non-view aten ops per step on the CPU, fp32: {args.num_layers} layers, hidden {args.hidden_size}, "
             f"{args.num_heads} softmax maps over {args.num_kv_heads} KV heads, {args.seq_len} tokens (the decode step "
             f"after a {args.seq_len}-token prompt). Llama has DINT-V2's 2h query heads.", ""]
    for setting in SETTINGS:
        lines += [f"**{setting}**", "", *table(counts[setting], args.num_layers), ""]
    bench_common.write_result(result, RECORD, "\n".join(lines))
    update_document(counts, args.num_layers)


def update_document(counts: dict, layers: int) -> None:
    """Replaces the Markdown tables inside DOCUMENT's op-counts region, in order, by the tables of `SETTINGS`."""
    tables = iter("\n".join(table(counts[setting], layers)) for setting in SETTINGS)
    with open(DOCUMENT, encoding="utf-8") as file:
        text = file.read()

    def region(match):
        body = re.sub(r"(?:^\|.*\n)+", lambda _: next(tables) + "\n", match.group(2), flags=re.MULTILINE)
        return match.group(1) + body + match.group(3)

    with open(DOCUMENT, "w", encoding="utf-8") as file:
        file.write(REGION.sub(region, text, count=1))
    print(f"updated the op-counts tables of {os.path.relpath(DOCUMENT, bench_common.REPO_ROOT)}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.write:
        write_record(args, argv)
        return
    counts = count(args)
    if args.json:
        print(json.dumps(counts))
        return
    print(f"non-view aten ops per step ({args.num_layers} layers, {args.seq_len} tokens; "
          f"DINT_CPU_KERNEL={os.environ.get('DINT_CPU_KERNEL', 'unset')})")
    print("\n".join(table(counts, args.num_layers)))
    if args.by_op:
        for model, base in PAIRS:
            if model not in counts or base not in counts:
                continue
            for step in STEPS:
                ours, theirs = collections.Counter(counts[model][step]), collections.Counter(counts[base][step])
                rows = sorted(((ours[op] - theirs[op], op) for op in set(ours) | set(theirs) if ours[op] != theirs[op]),
                              reverse=True)
                print(f"\n{step}: op, {LABELS[model]} minus {LABELS[base]} (whole step)")
                for difference, op in rows:
                    print(f"  {op:<40} {difference:+d}")


if __name__ == "__main__":
    main()
