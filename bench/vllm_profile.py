# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Where vLLM's CPU path spends DINT's extra time: one request decoding on vLLM, DINT against Llama of the same size.

    python bench/vllm_profile.py                      # tiny, 1 request of 64 prompt tokens, 128 new tokens
    python bench/vllm_profile.py --size smollm2 --new-tokens 32

The models are `vllm_load.py`'s (random weights, same seed, the repository's tokenizer). Each runs in its own process
of the vLLM virtualenv (`.ci/vllm_env.py`), in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), vLLM's default
engine settings (compiled), fp32: one warm-up generate, then the timed generate (milliseconds per generated token, the
median of `--rounds`), then one generate under torch.profiler. Printed per model: ms/token, and the ops by self CPU
time per generated token; then, for DINT, the time per token inside DINT's integral op (`integral_output`: the
op's Python, its step rows, the kernel) and in the attention's wide-query build (v1). The result is written to
`--output` (JSON and a markdown table next to it).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(model_dir: str, prompt_tokens: int, new_tokens: int, rounds: int) -> dict:
    """Runs in the vLLM virtualenv: times and profiles one request's generate."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", max_model_len=2048, seed=0)
    prompt = {"prompt_token_ids": list(range(10, 10 + prompt_tokens))}
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], sampling, use_tqdm=False)  # warm-up: compilation, the kernel's load
    per_token = []
    for _ in range(rounds):
        started = time.perf_counter()
        llm.generate([prompt], sampling, use_tqdm=False)
        per_token.append((time.perf_counter() - started) * 1000 / new_tokens)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        llm.generate([prompt], sampling, use_tqdm=False)
    ops = sorted(
        ((event.key, event.self_cpu_time_total / 1000 / new_tokens, event.count / new_tokens)
         for event in profiler.key_averages()),
        key=lambda op: -op[1],
    )
    return {"ms_per_token": statistics.median(per_token), "rounds_ms_per_token": per_token,
            "ops": [{"op": name, "self_ms_per_token": ms, "calls_per_token": calls} for name, ms, calls in ops[:25]],
            "torch": torch.__version__}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm-python", default=None, help="default: the virtualenv of .ci/vllm_env.py")
    parser.add_argument("--output", default=os.path.join(REPO_ROOT, "bench", "results", "vllm_profile", "cpu", "results.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.prompt_tokens, args.new_tokens, args.rounds)))
        return

    from bench_common import load_average, machine_info, write_result
    from vllm_load import SIZES, save_models, vllm_python

    python = vllm_python(args.vllm_python)
    result = {"command": "python bench/vllm_profile.py " + " ".join(sys.argv[1:]), "machine": machine_info("cpu"),
              "size": args.size, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "load_average_before": load_average(), "models": {}}
    with tempfile.TemporaryDirectory() as directory:
        paths = save_models(SIZES[args.size], directory)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   TOKENIZERS_PARALLELISM="false")
        for name in ("dint", "llama"):
            completed = subprocess.run(
                [python, os.path.abspath(__file__), "--child", paths[name], "--prompt-tokens", str(args.prompt_tokens),
                 "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds)],
                env=env, capture_output=True, text=True, check=False,
            )
            if completed.returncode != 0:
                raise SystemExit(f"{name}: the vLLM child failed:\n{completed.stderr[-4000:]}")
            result["models"][name] = json.loads(completed.stdout.strip().splitlines()[-1])
    result["load_average_after"] = load_average()
    write_result(result, args.output, render(result))


def render(result: dict) -> str:
    machine = result["machine"]
    dint, llama = result["models"]["dint"], result["models"]["llama"]
    lines = [
        "# One request decoding on vLLM (CPU): where DINT's extra time goes", "",
        f"`{result['command']}`: {machine['date_utc']}, commit {machine.get('git_commit', '?')}, {machine['processor']} "
        f"({machine.get('torch_threads', '?')} torch threads here), vLLM's virtualenv torch {dint['torch']}; {result['size']}, "
        f"{result['prompt_tokens']} prompt tokens, {result['new_tokens']} new tokens, fp32, vLLM's default engine "
        f"(compiled). Load average {result['load_average_before']} before, {result['load_average_after']} after.", "",
        f"ms per generated token (median of rounds): DINT {dint['ms_per_token']:.2f} "
        f"({', '.join(f'{value:.2f}' for value in dint['rounds_ms_per_token'])}), Llama {llama['ms_per_token']:.2f} "
        f"({', '.join(f'{value:.2f}' for value in llama['rounds_ms_per_token'])}): DINT / Llama tokens/s "
        f"{llama['ms_per_token'] / dint['ms_per_token']:.2f}.", "",
    ]
    for name, model in (("DINT", dint), ("Llama", llama)):
        lines += [f"## {name}: ops by self CPU time per generated token (under the profiler)", "",
                  "| op | self ms / token | calls / token |", "| --- | ---: | ---: |"]
        lines += [f"| `{op['op']}` | {op['self_ms_per_token']:.3f} | {op['calls_per_token']:.1f} |" for op in model["ops"]]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
