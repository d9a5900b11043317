# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Issue 38's report (item 5): per claim of the papers, a verdict for every pair of architectures where both learn
key matching on at least 4 of 5 seeds, at hidden 64 and 128, and language modelling; what DINT's integral adds over
DIFF of the same layout; where an architecture does not learn, its budget curve.

    python examples/research/report_v2.py          # results/v2/report.md from the journals, as far as they go

It reads only the journals (`results/v2/h64/jobs.jsonl`, `h128/jobs.jsonl`, `lm_h64/jobs.jsonl`), with the verdicts of
`compare.py`'s summaries (`compare.needle_verdicts`, the LM summary's rule), so a cell is "pending" until its runs
(and their plateau retries) are in the journal; rerun it as they arrive. `results/report.md` (issue 30) is not touched.
"""

import argparse
import json
import sys
from pathlib import Path

from compare import (
    PAIRS, RESULTS, chosen_learning_rates, learned, lm_seed_records, lm_verdict, needle_verdicts, read_journal,
    run_on_every_seed, seed_records,
)
from decision_rule import ci_text, difference_text
from settings import COMPARISON, DESCRIPTIONS, comparison_settings, lm_hidden
from tasks import plateau_loss


HIDDEN_SIZES = (64, 128)

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


def name(kind: str) -> str:
    return DESCRIPTIONS.get(kind, kind)


def needle_cells(hidden: int, results: Path) -> tuple[dict, dict, object]:
    """Per kind, the run standing for each seed (`compare.seed_records`), and per pair the verdict cell text."""
    settings = comparison_settings(hidden)
    records = read_journal(results / f"h{hidden}" / "jobs.jsonl")
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
    return by_kind, cells, settings


def budget_curve(run: dict, settings) -> str:
    """Best validation loss by each of `BUDGET_STEPS` (against the plateau threshold), for one run."""
    best = []
    for limit in BUDGET_STEPS:
        losses = [loss for step, loss in zip(run["eval_steps"], run["validation_losses"]) if step <= limit]
        best.append(f"{min(losses):.2f}" if losses and run["steps"] >= limit else "-")
    return " / ".join(best)


def lm_section(lines: list[str], results: Path) -> None:
    settings = comparison_settings(64)
    hidden = lm_hidden(settings)
    records = read_journal(results / f"lm_h{hidden}" / "jobs.jsonl")
    lines += [f"## Claim 6: DINT models language better (lower test perplexity), hidden {hidden}", ""]
    sweep = [r for r in records.values() if r["phase"] == "sweep" and r.get("task") == "lm"]
    runs = {kind: lm_seed_records(records, hidden, kind) for kind in COMPARISON}
    if not any(runs.values()):
        lines += [f"Pending: not run yet (`python examples/research/compare.py --task lm --hidden {hidden}`; its rules "
                  f"are fixed in `comparison_settings`; {len(sweep)} sweep runs in the journal).", ""]
        return
    rates = chosen_learning_rates(sweep)
    lines += ["| architecture | lr | seeds run | stopped by the rule | test perplexity |", "| --- | --- | --- | --- | --- |"]
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


def write_report(out: Path, results: Path = RESULTS) -> str:
    """`out`/report.md from the journals under `results` (default: results/v2)."""
    states = {hidden: needle_cells(hidden, results) for hidden in HIDDEN_SIZES}
    lines = [
        "# Issue 38: the papers' claims judged where every architecture learns key matching", "",
        "Written by `python examples/research/report_v2.py` from the journals of `compare.py` (hidden 64: "
        "[`h64/`](h64/), hidden 128: [`h128/`](h128/), language modelling: `lm_h64/`). Task, "
        "rules, learning rates and the plateau extension and retry: the summaries and `examples/research/README.md`. "
        "A verdict (the decision rule: 95% paired bootstrap over 5 seeds) is given only where both architectures ran "
        "every seed and learned key matching (left the 1/N plateau) on at least 4 of 5; *pending* cells wait for runs "
        "still to come.", "",
        "## Who learns key matching", "",
        "| architecture | " + " | ".join(f"hidden {h}: learned (r: retried seeds)" for h in HIDDEN_SIZES) + " |",
        "| --- | " + " | ".join("---" for _ in HIDDEN_SIZES) + " |",
    ]
    for kind in COMPARISON:
        cells = []
        for hidden in HIDDEN_SIZES:
            by_kind, _, settings = states[hidden]
            runs = by_kind[kind]
            retried = sum(r["retried"] for r in runs)
            cells.append(f"{sum(learned(r, settings) for r in runs)}/{len(runs)} run" + (f" ({retried} r)" if retried else ""))
        lines.append(f"| {name(kind)} | " + " | ".join(cells) + " |")
    for hidden in HIDDEN_SIZES:
        by_kind, _, settings = states[hidden]
        transformer = by_kind["transformer"]
        two = min(n for n in settings.needle_counts if n >= 2)
        if len(transformer) == len(settings.seeds):
            accuracy = [r["accuracy"]["1"][str(two)] for r in transformer]
            lines += ["", f"Hidden {hidden}: the Transformer's {two}-needle accuracy at the trained length "
                      f"{ci_text(accuracy, settings)} (the sign that the task is learnable here: at least 0.9)."]
    lines += ["", "## Budget curves of the architectures that do not learn", "",
              "Best validation loss by 1000 / 3000 / 6000 steps (`-`: the run stopped earlier), per seed, the registered "
              "run and its plateau retry at half the rate; learned means below the threshold.", ""]
    for hidden in HIDDEN_SIZES:
        by_kind, _, settings = states[hidden]
        records = read_journal(results / f"h{hidden}" / "jobs.jsonl")
        threshold = settings.plateau_fraction * plateau_loss(settings)
        for kind in COMPARISON:
            runs = by_kind[kind]
            if len(runs) < len(settings.seeds) or sum(learned(r, settings) for r in runs) >= 4:
                continue
            lines.append(f"- hidden {hidden}, {name(kind)} (threshold {threshold:.2f}):")
            for run in runs:
                entries = sorted((r for r in records.values() if r["phase"] in ("main", "retry") and r["kind"] == kind
                                  and r["seed"] == run["seed"] and r["hidden"] == hidden), key=lambda r: r["phase"])
                lines.append(f"  - seed {run['seed']}: " + "; ".join(
                    f"{r['phase']} lr {r['lr']:g}: {budget_curve(r, settings)}" for r in entries))
    for number, claim, pairs in CLAIMS:
        lines += ["", f"## Claim {number}: {claim}", "", "| pair (A beats B) | " + " | ".join(
            f"hidden {h}" for h in HIDDEN_SIZES) + " |", "| --- | " + " | ".join("---" for _ in HIDDEN_SIZES) + " |"]
        for a, b in pairs:
            lines.append(f"| {name(a)} vs {name(b)} | " + " | ".join(states[h][1][a, b] for h in HIDDEN_SIZES) + " |")
    lines += [""]
    lm_section(lines, results)
    lines += [
        "## Why the head norm stops small models", "",
        "Measured, not guessed: [`headnorm/summary.md`](headnorm/summary.md) and `examples/research/README.md`. The "
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
