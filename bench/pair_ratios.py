# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Model-over-baseline ratios from `run_benchmark.py` (or `bf16_cpu.py`) results, per step, in two estimates, with the
run's own noise beside them.

    python bench/pair_ratios.py bench/results/run_benchmark/cpu/*.json                      # DINT-V1 / DiffLlama
    python bench/pair_ratios.py --pair dint_v2/llama --pair dint_v2/diff_v2 --pair dint_fast/diffllama RESULTS.json

- *paired median*: the median over rounds of (model time / baseline time), the two run back to back in each round,
  by wall time and by the process's CPU time (`run_benchmark.py`'s own ratio);
- *ratio of minima*: the model's fastest round over the baseline's fastest, the least-disturbed estimate where the
  machine's speed drifts between rounds;
- *spread*: the baseline's slowest round over its fastest, i.e. how far the machine drifted during the run (on a
  shared VM this reached 1.6 with the load average below 1).

Steps: per-token decode after each prompt length, batched `generate()`, prefill at each length. A pair whose models
the run lacks is left out of its table. `--write` files the table under `bench/results/pair_ratios/cpu/`.
"""

import argparse
import json
import os
import statistics
import sys


def samples(entries: list[dict], model: str, key: str, **match) -> list[float] | None:
    for entry in entries:
        if entry["model"] == model and all(entry.get(k) == v for k, v in match.items()) and key in entry:
            return entry[key]["samples"]
    return None


def ratio_rows(result: dict, model: str, baseline: str) -> list[dict]:
    """One row per step that both models ran: paired medians (wall, CPU), ratio of minima, rounds, spread."""
    settings = result["settings"]
    steps = [(f"decode after {p}", result.get("decode") or [], "per_token_s", "per_token_cpu_s", {"prompt_len": p})
             for p in settings.get("prompt_lens") or []]
    steps += [("batched generate", result.get("generate") or [], "time_s", "cpu_time_s", {})]
    steps += [(f"prefill {n}", result.get("steps") or [], "time_s", "cpu_time_s", {"seq_len": n, "mode": "prefill"})
              for n in settings.get("seq_lens") or []]
    rows = []
    for step, entries, wall_key, cpu_key, match in steps:
        wall, base_wall = samples(entries, model, wall_key, **match), samples(entries, baseline, wall_key, **match)
        cpu, base_cpu = samples(entries, model, cpu_key, **match), samples(entries, baseline, cpu_key, **match)
        if not wall or not base_wall:
            continue
        rows.append({
            "step": step,
            "paired_wall": statistics.median(a / b for a, b in zip(wall, base_wall)),
            "paired_cpu": statistics.median(a / b for a, b in zip(cpu, base_cpu)) if cpu and base_cpu else float("nan"),
            "minima": min(wall) / min(base_wall),
            "rounds": len(wall),
            "spread": max(base_wall) / min(base_wall),
        })
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results.json files of bench/run_benchmark.py")
    parser.add_argument("--pair", action="append", default=None,
                        help="MODEL/BASELINE (bench_common.MODEL_NAMES), repeatable; default dint_fast/diffllama")
    parser.add_argument("--write", action="store_true", help="file the table under bench/results/pair_ratios/cpu/")
    args = parser.parse_args(argv)
    pairs = [pair.split("/") for pair in args.pair or ["dint_fast/diffllama"]]
    lines = ["| run | step | pair | paired median (wall; CPU) | ratio of minima | rounds | spread | load at start, end |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path in args.results:
        result = json.load(open(path, encoding="utf-8"))
        settings, machine = result["settings"], result["machine"]
        run = f"{settings['size']} {settings['dtype']}, {machine.get('git_commit')}"
        load = f"{machine.get('load_average_at_start')}, {machine.get('load_average_1_5_15')}"
        for model, baseline in pairs:
            for row in ratio_rows(result, model, baseline):
                lines.append(f"| {run} | {row['step']} | {model} / {baseline} | {row['paired_wall']:.3f}; "
                             f"{row['paired_cpu']:.3f} | {row['minima']:.3f} | {row['rounds']} | {row['spread']:.2f} | {load} |")
    if not args.write:
        print("\n".join(lines))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_common

    output = os.path.join(bench_common.results_dir("pair_ratios", "cpu"), "results.json")
    summary = {"machine": bench_common.machine_info("cpu"), "results": args.results, "pairs": pairs}
    bench_common.write_result(summary, output, "Ratios from the results named in the command.\n\n" + "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
