# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Load on vLLM: DINT against Llama of the same size on vLLM, and against `dint-serve --continuous-batching`.

For each size (`tiny`: hidden 256, 4 layers, 8 softmax maps of 32 channels; `smollm2`: SmolLM2-135M's shape, hidden
576, 30 layers, MLP 1536, vocabulary 49152, head_dim 64, with 18 softmax maps over 6 KV heads as DINT's conversion of
SmolLM2's 9/3 heads gives them, the same for Llama), the models (bench_common.build_model: random weights, same seed,
shared tensors copied) are saved with the repository's tokenizer and served by the `--systems` servers, all up at
once:

- `vllm-dint`, `vllm-llama`, `vllm-dint-v2` (DINT on DIFF V2's layout: an ordinary attention layer with the same
  query and KV heads as the Llama), `vllm-dint-none` (the DINT model with `integral="none"`: the same layout and
  weights without the integral, so that DINT / DINT-none is what the integral op costs served): vLLM's OpenAI server
  (`python -m vllm.entrypoints.openai.api_server`, the CPU build in the virtualenv `.ci/vllm_env.py` makes; default
  engine settings: compiled, chunked prefill, prefix caching);
- `dint-serve`: `dint-serve --continuous-batching` (transformers' server, this python).

A level runs C clients (the async `openai` client, `serve_load.run_level`), each sending `--requests-per-client` chat
completions in turn (greedy, `--max-tokens`); levels and servers interleave (each repetition runs every server in
turn, the order alternating), so other load on the machine falls on all of them alike. Measured per level: generated
tokens/s and requests/s over the level's wall time, p50/p95 latency. Also each vLLM server's KV-cache capacity (the
tokens vLLM reports for its `VLLM_CPU_KVCACHE_SPACE`), i.e. the KV-cache bytes per token it accounts.

    python bench/vllm_load.py                                  # bench/results/vllm_load/cpu/results.{json,md}
    python bench/vllm_load.py --sizes tiny --concurrency 1 4 --repeats 1
    python bench/vllm_load.py --sizes tiny-gqa --systems vllm-dint vllm-llama vllm-dint-v2 --concurrency 1 16 \
        --repeats 1 --output-dir /tmp/vllm_v2    # DINT-V2's row (issue 37)

Needs the serving extra in this python (pip install -e ".[serve]") and the vLLM virtualenv (`python .ci/vllm_env.py`).
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_common import build_model, load_average, machine_info  # noqa: E402
from serve_load import TOKENIZER_DIR, chat_prompts, paired_ratio, peak_resident_mb, run_level, summarize  # noqa: E402


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    "tiny": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 8, "head_dim": 32, "vocab_size": None},
    # GQA: 8 query heads over 4 KV heads, so that DINT-V2 (4 differential heads, one KV head each) has the Llama's heads
    "tiny-gqa": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "head_dim": 32, "vocab_size": None},
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 18,
                "num_key_value_heads": 6, "head_dim": 64, "vocab_size": 49152},
}
"""vocab_size None: the tokenizer's. head_dim 32 and 64: vLLM's CPU attention takes 32, 64, 80, ...; DINT's cache
heads are 2*head_dim wide (64 and 128)."""
SYSTEMS = ("vllm-dint", "vllm-llama", "dint-serve", "vllm-dint-v2", "vllm-dint-none")
KV_CACHE_SPACE_GIB = 2
MAX_MODEL_LEN = 2048
SERVER_STARTUP_SECONDS = 900


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS[:3]), choices=list(SYSTEMS),
                        help="vllm-dint-v2 needs a size whose KV heads divide half the heads (tiny-gqa)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each level and server (interleaved)")
    parser.add_argument("--cb-num-blocks", type=int, default=64, help="dint-serve's paged-cache blocks")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=1024, help="dint-serve's tokens per step")
    parser.add_argument("--vllm-python", default=None, help="default: the virtualenv of .ci/vllm_env.py")
    parser.add_argument("--dint-serve-python", default=None,
                        help="the python that runs dint-serve (default: this one), e.g. a virtualenv with another "
                        "transformers release")
    parser.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "bench", "results", "vllm_load", "cpu"))
    return parser.parse_args()


def vllm_python(path: str | None) -> str:
    if path:
        return path
    completed = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, ".ci", "vllm_env.py")], check=True, capture_output=True, text=True
    )
    return completed.stdout.strip().splitlines()[-1]


def save_models(size: dict, directory: str, with_v2: bool = False) -> dict[str, str]:
    """DINT, Llama (and DINT-V2 where `with_v2`) of one size, same seed (shared tensors equal), with the repository's
    tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    size_kwargs = {**size, "vocab_size": size["vocab_size"] or len(tokenizer), "max_position_embeddings": MAX_MODEL_LEN,
                   "tie_word_embeddings": False, "use_cache": True, "pad_token_id": tokenizer.pad_token_id,
                   "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    paths = {}
    for name, model_name in (("dint", "dint_fast"), ("llama", "llama"), ("dint_v2", "dint_v2"))[: 3 if with_v2 else 2]:
        model = build_model(model_name, size_kwargs, "sdpa", torch.float32, "cpu")
        paths[name] = os.path.join(directory, name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        del model
    return paths


def save_integral_none(dint_path: str, directory: str) -> str:
    """A copy of the DINT model at `dint_path` with `integral="none"` (O1 - lambda * O2: the same layout and weights
    without the integral), saved under `directory`; returns its path."""
    path = os.path.join(directory, "dint_integral_none")
    shutil.copytree(dint_path, path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as file:
        config = json.load(file)
    with open(config_path, "w") as file:
        json.dump({**config, "integral": "none"}, file)
    return path


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(command: list[str], port: int, env: dict, log_path: str) -> tuple[subprocess.Popen, str]:
    """Starts an OpenAI-compatible server (its output to `log_path`) and waits until `/health` answers on
    127.0.0.1:`port`; returns the process and the base URL."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited ({process.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2):
                return process, base_url
        except OSError:
            time.sleep(2)
    process.kill()
    raise RuntimeError(f"{command[:4]} did not answer in {SERVER_STARTUP_SECONDS} s; see {log_path}")


def start_vllm_server(python: str, model: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server for `model` (default engine settings) on a free port of 127.0.0.1."""
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_SPACE_GIB), TOKENIZERS_PARALLELISM="false")
    return start_server(command, port, env, log_path)


def start_dint_serve(python: str, model: str, args, directory: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """`dint-serve --continuous-batching` for `model`, run by `python` (this one, or --dint-serve-python's)."""
    port = free_port()
    command = [python, "-m", "modeling_dint.integrations.serve_cli", model, "--host", "127.0.0.1", "--port", str(port),
               "--continuous-batching", "--cb-num-blocks", str(args.cb_num_blocks),
               "--cb-max-batch-tokens", str(args.cb_max_batch_tokens), "--log-level", "error"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=os.path.join(directory, "hub-cache"))
    return start_server(command, port, env, log_path)


def kv_cache_tokens(log_path: str) -> int | None:
    """The KV-cache capacity in tokens that vLLM logs at startup ("CPU KV cache size: 1,204 tokens")."""
    with open(log_path, encoding="utf-8", errors="replace") as log:
        found = re.findall(r"KV cache size: ([\d,]+) tokens", log.read())
    return int(found[-1].replace(",", "")) if found else None


def measure_size(args, size_name: str, python: str, prompts: list, directory: str) -> dict:
    paths = save_models(SIZES[size_name], directory, with_v2="vllm-dint-v2" in args.systems)
    if "vllm-dint-none" in args.systems:
        paths["dint_integral_none"] = save_integral_none(paths["dint"], directory)
    served = {"vllm-dint": paths["dint"], "vllm-llama": paths["llama"], "dint-serve": paths["dint"],
              "vllm-dint-v2": paths.get("dint_v2"), "vllm-dint-none": paths.get("dint_integral_none")}
    systems = [system for system in SYSTEMS if system in args.systems]
    servers, kv_tokens = {}, {}
    try:
        for system in systems:
            log_path = os.path.join(directory, f"{system}.log")
            if system == "dint-serve":
                dint_serve_python = args.dint_serve_python or sys.executable
                servers[system] = start_dint_serve(dint_serve_python, served[system], args, directory, log_path)
            else:
                servers[system] = start_vllm_server(python, served[system], log_path)
                kv_tokens[system] = kv_cache_tokens(log_path)
            print(f"[{size_name}] {system} up", flush=True)
        for system in systems:  # warm-up (first requests, compiled shapes)
            asyncio.run(run_level(servers[system][1], served[system], prompts, 2, 1, args.max_tokens))
        load_before = load_average()
        runs = {(concurrency, system): [] for concurrency in args.concurrency for system in systems}
        for concurrency in args.concurrency:
            for repeat in range(args.repeats):
                for system in systems if repeat % 2 == 0 else list(reversed(systems)):
                    process, base_url = servers[system]
                    wall, latencies, generated = asyncio.run(
                        run_level(base_url, served[system], prompts, concurrency, args.requests_per_client, args.max_tokens)
                    )
                    runs[concurrency, system].append(
                        {"wall_s": wall, "requests": len(latencies), "latencies_s": latencies,
                         "generated_tokens": generated, "peak_rss_mb": peak_resident_mb(process.pid)}
                    )
                    print(f"[{size_name}] {concurrency:3d} clients  {system:14s} {sum(generated) / wall:8.1f} tokens/s",
                          flush=True)
        load_after = load_average()
    finally:
        for process, _ in servers.values():
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    kv_bytes = KV_CACHE_SPACE_GIB * 2**30
    return {
        "size": size_name,
        "config": SIZES[size_name],
        "load_average_before": load_before,
        "load_average_after": load_after,
        "kv_cache_tokens": kv_tokens,
        "kv_cache_bytes_per_token": {system: kv_bytes / tokens for system, tokens in kv_tokens.items() if tokens},
        "levels": [
            {"concurrency": concurrency,
             "systems": {system: summarize(runs[concurrency, system]) for system in systems},
             "runs": {system: runs[concurrency, system] for system in systems}}
            for concurrency in args.concurrency
        ],
    }


def render_markdown(result: dict) -> str:
    info, args = result["machine"], result["args"]
    lines = [
        "# Serving load on vLLM: DINT vs Llama on vLLM, and vs dint-serve",
        "",
        f"`python bench/vllm_load.py {result['command']}` — {info['date_utc']}, commit {info['git_commit']}, "
        f"{info['processor']} ({info['cpu_count']} cores, shared with other work), torch {info['torch']} (vLLM's "
        f"virtualenv: {result['vllm_version']}), fp32. Each client sends {args['requests_per_client']} chat completions "
        f"in turn (greedy, max {args['max_tokens']} tokens); {args['repeats']} interleaved repetitions per level "
        "(median throughput; latency percentiles over all requests of the level). vLLM: default engine settings "
        f"(compiled, chunked prefill, prefix caching), `VLLM_CPU_KVCACHE_SPACE={KV_CACHE_SPACE_GIB}`, max model length "
        f"{MAX_MODEL_LEN}. dint-serve (transformers "
        f"{result['dint_serve_transformers']}): `--continuous-batching --cb-num-blocks {args['cb_num_blocks']} "
        f"--cb-max-batch-tokens {args['cb_max_batch_tokens']}`. All the servers run during the whole size.",
    ]
    for size in result["sizes"]:
        config = size["config"]
        lines += [
            "",
            f"## {size['size']}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
            f"{config['num_attention_heads']} softmax maps over {config['num_key_value_heads']} KV heads of "
            f"{config['head_dim']} channels (load average {size['load_average_before']} before, "
            f"{size['load_average_after']} after)",
            "",
            "| clients | server | requests/s | generated tokens/s | p50 latency (s) | p95 latency (s) | peak RSS (MB) |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for level in size["levels"]:
            for system, summary in level["systems"].items():
                lines.append(
                    f"| {level['concurrency']} | {system} | {summary['requests_per_s']:.2f} | "
                    f"{summary['tokens_per_s']:.1f} | {summary['p50_latency_s']:.2f} | {summary['p95_latency_s']:.2f} | "
                    f"{summary['peak_rss_mb']:.0f} |"
                )
        ratios = []
        for level in size["levels"]:
            runs = level["runs"]
            parts = []
            if "vllm-dint" in runs and "vllm-llama" in runs:
                parts.append(f"vLLM DINT / vLLM Llama {paired_ratio(runs['vllm-dint'], runs['vllm-llama']):.2f}")
            if "vllm-dint-v2" in runs and "vllm-llama" in runs:
                parts.append(f"vLLM DINT-V2 / vLLM Llama {paired_ratio(runs['vllm-dint-v2'], runs['vllm-llama']):.2f}")
            if "vllm-dint" in runs and "vllm-dint-none" in runs:
                parts.append(f"vLLM DINT / vLLM DINT-none {paired_ratio(runs['vllm-dint'], runs['vllm-dint-none']):.2f}")
            if "vllm-dint" in runs and "dint-serve" in runs:
                parts.append(f"vLLM DINT / dint-serve {paired_ratio(runs['vllm-dint'], runs['dint-serve']):.2f}")
            ratios.append(f"{level['concurrency']} clients: " + ", ".join(parts))
        lines += ["", "Generated tokens/s, median of the per-repetition ratios (runs of a repetition are adjacent in "
                  "time): " + "; ".join(ratios) + "."]
        kv = size["kv_cache_bytes_per_token"]
        if kv:
            lines += ["", "KV-cache capacity vLLM reports for its KV space: " + ", ".join(
                f"{system} {size['kv_cache_tokens'][system]:,} tokens ({bytes_per_token:,.0f} bytes/token)"
                for system, bytes_per_token in kv.items()) + "."]
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    python = vllm_python(args.vllm_python) if any(s.startswith("vllm") for s in args.systems) else None
    vllm_version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                  text=True).stdout.strip() if python else None
    prompts = chat_prompts(max(args.concurrency) * args.requests_per_client)
    sizes = []
    for size_name in args.sizes:
        with tempfile.TemporaryDirectory() as directory:
            sizes.append(measure_size(args, size_name, python, prompts, directory))
    dint_serve_transformers = subprocess.run(
        [args.dint_serve_python or sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True, text=True).stdout.strip()
    result = {"command": " ".join(sys.argv[1:]), "args": vars(args), "machine": machine_info("cpu"),
              "vllm_version": f"vllm-cpu {vllm_version}", "dint_serve_transformers": dint_serve_transformers,
              "sizes": sizes}
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as output:
        json.dump(result, output, indent=1)
    with open(os.path.join(args.output_dir, "results.md"), "w") as output:
        output.write(render_markdown(result))
    print(render_markdown(result))


if __name__ == "__main__":
    main()
