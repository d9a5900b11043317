# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Issue 38's registered comparison: the Transformer, DIFF-V1 and DINT-V1 (the paper's, head norm), both without the
head norm, DIFF-V2 and DINT-V2, at equal parameter count, on the committed report's needle task and rules plus the
plateau extension (`Settings.plateau_max_steps`) and the plateau retry (`Settings.plateau_retry_lr_factor`), 5 seeds,
one training process at a time (or two: `--only main` and `--only retry` share the journal).

    python research/compare.py --hidden 64                 # runs (resumable) then summary.md
    python research/compare.py --hidden 64 --summary-only  # summary.md from jobs.jsonl
    python research/compare.py --hidden 128 --rate 200     # steps/s per architecture (rate.json, rate.md)
    python research/compare.py --hidden 128 --sweep        # hidden 128: the learning-rate sweep first
    python research/compare.py --hidden 64 --only retry    # only the retries of runs left on the plateau
    python research/compare.py --task lm --hidden 64       # language modelling to the stopping rule
    python research/compare.py --hidden 128 --device cuda --no-compile --workers 12   # on a lent GPU
    python research/compare.py --hidden 128 --kinds diff_v2 --seeds 1 2 --long 2e-3 12000 --workers 2

Records go to `results/v2/h{hidden}/jobs.jsonl` (one line per finished run, appended as it finishes, so a killed run
resumes where it stopped); `summary.md` there says which (architecture, seed) ran and whether each learned, the
Table 4 accuracies at 1x/2x/4x with 95% bootstrap intervals, the first-query control, and a verdict (the decision
rule, `decision_rule.beats`) only for pairs where both architectures ran every seed and learned on at least 4 of 5.
It never writes results/report.md (the committed report of issue 30).

`--device cuda` runs the same registered jobs on a GPU, into `results/v2/h{hidden}_cuda/` (`lm_h{hidden}_cuda/`): a
replicate of the comparison on another device. Each record names its device, and a journal takes runs of one device
only. The needle task's learning rates are the out folder's `learning_rates.json`, else the CPU sweep's
(`results/v2/h{hidden}/`, whatever the out folder); `--task lm` sweeps its rates in its own journal, on its device.
`--long LR STEPS` (a diagnostic, no verdict uses it): each of `--kinds` on each seed at LR for exactly STEPS steps, in
`long_{STEPS}/jobs.jsonl` of the out folder.

`--task lm` (issue 38 item 4): the same architectures on the committed report's language modelling (Shakespeare, the
package's tokenizer), each run to the stopping rule (`comparison_settings`: from 1000 steps, a cap of 20,000 it is
not meant to reach), the learning rate swept per architecture (1e-3, 3e-3 on seed 100), then 5 seeds; records in
`results/v2/lm_h{hidden}/`, whose `summary.md` gives the test perplexity per architecture with its interval, how many
runs the rule stopped before the cap, and a verdict (lower perplexity) for each pair where both ran every seed.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from decision_rule import beats, ci_text, difference_text  # noqa: E402
from model_shapes import build_model, count_parameters  # noqa: E402
from runner import device_name, environment, job_id, run_jobs  # noqa: E402
from settings import (  # noqa: E402
    COMPARISON, DESCRIPTIONS, Settings, comparison_settings, lm_hidden, shrink_for_dry_run,
)
from tasks import NeedleVocabulary, make_mixed_needle_batch, plateau_loss  # noqa: E402
from training import make_training_step, on_plateau, to_device  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results" / "v2"

# The learning rates, fixed before any run of the comparison. Hidden 64: the committed report's sweep (1e-3, 2e-3,
# 4e-3 on seed 100) chose 2e-3 for the Transformer, 1e-3 for DIFF and for DINT; the kinds it did not sweep take their
# family's rate (DIFF's for DIFF without head norm and DIFF-V2, DINT's for DINT without head norm and DINT-V2), as the
# report's Table 6 ablations take DINT's. Hidden 128 has no committed sweep: `--sweep` runs it (the harness's rule).
REGISTERED_LEARNING_RATES = {
    64: {"transformer": 2e-3, "diff": 1e-3, "dint": 1e-3, "diff_no_head_norm": 1e-3, "dint_no_head_norm": 1e-3,
         "diff_v2": 1e-3, "dint_v2": 1e-3},
}

# The pairs a verdict is given for (A, B: "A beats B"), where both learned on at least 4 of 5 seeds.
PAIRS = (
    ("dint", "transformer"), ("diff", "transformer"), ("dint", "diff"),
    ("dint_no_head_norm", "diff_no_head_norm"), ("dint_no_head_norm", "transformer"),
    ("diff_no_head_norm", "transformer"),
    ("dint_v2", "diff_v2"), ("dint_v2", "transformer"), ("diff_v2", "transformer"),
)


def comparison_jobs(settings: Settings, kinds, learning_rates: dict) -> list[dict]:
    """Seed-major (every kind on seed 0 first), so a partial run covers every architecture on its first seeds."""
    hidden, context = settings.needle_configs[0]
    return [
        dict(phase="main", task="needle", kind=kind, hidden=hidden, context=context, lr=learning_rates[kind], seed=seed)
        for seed in settings.seeds
        for kind in kinds
    ]


def sweep_jobs(settings: Settings, kinds) -> list[dict]:
    hidden, context = settings.needle_configs[0]
    return [
        dict(phase="sweep", task="needle", kind=kind, hidden=hidden, context=context, lr=lr, seed=settings.sweep_seed)
        for kind in kinds
        for lr in settings.learning_rates
    ]


def lm_sweep_jobs(settings: Settings, kinds) -> list[dict]:
    return [
        dict(phase="sweep", task="lm", kind=kind, hidden=lm_hidden(settings), context=settings.lm_context, lr=lr,
             seed=settings.sweep_seed)
        for kind in kinds
        for lr in settings.lm_learning_rates
    ]


def lm_comparison_jobs(settings: Settings, kinds, learning_rates: dict) -> list[dict]:
    """Seed-major, as `comparison_jobs`."""
    return [
        dict(phase="main", task="lm", kind=kind, hidden=lm_hidden(settings), context=settings.lm_context,
             lr=learning_rates[kind], seed=seed)
        for seed in settings.lm_seeds
        for kind in kinds
    ]


def chosen_learning_rates(sweep: list[dict]) -> dict:
    """Per kind, the swept learning rate with the lowest best validation loss."""
    best = {}
    for record in sweep:
        if record["kind"] not in best or record["best_validation_loss"] < best[record["kind"]][1]:
            best[record["kind"]] = (record["lr"], record["best_validation_loss"])
    return {kind: lr for kind, (lr, _) in best.items()}


def retry_jobs(records: dict, settings: Settings, kinds) -> list[dict]:
    """The plateau retry: every finished registered run of `kinds` still on the plateau (it ran to
    `plateau_max_steps`) again on its seed at `plateau_retry_lr_factor` x its learning rate, in the order of `kinds`
    then seed, so the first architecture's retries run first."""
    if settings.plateau_retry_lr_factor is None:
        return []
    hidden, context = settings.needle_configs[0]
    stuck = [r for r in records.values() if r["phase"] == "main" and r["hidden"] == hidden and r["kind"] in kinds
             and not learned(r, settings)]
    stuck.sort(key=lambda r: (list(kinds).index(r["kind"]), r["seed"]))
    return [dict(phase="retry", task="needle", kind=r["kind"], hidden=hidden, context=context,
                 lr=r["lr"] * settings.plateau_retry_lr_factor, seed=r["seed"]) for r in stuck]


def seed_records(records: dict, settings: Settings, kind: str) -> list[dict]:
    """The record that stands for each seed of `kind`, by seed: the registered run, or its plateau retry where the
    registered run stayed on the plateau and the retry has finished (each carries `retried`: whether it is a
    retry)."""
    hidden = settings.needle_configs[0][0]
    main = {r["seed"]: r for r in records.values() if r["phase"] == "main" and r["kind"] == kind and r["hidden"] == hidden}
    retry = {r["seed"]: r for r in records.values() if r["phase"] == "retry" and r["kind"] == kind
             and r["hidden"] == hidden}
    chosen = []
    for seed in sorted(main):
        record = main[seed]
        if not learned(record, settings) and seed in retry:
            record = retry[seed]
        chosen.append({**record, "retried": record["phase"] == "retry"})
    return chosen


def read_journal(journal: Path) -> dict:
    if not journal.exists():
        return {}
    return {record["id"]: record for record in map(json.loads, journal.read_text().splitlines())}


def learned(record: dict, settings: Settings) -> bool:
    """Left the 1/N plateau: best validation loss below `plateau_fraction` x the plateau loss (the stopping rule's
    own test)."""
    return not on_plateau(record["best_validation_loss"], plateau_loss(settings), settings)


def parameter_counts(settings: Settings, kinds) -> dict:
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    hidden, context = settings.needle_configs[0]
    return {kind: count_parameters(build_model(kind, vocab.size, context * 4, settings, hidden, 0)) for kind in kinds}


def measure_rates(settings: Settings, kinds, steps: int) -> dict:
    """Training steps per second of one thread, compiled step, `steps` steps after the first (compilation), no
    validation; and the wall seconds of the first step."""
    torch.set_num_threads(1)
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    hidden, context = settings.needle_configs[0]
    rates = {}
    for kind in kinds:
        model = build_model(kind, vocab.size, context * 4, settings, hidden, 0)
        step, _ = make_training_step(model, 1e-3, settings)
        generator = torch.Generator().manual_seed(0)
        batches = [make_mixed_needle_batch(generator, settings.needle_batch, context, settings.train_needle_counts,
                                           vocab, settings.needle_layout) for _ in range(steps + 1)]
        started = time.perf_counter()
        step(to_device(batches[0], settings.device)).item()
        first = time.perf_counter() - started
        started, started_cpu = time.perf_counter(), time.thread_time()
        for batch in batches[1:]:
            loss = step(batch)
        loss.item()
        wall, cpu = time.perf_counter() - started, time.thread_time() - started_cpu
        rates[kind] = {"steps_per_second": steps / wall, "steps_per_cpu_second": steps / cpu,
                       "first_step_seconds": first, "parameters": count_parameters(model)}
        print(f"{kind}: {steps / wall:.1f} steps/s ({steps / cpu:.1f} per CPU second), first step {first:.1f} s",
              flush=True)
    return rates


def run_on_every_seed(runs_a: list[dict], runs_b: list[dict], seeds) -> bool:
    """Whether two architectures' runs (by seed) both cover `seeds`: what the decision rule needs to pair them."""
    return [r["seed"] for r in runs_a] == [r["seed"] for r in runs_b] == list(seeds)


def pairs_run_on_every_seed(by_kind: dict, kinds, seeds, lines: list[str]):
    """The pairs of `PAIRS` among `kinds` whose runs (`by_kind`, by seed) cover `seeds` on both sides, as
    (a, b, a's runs, b's runs); for each other pair, a "no verdict" line appended to `lines`."""
    for a, b in PAIRS:
        if a not in kinds or b not in kinds:
            continue
        if not run_on_every_seed(by_kind[a], by_kind[b], seeds):
            seeds_a, seeds_b = [r["seed"] for r in by_kind[a]], [r["seed"] for r in by_kind[b]]
            lines.append(f"- {a} vs {b}: no verdict (seeds run: {seeds_a} vs {seeds_b}; the rule needs {list(seeds)}).")
            continue
        yield a, b, by_kind[a], by_kind[b]


LEARNED_SEEDS_FOR_A_VERDICT = 4
"""A pair gets a verdict only where both architectures learned on at least this many of the 5 seeds."""


def needle_verdicts(runs_a: list[dict], runs_b: list[dict], settings: Settings) -> dict | str:
    """The decision rule (`decision_rule.beats`, A beats B) on the needle task, for two architectures' runs of the same
    seeds: per measure (mean accuracy over N at 1x, at the largest length factor, on the first query at 1x) the
    verdict and the paired difference; or, where one learned on fewer than `LEARNED_SEEDS_FOR_A_VERDICT` seeds, why
    there is none."""
    learned_a, learned_b = sum(learned(r, settings) for r in runs_a), sum(learned(r, settings) for r in runs_b)
    if min(learned_a, learned_b) < LEARNED_SEEDS_FOR_A_VERDICT:
        return f"learned {learned_a}/5 vs {learned_b}/5: not where both learn"
    verdicts = {}
    for name, factor, field in (("mean over N at 1x", 1, "accuracy"), (f"at {max(settings.length_factors)}x",
                                max(settings.length_factors), "accuracy"), ("first query at 1x", 1, "first_query_accuracy")):
        values_a = [float(np.mean(list(r[field][str(factor)].values()))) for r in runs_a]
        values_b = [float(np.mean(list(r[field][str(factor)].values()))) for r in runs_b]
        verdicts[name] = beats(values_a, values_b, settings)
    return verdicts


def device_flag(settings: Settings) -> str:
    return "" if settings.device == "cpu" else f" --device {settings.device}"


def devices_text(records: dict) -> str:
    """The devices a journal's runs ran on (a record written before `--device` names none: the CPU)."""
    return ", ".join(sorted({record.get("device", "cpu") for record in records.values()})) or "no run yet"


def write_summary(records: dict, settings: Settings, kinds, learning_rates: dict, out: Path, parameters: dict) -> str:
    hidden, context = settings.needle_configs[0]
    plateau = plateau_loss(settings)
    counts, factors = settings.needle_counts, settings.length_factors
    two = min(n for n in counts if n >= 2)
    by_kind = {kind: seed_records(records, settings, kind) for kind in kinds}
    ci = lambda values: ci_text(values, settings) if len(values) > 1 else (f"{values[0]:.3f}" if values else "-")  # noqa: E731
    lines = [
        f"# Issue 38's registered comparison, hidden {hidden}, trained at {context} tokens (partial until every cell "
        "has 5 seeds)", "",
        f"Written by `python research/compare.py --hidden {hidden}{device_flag(settings)} --summary-only` "
        f"from `jobs.jsonl` (one record per finished run), on {environment()}. The runs ran on: "
        f"{devices_text(records)}.", "",
        "Rules (fixed in code before the first run): the committed report's task, stopping rule and plateau clause "
        f"(`Settings`), plus issue 38's plateau extension: a run still on the plateau (best validation loss above "
        f"{settings.plateau_fraction} x {plateau:.3f}) at the {settings.max_steps}-step cap goes on to "
        f"{settings.plateau_max_steps} steps, every architecture alike; and its plateau retry (fixed before any retry "
        f"ran): a run still on the plateau at {settings.plateau_max_steps} steps is run again on its seed at "
        f"{settings.plateau_retry_lr_factor:g} x its learning rate, the retry's record standing for the seed (marked "
        "r below). Learning rates: "
        + ", ".join(f"{kind} {learning_rates[kind]:g}" for kind in kinds)
        + f". *Learned*: left the 1/N plateau (best validation loss below {settings.plateau_fraction * plateau:.3f}).",
        "", f"Parameters: " + ", ".join(f"{kind} {parameters[kind]:,}" for kind in kinds) + ".", "",
        "## Runs", "",
        "| architecture | lr | seeds run (r: retried) | learned | steps (per seed) | steps/s | "
        f"{two}-needle acc at 1x | mean over N at 1x | at 2x | at 4x | first query, mean over N at 1x |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in kinds:
        runs = by_kind[kind]
        if not runs:
            lines.append(f"| {DESCRIPTIONS.get(kind, kind)} | {learning_rates[kind]:g} | none | - | - | - | - | - | - | - | - |")
            continue
        mean_over_n = {f: [float(np.mean(list(r["accuracy"][str(f)].values()))) for r in runs] for f in factors}
        first = [float(np.mean(list(r["first_query_accuracy"]["1"].values()))) for r in runs]
        lines.append(
            f"| {DESCRIPTIONS.get(kind, kind)} | {learning_rates[kind]:g} | "
            f"{', '.join(str(r['seed']) + ('r' if r['retried'] else '') for r in runs)} | "
            f"{sum(learned(r, settings) for r in runs)}/{len(runs)} "
            f"({', '.join(str(r['seed']) for r in runs if learned(r, settings)) or 'none'}) | "
            f"{', '.join(str(r['steps']) for r in runs)} | {np.mean([r['steps_per_second'] for r in runs]):.1f} | "
            f"{ci([r['accuracy']['1'][str(two)] for r in runs])} | "
            + " | ".join(ci(mean_over_n[f]) for f in factors) + f" | {ci(first)} |"
        )
    lines += ["", "## Table 4 format (every query; mean over the seeds run)", "",
              "| architecture | " + " | ".join(f"N={n} {f}x" for f in factors for n in counts) + " |",
              "| --- | " + " | ".join("---" for _ in factors for _ in counts) + " |"]
    for kind in kinds:
        runs = by_kind[kind]
        if runs:
            lines.append(f"| {kind} | " + " | ".join(
                f"{np.mean([r['accuracy'][str(f)][str(n)] for r in runs]):.3f}" for f in factors for n in counts) + " |")
    lines += ["", "## Verdicts (decision rule: paired bootstrap over seeds; only where both ran every seed and "
              "learned on at least 4 of 5)", ""]
    for a, b, ra, rb in pairs_run_on_every_seed(by_kind, kinds, settings.seeds, lines):
        verdicts = needle_verdicts(ra, rb, settings)
        if isinstance(verdicts, str):
            lines.append(f"- {a} vs {b}: no verdict ({verdicts}).")
            continue
        lines.append(f"- {a} beats {b}? " + "; ".join(
            f"{name}: {verdict} {difference_text(difference)}" for name, (verdict, difference) in verdicts.items()) + ".")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def lm_seed_records(records: dict, hidden: int, kind: str) -> list[dict]:
    """The registered language-modelling runs of `kind` at `hidden`, by seed."""
    return sorted((r for r in records.values() if r["phase"] == "main" and r.get("task") == "lm" and r["kind"] == kind
                   and r["hidden"] == hidden), key=lambda r: r["seed"])


def lm_verdict(runs_a: list[dict], runs_b: list[dict], settings: Settings) -> tuple[str, tuple]:
    """The decision rule on test perplexity (A beats B: lower), for two architectures' runs of the same seeds."""
    return beats([r["test_perplexity"] for r in runs_a], [r["test_perplexity"] for r in runs_b], settings,
                 higher_is_better=False)


def write_lm_summary(records: dict, settings: Settings, kinds, learning_rates: dict, out: Path) -> str:
    """`summary.md` of `--task lm`: per architecture the runs, how many the stopping rule stopped before the cap, the
    test perplexity (mean over seeds, 95% bootstrap interval), and the decision rule on test perplexity (lower is
    better) for each pair of `PAIRS` where both ran every seed."""
    hidden = lm_hidden(settings)
    by_kind = {kind: lm_seed_records(records, hidden, kind) for kind in kinds}
    ci = lambda values: ci_text(values, settings, 2) if len(values) > 1 else (f"{values[0]:.2f}" if values else "-")  # noqa: E731
    lines = [
        f"# Issue 38's language modelling to the stopping rule, hidden {hidden}, context {settings.lm_context}", "",
        f"Written by `python research/compare.py --task lm --hidden {hidden}{device_flag(settings)} "
        f"--summary-only` from `jobs.jsonl`, on {environment()}. The runs ran on: {devices_text(records)}.", "",
        f"Rules (fixed in code before the first run): the committed report's corpus, model sizes and stopping rule; "
        f"from {settings.lm_min_steps} steps, a cap of {settings.lm_max_steps} (the committed runs stopped at 300), "
        f"validation every {settings.lm_eval_every} steps, batch {settings.lm_batch} x {settings.lm_context} tokens; "
        f"learning rate swept per architecture ({', '.join(f'{lr:g}' for lr in settings.lm_learning_rates)}, seed "
        f"{settings.sweep_seed}): " + ", ".join(f"{kind} {learning_rates[kind]:g}" for kind in kinds if kind in learning_rates)
        + f"; seeds {list(settings.lm_seeds)}.", "",
        "## Runs", "",
        "| architecture | lr | seeds run | steps (per seed; * at the cap) | stopped by the rule | steps/s | "
        "best validation loss | test perplexity |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in kinds:
        runs = by_kind[kind]
        lr = f"{learning_rates[kind]:g}" if kind in learning_rates else "-"
        if not runs:
            lines.append(f"| {DESCRIPTIONS.get(kind, kind)} | {lr} | none | - | - | - | - | - |")
            continue
        lines.append(
            f"| {DESCRIPTIONS.get(kind, kind)} | {lr} | {', '.join(str(r['seed']) for r in runs)} | "
            f"{', '.join(str(r['steps']) + ('*' if r['hit_cap'] else '') for r in runs)} | "
            f"{sum(not r['hit_cap'] for r in runs)}/{len(runs)} | {np.mean([r['steps_per_second'] for r in runs]):.1f} | "
            f"{ci([r['best_validation_loss'] for r in runs])} | {ci([r['test_perplexity'] for r in runs])} |"
        )
    lines += ["", "## Verdicts (decision rule on test perplexity, lower is better: paired bootstrap over seeds; only "
              "where both ran every seed)", ""]
    for a, b, ra, rb in pairs_run_on_every_seed(by_kind, kinds, settings.lm_seeds, lines):
        verdict, difference = lm_verdict(ra, rb, settings)
        lines.append(f"- {a} beats {b} (lower test perplexity)? {verdict} {difference_text(difference, 2)}.")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main_lm(args, settings: Settings, out: Path, log) -> None:
    """`--task lm`: the sweep, then the registered runs (resumable), then `summary.md`."""
    journal = out / "jobs.jsonl"
    sweep = lm_sweep_jobs(settings, args.kinds)
    if not args.summary_only:
        run_jobs(sweep, settings, journal, read_journal(journal), log)
    done = read_journal(journal)
    learning_rates = chosen_learning_rates([done[job_id(job)] for job in sweep if job_id(job) in done])
    (out / "learning_rates.json").write_text(json.dumps(learning_rates, indent=1))
    if not args.summary_only:
        jobs = lm_comparison_jobs(settings, args.kinds, learning_rates)
        run_jobs(jobs[: args.max_jobs] if args.max_jobs else jobs, settings, journal, done, log)
    print(write_lm_summary(read_journal(journal), settings, args.kinds, learning_rates, out))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("needle", "lm"), default="needle")
    parser.add_argument("--hidden", type=int, default=64, choices=(64, 128))
    parser.add_argument("--kinds", nargs="+", default=list(COMPARISON))
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sweep", action="store_true", help="sweep the learning rate per kind first (hidden 128)")
    parser.add_argument("--summary-only", action="store_true")
    parser.add_argument("--rate", type=int, metavar="STEPS", help="measure steps/s per kind (one thread) and stop")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the runs train (cuda: a replicate in results/v2/h{hidden}_cuda by default)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="every step count at most 2 and the data small: checks "
                        "the pipeline end to end (use with --out)")
    parser.add_argument("--long", nargs=2, metavar=("LR", "STEPS"),
                        help="a diagnostic, not part of any verdict: each of --kinds on each of --seeds at LR for "
                        "exactly STEPS steps (no early stopping), into long_STEPS/jobs.jsonl of the out folder")
    parser.add_argument("--max-jobs", type=int, help="run at most this many new jobs, then write the summary")
    parser.add_argument("--workers", type=int, help="jobs at once, one torch thread each (default 1: the registered "
                        "comparison leaves a core to other work; a run's result does not depend on it)")
    parser.add_argument("--only", choices=("main", "retry"),
                        help="run only the registered runs, or only the plateau retries (two processes can share "
                        "the journal this way); default: the registered runs, then the retries")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    settings = comparison_settings(args.hidden)
    if args.seeds:
        settings.seeds = settings.lm_seeds = tuple(args.seeds)
    if args.device == "cuda" and not torch.cuda.is_available() and not args.summary_only:
        parser.error("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here")
    settings.device = args.device
    if args.no_compile:
        settings.compile = False
    if args.long:
        if args.task == "lm" or args.sweep or args.summary_only or args.only or args.max_jobs or args.rate:
            parser.error("--long runs the needle diagnostic alone: not with --task lm, --sweep, --summary-only, "
                         "--only, --max-jobs or --rate")
        try:
            long_lr, settings.long_steps = float(args.long[0]), int(args.long[1])
        except ValueError:
            parser.error(f"--long takes a learning rate and a whole number of steps, got {args.long}")
        if long_lr <= 0 or settings.long_steps < 1:
            parser.error(f"--long takes a positive learning rate and at least 1 step, got {args.long}")
    if args.dry_run:
        shrink_for_dry_run(settings)
    if args.workers:
        settings.workers = args.workers
    out = args.out or RESULTS / ((f"lm_h{args.hidden}" if args.task == "lm" else f"h{args.hidden}")
                                 + ("_cuda" if args.device == "cuda" else ""))
    out.mkdir(parents=True, exist_ok=True)
    if args.rate:
        rates = measure_rates(settings, args.kinds, args.rate)
        record = {"hidden": args.hidden, "steps": args.rate, "load_average": os.getloadavg(),
                  "environment": environment(), "rates": rates}
        (out / "rate.json").write_text(json.dumps(record, indent=1))
        return
    journal = out / ("jobs.jsonl" if not args.long else f"long_{settings.long_steps}/jobs.jsonl")
    journal.parent.mkdir(exist_ok=True)
    done = read_journal(journal)
    device = None if args.summary_only else device_name(settings.device)
    if device is not None and any(record.get("device", "cpu") != device for record in done.values()):
        parser.error(f"{journal} holds runs on {devices_text(done)}, not {device}: a journal takes runs of one device "
                     "(give another --out)")

    def log(message):
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    if args.task == "lm":
        main_lm(args, settings, out, log)
        return
    if args.long:
        hidden, context = settings.needle_configs[0]
        jobs = [dict(phase="long", task="needle", kind=kind, hidden=hidden, context=context, lr=long_lr, seed=seed)
                for kind in args.kinds for seed in settings.seeds]
        run_jobs(jobs, settings, journal, done, log)
        return

    learning_rates = REGISTERED_LEARNING_RATES.get(args.hidden)
    for chosen in (out / "learning_rates.json", RESULTS / f"h{args.hidden}" / "learning_rates.json"):
        if learning_rates is None and not args.sweep and chosen.exists():  # chosen by an earlier --sweep
            learning_rates = json.loads(chosen.read_text())
    if args.sweep or learning_rates is None:
        if not args.sweep:
            parser.error(f"hidden {args.hidden} has no registered learning rates: run with --sweep")
        if args.sweep:
            sweep = run_jobs(sweep_jobs(settings, args.kinds), settings, journal, done, log)
            learning_rates = {}
            for record in sweep:
                if record["kind"] not in learning_rates or record["best_validation_loss"] < learning_rates[record["kind"]][1]:
                    learning_rates[record["kind"]] = (record["lr"], record["best_validation_loss"])
            learning_rates = {kind: lr for kind, (lr, _) in learning_rates.items()}
            (out / "learning_rates.json").write_text(json.dumps(learning_rates, indent=1))
            log(f"chosen learning rates: {learning_rates}")
    if not args.summary_only:
        started = 0
        while args.max_jobs is None or started < args.max_jobs:
            done = read_journal(journal)  # again before each job: a second process may have appended records
            pending = []
            if args.only in (None, "main"):
                pending = [job for job in comparison_jobs(settings, args.kinds, learning_rates) if job_id(job) not in done]
            if not pending and args.only in (None, "retry"):
                pending = [job for job in retry_jobs(done, settings, args.kinds) if job_id(job) not in done]
            if not pending:
                break
            # The whole queue to the pool (a worker takes the next job as soon as its own ends; a batch of `workers`
            # would leave a core idle beside a run on the plateau), then the journal is read again for the retries
            batch = pending if args.max_jobs is None else pending[: args.max_jobs - started]
            run_jobs(batch, settings, journal, done, log)
            started += len(batch)
    parameters = parameter_counts(settings, args.kinds)
    print(write_summary(read_journal(journal), settings, args.kinds, learning_rates, out, parameters))


if __name__ == "__main__":
    sys.exit(main())
