# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Requests decoding on vLLM (one, or `--requests`), DINT against Llama of the same size, the engines in one process
and their rounds interleaved (this machine's speed drifts by more than the difference between two processes run one
after the other).

    python bench/vllm_interleaved.py                  # tiny, 64 prompt tokens, 128 new tokens, 8 rounds
    python bench/vllm_interleaved.py --size smollm2 --new-tokens 32 --rounds 4
    python bench/vllm_interleaved.py --requests 16 --new-tokens 32     # 16 requests decoding together

Three engines of `vllm_load.py`'s models (random weights, same seed; vLLM's default engine settings, compiled, fp32,
in-process): DINT, DINT with `integral="none"` (the same layout without the integral: what the integral op costs), and
Llama. Each round generates once on each, in alternating order (`--requests` different prompts at once, so that a
decoding step carries that many rows). Printed: ms per generated token (of all requests) per engine (median),
the paired medians of DINT / Llama and DINT-none / Llama tokens/s, and the wall time inside DINT's integral op
(`integral_output`) per generated token. Written to `--output` (JSON and a markdown table next to it).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("dint", "dint_integral_none", "llama")


def child(paths: dict, prompt_tokens: int, new_tokens: int, rounds: int, requests: int) -> dict:
    """Runs in the vLLM virtualenv: the three engines, interleaved rounds, the integral op's wall time."""
    import torch
    from vllm import LLM, SamplingParams

    from modeling_dint.integrations.vllm import modeling_dint_vllm

    op_seconds = [0.0]
    integral_output = modeling_dint_vllm.integral_output

    def timed_integral_output(*args):
        started = time.perf_counter()
        integral_output(*args)
        op_seconds[0] += time.perf_counter() - started

    modeling_dint_vllm.integral_output = timed_integral_output
    engines = {name: LLM(model=paths[name], dtype="float32", max_model_len=2048, seed=0) for name in ENGINES}
    prompts = [{"prompt_token_ids": list(range(10 + index, 10 + index + prompt_tokens))} for index in range(requests)]
    generated_tokens = requests * new_tokens
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for engine in engines.values():  # warm-up: compilation, the kernel's load
        engine.generate(prompts, sampling, use_tqdm=False)
    per_token = {name: [] for name in ENGINES}
    op_per_token = []
    for index in range(rounds):
        for name in ENGINES if index % 2 == 0 else ENGINES[::-1]:
            op_seconds[0] = 0.0
            started = time.perf_counter()
            engines[name].generate(prompts, sampling, use_tqdm=False)
            per_token[name].append((time.perf_counter() - started) * 1000 / generated_tokens)
            if name == "dint":
                op_per_token.append(op_seconds[0] * 1000 / generated_tokens)
    return {
        "ms_per_token": {name: statistics.median(values) for name, values in per_token.items()},
        "rounds_ms_per_token": per_token,
        "llama_over_dint_tokens_per_s": statistics.median(
            llama / dint for dint, llama in zip(per_token["dint"], per_token["llama"])
        ),
        "llama_over_dint_none_tokens_per_s": statistics.median(
            llama / none for none, llama in zip(per_token["dint_integral_none"], per_token["llama"])
        ),
        "integral_op_ms_per_token": statistics.median(op_per_token),
        "torch": torch.__version__,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1, help="different prompts generated together")
    parser.add_argument("--vllm-python", default=None, help="default: the virtualenv of .ci/vllm_env.py")
    parser.add_argument("--output", default=os.path.join(REPO_ROOT, "bench", "results", "vllm_interleaved", "cpu", "results.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requests < 1:
        parser.error(f"--requests: at least 1, got {args.requests}")
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.prompt_tokens, args.new_tokens, args.rounds, args.requests)))
        return

    from bench_common import load_average, machine_info, write_result
    from vllm_load import SIZES, save_integral_none, save_models, vllm_python

    python = vllm_python(args.vllm_python)
    result = {"command": "python bench/vllm_interleaved.py " + " ".join(sys.argv[1:]), "machine": machine_info("cpu"),
              "size": args.size, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens,
              "load_average_before": load_average()}
    with tempfile.TemporaryDirectory() as directory:
        paths = save_models(SIZES[args.size], directory)
        paths["dint_integral_none"] = save_integral_none(paths["dint"], directory)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   TOKENIZERS_PARALLELISM="false")
        completed = subprocess.run(
            [python, os.path.abspath(__file__), "--child", json.dumps({name: paths[name] for name in ENGINES}),
             "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
             "--rounds", str(args.rounds), "--requests", str(args.requests)],
            env=env, capture_output=True, text=True, check=False,
        )
        if completed.returncode != 0:
            raise SystemExit(f"the vLLM child failed:\n{completed.stderr[-4000:]}")
        result.update(json.loads(completed.stdout.strip().splitlines()[-1]))
    result["load_average_after"] = load_average()
    write_result(result, args.output, render(result))


def render(result: dict) -> str:
    machine = result["machine"]
    rounds = result["rounds_ms_per_token"]
    lines = [
        "# Requests decoding on vLLM (CPU), engines interleaved in one process", "",
        f"`{result['command']}`: {machine['date_utc']}, commit {machine.get('git_commit', '?')}, {machine['processor']}, "
        f"vLLM's virtualenv torch {result['torch']}; {result['size']}, {result.get('requests', 1)} request(s) of "
        f"{result['prompt_tokens']} prompt tokens, "
        f"{result['new_tokens']} new tokens, fp32, vLLM's default engine (compiled). Load average "
        f"{result['load_average_before']} before, {result['load_average_after']} after.", "",
        "| engine | ms per generated token (median) | rounds |", "| --- | ---: | --- |",
    ]
    lines += [f"| {name} | {result['ms_per_token'][name]:.2f} | {', '.join(f'{v:.2f}' for v in rounds[name])} |"
              for name in ENGINES]
    lines += [
        "",
        f"Paired medians of tokens/s: DINT / Llama **{result['llama_over_dint_tokens_per_s']:.3f}**, DINT with integral "
        f"\"none\" / Llama {result['llama_over_dint_none_tokens_per_s']:.3f}. Wall time inside DINT's integral op "
        f"(`integral_output`, every layer): {result['integral_op_ms_per_token']:.3f} ms per generated token.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
