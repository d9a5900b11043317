# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The host's time for each piece of a decoding step that DINT adds or replaces, called alone in a hot loop: once per
forward, the integral's count and plan (`forward_integral_layout`), the masks (`create_dint_masks`, against Llama's
`create_causal_mask`) and the cache check (`check_dint_cache`); per layer, the integral's call (`DintIntegral`) in a
decoding step, against DIFF-V2's (integral "none"). `decode_overhead.py` times the whole step; this says where its
microseconds go.

    python bench/host_pieces.py                                 # bench/results/host_pieces/cpu/results_auto.{json,md}
    DINT_INTEGRAL_KERNEL=eager python bench/host_pieces.py      # results_eager.{json,md}

The models are `decode_overhead.py`'s (`gpu_bf16.py --smoke` shapes, fp32), the dynamic cache after a 16-token
prompt, batch 1, one thread. Each piece runs with the arguments a decoding step gives it, without position ids and
with generate()'s (`[[16]]`: no row restarts, but DINT tests each row); the per-layer call is layer 1's. A time is the
minimum over `REPEATS` repeats of the mean of `--number` calls, the repeats of all pieces interleaved (the
host's cost with warm caches, not a step's share of it).
"""

import argparse
import os
import sys
import timeit

import torch


BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import bench_common  # noqa: E402
import gpu_bf16  # noqa: E402


MODELS = ("dint_v2", "diff_v2", "dint_v1", "llama_2h")
REPEATS = 21  # the minimum over many short repeats: this VM's speed drifts by tens of percent within seconds


def interleaved_microseconds(functions: dict, number: int) -> dict:
    """`{key: microseconds per call}`: per repeat, `number` calls of each function in turn; the minimum over the
    repeats, which are spread over the whole run (the machine's fast stretches reach every function alike)."""
    best = dict.fromkeys(functions, float("inf"))
    for _ in range(REPEATS):
        for key, function in functions.items():
            best[key] = min(best[key], timeit.timeit(function, number=number) / number * 1e6)
    return best


def step_pieces(name: str, model, position_ids: bool) -> dict:
    """`{piece: a call}` for one model: the pieces above with the arguments of a decoding step after a 16-token
    prompt (DIFF-V2: its integral call; Llama: its mask)."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    from modeling_dint.cache_dint import check_dint_cache
    from modeling_dint.integral_dint import forward_integral_layout
    from modeling_dint.masking_dint import DINT_QUERY_VALID_KEY, create_dint_masks

    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    step_kwargs = {"position_ids": torch.tensor([[16]])} if position_ids else {}
    captured = {}
    attention = model.model.layers[1].self_attn
    hook = attention.register_forward_pre_hook(lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        model(prompt, **{bench_common.CACHE_ARGUMENT: cache}, use_cache=True)
        model(prompt[:, :1], **step_kwargs, **{bench_common.CACHE_ARGUMENT: cache}, use_cache=True)
    hook.remove()
    config, inner = model.config, model.model
    embeds = inner.embed_tokens(prompt[:, :1])
    positions = torch.tensor([[17]])
    if name == "llama_2h":
        mask = lambda: create_causal_mask(  # noqa: E731
            config=config, inputs_embeds=embeds, attention_mask=None, position_ids=positions,
            **{bench_common.CACHE_ARGUMENT: cache},
        )
        return {"masks (per forward)": mask}
    pieces = {
        "masks (per forward)": lambda: create_dint_masks(config, embeds, None, cache, positions, False),
        "cache check (per forward)": lambda: check_dint_cache(cache, config, False),
    }
    if name != "diff_v2":
        masks = create_dint_masks(config, embeds, None, cache, positions, False)
        pieces["count and plan (per forward)"] = lambda: forward_integral_layout(
            *inner.integral_settings, cache, masks[DINT_QUERY_VALID_KEY], step_kwargs.get("position_ids"), embeds,
            False,
        )
    layout = captured["integral_layout"]
    heads, channels = config.num_differential_heads, config.differential_head_dim
    signal_output, noise_output = torch.randn(2, 1, 1, heads, channels)
    with torch.no_grad():
        if config.differential_attention == "v1":
            lambda_ = attention.lambda_full()
        else:
            lambda_ = attention.differential_lambda(torch.randn(1, 1, config.hidden_size))
    pieces["integral call (per layer)"] = lambda: attention.integral(
        signal_output, noise_output, lambda_, layout, attention.head_norm
    )
    return pieces


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=500, help="calls per repeat")
    parser.add_argument("--output-dir", default=bench_common.results_dir("host_pieces", "cpu"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = gpu_bf16.parse_args(["--device", "cpu", "--smoke"])
    models = {name: model.float() for name, model in gpu_bf16.build_models(shapes, MODELS).items()}
    functions = {
        (inputs, name, piece): function
        for inputs in ("no position ids", "position ids")
        for name in MODELS
        for piece, function in step_pieces(name, models[name], inputs == "position ids").items()
    }
    with torch.no_grad():
        times = interleaved_microseconds(functions, args.number)
    microseconds_by_inputs = {}
    for (inputs, name, piece), time in times.items():
        microseconds_by_inputs.setdefault(inputs, {}).setdefault(name, {})[piece] = time
    kernel_setting = os.environ.get("DINT_INTEGRAL_KERNEL") or "auto"
    result = {
        "argv": sys.argv, "machine": bench_common.machine_info("cpu"), "integral_kernel": kernel_setting,
        "microseconds": microseconds_by_inputs,
    }
    pieces = list(dict.fromkeys(piece for by_model in microseconds_by_inputs.values() for times in by_model.values()
                                for piece in times))
    lines = [
        f"# Host time of a decoding step's pieces (us per call, min of {REPEATS} repeats)", "",
        f"Command: `DINT_INTEGRAL_KERNEL={kernel_setting} python {' '.join(sys.argv)}`; one thread, fp32, batch 1, "
        "after a 16-token prompt.", "",
    ]
    for inputs, by_model in microseconds_by_inputs.items():
        lines += [f"**{inputs}**", "", "| piece | " + " | ".join(MODELS) + " |", "| --- |" + " ---: |" * len(MODELS)]
        for piece in pieces:
            cells = [f"{by_model[name][piece]:.1f}" if piece in by_model[name] else "" for name in MODELS]
            lines.append(f"| {piece} | " + " | ".join(cells) + " |")
        lines.append("")
    output = os.path.join(args.output_dir, f"results_{kernel_setting}.json")
    bench_common.write_result(result, output, "\n".join(lines))


if __name__ == "__main__":
    main()
