# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Issue 38: why does the head norm stop small DIFF/DINT models? A test of the scale hypothesis.

The hypothesis (issue 30's README, untested there): the head norm gives each differential head's output unit RMS per
channel, so from the first step the attention block adds to the residual stream an output far larger than the
stream itself (token embeddings at std 0.02), and the token identity that key matching must carry from layer to layer
is swamped. This script trains DINT-V1 (hidden 64, the comparison's task and learning rate, fixed 1500 steps, seeds
given) with the head norm's output multiplied by a factor (`--variants`): 1 (the paper's), (1 - lambda_init) per
layer (DIFF's factor, which the package leaves out), a small constant; and measures, at init and every
`--measure-every` steps on the validation batch (eager forward hooks): per layer, the RMS of the residual stream
entering the layer, of the head norm's output (or, without head norm, of the combined heads), and of the attention
block's output (o_proj, what is added to the stream). `--init-only` measures every comparison kind at init, no
training (`--hidden 128`: at the comparison's hidden-128 shape, into `init_h128.json`).

    python research/headnorm_probe.py --variants 1 lambda 0.1 --seeds 0 1 --steps 1500

Writes `results/v2/headnorm/<variant>_s<seed>.json` (one per run, as it finishes) and `init.json`.
"""

import argparse
import json
import sys
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from model_shapes import build_model  # noqa: E402
from runner import environment  # noqa: E402
from settings import COMPARISON, comparison_settings  # noqa: E402
from tasks import NeedleVocabulary, make_mixed_needle_batch, plateau_loss, validation_needle_counts  # noqa: E402
from training import on_plateau, to_device, train_to_convergence  # noqa: E402


OUT = Path(__file__).resolve().parent / "results" / "v2" / "headnorm"


class ScaledHeadNorm(nn.Module):
    """The head norm with its output multiplied by a fixed factor (DIFF's `(1 - lambda_init)`, or a constant)."""

    def __init__(self, norm: nn.Module, scale: float):
        super().__init__()
        self.norm, self.scale = norm, scale

    def forward(self, hidden_states):
        return self.norm(hidden_states) * self.scale


def scale_head_norm(model, variant: str) -> list[float]:
    """Wraps each layer's head norm; returns the factors (per layer). `"emb<std>"` (e.g. "emb0.2"): the head norm
    as is (x1), the token embedding (tied to the LM head) drawn again with that std instead of 0.02, so the residual
    stream is at the head norm's scale: the same ratio changed from the other side."""
    if variant.startswith("emb"):
        generator = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            weight = model.model.embed_tokens.weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * float(variant[3:]))
        return [1.0 for _ in model.model.layers]
    scales = []
    for layer in model.model.layers:
        attention = layer.self_attn
        scale = 1 - attention.lambda_init if variant == "lambda" else float(variant)
        if scale != 1:
            attention.head_norm = ScaledHeadNorm(attention.head_norm, scale)
        scales.append(scale)
    return scales


def rms(tensor) -> float:
    return tensor.float().pow(2).mean().sqrt().item()


@torch.no_grad()
def measure(model, input_ids) -> list[dict]:
    """Per layer: RMS of the residual stream entering the layer, of the head norm's output (the combined heads
    without head norm; the Transformer: the heads before o_proj), of the attention block's output (o_proj's), and
    the ratio of the last two to the first."""
    found = [dict() for _ in model.model.layers]
    handles = []
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        handles.append(layer.register_forward_pre_hook(
            lambda module, args, kwargs, i=index: found[i].__setitem__("residual", rms(
                args[0] if args else kwargs["hidden_states"])), with_kwargs=True))
        handles.append(attention.o_proj.register_forward_pre_hook(
            lambda module, args, i=index: found[i].__setitem__("heads", rms(args[0]))))
        handles.append(attention.o_proj.register_forward_hook(
            lambda module, args, output, i=index: found[i].__setitem__("attention_output", rms(output))))
    try:
        model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    for values in found:
        values["attention_over_residual"] = values["attention_output"] / values["residual"]
    return found


def write_summary(out: Path) -> str:
    """summary.md: per run, whether it learned, and the attention output's RMS over the residual stream's per layer at
    init, at step 250 and at the end; the init measurement of every comparison kind (init.json)."""
    lines = ["# Head-norm probe (issue 38): DINT-V1, hidden 64, head norm output scaled", "",
             "Written by `python research/headnorm_probe.py --summary`. attention/residual: RMS of the attention "
             "block's output (o_proj, what is added to the stream) over the RMS of the residual stream entering the "
             "layer, layers 0 / 1, on the validation batch; heads: RMS of the head norm's (scaled) output.", "",
             "| variant (head norm output x) | seed | learned | best val loss (step) | attention/residual at init | "
             "at 250 | at end | heads RMS at end | residual RMS at end |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ratio = lambda layers: " / ".join(f"{layer['attention_over_residual']:.2f}" for layer in layers)  # noqa: E731
    for path in sorted(out.glob("*_s*.json")):
        record = json.loads(path.read_text())
        trajectory = {point["step"]: point["layers"] for point in record["trajectory"]}
        last = record["trajectory"][-1]["layers"]
        lines.append(
            f"| {record['variant']} ({', '.join(f'{s:.2f}' for s in record['scales'])}) | {record['seed']} | "
            f"{'yes' if record['learned'] else 'no'} | {record['best_validation_loss']:.3f} ({record['best_step']}) | "
            f"{ratio(trajectory[0])} | {ratio(trajectory[250]) if 250 in trajectory else '-'} | {ratio(last)} | "
            + " / ".join(f"{layer['heads']:.3f}" for layer in last) + " | "
            + " / ".join(f"{layer['residual']:.3f}" for layer in last) + " |")
    if (out / "init.json").exists():
        lines += ["", "At init (seed 0), per kind: residual / heads / attention output RMS, layers 0 ; 1", ""]
        for name, layers in json.loads((out / "init.json").read_text())["layers"].items():
            lines.append(f"- {name}: " + " ; ".join(
                f"{layer['residual']:.3f} / {layer['heads']:.3f} / {layer['attention_output']:.3f} "
                f"(x{layer['attention_over_residual']:.2f})" for layer in layers))
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["1", "lambda", "0.1"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--measure-every", type=int, default=250)
    parser.add_argument("--init-only", action="store_true")
    parser.add_argument("--hidden", type=int, default=64, choices=(64, 128),
                        help="the comparison's size (training: 64 only; --init-only writes init_h128.json for 128)")
    parser.add_argument("--summary", action="store_true", help="write OUT/summary.md from the records and stop")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summary:
        print(write_summary(args.out))
        return
    if args.hidden != 64 and not args.init_only:
        parser.error("--hidden 128 measures at init only (--init-only)")
    settings = comparison_settings(args.hidden)
    hidden, context = settings.needle_configs[0]
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    counts = validation_needle_counts(settings)
    validation = make_mixed_needle_batch(
        torch.Generator().manual_seed(settings.validation_seed + context), settings.validation_examples * len(counts),
        context, counts, vocab, settings.needle_layout,
    )
    if args.init_only:
        init = {}
        for kind in COMPARISON:
            for variant in (args.variants if kind == "dint" else ["1"]):
                model = build_model(kind, vocab.size, context * 4, settings, hidden, 0)
                if variant != "1":
                    scale_head_norm(model, variant)
                init[f"{kind} x{variant}"] = measure(model, validation["input_ids"])
                print(kind, variant, [{k: round(v, 4) for k, v in layer.items()} for layer in init[f"{kind} x{variant}"]],
                      flush=True)
        init_file = args.out / ("init.json" if hidden == 64 else f"init_h{hidden}.json")
        init_file.write_text(json.dumps({"environment": environment(), "layers": init}, indent=1))
        return
    plateau = plateau_loss(settings)
    for seed in args.seeds:
        for variant in args.variants:
            path = args.out / f"{variant}_s{seed}.json"
            if path.exists():
                continue
            started = time.time()
            model = build_model("dint", vocab.size, context * 4, settings, hidden, seed)
            scales = scale_head_norm(model, variant)
            trajectory = [{"step": 0, "layers": measure(model, validation["input_ids"])}]

            def progress(step, result):
                if step % args.measure_every == 0:
                    trajectory.append({"step": step, "validation_loss": result["loss"],
                                       "accuracy": result["accuracy"], "layers": measure(model, validation["input_ids"])})

            data = torch.Generator().manual_seed(seed)
            history = train_to_convergence(
                model,
                lambda: make_mixed_needle_batch(data, settings.needle_batch, context, settings.train_needle_counts,
                                                vocab, settings.needle_layout),
                to_device(validation, settings.device), args.lr, args.steps, args.steps, settings.eval_every, settings,
                progress, plateau,
            )
            record = {"variant": variant, "scales": scales, "seed": seed, "lr": args.lr, "steps": args.steps,
                      "learned": not on_plateau(history["best_validation_loss"], plateau, settings),
                      "best_validation_loss": history["best_validation_loss"], "best_step": history["best_step"],
                      "plateau_loss": plateau, "eval_steps": history["eval_steps"],
                      "validation_losses": history["validation_losses"],
                      "steps_per_second": history["steps_per_second"], "trajectory": trajectory,
                      "seconds": time.time() - started, "load_average": os.getloadavg(),
                      "command": "python research/headnorm_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
                      "environment": environment()}
            path.write_text(json.dumps(record, indent=1))
            last = trajectory[-1]["layers"]
            print(f"variant {variant} seed {seed}: learned {record['learned']}, best val loss "
                  f"{record['best_validation_loss']:.3f} at {record['best_step']} (plateau {plateau:.3f}); "
                  f"attention/residual at init {[round(l['attention_over_residual'], 2) for l in trajectory[0]['layers']]}, "
                  f"at end {[round(l['attention_over_residual'], 2) for l in last]} ({record['seconds']:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
