# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Runs DINT on vLLM for `tests/test_vllm.py`, in a process of its own (vLLM's engine wants a `__main__` guard).

    python tests/vllm_worker.py RUNS.json OUT.json

RUNS.json: `{"model": DIR, "runs": [{"name": ..., "engine": {LLM kwargs}, "batches": [[token ids, ...], ...],
"max_tokens": N, "logprobs": K, "drop_integral_state": bool, "model": DIR (optional: another checkpoint)}, ...]}`.
Each run builds one `vllm.LLM` (in this process where `VLLM_ENABLE_V1_MULTIPROCESSING=0`), generates greedily for
each batch of prompts in turn (a later batch can hit the prefix cache the earlier ones filled), and records per request
the generated token ids, the top-K log-probabilities of each step, and the prompt tokens served from the prefix cache;
per run the engine's preemption count. `drop_integral_state` is the negative control: the integral state is neither read nor written, so each step
sees only its own tokens' running sum. `eager_integral`: the integral runs as eager ops, not the fused CPU kernel.

OUT.json: `{name: {"requests": [[{"token_ids", "logprobs", "num_cached_tokens"}, ...] per batch], "preemptions": n,
"kv_cache_tokens": n, "block_size": n, "kernel_built": bool, "kernel_calls": n, "kernel_table_calls": n, "kernel_prepared_calls": n,
"wave_steps": n}}` (the KV
cache's capacity in tokens; the fused CPU integral kernel: built in this process, its calls in the run, and those that
read and stored the requests' state table; the steps whose integral ran in waves).
"""

import contextlib
import gc
import json
import sys


@contextlib.contextmanager
def integral_state_dropped(dropped: bool):
    """The negative control (where `dropped`): the integral runs without the state, so each step's running sum
    restarts from zero, the carried state neither read nor written. Restored on exit, for the runs that follow."""
    from modeling_dint.integrations.vllm import modeling_dint_vllm

    original = modeling_dint_vllm.vllm_integral_step

    def step_without_state(layer, step_rows):
        return None

    if dropped:
        modeling_dint_vllm.vllm_integral_step = step_without_state
    try:
        yield
    finally:
        modeling_dint_vllm.vllm_integral_step = original


class KernelCalls(list):
    """Per call of the fused kernel: whether it read and stored a state table (vLLM's requests), not a step without
    state; `prepared`, per call: whether it wrote vLLM's output buffer (the op's path over `PreparedStepRows`)."""

    def __init__(self):
        super().__init__()
        self.prepared = []


@contextlib.contextmanager
def integral_kernel_counted(eager: bool):
    """Counts the fused CPU integral kernel's calls in the block (where it was built), or turns it off (`eager`)."""
    from modeling_dint import integral_cpu_kernel

    op = integral_cpu_kernel.integral_kernel()
    calls = KernelCalls()

    def counted(*args):
        calls.append(len(args) > 9 and args[9] is not None)
        calls.prepared.append(len(args) > 12 and args[12] is not None)
        return op(*args)

    integral_cpu_kernel._state["op"] = None if eager or op is None else counted
    try:
        yield calls, op is not None
    finally:
        integral_cpu_kernel._state["op"] = op


@contextlib.contextmanager
def waves_counted():
    """Counts the steps whose integral ran in waves (a request continuing from a block another request of the same
    step completes: `VllmStepRows.waves`)."""
    from modeling_dint.integrations.vllm import modeling_dint_vllm

    original = modeling_dint_vllm.VllmStepRows._waves
    steps = []

    def counted(*args, **kwargs):
        waves = original(*args, **kwargs)
        steps.append(len(waves))
        return waves

    modeling_dint_vllm.VllmStepRows._waves = staticmethod(counted)
    try:
        yield steps
    finally:
        modeling_dint_vllm.VllmStepRows._waves = staticmethod(original)


def preemption_count(llm) -> int:
    return int(sum(metric.value for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions"))


def run_one(model: str, run: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, seed=0, disable_log_stats=False, **run["engine"])
    sampling = SamplingParams(
        temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True, logprobs=run.get("logprobs", 0)
    )
    batches = []
    for prompts in run["batches"]:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], sampling, use_tqdm=False)
        batches.append(
            [
                {
                    "token_ids": list(output.outputs[0].token_ids),
                    "logprobs": [
                        {str(token): entry.logprob for token, entry in step.items()} for step in output.outputs[0].logprobs
                    ],
                    "num_cached_tokens": output.num_cached_tokens or 0,
                }
                for output in outputs
            ]
        )
    cache_config = llm.llm_engine.vllm_config.cache_config
    result = {
        "requests": batches,
        "preemptions": preemption_count(llm),
        "kv_cache_tokens": cache_config.num_gpu_blocks * cache_config.block_size,
        "block_size": cache_config.block_size,
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    runs_path, out_path = sys.argv[1], sys.argv[2]
    with open(runs_path, encoding="utf-8") as file:
        spec = json.load(file)
    results = {}
    for run in spec["runs"]:
        with integral_state_dropped(run.get("drop_integral_state", False)), waves_counted() as wave_steps:
            with integral_kernel_counted(run.get("eager_integral", False)) as (calls, built):
                results[run["name"]] = run_one(run.get("model", spec["model"]), run)
        results[run["name"]].update(
            kernel_built=built, kernel_calls=len(calls), kernel_table_calls=sum(calls),
            kernel_prepared_calls=sum(calls.prepared), wave_steps=len(wave_steps)
        )
    with open(out_path, "w", encoding="utf-8") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main()
