# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT at this checkout against DINT at an older commit, and both against transformers' DiffLlama, in one
interleaved run (issue 36: a refactor keeps DINT / DiffLlama within +-0.02).

The older commit's `modeling_dint/` is extracted (`git archive`) into a temporary folder as the package
`modeling_dint_old` (its imports are relative, so it loads beside this checkout's package). Both register a cache layer
for the layer type `dint_attention`; transformers' registry keeps the last, so before each model's turn the registry
is pointed at that model's classes (a bench-only step: models never share a cache). The three models share one copy of
the weights. Per round, in rotating order: a prefill of `--seq-len` tokens, `--decode-tokens` greedy decode steps after
a 128-token prompt (batch 1), and one batched `generate()` (8 x 128-token prompts, 32 new tokens).

    python bench/compare_commits.py --old 4a1f2b2 --size default --rounds 5
    python bench/compare_commits.py --old 4a1f2b2 --size 1b --dtype bf16 --rounds 2
"""

import argparse
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_old_package(revision: str, folder: str):
    """`modeling_dint/` at `revision`, imported as `modeling_dint_old`."""
    archive = subprocess.run(["git", "archive", revision, "modeling_dint"], cwd=REPO_ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    os.rename(os.path.join(folder, "modeling_dint"), os.path.join(folder, "modeling_dint_old"))
    sys.path.insert(0, folder)
    return importlib.import_module("modeling_dint_old")


def use_cache_layers(package) -> None:
    """Points transformers' cache-layer registry for `dint_attention` at `package`'s layers (None: leave it)."""
    from transformers import cache_utils

    if package is None or not hasattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING"):
        return
    cache_utils.DYNAMIC_LAYER_TYPE_MAPPING["dint_attention"] = package.DintDynamicLayer
    cache_utils.STATIC_LAYER_TYPE_MAPPING["dint_attention"] = package.DintStaticLayer


def build(args, old_package):
    import modeling_dint
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    size_kwargs = bench_common.model_size_kwargs(args)
    dtype = bench_common.DTYPES[args.dtype]
    torch.manual_seed(0)
    new = modeling_dint.DintForCausalLM(modeling_dint.DintConfig(**size_kwargs)).to(dtype).eval()
    for name, parameter in new.named_parameters():  # the lambda vectors stay fp32 (from_pretrained keeps them)
        if name.rsplit(".", 1)[-1].startswith("lambda_"):
            parameter.data = parameter.data.float()
    with torch.device("meta"):
        old = old_package.DintForCausalLM._from_config(old_package.DintConfig(**size_kwargs), attn_implementation="sdpa")
        diff = DiffLlamaForCausalLM._from_config(DiffLlamaConfig(**size_kwargs), attn_implementation="sdpa")
    state = new.state_dict()
    old.load_state_dict(state, strict=True, assign=True)
    diff.load_state_dict({k: v for k, v in state.items() if "head_norm" not in k}, strict=True, assign=True)
    for model in (old, diff):
        for key, buffer in model.named_buffers():
            module_name, _, buffer_name = key.rpartition(".")
            model.get_submodule(module_name)._buffers[buffer_name] = dict(new.named_buffers())[key]
        model.eval()
    return {"dint_new": (new, modeling_dint), "dint_old": (old, old_package), "diffllama": (diff, None)}


def time_model(model, package, step, *inputs) -> tuple[float, float]:
    use_cache_layers(package)
    wall, cpu = time.perf_counter(), time.process_time()
    step(model, *inputs)
    return time.perf_counter() - wall, time.process_time() - cpu


def prefill_step(model, input_ids):
    bench_common.prefill(model, input_ids)


def decode_steps(model, prompt, tokens):
    cache, next_token = bench_common.prefill(model, prompt)
    for _ in range(tokens):
        next_token = bench_common.decode_step(model, cache, next_token)


def generate_step(model, prompts):
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=32, min_new_tokens=32,
                       do_sample=False, pad_token_id=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="4a1f2b2", help="the older commit")
    parser.add_argument("--dtype", default="fp32", choices=sorted(bench_common.DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=2048, help="prefill length")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--output", default=None, help="a JSON file for the samples and the medians")
    bench_common.add_model_size_arguments(parser)
    args = parser.parse_args()
    args.max_positions = max(args.seq_len, 256)
    torch.set_num_threads(args.threads)
    load_before = bench_common.load_average()
    with tempfile.TemporaryDirectory() as folder:
        models = build(args, import_old_package(args.old, folder))
        vocab = bench_common.model_size_kwargs(args)["vocab_size"]
        long_prompt = bench_common.make_input_ids(args.seq_len, 1, vocab, "cpu")
        prompt = bench_common.make_input_ids(128, 1, vocab, "cpu")
        prompts = bench_common.make_input_ids(128, 8, vocab, "cpu", seed=2)
        steps = {"prefill": (prefill_step, long_prompt), "decode": (decode_steps, prompt, args.decode_tokens),
                 "generate": (generate_step, prompts)}
        names = list(models)
        samples = {step: {name: [] for name in names} for step in steps}
        for round_index in range(args.rounds + 1):  # round 0: warm-up
            order = names[round_index % 3:] + names[: round_index % 3]
            for step, (function, *inputs) in steps.items():
                for name in order:
                    model, package = models[name]
                    wall, cpu = time_model(model, package, function, *inputs)
                    if round_index:
                        samples[step][name].append((wall, cpu))
            print(f"round {round_index} done", flush=True)
    load_after = bench_common.load_average()
    result = {"machine": bench_common.machine_info("cpu"), "threads": args.threads, "dtype": args.dtype,
              "size": args.size, "old": args.old, "load_average_before": load_before, "load_after": load_after,
              "samples": samples, "ratios": {}}
    print(f"\n{args.size} {args.dtype}, {args.threads} thread(s), {args.rounds} rounds; load average before "
          f"{load_before}, after {load_after}; CPU: {result['machine'].get('processor')}")
    print("| step | DINT new / DiffLlama (wall; CPU) | DINT old / DiffLlama (wall; CPU) | new / old (wall) |")
    print("| --- | --- | --- | --- |")
    for step in steps:
        ratio = {}
        for name in ("dint_new", "dint_old"):
            for kind, index in (("wall", 0), ("cpu", 1)):
                ratio[(name, kind)] = statistics.median(
                    mine[index] / base[index] for mine, base in zip(samples[step][name], samples[step]["diffllama"])
                )
        new_old = statistics.median(n[0] / o[0] for n, o in zip(samples[step]["dint_new"], samples[step]["dint_old"]))
        result["ratios"][step] = {f"{n}/{k}": v for (n, k), v in ratio.items()} | {"new/old wall": new_old}
        print(f"| {step} | {ratio[('dint_new', 'wall')]:.3f}; {ratio[('dint_new', 'cpu')]:.3f} | "
              f"{ratio[('dint_old', 'wall')]:.3f}; {ratio[('dint_old', 'cpu')]:.3f} | {new_old:.3f} |")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
