# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Issue 38's report (item 5): per claim of the papers, a verdict for every pair of architectures where both learn
key matching on at least 4 of 5 seeds, at hidden 64 and 128, and language modelling; what DINT's integral adds over
DIFF of the same layout; where an architecture does not learn, its budget curve.

    python research/report_v2.py          # results/v2/report.md from the journals, as far as they go

It reads only the journals of `NEEDLE_STUDIES` and `LM_STUDIES` (`results/v2/<folder>/jobs.jsonl`), with the verdicts
of `compare.py`'s summaries (`compare.needle_verdicts`, the LM summary's rule), so a cell is "pending" until its runs
(and their plateau retries) are in the journal; rerun it as they arrive. `results/report.md` (issue 30) is not touched.
"""

import argparse
import json
import sys
from pathlib import Path

from compare import (
    PAIRS, RESULTS, chosen_learning_rates, devices_text, learned, lm_seed_records, lm_verdict, needle_verdicts,
    read_journal, run_on_every_seed, seed_records,
)
from decision_rule import ci_text, difference_text
from settings import COMPARISON, DESCRIPTIONS, comparison_settings, lm_hidden
from tasks import plateau_loss


NEEDLE_STUDIES = (
    (64, "h64", "hidden 64 (CPU)"), (128, "h128", "hidden 128 (CPU)"), (128, "h128_cuda", "hidden 128 (GPU)"),
)
"""Each needle study: its hidden size, its journal's folder under results/v2, its label (the report names the GPU
from the records). Hidden 128 ran twice with the same rules, seeds and learning rates (the CPU sweep's): on the CPUs
(the registered run, resumable) and as a replicate on a lent GPU (`compare.py --device cuda`); a journal holds runs
of one device only."""
LM_STUDIES = (("lm_h64", "CPU"), ("lm_h64_cuda", "GPU"))
"""Each language-modelling study: its journal's folder under results/v2 and the kind of device it runs on."""
DEVICE_PAIR = ("h128", "h128_cuda")
"""The same registered runs on two devices: their outcomes compared run by run."""

CLAIMS = (
    ("1", "DINT retrieves needles better than DIFF of the same layout (what the integral adds)",
     (("dint", "diff"), ("dint_no_head_norm", "diff_no_head_norm"), ("dint_v2", "diff_v2"))),
    ("2", "DINT retrieves needles better than the Transformer",
     (("dint", "transformer"), ("dint_no_head_norm", "transformer"), ("dint_v2", "transformer"))),
    ("3", "DIFF retrieves needles better than the Transformer (the DIFF paper's claim)",
     (("diff", "transformer"), ("diff_no_head_norm", "transformer"), ("diff_v2", "transformer"))),
)
"""The needle claims of the committed report (results/report.md, claims 1-3), each judged for every layout's pair."""
assert {pair for _, _, pairs in CLAIMS for pair in pairs} == set(PAIRS), "every verdict pair belongs to one claim"

BUDGET_STEPS = (1000, 3000, 6000)
"""The budget curve of an architecture that does not learn: its best validation loss by these steps, per seed."""
LONG_BUDGET_STEPS = BUDGET_STEPS + (9000, 12000)
"""The budget curve of a diagnostic run beyond the registered budget (`compare.py --long`)."""


def name(kind: str) -> str:
    return DESCRIPTIONS.get(kind, kind)


def needle_cells(hidden: int, folder: str, results: Path) -> tuple[dict, dict, dict, object]:
    """The study's journal (id -> record), per kind the run standing for each seed (`compare.seed_records`), and per
    pair the verdict cell text."""
    settings = comparison_settings(hidden)
    records = read_journal(results / folder / "jobs.jsonl")
    by_kind = {kind: seed_records(records, settings, kind) for kind in COMPARISON}
    cells = {}
    for a, b in PAIRS:
        if not run_on_every_seed(by_kind[a], by_kind[b], settings.seeds):
            cells[a, b] = f"pending (seeds run {len(by_kind[a])} and {len(by_kind[b])} of {len(settings.seeds)})"
            continue
        retries_due = any(not learned(r, settings) and not r["retried"] for r in by_kind[a] + by_kind[b])
        verdicts = needle_verdicts(by_kind[a], by_kind[b], settings)
        if isinstance(verdicts, str):
            cells[a, b] = f"pending ({verdicts}; plateau retries to run)" if retries_due else f"no verdict ({verdicts})"
            continue
        cells[a, b] = "; ".join(f"{measure}: **{verdict}** {difference_text(difference)}"
                                for measure, (verdict, difference) in verdicts.items())
    return records, by_kind, cells, settings


def budget_text(budget_steps: tuple) -> str:
    return " / ".join(str(steps) for steps in budget_steps)


def budget_curve(run: dict, settings, budget_steps: tuple = BUDGET_STEPS) -> str:
    """Best validation loss by each of `budget_steps` (against the plateau threshold), then the run's best and its
    step (a run that learned and stopped before a budget step shows there)."""
    best = []
    for limit in budget_steps:
        losses = [loss for step, loss in zip(run["eval_steps"], run["validation_losses"]) if step <= limit]
        best.append(f"{min(losses):.2f}" if losses and run["steps"] >= limit else "-")
    return " / ".join(best) + f" (best {run['best_validation_loss']:.2f} at step {run['best_step']} of {run['steps']})"


def lm_section(lines: list[str], results: Path) -> None:
    settings = comparison_settings(64)
    hidden = lm_hidden(settings)
    lines += [f"## Claim 6: DINT models language better (lower test perplexity), hidden {hidden}", ""]
    for folder, device in LM_STUDIES:
        records = read_journal(results / folder / "jobs.jsonl")
        where = f"[`{folder}/`]({folder}/)" if (results / folder).is_dir() else f"`{folder}/`"
        lines += [f"### On the {device} ({where}" + (f", run on {devices_text(records)}" if records else "") + ")", ""]
        sweep = [r for r in records.values() if r["phase"] == "sweep" and r.get("task") == "lm"]
        runs = {kind: lm_seed_records(records, hidden, kind) for kind in COMPARISON}
        if not any(runs.values()):
            lines += [f"Not run yet (`python research/compare.py --task lm --hidden {hidden}`"
                      + (" --device cuda" if device != "CPU" else "") + f"; its rules are fixed in "
                      f"`comparison_settings`; {len(sweep)} sweep runs in the journal).", ""]
            continue
        rates = chosen_learning_rates(sweep)
        lines += ["| architecture | lr | seeds run | stopped by the rule | test perplexity |",
                  "| --- | --- | --- | --- | --- |"]
        for kind in COMPARISON:
            kind_runs = runs[kind]
            perplexity = [r["test_perplexity"] for r in kind_runs]
            lines.append(f"| {name(kind)} | {rates.get(kind, '-')} | {len(kind_runs)} | "
                         f"{sum(not r['hit_cap'] for r in kind_runs)}/{len(kind_runs)} | "
                         f"{ci_text(perplexity, settings, 2) if len(perplexity) > 1 else '-'} |")
        lines += ["", "| pair (A beats B: lower perplexity) | verdict |", "| --- | --- |"]
        for _, _, pairs in CLAIMS:
            for a, b in pairs:
                ra, rb = runs[a], runs[b]
                if not run_on_every_seed(ra, rb, settings.lm_seeds):
                    lines.append(f"| {name(a)} vs {name(b)} | pending (seeds run {len(ra)} and {len(rb)}) |")
                    continue
                verdict, difference = lm_verdict(ra, rb, settings)
                lines.append(f"| {name(a)} vs {name(b)} | **{verdict}** {difference_text(difference, 2)} |")
        lines.append("")


def long_section(lines: list[str], results: Path) -> None:
    """The diagnostics beyond the registered budget (`compare.py --long`, `<study>/long_<STEPS>/jobs.jsonl`): no verdict
    uses them; they say whether an architecture short of 4 of 5 learns given more steps."""
    found = [(hidden, folder, label, journal.parent.name, run) for hidden, folder, label in NEEDLE_STUDIES
             for journal in sorted((results / folder).glob("long_*/jobs.jsonl"))
             for run in read_journal(journal).values()]
    if not found:
        return
    lines += ["", "Beyond the registered budget (a diagnostic: `compare.py --long LR STEPS`, exactly STEPS steps, "
              f"no early stopping; no verdict uses it), best validation loss by {budget_text(LONG_BUDGET_STEPS)} "
              "steps:", ""]
    for hidden, folder, label, long_folder, run in sorted(found, key=lambda item: (item[1], item[3], item[4]["kind"],
                                                                                    item[4]["seed"])):
        settings = comparison_settings(hidden)
        device = run.get("device", "cpu").replace("cpu", "CPU")
        lines.append(f"- {label} ([`{folder}/{long_folder}/`]({folder}/{long_folder}/), on the {device}), "
                     f"{name(run['kind'])}, seed {run['seed']}, lr {run['lr']:g}: "
                     f"{budget_curve(run, settings, LONG_BUDGET_STEPS)}: "
                     f"{'learned' if learned(run, settings) else 'not learned'}")


def device_section(lines: list[str], states: dict) -> None:
    """The registered runs (phase main) that both journals of `DEVICE_PAIR` hold: learned or not on each device
    (`states`: `needle_cells` by folder)."""
    cpu_folder, gpu_folder = DEVICE_PAIR
    (cpu, _, _, settings), (gpu, _, _, _) = states[cpu_folder], states[gpu_folder]
    both = sorted(set(cpu) & set(gpu), key=lambda key: (COMPARISON.index(cpu[key]["kind"]), cpu[key]["seed"]))
    both = [key for key in both if cpu[key]["phase"] == "main"]
    lines += ["## The same runs on two devices", "",
              f"The registered runs (before any retry) that both [`{cpu_folder}/`]({cpu_folder}/) "
              f"({devices_text(cpu)}) and [`{gpu_folder}/`]({gpu_folder}/) ({devices_text(gpu)}) hold: the same "
              "model, initialisation, "
              "batches, seed and learning rate; the arithmetic differs (another device, and the journals' summaries "
              "name their releases and whether the steps ran compiled), so whether a run leaves the plateau can "
              "differ where its training is near the edge.", ""]
    if not both:
        lines += ["None yet.", ""]
        return
    agree = sum(learned(cpu[key], settings) == learned(gpu[key], settings) for key in both)
    lines += [f"Same outcome (learned or not) on {agree} of {len(both)} runs.", "",
              "| architecture | seed | CPU: best validation loss (learned) | GPU |", "| --- | --- | --- | --- |"]
    for key in both:
        cells = [f"{run['best_validation_loss']:.3f} ({'yes' if learned(run, settings) else 'no'})"
                 for run in (cpu[key], gpu[key])]
        lines.append(f"| {name(cpu[key]['kind'])} | {cpu[key]['seed']} | " + " | ".join(cells) + " |")
    lines.append("")


def write_report(out: Path, results: Path = RESULTS) -> str:
    """`out`/report.md from the journals under `results` (default: results/v2)."""
    states = {folder: needle_cells(hidden, folder, results) for hidden, folder, _ in NEEDLE_STUDIES}
    lines = [
        "# Issue 38: the papers' claims judged where every architecture learns key matching", "",
        "Written by `python research/report_v2.py` from the journals of `compare.py` ("
        + "; ".join(f"{label}: [`{folder}/`]({folder}/), run on {devices_text(states[folder][0])}"
                    for _, folder, label in NEEDLE_STUDIES)
        + "; language modelling: " + ", ".join(f"`{folder}/` ({device})" for folder, device in LM_STUDIES) + "). Task, "
        "rules, learning rates and the plateau extension and retry: the summaries and `research/README.md`. "
        "A verdict (the decision rule: 95% paired bootstrap over 5 seeds) is given only where both architectures ran "
        "every seed and learned key matching (left the 1/N plateau) on at least 4 of 5; *pending* cells wait for runs "
        "still to come.", "",
        "## Who learns key matching", "",
        "| architecture | "
        + " | ".join(f"{label}: learned (r: retried seeds)" for _, _, label in NEEDLE_STUDIES) + " |",
        "| --- | " + " | ".join("---" for _ in NEEDLE_STUDIES) + " |",
    ]
    for kind in COMPARISON:
        cells = []
        for _, folder, _ in NEEDLE_STUDIES:
            _, by_kind, _, settings = states[folder]
            runs = by_kind[kind]
            retried = sum(r["retried"] for r in runs)
            cells.append(f"{sum(learned(r, settings) for r in runs)}/{len(runs)} run"
                         + (f" ({retried} r)" if retried else ""))
        lines.append(f"| {name(kind)} | " + " | ".join(cells) + " |")
    for _, folder, label in NEEDLE_STUDIES:
        _, by_kind, _, settings = states[folder]
        transformer = by_kind["transformer"]
        two = min(n for n in settings.needle_counts if n >= 2)
        if len(transformer) == len(settings.seeds):
            accuracy = [r["accuracy"]["1"][str(two)] for r in transformer]
            lines += ["", f"{label[0].upper() + label[1:]}: the Transformer's {two}-needle accuracy at the trained "
                      f"length {ci_text(accuracy, settings)} (the sign that the task is learnable here: at least 0.9)."]
    lines += ["", "## Budget curves of the architectures that do not learn", "",
              f"Best validation loss by {budget_text(BUDGET_STEPS)} steps (`-`: the run stopped earlier), per seed, "
              "the registered run and its plateau retry at half the rate; learned means below the threshold.", ""]
    for hidden, folder, label in NEEDLE_STUDIES:
        records, by_kind, _, settings = states[folder]
        threshold = settings.plateau_fraction * plateau_loss(settings)
        for kind in COMPARISON:
            runs = by_kind[kind]
            if len(runs) < len(settings.seeds) or sum(learned(r, settings) for r in runs) >= 4:
                continue
            lines.append(f"- {label}, {name(kind)} (threshold {threshold:.2f}):")
            for run in runs:
                entries = sorted((r for r in records.values() if r["phase"] in ("main", "retry") and r["kind"] == kind
                                  and r["seed"] == run["seed"] and r["hidden"] == hidden), key=lambda r: r["phase"])
                lines.append(f"  - seed {run['seed']}: " + "; ".join(
                    f"{r['phase']} lr {r['lr']:g}: {budget_curve(r, settings)}" for r in entries))
    long_section(lines, results)
    for number, claim, pairs in CLAIMS:
        lines += ["", f"## Claim {number}: {claim}", "",
                  "| pair (A beats B) | " + " | ".join(label for _, _, label in NEEDLE_STUDIES) + " |",
                  "| --- | " + " | ".join("---" for _ in NEEDLE_STUDIES) + " |"]
        for a, b in pairs:
            lines.append(f"| {name(a)} vs {name(b)} | "
                         + " | ".join(states[folder][2][a, b] for _, folder, _ in NEEDLE_STUDIES) + " |")
    lines += [""]
    device_section(lines, states)
    lm_section(lines, results)
    lines += [
        "## Why the head norm stops small models", "",
        "Measured, not guessed: [`headnorm/summary.md`](headnorm/summary.md) and `research/README.md`. The "
        "head norm's unit-RMS output, through o_proj, is about 11x the residual stream at init at hidden 64; scaling "
        "the head norm's output by 0.1, or the embeddings up to the head norm's scale, makes DINT-V1 learn; DIFF's "
        "(1 - lambda_init) factor does not.", "",
    ]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of report.md (default: results/v2)")
    args = parser.parse_args(argv)
    print(write_report(args.out))


if __name__ == "__main__":
    sys.exit(main())
