# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The research harness's figures: accuracy against length, the validation-loss curves, the long diagnostic runs and
the attention heatmaps of the trained models, as PNGs beside report.md."""

from pathlib import Path

import numpy as np

from decision_rule import bootstrap_ci
from report import accuracy, select
from settings import ARCHITECTURES, Settings, lm_hidden


def draw_figures(results: dict, settings: Settings, out: Path) -> list[str]:
    """Draws every figure of the report into `out`; returns the files' names."""
    files = accuracy_figure(results, settings, out) + convergence_figure(results, settings, out)
    return files + long_run_figure(results, settings, out) + attention_maps_figure(results, settings, out)


def pyplot():
    """matplotlib's pyplot on the Agg backend, imported when a figure is drawn (the training workers never draw)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_figure(results: dict, settings: Settings, out: Path) -> list[str]:
    plt = pyplot()
    files = []
    configs, counts = settings.needle_configs, settings.needle_counts
    figure, axes = plt.subplots(len(configs), len(counts), figsize=(3.2 * len(counts), 2.6 * len(configs)),
                                squeeze=False, sharey=True)
    for row, (hidden, context) in enumerate(configs):
        lengths = [context * f for f in settings.length_factors]
        for column, count in enumerate(counts):
            axis = axes[row, column]
            for kind in ARCHITECTURES:
                records = select(results, kind, hidden, context)
                stats = [bootstrap_ci(accuracy(records, f, count), settings) for f in settings.length_factors]
                means = np.array([s[0] for s in stats])
                errors = np.array([[s[0] - s[1] for s in stats], [s[2] - s[0] for s in stats]])
                axis.errorbar(lengths, means, yerr=errors, marker="o", capsize=3, label=kind)
            axis.axhline(1 / settings.value_vocab, color="grey", linestyle=":", linewidth=0.8)
            axis.axhline(1 / count, color="grey", linestyle="--", linewidth=0.6)
            axis.set_xscale("log", base=2)
            axis.set_xticks(lengths, [str(n) for n in lengths])
            axis.set_ylim(-0.02, 1.02)
            axis.set_title(f"hidden {hidden}, trained at {context}: {count} needle{'s' if count > 1 else ''}", fontsize=8)
            if row == len(configs) - 1:
                axis.set_xlabel("context length (tokens)", fontsize=8)
            if column == 0:
                axis.set_ylabel("test accuracy", fontsize=8)
    axes[0, 0].legend(fontsize=7)
    figure.suptitle(f"Needle accuracy (mean, 95% bootstrap CI, {len(settings.seeds)} seeds); dotted: chance, "
                    "dashed: 1/N (a random needle's value)", fontsize=9)
    figure.tight_layout()
    figure.savefig(out / "accuracy_vs_length.png", dpi=110)
    plt.close(figure)
    files.append("accuracy_vs_length.png")
    return files


def convergence_figure(results: dict, settings: Settings, out: Path) -> list[str]:
    """Validation loss curves: every evaluated needle config and the LM."""
    plt = pyplot()
    configs = settings.needle_configs
    files = []
    panels = [(hidden, context, "needle") for hidden, context in configs] + [
        (lm_hidden(settings), settings.lm_context, "lm")
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.0), squeeze=False)
    colours = dict(zip(ARCHITECTURES, ("tab:blue", "tab:orange", "tab:green")))
    for axis, (hidden, context, task) in zip(axes[0], panels):
        for kind in ARCHITECTURES:
            for i, record in enumerate(select(results, kind, hidden, context, task)):
                axis.plot(record["eval_steps"], record["validation_losses"], color=colours[kind], linewidth=0.8,
                          alpha=0.7, label=kind if i == 0 else None)
                axis.plot(record["steps"], record["validation_losses"][-1], "x", color=colours[kind], markersize=4)
        axis.set_title(f"{task}: hidden {hidden}, length {context}", fontsize=8)
        axis.set_xlabel("step (x: stopped)", fontsize=8)
        axis.set_yscale("log")
    axes[0, 0].set_ylabel("validation loss", fontsize=8)
    axes[0, 0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "convergence.png", dpi=110)
    plt.close(figure)
    files.append("convergence.png")
    return files


def long_run_figure(results: dict, settings: Settings, out: Path) -> list[str]:
    plt = pyplot()
    counts = settings.needle_counts
    files = []
    long_runs = [r for r in results["runs"] if r["phase"] == "long"]
    if long_runs:
        figure, axes = plt.subplots(1, len(long_runs), figsize=(4.2 * len(long_runs), 3.0), squeeze=False)
        for axis, record in zip(axes[0], long_runs):
            for count in counts:
                axis.plot(record["eval_steps"], [a["all"][str(count)] for a in record["validation_accuracy"]],
                          label=f"N={count}", linewidth=0.9)
            rule_run = [r for r in select(results, record["kind"], record["hidden"], record["context"])
                        if r["seed"] == record["seed"]][0]
            axis.axvline(rule_run["steps"], color="grey", linestyle="--", linewidth=0.8)
            axis.set_ylim(-0.02, 1.02)
            axis.set_title(f"{record['kind']}, hidden {record['hidden']}, length {record['context']}, seed "
                           f"{record['seed']}, lr {record['lr']:g}", fontsize=8)
            axis.set_xlabel("step (dashed: where the rule stopped)", fontsize=8)
        axes[0, 0].set_ylabel("validation accuracy", fontsize=8)
        axes[0, 0].legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out / "long_run.png", dpi=110)
        plt.close(figure)
        files.append("long_run.png")
    return files


def attention_maps_figure(results: dict, settings: Settings, out: Path) -> list[str]:
    plt = pyplot()
    configs = settings.needle_configs
    files = []
    hidden, context = configs[0]
    maps = {kind: select(results, kind, hidden, context)[0].get("example_maps") for kind in ARCHITECTURES}
    names = ["A1", "A2", "G", "A_final"]
    figure, axes = plt.subplots(len(ARCHITECTURES), 4, figsize=(14, 3.4 * len(ARCHITECTURES)), squeeze=False)
    for row, kind in enumerate(ARCHITECTURES):
        for column, name in enumerate(names):
            axis = axes[row, column]
            if kind == "transformer":  # one softmax map per head: drawn in the first column
                name = "A_final" if column == 0 else None
            if not maps[kind] or name not in maps[kind]:
                axis.axis("off")
                continue
            matrix = np.asarray(maps[kind][name])
            limit = max(abs(matrix.min()), abs(matrix.max()), 1e-6)
            image = axis.imshow(matrix, cmap="RdBu_r", vmin=-limit, vmax=limit)
            title = f"{kind}: {name}" if kind != "transformer" else f"{kind}: softmax map"
            if kind != "transformer" and name == "A_final":
                title += f" (lambda={maps[kind]['lambda']:.2f})"
            axis.set_title(title, fontsize=9)
            axis.set_xlabel("key")
            axis.set_ylabel("query")
            figure.colorbar(image, ax=axis, fraction=0.046)
    figure.suptitle(f"Trained models (hidden {hidden}, trained at {context}), last layer, head 0, held-out "
                    f"{settings.analysis_needles}-needle example 0, seed {settings.seeds[0]}")
    figure.tight_layout()
    figure.savefig(out / "attention_maps.png", dpi=100)
    plt.close(figure)
    files.append("attention_maps.png")
    return files
