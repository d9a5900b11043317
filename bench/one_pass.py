# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT's one-pass differential attention against DiffLlama and Llama, each on its backends (issue 20).

DINT with `one_pass_attention` computes the signal and noise outputs in one attention call over a 2*head_dim-wide V
(Q.K^T once per map); DiffLlama calls the backend twice over the two halves of V. This script times, in one run,
paired and interleaved (as `run_benchmark.py`: every round runs each model once, the order rotating; a ratio is the
median over rounds of the two models' times in that round):

- `dint_one_pass`:  `DintForCausalLM`, flex_attention, one pass (the default for flex_attention);
- `dint_two_calls`: the same model with `one_pass_attention=False` (what one pass buys on the same backend);
- `dint_sdpa`:      the same weights with sdpa (two calls: where one pass does not apply by default);
- `diffllama_<backend>`, `llama_<backend>`: transformers' classes on sdpa and flex_attention, same weights.

Steps: `prefill` (no gradient, a fresh cache, the last position's logits: what generate() does first), `forward`
(no gradient, no cache, every position's logits) and, on a GPU, `forward_backward` (LM loss, backward; FlexAttention
has no CPU backward in torch 2.13). Writes `results.json` (raw samples, machine, load average before and after) and
`results.md` to `--output-dir` (default `bench/results/one_pass/<machine kind>/`), named `<size>_<dtype>`.

    python bench/one_pass.py                                    # CPU fp32, prefill at 2048, 4096, 8192 tokens
    python bench/one_pass.py --device cuda --dtype bf16 --steps forward,forward_backward --seq-lens 2048,8192,16384
"""

import argparse
import gc
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
from report import _paired_ratio  # noqa: E402
from run_benchmark import timed_region  # noqa: E402

# name -> (bench_common model, backend, one_pass_attention for DINT)
VARIANTS = {
    "dint_one_pass": ("dint_fast", "flex_attention", None),
    "dint_two_calls": ("dint_fast", "flex_attention", False),
    "dint_sdpa": ("dint_fast", "sdpa", None),
    "dint_one_pass_sdpa": ("dint_fast", "sdpa", True),
    "diffllama_sdpa": ("diffllama", "sdpa", None),
    "diffllama_flex": ("diffllama", "flex_attention", None),
    "llama_sdpa": ("llama", "sdpa", None),
    "llama_flex": ("llama", "flex_attention", None),
}
DEFAULT_VARIANTS = [name for name in VARIANTS if name != "dint_one_pass_sdpa"]  # sdpa + wide V: CPU math kernel
DIFFLLAMA_VARIANTS = ("diffllama_sdpa", "diffllama_flex")
RATIO_TARGET = 0.85


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(bench_common.DTYPES), help="fp32 on CPU, bf16 on GPU")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--steps", default="prefill", help="comma-separated: prefill, forward, forward_backward")
    parser.add_argument("--seq-lens", default="2048,4096,8192")
    bench_common.add_model_size_arguments(parser)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per length and step (compiles flex)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per length and step")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    args.variants = args.variants.split(",") if args.variants else list(DEFAULT_VARIANTS)
    if args.device.startswith("cuda") and not any("one_pass_sdpa" in name for name in args.variants):
        args.variants.append("dint_one_pass_sdpa")
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; allowed: {list(VARIANTS)}")
    args.steps = args.steps.split(",")
    args.seq_lens = [int(n) for n in args.seq_lens.split(",")]
    args.max_positions = max(args.seq_lens)
    args.output_dir = args.output_dir or bench_common.results_dir("one_pass", args.device)
    return args


def build_variants(args) -> dict:
    from modeling_dint.configuration_dint import uses_one_pass_attention

    size_kwargs = bench_common.model_size_kwargs(args)
    models = bench_common.build_models(
        {name: VARIANTS[name][:2] for name in args.variants}, size_kwargs, bench_common.DTYPES[args.dtype], args.device
    )
    for name, model in models.items():
        base, attn, one_pass = VARIANTS[name]
        if base == "dint_fast":
            model.config.one_pass_attention = one_pass
            expected = name.startswith("dint_one_pass")
            if uses_one_pass_attention(model.config) != expected:
                raise RuntimeError(f"{name}: uses_one_pass_attention is not {expected}")
    return models


def check_outputs_agree(models: dict, args) -> dict:
    """max |logits - logits(dint_sdpa or the first DINT)| of each DINT variant at 256 tokens: the same model."""
    input_ids = bench_common.make_input_ids(256, 1, args.vocab_size, args.device)
    dint = [name for name in models if name.startswith("dint")]
    with torch.no_grad():
        logits = {name: models[name](input_ids, use_cache=False).logits.float() for name in dint}
    return {name: (logits[name] - logits[dint[0]]).abs().max().item() for name in dint[1:]}


STEPS = {
    "prefill": lambda model, input_ids: bench_common.prefill(model, input_ids),
    "forward": bench_common.forward_step,
    "forward_backward": bench_common.train_step,
}


def measure(args, models: dict, log) -> list[dict]:
    results = []
    for seq_len in args.seq_lens:
        input_ids = bench_common.make_input_ids(seq_len, args.batch_size, args.vocab_size, args.device)
        for step_name in args.steps:
            step, active = STEPS[step_name], list(models)
            if step_name == "forward_backward":
                for model in models.values():
                    model.train()
            samples = {name: [] for name in active}
            cpu_samples = {name: [] for name in active}
            for round_index in range(args.warmup + args.repeats):
                shift = round_index % len(active)
                for name in active[shift:] + active[:shift]:
                    gc.collect()
                    with timed_region(args.device) as timer:
                        step(models[name], input_ids)
                    if round_index >= args.warmup:
                        samples[name].append(timer["seconds"])
                        cpu_samples[name].append(timer["cpu_seconds"])
                    models[name].zero_grad(set_to_none=True)
            for model in models.values():
                model.eval()
            for name in active:
                results.append({"model": name, "seq_len": seq_len, "step": step_name, "samples": samples[name],
                                "cpu_samples": cpu_samples[name]})  # fmt: skip
            log(
                f"N={seq_len:>6} {step_name:<16} "
                + " ".join(f"{name}={statistics.median(samples[name]):.3f}s" for name in active)
                + f"  load={bench_common.load_average()}"
            )
    return results


def matmul_flops(args, seq_len: int, step: str, one_pass: bool) -> float:
    """The forward's matrix-multiply FLOPs of DINT one pass (`one_pass=True`) or of a model that calls the backend
    twice (DiffLlama, DINT two calls), for `args`' size: projections, MLP, the LM head (the last position for
    `prefill`), and causal attention with Q.K^T once (one pass: P.V over 2d channels) or twice (two calls: P.V over d
    channels each). Elementwise work (softmax, norms, the integral) is left out."""
    size = bench_common.model_size_kwargs(args)
    hidden, heads, head_dim = size["hidden_size"], size["num_attention_heads"], size["head_dim"]
    tokens = args.batch_size * seq_len
    projections = 2 * tokens * hidden * head_dim * (2 * heads + 2 * size["num_key_value_heads"])
    mlp = 2 * 3 * tokens * hidden * size["intermediate_size"]
    causal_pairs = args.batch_size * seq_len * (seq_len + 1) / 2
    channels_per_map = 3 * head_dim if one_pass else 4 * head_dim  # Q.K^T (d) + P.V (2d), or twice (d + d)
    attention = 2 * heads * causal_pairs * channels_per_map
    lm_head = 2 * hidden * size["vocab_size"] * (args.batch_size if step == "prefill" else tokens)
    return size["num_hidden_layers"] * (projections + mlp + attention) + lm_head


def ratio_table(results: list[dict], args) -> list[str]:
    by_key = {(r["model"], r["step"], r["seq_len"]): r["samples"] for r in results}
    cpu_by_key = {(r["model"], r["step"], r["seq_len"]): r["cpu_samples"] for r in results if "cpu_samples" in r}

    def ratio(model, other, step, seq_len, samples=by_key):
        if (model, step, seq_len) not in samples or (other, step, seq_len) not in samples:
            return None
        return _paired_ratio(samples[(model, step, seq_len)], samples[(other, step, seq_len)])

    def fmt(value):
        return "–" if value is None else f"{value:.3f}"

    def fmt_both(model, other, step, seq_len):  # wall time (CPU time)
        cpu = ratio(model, other, step, seq_len, cpu_by_key)
        return fmt(ratio(model, other, step, seq_len)) + ("" if cpu is None else f" ({fmt(cpu)})")

    lines = []
    for step in args.steps:
        lines += [
            f"### {step}",
            "",
            "Median seconds per step [min–max] of the timed rounds:",
            "",
            "| model | " + " | ".join(f"N={n}" for n in args.seq_lens) + " |",
            "| --- |" + " --- |" * len(args.seq_lens),
        ]
        for name in args.variants:
            cells = []
            for n in args.seq_lens:
                samples = by_key.get((name, step, n))
                cells.append(
                    f"{statistics.median(samples):.3f} [{min(samples):.3f}–{max(samples):.3f}]" if samples else "–"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "Paired ratios (median over rounds of the per-round ratio), wall time (CPU time of the process):", ""]
        lines += ["| ratio | " + " | ".join(f"N={n}" for n in args.seq_lens) + " |"]
        lines += ["| --- |" + " --- |" * len(args.seq_lens)]
        pairs = []
        for other in DIFFLLAMA_VARIANTS:
            pairs += [("dint_one_pass", other), ("dint_sdpa", other)]
        pairs += [("dint_one_pass", "dint_two_calls"), ("dint_one_pass", "llama_sdpa"), ("dint_one_pass", "llama_flex")]
        pairs += [("dint_one_pass_sdpa", "dint_sdpa")]
        for model, other in pairs:
            values = [ratio(model, other, step, n) for n in args.seq_lens]
            if any(value is not None for value in values):
                lines.append(f"| {model} / {other} | " + " | ".join(fmt_both(model, other, step, n) for n in args.seq_lens) + " |")
        best = []
        for n in args.seq_lens:
            medians = {d: statistics.median(by_key[(d, step, n)]) for d in DIFFLLAMA_VARIANTS if (d, step, n) in by_key}
            fastest = min(medians, key=medians.get) if medians else None
            best.append((fastest, ratio("dint_one_pass", fastest, step, n) if fastest else None))
        lines.append(
            "| **dint_one_pass / fastest DiffLlama** | "
            + " | ".join(f"**{fmt(value)}** ({name})" for name, value in best)
            + " |"
        )
        floors = [matmul_flops(args, n, step, True) / matmul_flops(args, n, step, False) for n in args.seq_lens]
        lines.append(
            "| arithmetic floor: matmul FLOPs, one pass / two calls | " + " | ".join(fmt(f) for f in floors) + " |"
        )
        lines += [
            "",
            "The arithmetic floor is what one pass would give if both paths ran their matrix multiplies at the same "
            "speed (`matmul_flops`): the ratio above it is the price of the one-pass kernel's speed against the "
            "two-call backend's.",
        ]
        lines.append("")
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.output_dir, exist_ok=True)

    def log(message):
        print(message, flush=True)

    machine_before = bench_common.machine_info(args.device)
    log(f"machine: {machine_before}")
    models = build_variants(args)
    agreement = check_outputs_agree(models, args)
    log(f"max |logits - logits({args.variants[0]})|: {agreement}")
    results = measure(args, models, log)
    load_after = bench_common.load_average()
    command = "python bench/one_pass.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(os.path.join(args.output_dir, f"{args.size}_{args.dtype}.json"), "w") as handle:
        json.dump(
            {
                "command": command,
                "machine": machine_before,
                "load_average_after": load_after,
                "args": {k: v for k, v in vars(args).items()},
                "logits_agreement": agreement,
                "results": results,
            },
            handle,
            indent=1,
        )
    lines = [
        f"# DINT one pass against DiffLlama and Llama ({args.device}, {args.dtype})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine_before['processor']}, {machine_before['cpu_count']} CPUs, torch "
        f"{machine_before['torch']}, transformers {machine_before['transformers']}, commit "
        f"{machine_before['git_commit']}, {machine_before['date_utc']}. Load average (1, 5, 15 min) before: "
        f"{machine_before['load_average_1_5_15']}, after: {load_after} (other work shared the cores).",
        "",
        f"Model (size {args.size}): hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads} softmax "
        f"maps, {args.num_kv_heads} KV heads, head_dim {args.head_dim}, MLP {args.intermediate_size}, vocab "
        f"{args.vocab_size}, batch {args.batch_size}; {args.warmup} warm-up and {args.repeats} "
        f"timed rounds per length. DINT variants agree: max |logits difference| {agreement}.",
        "",
        f"Target: dint_one_pass / fastest DiffLlama <= {RATIO_TARGET} from 4096 tokens (CPU prefill).",
        "",
    ] + ratio_table(results, args)
    with open(os.path.join(args.output_dir, f"{args.size}_{args.dtype}.md"), "w") as handle:
        handle.write(bench_common.run_header({**machine_before, "load_average_at_start": machine_before["load_average_1_5_15"],
                                              "load_average_1_5_15": load_after}) + "\n"
                     + "\n".join(lines) + "\n")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
