# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Peak CPU memory of one model at one sequence length, measured in this fresh process (run by `run_benchmark.py`).

Prints one JSON object per step ("forward", then "forward_backward") on stdout, each with `peak_bytes`: the rise of
the process's resident set during the step over the resident set just before it. On Linux the kernel's high-water
mark (VmHWM) is reset before each step (`/proc/self/clear_refs`), and freed heap memory is handed back first
(`malloc_trim`), so the two steps of one process do not see each other. Where the reset is not available, only the
first step is measured (`ru_maxrss` is a high-water mark since the process started).

An address-space limit of (current size + `--budget-gb`) makes a step that needs more memory fail with an allocation
error, reported as `"status": "over_budget"`, instead of pushing the machine into the kernel's OOM killer.
"""

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            match = re.search(rf"{field}:\s+(\d+) kB", status.read())
        return int(match.group(1)) if match else None
    except OSError:
        return None


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_step(step, first_step: bool) -> dict:
    """Runs `step()` once; returns `{"status", "peak_bytes", "method"}`."""
    _trim_heap()
    can_reset = _reset_high_water_mark()
    if not can_reset and not first_step:
        return {"status": "not_measured", "peak_bytes": None, "method": "no VmHWM reset on this system"}
    resident_before_kb = _status_kb("VmRSS")
    try:
        step()
    except (RuntimeError, MemoryError) as error:
        if "alloc" in str(error).lower() or isinstance(error, MemoryError):
            return {"status": "over_budget", "peak_bytes": None, "method": str(error).splitlines()[0][:200]}
        raise
    if can_reset:
        peak_kb, method = _status_kb("VmHWM"), "VmHWM after clear_refs, minus VmRSS before"
    else:
        peak_kb, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss minus VmRSS before"
    return {"status": "ok", "peak_bytes": (peak_kb - resident_before_kb) * 1024, "method": method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=bench_common.MODEL_NAMES)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", default="forward,forward_backward")
    parser.add_argument("--size-json", required=True, help="the config fields, as `model_size_kwargs` returns them")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--dtype", default="fp32", choices=sorted(bench_common.DTYPES))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--budget-gb", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    size_kwargs = json.loads(args.size_json)
    model = bench_common.build_model(
        args.model, size_kwargs, args.attn, bench_common.DTYPES[args.dtype], "cpu", seed=args.seed
    )
    input_ids = bench_common.make_input_ids(args.seq_len, args.batch_size, size_kwargs["vocab_size"], "cpu")
    # One short warm-up so that lazily created state (threads, kernels' scratch) is not counted as the step's memory.
    bench_common.forward_step(model, input_ids[:, :16])

    virtual_kb = _status_kb("VmSize")
    if virtual_kb is not None and args.budget_gb > 0:
        limit = virtual_kb * 1024 + int(args.budget_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    steps = {"forward": bench_common.forward_step, "forward_backward": bench_common.train_step}
    for index, mode in enumerate(args.steps.split(",")):
        result = measure_step(lambda: steps[mode](model, input_ids), first_step=index == 0)
        result.update({"model": args.model, "seq_len": args.seq_len, "mode": mode})
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
