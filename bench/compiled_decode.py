# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Compiled decoding, measured: DINT against DiffLlama (and Llama) compiled the same way (issue 15).

Each model generates greedily with a static cache and `CompileConfig(fullgraph=True, dynamic=False)` (what generate()
does by default on a GPU; `compile_on_every_device` asks for it on CPU too), from a left-padded batch, so that a decode
step that recompiled for a growing 2D mask would show. The decode time per token is the median interval between
consecutive decoding steps of one generation (a logits processor stamps each step: the compiled forward plus
generate()'s own work per token, the same for every model). The models run round-robin inside each repetition (the
order rotates), after a warm-up that compiles; the ratio is the median of the per-round ratios. The compiled graphs
each model needed are counted (one decode graph expected).

    python bench/compiled_decode.py                  # bench/results/compiled_decode/cpu/results.{json,md}

Writes `results.json` and `results.md` to `--output-dir` (default: `bench/results/compiled_decode/cpu/`).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch._dynamo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
from run_benchmark import summarize, timed_region  # noqa: E402


MODELS = ("dint_fast", "diffllama", "llama")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_common.add_model_size_arguments(parser)
    parser.set_defaults(batch_size=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32, help="decoded tokens timed per repetition")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=sorted(bench_common.DTYPES))
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--output-dir", default=bench_common.results_dir("compiled_decode", "cpu"))
    args = parser.parse_args(argv)
    args.max_positions = args.prompt_len + args.new_tokens + 1
    return args


class StepClock:
    """A logits processor that stamps the time of every decoding step (it leaves the scores as they are)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores

    def median_step_seconds(self) -> float:
        return statistics.median(later - earlier for earlier, later in zip(self.stamps[1:], self.stamps[2:]))


def compiled_generate(model, input_ids, attention_mask, cache, new_tokens: int, clock: StepClock | None = None):
    """Greedy generate() with the static `cache` (reset first) and the compiled decode step."""
    from transformers import CompileConfig, LogitsProcessorList

    from modeling_dint.integrations.release_bridges import compile_on_every_device

    compile_config = compile_on_every_device(CompileConfig(fullgraph=True, dynamic=False))  # the CPU included
    cache.reset()
    with torch.no_grad():
        return model.generate(
            input_ids, attention_mask=attention_mask, **{bench_common.CACHE_ARGUMENT: cache}, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, compile_config=compile_config, pad_token_id=0,
            logits_processor=LogitsProcessorList([clock] if clock is not None else []),
        )


def main(argv=None) -> None:
    from transformers import StaticCache

    args = parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    size_kwargs = bench_common.model_size_kwargs(args)
    dtype = bench_common.DTYPES[args.dtype]
    input_ids = bench_common.make_input_ids(args.prompt_len, args.batch_size, args.vocab_size, args.device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1:, : args.prompt_len // 4] = 0  # left padding on every row but the first
    models, caches, graphs = {}, {}, {}
    for name in MODELS:
        models[name] = bench_common.build_model(name, size_kwargs, args.attn, dtype, args.device).eval()
        caches[name] = StaticCache(config=models[name].config, max_cache_len=args.max_positions)
    # Compile only once every model is built: building a model class registers it in a transformers registry whose
    # size the compiled graphs guard on, so a graph compiled before another model was built would recompile.
    for name in MODELS:
        torch._dynamo.utils.counters.clear()
        compiled_generate(models[name], input_ids, attention_mask, caches[name], 1 + args.new_tokens)  # compiles
        graphs[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(f"{name}: compiled, {graphs[name]} graph(s)", flush=True)
    torch._dynamo.utils.counters.clear()

    samples = {name: [] for name in MODELS}
    for repeat in range(args.repeats):
        order = MODELS[repeat % len(MODELS) :] + MODELS[: repeat % len(MODELS)]
        for name in order:
            clock = StepClock()
            with timed_region(args.device):  # the garbage collector off, as in the other benchmarks
                compiled_generate(models[name], input_ids, attention_mask, caches[name], 2 + args.new_tokens, clock)
            samples[name].append(clock.median_step_seconds())
        step_times = ", ".join(f"{name} {samples[name][-1] * 1e3:.2f} ms" for name in MODELS)
        print(f"repeat {repeat + 1}/{args.repeats}: {step_times}", flush=True)
    recompiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    ratios = {
        other: statistics.median(d / o for d, o in zip(samples["dint_fast"], samples[other]))
        for other in ("diffllama", "llama")
    }
    machine = bench_common.machine_info(args.device)
    results = {
        "args": vars(args),
        "machine": machine,
        "decode_seconds_per_token": {name: summarize(samples[name]) for name in MODELS},
        "compiled_graphs_at_warm_up": graphs,
        "graphs_compiled_while_timing": recompiled_graphs,
        "dint_over": ratios,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as file:
        json.dump(results, file, indent=2)
    lines = [
        "# Compiled decoding (static cache, `CompileConfig(fullgraph=True, dynamic=False)`)",
        "",
        f"Command: `python bench/compiled_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        f"Machine: {machine.get('gpu') or machine['processor']} ({machine['torch_threads']} threads, load average "
        f"{machine['load_average_1_5_15']} at the start), torch {torch.__version__}, transformers "
        f"{machine['transformers']}, commit {machine['git_commit']}; batch {args.batch_size} "
        f"(rows 2.. left-padded), prompt {args.prompt_len}, {args.new_tokens} decoded tokens per repetition, "
        f"{args.repeats} repetitions, {args.dtype}, hidden {args.hidden_size}, {args.num_layers} layers.",
        "",
        "| model | decode ms/token (median) | min | max | compiled graphs | DINT / model (median of round ratios) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in MODELS:
        summary = results["decode_seconds_per_token"][name]
        ratio = "" if name == "dint_fast" else f"{ratios[name]:.3f}"
        lines.append(
            f"| {name} | {summary['median'] * 1e3:.3f} | {summary['min'] * 1e3:.3f} | {summary['max'] * 1e3:.3f} "
            f"| {graphs[name]} | {ratio} |"
        )
    lines += ["", f"Graphs compiled while timing (recompilations): {recompiled_graphs}.", ""]
    with open(os.path.join(args.output_dir, "results.md"), "w") as file:
        file.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
