# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Steps per second of the research harness before and after its training step was rebuilt (issue 30).

    python research/bench_speed.py [--hidden 64] [--context 64] [--rounds 12] [--block 10] [--out DIR]

"Before" is the harness of commit a160467, read from git (`git show`): the model's own loss over every position's
logits, eager, AdamW and gradient clipping one parameter at a time, the needle batches made row by row in Python.
"After" is the harness here: `training.make_training_step` (forward and backward compiled by torch.compile, logits at the
answers only, fused AdamW, foreach clipping), the batches made in tensor operations.

Per architecture (transformers' Llama, DIFF, DINT; hidden 64 as 4 heads of 16 (the model of the before harness), 64
tokens, batch 32, one torch thread):
  - the training step alone, before and after, on the same model (same seed) and the same batches (made by the old
    harness), in interleaved blocks of `--block` steps (`--rounds` of each; the first round is warm-up and not
    counted): thread CPU time and wall time per step, the paired ratio, and the largest difference of the two loss
    curves over those steps (the same model and data: only rounding differs);
  - making one training batch, before and after;
  - the whole training loop of each harness (batches, steps, a validation every 50 steps) for a fixed number of
    steps: steps per second.
The machine is shared: the load average is printed beside every number, and only ratios measured in the same
interleaved rounds are comparable. Writes speed.md and speed.json to `--out` (default: research/results).
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode


RESEARCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RESEARCH_DIR))
from model_shapes import build_model  # noqa: E402
from run import DEFAULT_OUT  # noqa: E402
from runner import environment  # noqa: E402
from settings import ARCHITECTURES, REPO_ROOT, Settings  # noqa: E402
from tasks import NeedleVocabulary, make_mixed_needle_batch  # noqa: E402
from training import answer_logits, make_training_step, train_to_convergence  # noqa: E402


BEFORE_COMMIT = "a160467"
"""The last commit of the harness before issue 30."""


def load_harness_before():
    """The module run.py of `BEFORE_COMMIT`, read with `git show` into a temporary file."""
    source = subprocess.run(
        ["git", "show", f"{BEFORE_COMMIT}:examples/research/run.py"], cwd=REPO_ROOT, capture_output=True,
        text=True, check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "run_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("run_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settings_after(args) -> "Settings":
    """This harness's settings with the model shape and the task of `BEFORE_COMMIT` (hidden / 16 heads of 16 channels;
    needles scattered in filler, N in 1, 2, 4, 6), so that before and after train the same model on the same task."""
    return Settings(attention_heads=args.hidden // 16, head_dim=16, needle_layout="haystack",
                            train_needle_counts=(1, 2, 4, 6))


def kind_after(kind: str) -> str:
    """The harness's name for `BEFORE_COMMIT`'s model: its Transformer had one head per softmax map."""
    return "transformer_per_map" if kind == "transformer" else kind


def answers_of_old_batch(batch: dict) -> dict:
    """An old harness batch (labels: -100 except the answers) in the new harness's answer layout: the logits at
    position t - 1 predict the label at t."""
    rows, label_columns = (batch["labels"] != -100).nonzero(as_tuple=True)
    return {
        "input_ids": batch["input_ids"],
        "answer_rows": rows,
        "answer_columns": label_columns - 1,
        "answers": batch["labels"][rows, label_columns],
    }


def step_before(model, optimizer, batch: dict) -> float:
    """The training step of `BEFORE_COMMIT`'s `train_to_convergence` (its lines, without the scheduler)."""
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def make_step_after(model, settings):
    """The training step of this harness (`training.make_training_step`, as `train_to_convergence` runs it)."""
    step, _ = make_training_step(model, 1e-3, settings)
    return lambda batch: step(batch).item()


def timed(function, *args):
    """(result, wall seconds, thread CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    result = function(*args)
    return result, time.perf_counter() - wall, time.thread_time() - cpu


def paired_step_rounds(kind: str, before, args) -> dict:
    settings = settings_after(args)
    old_settings = before.Settings()
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    generator = torch.Generator().manual_seed(0)
    batches = [
        before.make_mixed_needle_batch(generator, 32, args.context, old_settings.needle_counts, 1, vocab)
        for _ in range(args.rounds * args.block)
    ]
    max_positions = args.context * 4
    model_before = before.build_model(kind, vocab.size, max_positions, old_settings, args.hidden, 0)
    optimizer_before = torch.optim.AdamW(model_before.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model_after = build_model(kind_after(kind), vocab.size, max_positions, settings, args.hidden, 0)
    step_after = make_step_after(model_after, settings)
    model_before.train()
    model_after.train()
    times = {"before": [], "after": []}
    losses = {"before": [], "after": []}
    load = [os.getloadavg()[0]]
    compile_seconds = None
    for round_index in range(args.rounds):
        block = batches[round_index * args.block : (round_index + 1) * args.block]
        for name in ("before", "after"):
            for batch in block:
                if name == "before":
                    loss, wall, cpu = timed(step_before, model_before, optimizer_before, batch)
                else:
                    loss, wall, cpu = timed(step_after, answers_of_old_batch(batch))
                    if compile_seconds is None:
                        compile_seconds = wall
                losses[name].append(loss)
                if round_index > 0:  # the first round warms up (and compiles)
                    times[name].append((wall, cpu))
    load.append(os.getloadavg()[0])
    result = {"kind": kind, "load_average": load, "first_step_after_seconds": compile_seconds}
    for name in ("before", "after"):
        result[f"{name}_cpu_ms"] = 1e3 * statistics.median(cpu for _, cpu in times[name])
        result[f"{name}_wall_ms"] = 1e3 * statistics.median(wall for wall, _ in times[name])
    result["cpu_ratio"] = result["before_cpu_ms"] / result["after_cpu_ms"]
    result["wall_ratio"] = result["before_wall_ms"] / result["after_wall_ms"]
    result["steps_compared"] = len(losses["before"])
    result["max_loss_difference"] = max(abs(a - b) for a, b in zip(losses["before"], losses["after"]))
    result["losses_before"] = [round(x, 5) for x in losses["before"][:: args.block]]
    result["losses_after"] = [round(x, 5) for x in losses["after"][:: args.block]]
    return result


def data_rounds(before, args) -> dict:
    """Milliseconds (thread CPU) to make one training batch: the old row-by-row one-query batch, the new one."""
    settings, old_settings = settings_after(args), before.Settings()
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    old_generator, new_generator = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    times = {"before": [], "after": []}
    for _ in range(args.rounds):
        for _ in range(args.block):
            times["before"].append(timed(before.make_mixed_needle_batch, old_generator, 32, args.context,
                                         old_settings.needle_counts, 1, vocab)[2])
        for _ in range(args.block):
            times["after"].append(timed(make_mixed_needle_batch, new_generator, settings.needle_batch,
                                        args.context, settings.train_needle_counts, vocab)[2])
    return {f"{name}_cpu_ms": 1e3 * statistics.median(values) for name, values in times.items()}


def loop_rounds(kind: str, before, args) -> dict:
    """Steps per second of each harness's whole training loop (its own task: batches, steps, a validation every 50),
    `args.loop_steps` steps, thread CPU time. After: from the loop's own clock, which keeps the first (compiling) step
    apart; before: timed from outside (nothing to compile)."""
    settings, old_settings = settings_after(args), before.Settings()
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    steps = args.loop_steps
    model = before.build_model(kind, vocab.size, args.context * 4, old_settings, args.hidden, 0)
    old_generator = torch.Generator().manual_seed(0)
    old_validation = before.chunked(before.make_mixed_needle_batch(
        torch.Generator().manual_seed(1), 256, args.context, old_settings.needle_counts, 1, vocab), 64)
    _, wall, cpu = timed(
        before.train_to_convergence, model,
        lambda: before.make_mixed_needle_batch(old_generator, 32, args.context, old_settings.needle_counts, 1, vocab),
        old_validation, 1e-3, steps, steps, 50, old_settings,
    )
    result = {"before_steps_per_second_cpu": steps / cpu, "before_steps_per_second_wall": steps / wall}
    model = build_model(kind_after(kind), vocab.size, args.context * 4, settings, args.hidden, 0)
    generator = torch.Generator().manual_seed(0)
    validation = make_mixed_needle_batch(
        torch.Generator().manual_seed(1), 256, args.context, settings.train_needle_counts, vocab)
    history = train_to_convergence(
        model,
        lambda: make_mixed_needle_batch(generator, settings.needle_batch, args.context,
                                                settings.train_needle_counts, vocab),
        validation, 1e-3, steps, steps, 50, settings,
    )
    result["after_steps_per_second_cpu"] = history["steps_per_cpu_second"]
    result["after_steps_per_second_wall"] = history["steps_per_second"]
    result["after_first_step_seconds"] = history["first_step_seconds"]
    result["ratio_cpu"] = result["after_steps_per_second_cpu"] / result["before_steps_per_second_cpu"]
    result["load_average"] = os.getloadavg()[0]
    return result


def step_flops(kind: str, before, args) -> dict:
    """Floating-point operations of one training step's forward and backward (torch's FlopCounterMode: matmuls and
    attention), before (every position's logits) and after (logits at the answers only), on one batch of the old
    harness; and the rate of one large fp32 matmul on this core, the ceiling a step could approach."""
    settings = settings_after(args)
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    batch = before.make_mixed_needle_batch(torch.Generator().manual_seed(0), 32, args.context,
                                           before.Settings().needle_counts, 1, vocab)
    model = build_model(kind_after(kind), vocab.size, args.context * 4, settings, args.hidden, 0)
    result = {}
    for name in ("before", "after"):
        counter = FlopCounterMode(display=False)
        with counter:
            if name == "before":
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            else:
                answers = answers_of_old_batch(batch)
                logits = answer_logits(model, answers["input_ids"], answers["answer_rows"],
                                               answers["answer_columns"])
                loss = torch.nn.functional.cross_entropy(logits, answers["answers"])
            loss.backward()
        result[f"{name}_gflop"] = counter.get_total_flops() / 1e9
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    _, _, cpu = timed(lambda: [torch.mm(a, b) for _ in range(20)])
    result["matmul_gflop_per_second"] = 20 * 2 * 1024**3 / cpu / 1e9
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--loop-steps", type=int, default=200)
    parser.add_argument("--kinds", nargs="+", default=list(ARCHITECTURES))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite speed.md from OUT/speed.json (the FLOP counts are measured again: seconds)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = load_harness_before()
    if args.report_only:
        results = json.loads((args.out / "speed.json").read_text())
        saved = argparse.Namespace(**{**results["settings"], "out": args.out})
        results["flops"] = {kind: step_flops(kind, before, saved) for kind in saved.kinds}
        (args.out / "speed.json").write_text(json.dumps(round_floats(results), indent=1))
        (args.out / "speed.md").write_text(speed_report(results, saved))
        print((args.out / "speed.md").read_text())
        return
    started = time.time()
    results = {"command": "python research/bench_speed.py " + " ".join(sys.argv[1:]),
               "environment": environment(), "settings": vars(args) | {"out": str(args.out)},
               "steps": [], "loops": []}
    for kind in args.kinds:
        results["steps"].append(paired_step_rounds(kind, before, args))
        print(json.dumps(results["steps"][-1]), flush=True)
    results["data"] = data_rounds(before, args)
    print(json.dumps(results["data"]), flush=True)
    for kind in args.kinds:
        results["loops"].append({"kind": kind, **loop_rounds(kind, before, args)})
        print(json.dumps(results["loops"][-1]), flush=True)
    results["flops"] = {kind: step_flops(kind, before, args) for kind in args.kinds}
    results["wall_seconds"] = time.time() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speed.json").write_text(json.dumps(round_floats(results), indent=1))
    (args.out / "speed.md").write_text(speed_report(results, args))
    print((args.out / "speed.md").read_text())


def round_floats(value, digits: int = 5):
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: round_floats(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [round_floats(v, digits) for v in value]
    return value


def speed_report(results: dict, args) -> str:
    env = results["environment"]
    lines = [
        "# Research harness: steps per second before and after (issue 30)", "",
        f"Command: `{results['command']}`  ",
        f"Versions: torch {env['torch']}, transformers {env['transformers']}, repo commit {env['git_commit']}; "
        f"{env['machine']} ({platform.processor() or 'cpu'}); one torch thread. Before: commit {BEFORE_COMMIT}.  ",
        f"Wall time of the benchmark: {results['wall_seconds'] / 60:.1f} min.", "",
        f"## The training step (hidden {args.hidden}, {args.context} tokens, batch 32; same model, same batches)", "",
        f"Interleaved blocks of {args.block} steps, {args.rounds - 1} rounds of each counted (after a warm-up round "
        "that compiles). Median per step; ratio = before / after. The loss difference is the largest over the "
        f"{args.rounds * args.block} steps both made from the same initial weights on the same batches.", "",
        "| architecture | before: CPU ms | after: CPU ms | ratio (CPU) | before: wall ms | after: wall ms | "
        "ratio (wall) | max abs loss difference | load average (start, end) | first compiled step, s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["steps"]:
        lines.append(
            f"| {r['kind']} | {r['before_cpu_ms']:.1f} | {r['after_cpu_ms']:.1f} | {r['cpu_ratio']:.2f}x | "
            f"{r['before_wall_ms']:.1f} | {r['after_wall_ms']:.1f} | {r['wall_ratio']:.2f}x | "
            f"{r['max_loss_difference']:.1e} | {r['load_average'][0]:.1f}, {r['load_average'][1]:.1f} | "
            f"{r['first_step_after_seconds']:.0f} |"
        )
    lines += [
        "", "## Where the step's time goes: floating-point work (FlopCounterMode, forward and backward)", "",
        "A step is bounded below by its arithmetic. *Achieved* = GFLOP per step / median CPU seconds per step above; "
        "*ceiling* = the rate of a 1024 x 1024 fp32 matmul on this core (one thread), which the step's small matrices "
        "(64 to 256 wide) cannot reach.", "",
        "| architecture | before: GFLOP/step | after: GFLOP/step | before: achieved GFLOP/s | after: achieved "
        "GFLOP/s | ceiling GFLOP/s | after: share of ceiling | 5x before's steps/s would need |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["steps"]:
        flops = results["flops"][r["kind"]]
        before_rate = flops["before_gflop"] / (r["before_cpu_ms"] / 1e3)
        after_rate = flops["after_gflop"] / (r["after_cpu_ms"] / 1e3)
        lines.append(
            f"| {r['kind']} | {flops['before_gflop']:.2f} | {flops['after_gflop']:.2f} | {before_rate:.0f} | "
            f"{after_rate:.0f} | {flops['matmul_gflop_per_second']:.0f} | "
            f"{after_rate / flops['matmul_gflop_per_second']:.0%} | "
            f"{5 * flops['after_gflop'] / (r['before_cpu_ms'] / 1e3):.0f} GFLOP/s |"
        )
    lines += [
        "", "The last column is the rate the after-step's arithmetic would have to run at for 5x the before-step's "
        "steps per second. Where it is near or above the ceiling, no rewrite of the step reaches 5x on this core: "
        "only less arithmetic per step would (a smaller batch or model, which changes the protocol).",
    ]
    data = results["data"]
    lines += [
        "", "## Making one training batch (CPU ms, median)", "",
        f"Before (row by row, one query per example): {data['before_cpu_ms']:.2f}; after (tensor operations, every "
        f"needle queried): {data['after_cpu_ms']:.2f}.", "",
        f"## The whole training loop ({args.loop_steps} steps, validation every 50, each harness on its own task)",
        "",
        "| architecture | before: steps/s (CPU) | after: steps/s (CPU) | ratio | before: steps/s (wall) | after: steps/s "
        "(wall) | load average at the end |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["loops"]:
        lines.append(
            f"| {r['kind']} | {r['before_steps_per_second_cpu']:.1f} | {r['after_steps_per_second_cpu']:.1f} | "
            f"{r['ratio_cpu']:.2f}x | {r['before_steps_per_second_wall']:.1f} | "
            f"{r['after_steps_per_second_wall']:.1f} | {r['load_average']:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
