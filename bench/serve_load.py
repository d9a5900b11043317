# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Load on the continuous-batching server: DINT against LlamaForCausalLM (and DiffLlama) of the same size.

Each model (bench_common.build_model: same seed, weights copied where shapes allow, the repo's tokenizer) is saved and
served by its own `dint-serve --continuous-batching` process; all servers run during the whole run and the
measurements interleave them (for each concurrency level and repetition, every model in turn, the order alternating),
so that other load on the machine falls on all of them alike. A level runs C clients (the async `openai` client), each
sending `--requests-per-client` chat completions one after the other (greedy, `--max-tokens`, each request its own
prompt). Measured per level: requests/s and generated tokens/s over the level's wall time, p50 and p95 request
latency, and the server process's peak resident memory (VmHWM) after the level.

    python bench/serve_load.py                       # writes bench/results/serve_load/cpu/results.{json,md}
    python bench/serve_load.py --models dint llama diffllama --concurrency 1 4 16 --repeats 3
    python bench/serve_load.py --offline             # no server: model.generate_batch on the same requests

`--offline` separates the model from the server: each model runs all the requests of the largest level through
`generate_batch` (the same continuous-batching engine, the same cache flags), interleaved, and the table gives the
generated tokens/s; results go to `offline.{json,md}` beside the server results.

Needs the serving extra: pip install -e ".[serve]".
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # serve_harness

import torch  # noqa: E402
from bench_common import add_model_size_arguments, build_model, load_average, machine_info, model_size_kwargs  # noqa: E402


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(REPO_ROOT, "examples", "data", "tokenizer")
PROMPTS_FILE = os.path.join(REPO_ROOT, "examples", "data", "shakespeare_heldout.txt")
MODEL_CLASSES = {"dint": "dint_fast", "llama": "llama", "diffllama": "diffllama"}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["dint", "llama"], choices=list(MODEL_CLASSES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each level and model (interleaved)")
    # A cache sized for the load (64 blocks of 256 tokens): sized from the free memory, the paged cache and its
    # attention mask would take most of the machine's memory
    parser.add_argument("--cb-num-blocks", type=int, default=64, help="paged-cache blocks of each server")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=1024, help="tokens per step of each server")
    parser.add_argument("--offline", action="store_true", help="generate_batch without a server (see above)")
    parser.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "bench", "results", "serve_load", "cpu"))
    add_model_size_arguments(parser)
    parser.set_defaults(max_positions=2048)
    return parser.parse_args()


def chat_prompts(count: int) -> list[list[dict]]:
    """`count` different one-turn chats, from consecutive lines of the held-out text."""
    with open(PROMPTS_FILE, encoding="utf-8") as text:
        lines = [line.strip() for line in text if len(line.strip()) > 20]
    return [[{"role": "user", "content": " ".join(lines[2 * i : 2 * i + 2])}] for i in range(count)]


def save_models(names: list[str], size_kwargs: dict, directory: str) -> dict[str, str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    token_ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    paths = {}
    for name in names:
        model = build_model(MODEL_CLASSES[name], {**size_kwargs, **token_ids}, "sdpa", torch.float32, "cpu")
        paths[name] = os.path.join(directory, name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        del model
    return paths


def peak_resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def run_level(base_url: str, model: str, prompts: list, concurrency: int, requests_per_client: int, max_tokens: int):
    """C clients, each sending its requests one after the other. Returns the level's wall time, the latencies and the
    generated token counts."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600)
    latencies, generated = [], []

    async def one_client(client_index: int):
        for request_index in range(requests_per_client):
            messages = prompts[(client_index * requests_per_client + request_index) % len(prompts)]
            start = time.perf_counter()
            response = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
            latencies.append(time.perf_counter() - start)
            generated.append(response.usage.completion_tokens)

    start = time.perf_counter()
    await asyncio.gather(*(one_client(index) for index in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return wall, latencies, generated


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]


def summarize(runs: list[dict]) -> dict:
    """Median over repetitions of each per-run figure; latencies pooled over repetitions."""
    latencies = [latency for run in runs for latency in run["latencies_s"]]
    return {
        "requests_per_s": statistics.median(run["requests"] / run["wall_s"] for run in runs),
        "tokens_per_s": statistics.median(sum(run["generated_tokens"]) / run["wall_s"] for run in runs),
        "p50_latency_s": percentile(latencies, 0.50),
        "p95_latency_s": percentile(latencies, 0.95),
        "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
        "repeats": len(runs),
    }


def paired_ratio(runs: list[dict], reference_runs: list[dict]) -> float:
    """Median over repetitions of the ratio of generated tokens/s, run by run."""
    def tokens_per_s(run):
        return sum(run["generated_tokens"]) / run["wall_s"]

    return statistics.median(tokens_per_s(run) / tokens_per_s(reference) for run, reference in zip(runs, reference_runs))


def render_markdown(result: dict) -> str:
    info, args = result["machine"], result["args"]
    lines = [
        "# Serving load: continuous batching, DINT vs Llama (same size)",
        "",
        f"`python bench/serve_load.py {result['command']}` — {info['date_utc']}, commit {info['git_commit']}, "
        f"{info['processor']} ({info['cpu_count']} cores, shared with other work: load average "
        f"{result['load_average_before']} before, {result['load_average_after']} after), torch {info['torch']}, "
        f"transformers {info['transformers']}, fp32, sdpa.",
        "",
        f"Model: hidden {args['hidden_size']}, {args['num_layers']} layers, {args['num_heads']} softmax maps, vocabulary "
        f"{result['vocab_size']}. Each server: `dint-serve --continuous-batching --cb-num-blocks {args['cb_num_blocks']} "
        f"--cb-max-batch-tokens {args['cb_max_batch_tokens']}`. "
        f"Each client sends {args['requests_per_client']} chat completions in turn (greedy, max {args['max_tokens']} "
        f"tokens); {args['repeats']} interleaved repetitions per level (median throughput; latency percentiles over all "
        "requests of the level). Peak memory: the server process's peak resident set (VmHWM) after the level.",
        "",
        "| clients | model | requests/s | generated tokens/s | p50 latency (s) | p95 latency (s) | peak RSS (MB) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for level in result["levels"]:
        for name, summary in level["models"].items():
            lines.append(
                f"| {level['concurrency']} | {name} | {summary['requests_per_s']:.2f} | {summary['tokens_per_s']:.1f} | "
                f"{summary['p50_latency_s']:.2f} | {summary['p95_latency_s']:.2f} | {summary['peak_rss_mb']:.0f} |"
            )
    if "llama" in result["models"] and "dint" in result["models"]:
        lines += ["", "DINT / Llama generated tokens/s, the median of the per-repetition ratios (the two runs of a "
                  "repetition are adjacent in time, so they share the machine's load; the ratio of the medians above "
                  "mixes runs minutes apart): " + ", ".join(
                      f"{level['concurrency']} clients {paired_ratio(level['runs']['dint'], level['runs']['llama']):.2f}"
                      for level in result["levels"]) + "."]
    for note in result.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def run_offline(args, size_kwargs: dict, prompts: list) -> None:
    """All the requests of the largest level through `generate_batch` per model, interleaved (`--offline`)."""
    from transformers import AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    inputs = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for messages in prompts]
    token_ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": None}
    models = {name: build_model(MODEL_CLASSES[name], {**size_kwargs, **token_ids}, "sdpa", torch.float32, "cpu") for name in args.models}
    generation_config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens_per_s = {name: [] for name in args.models}
    load_before = load_average()
    for repeat in range(args.repeats):
        for name in args.models if repeat % 2 == 0 else list(reversed(args.models)):
            cache_config = ContinuousBatchingConfig(
                num_blocks=args.cb_num_blocks, max_batch_tokens=args.cb_max_batch_tokens, max_requests_per_batch=max(args.concurrency)
            )
            start = time.perf_counter()
            outputs = models[name].generate_batch(inputs, generation_config=generation_config, continuous_batching_config=cache_config, warmup=False)
            tokens_per_s[name].append(sum(len(output.generated_tokens) for output in outputs.values()) / (time.perf_counter() - start))
            print(f"offline  {name:10s} {tokens_per_s[name][-1]:8.1f} tokens/s", flush=True)
    result = {"command": " ".join(sys.argv[1:]), "args": vars(args), "machine": machine_info("cpu"),
              "load_average_before": load_before, "load_average_after": load_average(), "tokens_per_s": tokens_per_s}
    lines = [
        "# Continuous batching without the server: generate_batch, DINT vs Llama (same size)",
        "",
        f"`python bench/serve_load.py {result['command']}` — {result['machine']['date_utc']}, commit "
        f"{result['machine']['git_commit']}, {result['machine']['cpu_count']} shared cores (load average "
        f"{load_before} before, {result['load_average_after']} after). {len(inputs)} chat requests, {args.max_tokens} "
        f"greedy tokens each, at most {max(args.concurrency)} requests per step; {args.repeats} interleaved runs.",
        "",
        "| model | generated tokens/s (median) | runs |",
        "| --- | ---: | --- |",
    ]
    for name, values in tokens_per_s.items():
        lines.append(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{value:.0f}' for value in values)} |")
    if "dint" in tokens_per_s and "llama" in tokens_per_s:
        ratio = statistics.median(tokens_per_s["dint"]) / statistics.median(tokens_per_s["llama"])
        lines += ["", f"DINT / Llama: {ratio:.2f}."]
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "offline.json"), "w") as output:
        json.dump(result, output, indent=1)
    with open(os.path.join(args.output_dir, "offline.md"), "w") as output:
        output.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    args = parse_args()
    from serve_harness import start_dint_serve

    size_kwargs = model_size_kwargs(args)
    from transformers import AutoTokenizer

    size_kwargs["vocab_size"] = len(AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    prompts = chat_prompts(max(args.concurrency) * args.requests_per_client)
    if args.offline:
        run_offline(args, size_kwargs, prompts)
        return
    servers = {}
    with tempfile.TemporaryDirectory() as directory:
        paths = save_models(args.models, size_kwargs, directory)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=os.path.join(directory, "hub-cache"))
        try:
            for name in args.models:
                flags = ["--continuous-batching", "--cb-num-blocks", str(args.cb_num_blocks),
                         "--cb-max-batch-tokens", str(args.cb_max_batch_tokens), "--log-level", "error"]
                servers[name] = start_dint_serve(paths[name], *flags, env=env)
            for name in args.models:  # warm-up: the first request creates the continuous-batching manager
                asyncio.run(run_level(servers[name].base_url, paths[name], prompts, 2, 1, args.max_tokens))
            load_before = load_average()
            runs = {(concurrency, name): [] for concurrency in args.concurrency for name in args.models}
            for concurrency in args.concurrency:
                for repeat in range(args.repeats):
                    order = args.models if repeat % 2 == 0 else list(reversed(args.models))
                    for name in order:
                        server = servers[name]
                        wall, latencies, generated = asyncio.run(
                            run_level(server.base_url, paths[name], prompts, concurrency, args.requests_per_client,
                                      args.max_tokens)
                        )
                        runs[concurrency, name].append(
                            {"wall_s": wall, "requests": len(latencies), "latencies_s": latencies,
                             "generated_tokens": generated, "peak_rss_mb": peak_resident_mb(server.process.pid)}
                        )
                        print(f"{concurrency:3d} clients  {name:10s} {sum(generated) / wall:8.1f} tokens/s  "
                              f"{len(latencies) / wall:6.2f} requests/s", flush=True)
        finally:
            for server in servers.values():
                server.stop(timeout=60)
    result = {
        "command": " ".join(sys.argv[1:]),
        "args": vars(args),
        "machine": machine_info("cpu"),
        "vocab_size": size_kwargs["vocab_size"],
        "models": args.models,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "levels": [
            {"concurrency": concurrency, "models": {name: summarize(runs[concurrency, name]) for name in args.models},
             "runs": {name: runs[concurrency, name] for name in args.models}}
            for concurrency in args.concurrency
        ],
    }
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as output:
        json.dump(result, output, indent=1)
    with open(os.path.join(args.output_dir, "results.md"), "w") as output:
        output.write(render_markdown(result))
    print(render_markdown(result))


if __name__ == "__main__":
    main()
