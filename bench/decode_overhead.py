# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""What a decoding step costs beyond its arithmetic: per-token time of tiny models with 16 layers at batch 1, where
Python, the dispatcher and the op count are nearly all of it, as in eager decoding of a 1B model on a GPU (launch-bound:
the GPU waits on the host). A CPU-side proxy for `bench/gpu_bf16.py`'s eager decode target (DINT-V2 / Llama with 2h
query heads <= 1.05), measured without a GPU.

    python bench/decode_overhead.py                  # bench/results/decode_overhead/cpu/results.{json,md}

The models are `gpu_bf16.py`'s (`--smoke` shapes: hidden 64, 4 softmax maps, 2 KV heads, vocab 256; `--layers`
layers), fp32, the dynamic cache after a 16-token prompt; a round decodes `--tokens` tokens with each model in turn (the
order rotates); a ratio is the median over the rounds of the per-round ratios (paired median). One thread.
"""

import argparse
import functools
import os
import statistics
import sys
import time

import torch


BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import bench_common  # noqa: E402
import gpu_bf16  # noqa: E402
from run_benchmark import timed_region  # noqa: E402


MODELS = ("dint_v2", "diff_v2", "llama_2h", "llama_h", "dint_v1", "diffllama")
PAIRS = (("dint_v2", "llama_2h"), ("dint_v2", "diff_v2"), ("diff_v2", "llama_2h"), ("dint_v1", "diffllama"))


def decode_seconds_per_token(model, prompt: torch.Tensor, tokens: int) -> float:
    """Greedy decoding with the dynamic cache, model forward by forward (no generate() around it)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(prompt, **{bench_common.CACHE_ARGUMENT: cache}, use_cache=True).logits
        started = time.perf_counter()
        for _ in range(tokens):
            token = logits[:, -1:].argmax(-1)
            logits = model(token, **{bench_common.CACHE_ARGUMENT: cache}, use_cache=True).logits
        return (time.perf_counter() - started) / tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per model and round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output-dir", default=bench_common.results_dir("decode_overhead", "cpu"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = gpu_bf16.parse_args(["--device", "cpu", "--smoke"])
    shapes.layers = args.layers
    models = {name: model.float() for name, model in gpu_bf16.build_models(shapes, MODELS).items()}
    prompt = torch.randint(0, models["dint_v2"].config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

    def step(name: str) -> float:
        with timed_region("cpu"):  # the garbage collector off, as in the other benchmarks
            return decode_seconds_per_token(models[name], prompt, args.tokens)

    # a warm-up step each, then the rounds in a rotating order (`gpu_bf16.paired_rounds`)
    samples, _ = gpu_bf16.paired_rounds("cpu", {name: functools.partial(step, name) for name in MODELS}, args.rounds)
    result = {
        "argv": sys.argv,
        "machine": bench_common.machine_info("cpu"),
        "seconds_per_token": samples,
        "median_ms_per_token": {name: 1e3 * statistics.median(samples[name]) for name in MODELS},
        "paired_ratios": {
            f"{a} / {b}": statistics.median(x / y for x, y in zip(samples[a], samples[b])) for a, b in PAIRS
        },
    }
    layers = args.layers
    kernel_setting = os.environ.get("DINT_INTEGRAL_KERNEL") or "auto"  # one file per setting: `results_<setting>`
    result["integral_kernel"] = kernel_setting
    lines = [
        "# Decoding overhead: tiny models, batch 1, the CPU (a proxy for launch-bound eager decoding on a GPU)", "",
        f"Machine: {result['machine']['processor']}, {result['machine']['torch_threads']} thread, load average "
        f"{result['machine']['load_average_1_5_15']}; torch {result['machine']['torch']}, transformers "
        f"{result['machine']['transformers']}; commit {result['machine']['git_commit']}; "
        f"{result['machine']['date_utc']}.",
        f"Command: `DINT_INTEGRAL_KERNEL={kernel_setting} python {' '.join(sys.argv)}`; {layers} layers, {args.rounds} "
        f"rounds of {args.tokens} tokens.", "",
        "| model | ms per token | per token / layers (us) |", "| --- | ---: | ---: |",
        *(f"| {name} | {ms:.3f} | {1e3 * ms / layers:.1f} |" for name, ms in result["median_ms_per_token"].items()),
        "", "| pair | paired median ratio |", "| --- | ---: |",
        *(f"| {pair} | {ratio:.3f} |" for pair, ratio in result["paired_ratios"].items()),
    ]
    output = os.path.join(args.output_dir, f"results_{kernel_setting}.json")
    bench_common.write_result(result, output, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
