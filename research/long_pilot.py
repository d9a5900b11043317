# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""One long pilot run beyond the pilot's step count: does a model leave the 1/N plateau if trained much longer?

    python research/long_pilot.py diff --lr 1e-3 --steps 15000 --seed 100 --out results/long_pilot_diff_lr0.001_s100.json

Runs `runner.run_job` as a pilot job (exactly `--steps` steps on the default needle config, no early stopping,
validation accuracy per needle count every `--eval-every` steps) with the default `settings.Settings` otherwise, and
writes its record (curves, final training loss, steps per second) as JSON. One torch thread, like a worker of `run.py`.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import run_job  # noqa: E402
from settings import ABLATIONS, ARCHITECTURES, CONTROLS, Settings  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", help=f"one of {ARCHITECTURES + CONTROLS + tuple(ABLATIONS)}")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--steps", type=int, default=15_000)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=Settings().sweep_seed)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = Settings(pilot_steps=args.steps, pilot_eval_every=args.eval_every)
    hidden, context = settings.needle_configs[0]
    job = dict(phase="pilot", task="needle", kind=args.kind, hidden=hidden, context=context, lr=args.lr, seed=args.seed)
    record = run_job(job, dataclasses.asdict(settings))
    record["command"] = "python research/long_pilot.py " + " ".join(sys.argv[1:])
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}: training loss at the end {record['final_train_loss']:.4f}")


if __name__ == "__main__":
    main()
