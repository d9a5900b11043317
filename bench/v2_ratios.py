# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT-V2's ratios from a `run_benchmark.py` result that has the `dint_v2` model (issue 37's targets): DINT-V2 /
Llama for per-token decode and batched generate, DINT-V2 / DiffLlama for prefill; each the median of the per-round
ratios (the models of a round ran back to back), by wall time and by the process's CPU time.

    python bench/v2_ratios.py bench/results/cpu_fp32_mid_v2/results.json [more results.json ...]
"""

import json
import statistics
import sys


TARGETS = {"decode": ("llama", 1.05), "generate": ("llama", 1.05), "prefill": ("diffllama", 0.8)}


def paired_ratios(first: list[float], second: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(first, second))


def samples(entries: list[dict], model: str, key: str, **match) -> list[float]:
    for entry in entries:
        if entry["model"] == model and all(entry.get(k) == v for k, v in match.items()):
            return entry[key]["samples"]
    raise KeyError((model, match))


def main() -> None:
    for path in sys.argv[1:]:
        result = json.load(open(path, encoding="utf-8"))
        settings = result["settings"]
        print(f"\n{path}: {settings['size']} {settings['dtype']}, {result['machine']['processor']}, "
              f"{result['machine']['torch_threads']} thread(s), load average at start "
              f"{result['machine'].get('load_average_at_start')}, at end {result['machine'].get('load_average_1_5_15')}")
        print("| step | DINT-V2 / Llama (wall; CPU) | DINT-V2 / DiffLlama (wall; CPU) | DINT-V1 / DiffLlama (wall; CPU) | target |")
        print("| --- | --- | --- | --- | --- |")
        rows = [("decode", result["decode"], "per_token_s", "per_token_cpu_s", {"prompt_len": p})
                for p in settings["prompt_lens"]]
        rows += [("generate", result["generate"], "time_s", "cpu_time_s", {})]
        rows += [("prefill", result["steps"], "time_s", "cpu_time_s", {"seq_len": n, "mode": "prefill"})
                 for n in settings["seq_lens"]]
        for step, entries, wall_key, cpu_key, match in rows:
            cells = []
            for model, base in (("dint_v2", "llama"), ("dint_v2", "diffllama"), ("dint_fast", "diffllama")):
                wall = paired_ratios(samples(entries, model, wall_key, **match), samples(entries, base, wall_key, **match))
                cpu = paired_ratios(samples(entries, model, cpu_key, **match), samples(entries, base, cpu_key, **match))
                cells.append(f"{wall:.3f}; {cpu:.3f}")
            base, bound = TARGETS[step]
            label = f"{step} {match}" if match else step
            print(f"| {label} | {' | '.join(cells)} | V2/{base} <= {bound} |")


if __name__ == "__main__":
    main()
