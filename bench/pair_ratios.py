# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""One model over another from `run_benchmark.py` results, per step, in two estimates, with the run's own noise beside
them (issue 40: DINT / DiffLlama <= 1.02 in bf16 and fp32 at the mid, SmolLM2-135M and 1B shapes).

    python bench/pair_ratios.py bench/results/issue40_cpu_*/results.json
    python bench/pair_ratios.py --pair dint_v2/llama bench/results/cpu_fp32_mid_v2/results.json

- *paired median*: the median over rounds of (model time / baseline time), the two run back to back in each round,
  by wall time and by the process's CPU time (`run_benchmark.py`'s own ratio);
- *ratio of minima*: the model's fastest round over the baseline's fastest, the least-disturbed estimate where the
  machine's speed drifts between rounds;
- *spread*: the baseline's slowest round over its fastest, i.e. how far the machine drifted during the run (on a
  shared VM this reached 1.6 with the load average below 1).
"""

import argparse
import json
import statistics


def samples(entries: list[dict], model: str, key: str, **match) -> list[float] | None:
    for entry in entries:
        if entry["model"] == model and all(entry.get(k) == v for k, v in match.items()) and key in entry:
            return entry[key]["samples"]
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files of bench/run_benchmark.py")
    parser.add_argument("--pair", default="dint_fast/diffllama", help="MODEL/BASELINE (bench_common.MODEL_NAMES)")
    args = parser.parse_args(argv)
    model, baseline = args.pair.split("/")
    print(f"| run | step | {model} / {baseline}: paired median (wall; CPU) | ratio of minima | rounds | spread | load at start, end |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in args.results:
        result = json.load(open(path, encoding="utf-8"))
        settings, machine = result["settings"], result["machine"]
        run = f"{settings['size']} {settings['dtype']}"
        load = f"{machine.get('load_average_at_start')}, {machine.get('load_average_1_5_15')}"
        rows = [(f"decode after {p}", result.get("decode") or [], "per_token_s", "per_token_cpu_s", {"prompt_len": p})
                for p in settings.get("prompt_lens") or []]
        rows += [("batched generate", result.get("generate") or [], "time_s", "cpu_time_s", {})]
        rows += [(f"prefill {n}", result.get("steps") or [], "time_s", "cpu_time_s", {"seq_len": n, "mode": "prefill"})
                 for n in settings.get("seq_lens") or []]
        for step, entries, wall_key, cpu_key, match in rows:
            wall, base_wall = samples(entries, model, wall_key, **match), samples(entries, baseline, wall_key, **match)
            cpu, base_cpu = samples(entries, model, cpu_key, **match), samples(entries, baseline, cpu_key, **match)
            if not wall or not base_wall:
                continue
            paired_wall = statistics.median(a / b for a, b in zip(wall, base_wall))
            paired_cpu = statistics.median(a / b for a, b in zip(cpu, base_cpu)) if cpu and base_cpu else float("nan")
            print(f"| {run} | {step} | {paired_wall:.3f}; {paired_cpu:.3f} | {min(wall) / min(base_wall):.3f} | "
                  f"{len(wall)} | {max(base_wall) / min(base_wall):.2f} | {load} |")


if __name__ == "__main__":
    main()
