# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The research harness's pilot report (`--pilot`): pilot.md and pilot.png, validation accuracy per needle count
against steps, from pilot.json."""

from pathlib import Path

from figures import pyplot
from model_shapes import transformer_shape
from settings import CONTROLS, Settings
from tasks import plateau_loss, validation_needle_counts


def first_step_reaching(record: dict, count: int, level: float, which: str = "all"):
    """The first evaluated step at which the validation accuracy at `count` needles reached `level`, or None."""
    for step, accuracies in zip(record["eval_steps"], record["validation_accuracy"]):
        if accuracies[which][str(count)] >= level:
            return step
    return None


def write_pilot(pilot: dict, settings: Settings, out: Path) -> str:
    """pilot.md and pilot.png from the pilot's results (`pilot.json`: its runs, command, wall time, load average and
    the environment at its start): validation accuracy per needle count against steps, over every query and over the
    first query of each example, and the step at which each run left 1/N and reached 0.9."""
    plt = pyplot()
    records = pilot["runs"]
    all_counts = validation_needle_counts(settings)
    counts = [n for n in all_counts if n >= 2]
    figure, axes = plt.subplots(1, len(records), figsize=(4.4 * len(records), 3.2), squeeze=False)
    for axis, record in zip(axes[0], records):
        for count in all_counts:
            line, = axis.plot(record["eval_steps"], [a["all"][str(count)] for a in record["validation_accuracy"]],
                              label=f"N={count}", linewidth=1.0)
            if count >= 2 and record["validation_accuracy"][0]["first"] is not None:
                axis.plot(record["eval_steps"], [a["first"][str(count)] for a in record["validation_accuracy"]],
                          color=line.get_color(), linestyle="--", linewidth=0.6)
            axis.axhline(1 / count, color=line.get_color(), linestyle=":", linewidth=0.7)
        axis.set_ylim(-0.02, 1.02)
        axis.set_title(f"{record['kind']}, hidden {record['hidden']}, {record['context']} tokens, lr {record['lr']:g}"
                       + (" (incomplete)" if record.get("incomplete") else ""), fontsize=8)
        axis.set_xlabel("training step", fontsize=8)
    axes[0, 0].set_ylabel("validation accuracy\n(solid: every query; dashed: first query; dotted: 1/N)", fontsize=7)
    axes[0, 0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "pilot.png", dpi=100)
    plt.close(figure)

    env, load_average = pilot["environment"], pilot["load_average"]
    lines = [
        "# Pilot: how many steps until key matching", "",
        f"Command: `{pilot['command']}`  ",
        f"Wall time: {pilot['wall_seconds'] / 60:.1f} min on {settings.workers} worker processes of one torch thread "
        f"each (load average at start {load_average[0]:.2f}, at end {load_average[1]:.2f}; above {settings.workers}: "
        "other work shared the cores).  ",
        f"Versions: torch {env['torch']}, transformers {env['transformers']}, repo commit {env['git_commit']}; "
        f"{env['machine']}; device {settings.device}.", "",
        f"Each run: exactly {settings.pilot_steps} steps, no early stopping, seed {settings.sweep_seed} (not a test "
        f"seed), hidden {records[0]['hidden']}, DIFF/DINT with {settings.attention_heads} softmax maps of head_dim "
        f"{settings.head_dim} per layer, the Transformers with "
        + ", ".join(f"{transformer_shape(kind, settings, records[0]['hidden'])[0]} head(s) of head_dim "
                    f"{settings.head_dim} ({kind})" for kind in ("transformer", *CONTROLS))
        + f" (`transformer_shape`: the same parameter count), batch {settings.needle_batch} over the trained needle counts "
        f"{list(settings.train_needle_counts)} (every needle queried), warmup {settings.warmup_steps} steps then a "
        f"constant learning rate. Validation accuracy per needle count every {settings.pilot_eval_every} steps on "
        f"{settings.validation_examples} held-out examples per count, over every query and over the first query of "
        "each example (the elimination control). A model that copies a random needle's value scores 1/N; *left 1/N* "
        "is the first evaluation at which the accuracy over every query reached halfway from 1/N to 1; *0.9* the "
        "first at or above 0.9. A run marked *incomplete* stopped before its last step; its curve is what its "
        "progress lines printed (every query only, 2 decimals): see its `note` in pilot.json. The validation loss of "
        f"a model that gives each of an example's N needle values probability 1/N (retrieval without key matching) is "
        f"{plateau_loss(settings):.3f}.", "",
        "| run | " + " | ".join(f"N={n}: left 1/N | N={n}: 0.9" for n in counts)
        + " | last accuracy per N, every query | last accuracy per N, first query | lowest validation loss | steps/s |",
        "| --- | " + " | ".join("--- | ---" for _ in counts) + " | --- | --- | --- | --- |",
    ]
    for record in records:
        cells = []
        for count in counts:
            for level in (1 / count + (1 - 1 / count) / 2, 0.9):
                step = first_step_reaching(record, count, level)
                cells.append(f"{step}" if step is not None else f"not by {record['steps']}")
        last = record["validation_accuracy"][-1]
        first = ("not recorded" if last["first"] is None
                 else ", ".join(f"{n}: {a:.2f}" for n, a in last["first"].items() if int(n) >= 2))
        speed = "-" if record.get("steps_per_second") is None else f"{record['steps_per_second']:.1f}"
        lines.append(f"| {record['kind']}, lr {record['lr']:g}" + (" (incomplete)" if record.get("incomplete") else "")
                     + " | " + " | ".join(cells) + " | "
                     + ", ".join(f"{n}: {a:.2f}" for n, a in last["all"].items())
                     + f" | {first} | {min(record['validation_losses']):.4f} | {speed} |")
    lines += ["", "![validation accuracy per needle count against steps](pilot.png)", ""]
    text = "\n".join(lines)
    (out / "pilot.md").write_text(text)
    return text
