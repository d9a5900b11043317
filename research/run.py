# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Check the DINT paper's claims at small scale, at convergence: Transformer (Llama) vs DIFF vs DINT.

    python research/run.py [--quick | --gpu] [--pilot] [--device cuda] [--out DIR] [--workers 2] [--resume]

Every run trains until a convergence rule fixed in code (`converged`) says stop, or a step cap (`--pilot` measures
accuracy against steps to choose it); each architecture gets its own learning rate from a small sweep (`Settings.learning_rates`) judged on a
validation set that neither training nor the test set uses. Then, over 5 seeds with 95% bootstrap intervals and a
decision rule fixed in code (`beats`):
  - "transformer": transformers' `LlamaForCausalLM` (one head per differential head, its SwiGLU widened to the same
    parameter count; "transformer_per_map", one head per softmax map, runs beside it as a control),
    "diff": `DintForCausalLM(integral="none")` (DIFF attention), "dint": `DintForCausalLM(integral="mean")`;
  - multi-needle retrieval (the paper's Table 4 counts, as multi-query associative recall, Zoology's layout): each
    training example starts with N `key value` pairs, then every key appears once more, as its own query, at a random
    place in random filler; the answer (its value) is predicted there and is not in the input after it
    (`make_needle_batch`); accuracy per needle count at 1x, 2x and 4x the trained length, over every query and over
    the first query of each example (the elimination control);
  - the ablations of the paper's Table 6 (DINT with lambda_init 0.8 / 0.5, without head norm, with the "softmax"
    integral; "none" is DIFF) on one size and length;
  - language modelling on the repo's Shakespeare corpus (validation split carved from the training text; held-out
    perplexity on two plays no training saw);
  - eager attention analysis of the trained models (answer share, filler share, previous-token score, negative
    entries, row sums) and heatmaps of A1, A2, G, A_final.
The training step is compiled by torch.compile (forward and backward, static shapes) and the batches are made in
tensor operations (`bench_speed.py` measures before and after). Runs are independent jobs (one training run each),
executed by a pool of `--workers` processes with one torch thread each; a job's result depends only on its own
seeds, never on scheduling. Writes `report.md`, `results.json` and PNGs to `--out`; finished jobs are appended to
`jobs.jsonl` there so `--resume` can continue a killed run. `--gpu` is the preset for one large GPU.

The harness, by concern (this file is the entry point and its command line):
  settings.py       `Settings`, the architectures, ablations and controls, the presets (`--quick`, `--gpu`, `--dry-run`)
  tasks.py          the needle task and the corpus, as batches of scored answers; the plateau loss of the task
  model_shapes.py   the models at equal size (`build_model`, `transformer_shape`) and their final attention maps
  training.py       the stopping rule (`converged`), the compiled training step, `train_to_convergence`
  evaluation.py     needle accuracy, held-out perplexity, the attention analysis
  runner.py         jobs, the learning-rate sweep and the runs after it, the pool of worker processes
  decision_rule.py  bootstrap intervals over seeds and the paired verdict (`beats`)
  report.py         report.md (one function per section) and results.json; figures.py the PNGs
  pilot_report.py   pilot.md and pilot.png (`--pilot`)
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from figures import draw_figures
from pilot_report import write_pilot
from report import all_numbers_finite, compact_for_json, write_report
from runner import environment, pilot_jobs, run_experiment, run_jobs
from settings import REPO_ROOT, Settings, gpu_settings, quick_settings, settings_from_dict, shrink_for_dry_run


DEFAULT_OUT = Path(__file__).resolve().parent / "results"
QUICK_OUT = Path("outputs") / "research-quick"
"""Where --quick writes by default: outputs/ is git-ignored (relative to the working directory, like the main job)."""
GPU_OUT = Path("outputs") / "research-gpu"
"""Where --gpu writes by default (git-ignored): its report is committed by hand, beside the CPU one."""
DRY_RUN_OUT = Path("outputs") / "research-dry-run"
"""Where --dry-run writes by default (git-ignored), whatever the preset."""


def parse_arguments(argv=None) -> tuple[argparse.Namespace, Settings]:
    """The command line, and the settings of the preset it names with its overrides applied."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and steps: the whole pipeline in < 3 minutes")
    parser.add_argument("--gpu", action="store_true",
                        help="the preset for one large GPU (hidden 128/256, 10^4+ steps; implies --device cuda)")
    parser.add_argument("--device", help="cpu or cuda (default: cpu; cuda with --gpu)")
    parser.add_argument("--pilot", action="store_true",
                        help="run the pilot only (fixed long runs, accuracy against steps): OUT/pilot.md")
    parser.add_argument(
        "--out", type=Path, default=None,
        help=f"results folder (default: {DEFAULT_OUT.relative_to(REPO_ROOT)}, the committed report; with --quick "
        f"{QUICK_OUT}, with --gpu {GPU_OUT}, with --dry-run {DRY_RUN_OUT})",
    )
    parser.add_argument("--workers", type=int, help="worker processes, one torch thread each (default 2)")
    parser.add_argument("--seeds", type=int, nargs="+", help="training seeds (default: 0 1 2 3 4)")
    parser.add_argument("--resume", action="store_true", help="reuse the finished jobs in OUT/jobs.jsonl")
    parser.add_argument("--no-compile", action="store_true", help="run the training steps eagerly")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="every training run 2 steps, 8 examples per test set: a preset's whole code path in minutes (e.g. "
        "`--gpu --device cpu --dry-run`, before a GPU run); its numbers mean nothing",
    )
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite report.md and the PNGs from OUT/results.json (no training); with --pilot, "
                        "pilot.md and pilot.png from OUT/pilot.json")
    args = parser.parse_args(argv)

    if args.quick and args.gpu:
        parser.error("--quick and --gpu are two presets: give one")
    if args.out is None:  # a --quick, --gpu or --dry-run run must not overwrite the committed report
        args.out = DRY_RUN_OUT if args.dry_run else QUICK_OUT if args.quick else GPU_OUT if args.gpu else DEFAULT_OUT
    settings = quick_settings() if args.quick else gpu_settings() if args.gpu else Settings()
    if args.device is not None:
        settings.device = args.device
    if settings.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda (or --gpu) needs a CUDA GPU, and torch.cuda.is_available() is False here")
    if args.workers is not None:
        settings.workers = args.workers
    if args.seeds is not None:
        settings.seeds = tuple(args.seeds)
    if args.no_compile:
        settings.compile = False
    if args.dry_run:
        shrink_for_dry_run(settings)
    return args, settings


def rewrite_reports(out: Path, pilot: bool) -> None:
    """`--report-only`: report.md, its PNGs and results.json from OUT/results.json; with `--pilot`, pilot.md and
    pilot.png from OUT/pilot.json. No training."""
    if pilot:
        record = json.loads((out / "pilot.json").read_text())
        write_pilot(record, settings_from_dict(record["settings"]), out)
        print(f"rewrote {out / 'pilot.md'} from pilot.json")
        return
    results = json.loads((out / "results.json").read_text())
    settings = settings_from_dict(results["settings"])
    figures = draw_figures(results, settings, out)
    report = write_report(results, settings, results["command"], results["wall_seconds"], figures)
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(compact_for_json(results, settings), indent=1))
    print(f"rewrote {out / 'report.md'} from results.json")


def run_pilot(settings: Settings, out: Path, resume: bool, command: str, started: float, log) -> None:
    """`--pilot`: the pilot's runs, then pilot.json, pilot.md and pilot.png."""
    load_start = os.getloadavg()[0]
    environment_at_start = environment()  # the commit the run started from
    journal = out / "pilot_jobs.jsonl"
    done = {}
    if resume and journal.exists():
        done = {record["id"]: record for record in map(json.loads, journal.read_text().splitlines())}
    records = run_jobs(pilot_jobs(settings), settings, journal, done, log)
    pilot = {"settings": dataclasses.asdict(settings), "runs": records, "wall_seconds": time.time() - started,
             "load_average": [load_start, os.getloadavg()[0]], "command": command,
             "environment": environment_at_start}
    (out / "pilot.json").write_text(json.dumps(pilot, indent=1))
    write_pilot(pilot, settings, out)
    journal.unlink(missing_ok=True)
    log(f"wrote {out / 'pilot.md'}")


def run_study(settings: Settings, out: Path, resume: bool, command: str, started: float, log) -> None:
    """The sweep, the runs after it, then report.md, its PNGs and results.json."""
    load_start = os.getloadavg()[0]
    environment_at_start = environment()  # the commit the run started from
    results = run_experiment(settings, out, resume, log)
    results["settings"] = dataclasses.asdict(settings)
    results["environment"] = environment_at_start
    figures = draw_figures(results, settings, out)
    wall_seconds = time.time() - started
    results["load_average"] = [load_start, os.getloadavg()[0]]
    results["wall_seconds"] = wall_seconds
    results["command"] = command
    report = write_report(results, settings, command, wall_seconds, figures)
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(compact_for_json(results, settings), indent=1))
    if not all_numbers_finite(results):
        raise RuntimeError(f"non-finite numbers in {out / 'results.json'}")
    (out / "jobs.jsonl").unlink(missing_ok=True)  # the records are all in results.json now
    log(f"wrote {out / 'report.md'} ({wall_seconds / 60:.1f} min)")


def main(argv=None) -> Path:
    args, settings = parse_arguments(argv)
    if args.report_only:
        rewrite_reports(args.out, args.pilot)
        return args.out
    command = "python research/run.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:] if argv is None else argv))
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)

    def log(message):
        print(f"[{time.strftime('%H:%M:%S')} +{(time.time() - started) / 60:.1f} min] {message}", flush=True)

    log(f"settings: {dataclasses.asdict(settings)}")
    (run_pilot if args.pilot else run_study)(settings, args.out, args.resume, command, started, log)
    return args.out


if __name__ == "__main__":
    main()
