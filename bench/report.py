# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Markdown tables and a plot from a benchmark's `results.json`.

`run_benchmark.py` calls `write_report`; to render again from saved results (`--plot`: also the PNG):

    python bench/report.py bench/results/run_benchmark/cpu/default_fp32.json
"""

import argparse
import math
import os
import statistics


MODEL_LABELS = {
    "dint_fast": "DINT fast",
    "dint_eager": "DINT eager",
    "diffllama": "DiffLlama",
    "llama": "Llama",
    "dint_v2": "DINT-V2",
    "diff_v2": "DIFF-V2",
}
MODEL_STYLES = {
    "dint_fast": {"color": "tab:red", "marker": "o"},
    "dint_eager": {"color": "tab:orange", "marker": "s"},
    "diffllama": {"color": "tab:blue", "marker": "^"},
    "llama": {"color": "tab:gray", "marker": "v"},
    "dint_v2": {"color": "tab:purple", "marker": "D"},
    "diff_v2": {"color": "tab:green", "marker": "P"},
}
RATIO_TARGET = 1.05
TARGET_FROM_LENGTH = 2048
USER_SIZE_TARGET = 1.02
"""Issue 31: DINT fast / DiffLlama for batched generate() and per-token decode at the sizes users run."""
STEP_LABELS = {"forward": "forward", "forward_backward": "forward+backward", "prefill": "prefill"}


class Tables:
    """Lookups over the raw results: medians, peaks and skip notes by (model, mode, length)."""

    def __init__(self, results: dict):
        self.results = results
        self.models = results["settings"]["models"]
        self.seq_lens = results["settings"]["seq_lens"]
        self.prompt_lens = results["settings"]["prompt_lens"]
        # Results from before `--steps` timed forward and forward+backward.
        self.steps = results["settings"].get("steps", ["forward", "forward_backward"])
        self.generate = {entry["model"]: entry for entry in results.get("generate", [])}
        self.time, self.cpu, self.peak, self.decode, self.notes = {}, {}, {}, {}, {}
        for entry in results["steps"]:
            key = (entry["model"], entry["mode"], entry["seq_len"])
            if "time_s" in entry:
                self.time[key] = entry["time_s"]
            if "cpu_time_s" in entry:
                self.cpu[key] = entry["cpu_time_s"]
            else:
                self.notes[key] = entry["skipped"]
            if entry.get("peak_bytes"):
                self.peak[key] = entry["peak_bytes"]
        for entry in results["memory"]:
            key = (entry["model"], entry["mode"], entry["seq_len"])
            if entry["status"] == "ok":
                self.peak[key] = entry["peak_bytes"]
            else:
                self.notes.setdefault(key, entry.get("note") or entry["status"])
        for entry in results["decode"]:
            key = (entry["model"], entry["prompt_len"])
            if "per_token_s" in entry:
                self.decode[key] = entry
            else:
                self.notes[(entry["model"], "decode", entry["prompt_len"])] = entry["skipped"]

    def cpu_ratios(self, model, other) -> dict:
        """`model`'s CPU time over `other`'s (median of the per-round ratios; results from before CPU times were
        recorded have none): `{("step", mode, N) | ("decode", prompt) | ("generate",): ratio}`."""
        ratios = {}
        for (name, mode, n), entry in self.cpu.items():
            if name == model and (other, mode, n) in self.cpu:
                ratios[("step", mode, n)] = _paired_ratio(entry["samples"], self.cpu[(other, mode, n)]["samples"])
        for (name, prompt_len), entry in self.decode.items():
            other_entry = self.decode.get((other, prompt_len))
            if name == model and other_entry and "per_token_cpu_s" in entry:
                ratios[("decode", prompt_len)] = _paired_ratio(
                    entry["per_token_cpu_s"]["samples"], other_entry["per_token_cpu_s"]["samples"]
                )
        if model in self.generate and other in self.generate and "cpu_time_s" in self.generate[model]:
            ratios[("generate",)] = _paired_ratio(
                self.generate[model]["cpu_time_s"]["samples"], self.generate[other]["cpu_time_s"]["samples"]
            )
        return ratios

    def median(self, model, mode, seq_len):
        entry = self.time.get((model, mode, seq_len))
        return None if entry is None else entry["median"]

    def decode_median(self, model, prompt_len):
        entry = self.decode.get((model, prompt_len))
        return None if entry is None else entry["per_token_s"]["median"]

    def time_ratio(self, model, other, mode, seq_len):
        """`model`'s time over `other`'s: the median of the per-repetition ratios (None if either is missing)."""
        entries = self.time.get((model, mode, seq_len)), self.time.get((other, mode, seq_len))
        return None if None in entries else _paired_ratio(entries[0]["samples"], entries[1]["samples"])

    def generate_ratio(self, model, other):
        """`model`'s generate() time over `other`'s: the median of the per-round ratios."""
        if model not in self.generate or other not in self.generate:
            return None
        return _paired_ratio(self.generate[model]["time_s"]["samples"], self.generate[other]["time_s"]["samples"])

    def decode_ratio(self, model, other, prompt_len):
        """`model`'s per-token latency over `other`'s: the median of the per-sample ratios."""
        entries = self.decode.get((model, prompt_len)), self.decode.get((other, prompt_len))
        if None in entries:
            return None
        return _paired_ratio(entries[0]["per_token_s"]["samples"], entries[1]["per_token_s"]["samples"])


def _paired_ratio(samples, other_samples) -> float | None:
    """Median of `samples[i] / other_samples[i]`. The i-th samples of all models ran in the same round-robin round, back
    to back, so a drift of the machine during the run (seen: every model 30% slower for a minute) cancels in each
    ratio, where it would not between two medians taken over the whole run."""
    if len(samples) != len(other_samples):
        raise ValueError(f"cannot pair {len(samples)} samples with {len(other_samples)}: they come from different runs")
    ratios = [a / b for a, b in zip(samples, other_samples) if b > 0]
    return statistics.median(ratios) if ratios else None


def _ratio(numerator, denominator) -> str:
    if numerator is None or denominator is None or denominator == 0:
        return "–"
    return _format_ratio(numerator / denominator)


def _format_ratio(ratio, digits=2) -> str:
    return "–" if ratio is None else f"{ratio:.{digits}f}"


def _seconds(entry, scale=1.0, digits=3) -> str:
    if entry is None:
        return "–"
    return f"{entry['median'] * scale:.{digits}f} [{entry['min'] * scale:.{digits}f}–{entry['max'] * scale:.{digits}f}]"


def _mib(value) -> str:
    return "–" if value is None else f"{value / 2**20:.1f}"


def _to_mib(value):
    return None if value is None else value / 2**20


def _slope(points: list[tuple[int, float]]) -> float | None:
    """Log-log slope over the last doubling (or last step) of `points` [(length, value)]: 1 = linear, 2 = quadratic."""
    points = sorted((n, v) for n, v in points if v)
    if len(points) < 2:
        return None
    (n0, v0), (n1, v1) = points[-2], points[-1]
    return math.log(v1 / v0) / math.log(n1 / n0)


def targets_table(tables: Tables) -> list[str]:
    lines = ["| target (issue 7) | measured | met |", "| --- | --- | --- |"]
    have = set(tables.models)

    def worst_ratio(values):
        values = [(n, r) for n, r in values if r is not None]
        if not values:
            return None, "not measured"
        n, ratio = max(values, key=lambda item: item[1])
        text = ", ".join(f"{r:.3f} @ {length}" for length, r in values)
        return ratio, f"worst {ratio:.3f} (N={n}); all: {text}"

    if {"dint_fast", "diffllama"} <= have and tables.generate:
        ratio = tables.generate_ratio("dint_fast", "diffllama")
        cpu_ratio = tables.cpu_ratios("dint_fast", "diffllama").get(("generate",))
        met = "–" if ratio is None else ("yes" if ratio <= USER_SIZE_TARGET else "**no**")
        lines.append(f"| DINT fast / DiffLlama batched generate() (issue 31): ≤ {USER_SIZE_TARGET} | "
                     f"{_format_ratio(ratio, 3)} (CPU time: {_format_ratio(cpu_ratio, 3)}) | {met} |")  # fmt: skip
        values = [(p, tables.decode_ratio("dint_fast", "diffllama", p)) for p in tables.prompt_lens]
        ratio, text = worst_ratio(values)
        met = "–" if ratio is None else ("yes" if ratio <= USER_SIZE_TARGET else "**no**")
        lines.append(f"| DINT fast / DiffLlama decode per token, every prompt (issue 31): ≤ {USER_SIZE_TARGET} | "
                     f"{text} | {met} |")  # fmt: skip
    if {"dint_fast", "diffllama"} <= have:
        for mode, label in (("forward_backward", "forward+backward"), ("forward", "forward"), ("prefill", "prefill")):
            if mode not in tables.steps:
                continue
            values = [(n, tables.time_ratio("dint_fast", "diffllama", mode, n))
                      for n in tables.seq_lens if n >= TARGET_FROM_LENGTH]  # fmt: skip
            ratio, text = worst_ratio(values)
            met = "–" if ratio is None or mode != "forward_backward" else ("yes" if ratio <= RATIO_TARGET else "**no**")
            goal = f"≤ {RATIO_TARGET}" if mode == "forward_backward" else "(no target, shown)"
            lines.append(f"| DINT fast / DiffLlama time, {label}, N ≥ {TARGET_FROM_LENGTH}: {goal} | {text} | {met} |")
        values = [(p, tables.decode_ratio("dint_fast", "diffllama", p))
                  for p in tables.prompt_lens if p >= TARGET_FROM_LENGTH]  # fmt: skip
        ratio, text = worst_ratio(values)
        met = "–" if ratio is None else ("yes" if ratio <= RATIO_TARGET else "**no**")
        lines.append(f"| DINT fast / DiffLlama decode per token, prompt ≥ {TARGET_FROM_LENGTH}: ≤ {RATIO_TARGET} | {text} | {met} |")
    for model, expected, label in (("dint_fast", 1, "linear"), ("dint_eager", 2, "quadratic")):
        if model not in have:
            continue
        for mode in ("forward_backward", "forward"):
            if mode not in tables.steps:
                continue
            points = [(n, tables.peak.get((model, mode, n))) for n in tables.seq_lens]
            slope = _slope(points)
            measured = [n for n, v in points if v]
            if slope is None:
                why = "not enough lengths" if measured else "not measured (--no-memory)"
                lines.append(f"| {MODEL_LABELS[model]} peak memory ({mode}) {label} in N | {why} | – |")
                continue
            if expected == 1:
                met = "yes" if slope <= 1.25 else "**no**"
            else:
                met = "shown (quadratic)" if slope >= 1.6 else "shown (sub-quadratic at these N)"
            lines.append(
                f"| {MODEL_LABELS[model]} peak memory ({mode.replace('_', '+')}) {label} in N | log-log slope "
                f"{slope:.2f} between N={measured[-2]} and {measured[-1]} (1 = linear, 2 = quadratic) | {met} |"
            )
    for model in ("dint_fast", "dint_eager"):
        sizes = [(p, tables.decode[(model, p)]["integral_bytes_per_layer_after_prefill"][0])
                 for p in tables.prompt_lens if (model, p) in tables.decode]  # fmt: skip
        if not sizes:
            continue
        constant = len({size for _, size in sizes}) == 1
        text = ", ".join(f"{size} B @ {p}" for p, size in sizes)
        if model == "dint_fast":
            lines.append(f"| DINT fast integral state per layer constant in N | {text} | {'yes' if constant else '**no**'} |")
        else:
            lines.append(f"| (DINT eager keeps A1's column sums: grows with N, by design) | {text} | – |")
    return lines


def ratio_tables(tables: Tables) -> list[str]:
    pairs = [("diffllama", "DINT/DiffLlama"), ("llama", "DINT/Llama"), ("dint_eager", "fast/eager")]
    pairs = [(other, label) for other, label in pairs if other in tables.models]
    if "dint_fast" not in tables.models:
        return []
    header = ["N"]
    for mode in tables.steps:
        header += [f"{STEP_LABELS[mode]} time {label}" for _, label in pairs]
    with_memory = "forward_backward" in tables.steps
    if with_memory:
        header += [f"fwd+bwd peak mem {label}" for _, label in pairs]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for n in tables.seq_lens:
        row = [str(n)]
        for mode in tables.steps:
            row += [_format_ratio(tables.time_ratio("dint_fast", other, mode, n)) for other, _ in pairs]
        if with_memory:
            row += [_ratio(tables.peak.get(("dint_fast", "forward_backward", n)), tables.peak.get((other, "forward_backward", n)))
                    for other, _ in pairs]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Decode (per-token latency with the cache; cache = keys + values + integral state):", ""]
    header = ["prompt"] + [f"latency {label}" for _, label in pairs] + [f"cache bytes {label}" for _, label in pairs]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for p in tables.prompt_lens:
        row = [str(p)] + [_format_ratio(tables.decode_ratio("dint_fast", other, p)) for other, _ in pairs]
        fast = tables.decode.get(("dint_fast", p))
        for other, _ in pairs:
            entry = tables.decode.get((other, p))
            row.append(_ratio(fast and fast["cache_bytes_after_prefill"], entry and entry["cache_bytes_after_prefill"]))
        lines.append("| " + " | ".join(row) + " |")
    if tables.generate:
        entry = next(iter(tables.generate.values()))
        lines += ["", f"Batched generate() ({entry['batch_size']} prompts of {entry['prompt_len']} tokens, "
                  f"{entry['new_tokens']} greedy new tokens; median of the per-round ratios):", ""]  # fmt: skip
        lines += ["| " + " | ".join(label for _, label in pairs) + " |", "|" + " --- |" * len(pairs)]
        lines.append("| " + " | ".join(_format_ratio(tables.generate_ratio("dint_fast", other), 3) for other, _ in pairs) + " |")
    cpu = {other: tables.cpu_ratios("dint_fast", other) for other, _ in pairs}
    keys = sorted({key for ratios in cpu.values() for key in ratios}, key=lambda key: (key[0], str(key[1:])))
    if keys:
        lines += ["", "The same ratios by CPU time (this process's, all threads: it leaves out the time other work "
                  "held the cores, the steadier measure on a shared machine with `--threads 1`):", ""]  # fmt: skip
        lines += ["| step | " + " | ".join(label for _, label in pairs) + " |", "|" + " --- |" * (len(pairs) + 1)]
        for key in keys:
            what = {"step": lambda k: f"{STEP_LABELS[k[1]]} N={k[2]}", "decode": lambda k: f"decode per token, prompt {k[1]}",
                    "generate": lambda k: "batched generate()"}[key[0]](key)  # fmt: skip
            lines.append(f"| {what} | " + " | ".join(_format_ratio(cpu[other].get(key), 3) for other, _ in pairs) + " |")
    return lines


def absolute_tables(tables: Tables) -> list[str]:
    models = tables.models
    lines = ["Time per step, seconds: median [min–max] over the repetitions.", ""]
    lines += ["| N | step | " + " | ".join(MODEL_LABELS[m] for m in models) + " |", "|" + " --- |" * (len(models) + 2)]
    for n in tables.seq_lens:
        for mode in tables.steps:
            cells = [_seconds(tables.time.get((m, mode, n))) for m in models]
            lines.append(f"| {n} | {STEP_LABELS[mode]} | " + " | ".join(cells) + " |")
    if tables.generate:
        lines += ["", "Batched generate(): seconds per call, median [min–max] over the rounds; new tokens per second:",
                  ""]  # fmt: skip
        lines += ["| | " + " | ".join(MODEL_LABELS[m] for m in models if m in tables.generate) + " |",
                  "|" + " --- |" * (1 + sum(m in tables.generate for m in models))]  # fmt: skip
        generated = [tables.generate[m] for m in models if m in tables.generate]
        lines.append("| seconds | " + " | ".join(_seconds(entry["time_s"]) for entry in generated) + " |")
        lines.append("| tokens/s | " + " | ".join(
            f"{entry['batch_size'] * entry['new_tokens'] / entry['time_s']['median']:.1f}" for entry in generated) + " |")
    if not any(tables.peak.values()):
        lines += ["", "Peak memory: not measured in this run (--no-memory)."]
    else:
        lines += ["", "Peak memory of one step, MiB (CPU: rise of the resident set in a fresh process; GPU: "
                  "max_memory_allocated minus the memory held before):", ""]  # fmt: skip
        lines += ["| N | step | " + " | ".join(MODEL_LABELS[m] for m in models) + " |",
                  "|" + " --- |" * (len(models) + 2)]  # fmt: skip
        for n in tables.seq_lens:
            for mode in tables.steps:
                cells = [_mib(tables.peak.get((m, mode, n))) for m in models]
                lines.append(f"| {n} | {mode.replace('_', '+')} | " + " | ".join(cells) + " |")
    lines += ["", "Decode: per-token latency, ms, median [min–max]; cache after the prompt, MiB (of which the integral "
              "state, bytes per layer):", ""]  # fmt: skip
    lines += ["| prompt | " + " | ".join(f"{MODEL_LABELS[m]} latency | {MODEL_LABELS[m]} cache" for m in models) + " |",
              "|" + " --- |" * (2 * len(models) + 1)]  # fmt: skip
    for p in tables.prompt_lens:
        cells = []
        for m in models:
            entry = tables.decode.get((m, p))
            if entry is None:
                cells += ["–", "–"]
                continue
            integral = entry["integral_bytes_per_layer_after_prefill"][0]
            cells += [_seconds(entry["per_token_s"], 1e3, 2), f"{_mib(entry['cache_bytes_after_prefill'])} ({integral} B/layer)"]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines


def op_count_table(results: dict) -> list[str]:
    """Tensor ops per step by model, and what DINT fast adds over DiffLlama per layer (results from before the counts
    were recorded have none)."""
    counts = results.get("op_counts")
    if not counts:
        return []
    models = list(counts)
    layers = results["model_config"]["num_hidden_layers"]
    compare = "dint_fast" in counts and "diffllama" in counts
    lines = [
        "Non-view aten ops one step dispatches (on a GPU, each is at least one kernel launch: at launch-bound sizes "
        "their number sets the time; `bench/count_ops.py`):",
        "",
        "| step | " + " | ".join(MODEL_LABELS[m] for m in models) + (" | DINT fast − DiffLlama, per layer |" if compare else " |"),
        "|" + " --- |" * (len(models) + 1 + compare),
    ]
    for step in ("forward", "forward_backward", "decode"):
        if any(step not in counts[m] for m in models):
            continue
        row = [step.replace("_", "+")] + [str(counts[m][step]) for m in models]
        if compare:
            row.append(f"{(counts['dint_fast'][step] - counts['diffllama'][step]) / layers:+.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def skipped_lines(tables: Tables) -> list[str]:
    notes = {}
    for (model, mode, n), note in sorted(tables.notes.items(), key=lambda item: (item[0][0], item[0][1], item[0][2])):
        notes.setdefault((model, mode, note), []).append(n)
    return [f"- {MODEL_LABELS[model]}, {mode.replace('_', '+')}, N = {', '.join(map(str, ns))}: {note}"
            for (model, mode, note), ns in notes.items()]  # fmt: skip


def render_markdown(results: dict) -> str:
    tables = Tables(results)
    machine, settings, config = results["machine"], results["settings"], results["model_config"]
    device = machine.get("gpu") or machine.get("processor")
    lines = [
        f"# DINT benchmark: {settings['device']}, {settings['dtype']}, attn={settings['attn']}",
        "",
        f"Machine: {device}, {machine.get('cpu_count')} CPUs ({machine.get('torch_threads')} torch threads), "
        f"{machine.get('memory_gb')} GB; {machine.get('platform')}. Python {machine.get('python')}, torch "
        f"{machine.get('torch')}, transformers {machine.get('transformers')}, modeling_dint "
        f"{machine.get('modeling_dint')} (commit {machine.get('git_commit')}); {machine.get('date_utc')}; run took "
        f"{results.get('wall_s', 0) / 60:.1f} min"
        + (
            f"; load average (1, 5, 15 min) at start {machine['load_average_at_start']}, at end "
            f"{machine.get('load_average_1_5_15')}."
            if machine.get("load_average_at_start")
            else "."
        ),
        "",
        f"Model ({', '.join(MODEL_LABELS[m] for m in results['parameters'])}; size {settings.get('size', 'default')}): hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"{config['num_attention_heads']} softmax maps ({config['num_attention_heads'] // 2} differential heads for "
        f"DINT/DiffLlama), {config['num_key_value_heads']} KV heads, head_dim {config['head_dim']}, MLP "
        f"{config['intermediate_size']}, vocab {config['vocab_size']}"
        + (", tied embeddings" if config.get("tie_word_embeddings") else "")
        + f", batch {settings['batch_size']}; parameters "
        + ", ".join(f"{MODEL_LABELS[m]} {n:,}" for m, n in results["parameters"].items())
        + ". Weights copied from DINT where shapes allow.",
        "",
        f"Method: {settings['warmup']} warm-up + {settings['repeats']} timed repetitions per model and length, the "
        f"models run round-robin inside each repetition (order rotated); steps {', '.join(tables.steps)}; decode: {settings['decode_warmup']} warm-up + "
        f"{settings['decode_blocks']} timed samples of {settings['decode_block']} consecutive greedy tokens per model, "
        "round-robin, the Python garbage collector off while timing. Forward = no-grad pass over the sequence; "
        "forward+backward = LM loss and backward; prefill = no-grad pass with a fresh cache, last position's logits"
        + (f"; generate: {settings['generate_warmup']} warm-up + {settings['generate_rounds']} timed rounds of one "
           "generate() call per model, round-robin." if tables.generate else "."),
        "",
        "Sanity: "
        + (", ".join(f"{k} = {v:.2e}" for k, v in results["sanity"].items()) or "not run (needs DINT fast and eager)"),
        "",
        "## Targets",
        "",
        *targets_table(tables),
        "",
        "## Ratios (DINT fast over each; time: median of the per-round ratios, memory: ratio of peaks)",
        "",
        *ratio_tables(tables),
        "",
        "## Absolute numbers",
        "",
        *absolute_tables(tables),
    ]
    op_counts = op_count_table(results)
    if op_counts:
        lines += ["", "## Tensor ops per step", "", *op_counts]
    skipped = skipped_lines(tables)
    if skipped:
        lines += ["", "## Skipped", "", *skipped]
    return "\n".join(lines) + "\n"


def render_plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tables = Tables(results)
    figure, axes = plt.subplots(2, 4, figsize=(22, 9.5))
    settings = results["settings"]
    figure.suptitle(
        f"DINT vs DiffLlama vs Llama — {settings['device']}, {settings['dtype']}, attn={settings['attn']}, "
        f"hidden {results['model_config']['hidden_size']}, {results['model_config']['num_hidden_layers']} layers"
    )

    def plot_models(axis, points_of, title, ylabel, logy=True):
        for m in tables.models:
            points = [(x, y) for x, y in points_of(m) if y]
            if points:
                xs, ys = zip(*points)
                axis.plot(xs, ys, label=MODEL_LABELS[m], **MODEL_STYLES[m])
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        if logy:
            axis.set_yscale("log")
        axis.set_title(title)
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)

    for axis, mode in zip((axes[0, 0], axes[0, 1]), tables.steps):
        plot_models(axis, lambda m, mode=mode: [(n, tables.median(m, mode, n)) for n in tables.seq_lens],
                    f"{STEP_LABELS[mode]} time", "s")  # fmt: skip
    plot_models(axes[0, 2], lambda m: [(n, _to_mib(tables.peak.get((m, "forward_backward", n)))) for n in tables.seq_lens],
                "peak memory, forward+backward", "MiB")  # fmt: skip
    plot_models(axes[0, 3], lambda m: [(n, _to_mib(tables.peak.get((m, "forward", n)))) for n in tables.seq_lens],
                "peak memory, forward", "MiB")  # fmt: skip
    for axis in (axes[0, 0], axes[0, 1], axes[0, 2], axes[0, 3]):
        axis.set_xlabel("sequence length N")

    ratio_axis = axes[1, 0]
    for mode, style in zip(tables.steps, (":", "-", "-.")):
        points = [(n, tables.time_ratio("dint_fast", "diffllama", mode, n)) for n in tables.seq_lens]
        points = [(n, ratio) for n, ratio in points if ratio]
        if points:
            ratio_axis.plot(*zip(*points), style, marker="o", color="tab:red", label=f"{mode.replace('_', '+')}")
    points = [(p, tables.decode_ratio("dint_fast", "diffllama", p)) for p in tables.prompt_lens]
    points = [(p, ratio) for p, ratio in points if ratio]
    if points:
        ratio_axis.plot(*zip(*points), "--", marker="D", color="tab:purple", label="decode / token (x = prompt)")
    ratio_axis.axhline(RATIO_TARGET, color="black", linewidth=0.8, label=f"target {RATIO_TARGET}")
    ratio_axis.axhline(1.0, color="gray", linewidth=0.5)
    ratio_axis.set_xscale("log", base=2)
    ratio_axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ratio_axis.set_title("DINT fast / DiffLlama")
    ratio_axis.set_xlabel("N")
    ratio_axis.grid(True, alpha=0.3)
    ratio_axis.legend(fontsize=8)

    plot_models(axes[1, 1], lambda m: [(p, tables.decode_median(m, p)) for p in tables.prompt_lens],
                "decode latency per token", "s")  # fmt: skip
    plot_models(axes[1, 2], lambda m: [(p, _to_mib(tables.decode[(m, p)]["cache_bytes_after_prefill"]))
                                       for p in tables.prompt_lens if (m, p) in tables.decode],
                "cache after prompt (K, V + integral)", "MiB")  # fmt: skip
    plot_models(axes[1, 3], lambda m: [(p, tables.decode[(m, p)]["integral_bytes_per_layer_after_prefill"][0])
                                       for p in tables.prompt_lens if (m, p) in tables.decode],
                "integral state per layer (Llama/DiffLlama: 0)", "bytes")  # fmt: skip
    for axis in (axes[1, 1], axes[1, 2], axes[1, 3]):
        axis.set_xlabel("prompt length")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(results: dict, stem: str, plot: bool = False) -> list[str]:
    """`stem.md` (the run's header, then the tables) and, with `plot`, `stem.png`; returns the paths written."""
    from bench_common import run_header

    written = [stem + ".md"]
    with open(written[0], "w") as handle:
        handle.write(run_header(results.get("machine") or {}) + "\n" + render_markdown(results))
    if plot:
        written.append(stem + ".png")
        render_plot(results, written[1])
    return written


def main() -> None:
    import json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_json")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    with open(args.results_json) as handle:
        results = json.load(handle)
    for path in write_report(results, os.path.splitext(args.results_json)[0], plot=args.plot):
        print(path)


if __name__ == "__main__":
    main()
