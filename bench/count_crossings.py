# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""How far a decode step walks through the package's own files (issue 36): every Python call from a function in one
file of `modeling_dint/` into a function of another file of `modeling_dint/` (calls through transformers or torch in
between count where they land: a call from `integral_dint.py` into transformers' `Cache.update_recurrent_state` that
reaches `cache_dint.py` is one crossing, integral -> cache), counted with `sys.setprofile` over one cached decoding
step of a tiny model, per layer and before the first layer.

    python bench/count_crossings.py                         # v1 and v2, sdpa, integral "mean"
    python bench/count_crossings.py --attn eager --layers 4
"""

import argparse
import collections
import os
import sys

import torch
from transformers import DynamicCache


PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "modeling_dint")


def package_file(frame) -> str | None:
    filename = os.path.abspath(frame.f_code.co_filename)
    return os.path.relpath(filename, PACKAGE_DIR) if filename.startswith(PACKAGE_DIR + os.sep) else None


def nearest_package_caller(frame) -> tuple[str | None, str | None]:
    """The package file and function of the nearest caller frame that is in the package (through library frames)."""
    frame = frame.f_back
    while frame is not None:
        name = package_file(frame)
        if name is not None:
            return name, frame.f_code.co_name
        frame = frame.f_back
    return None, None


def count(differential_attention: str, attn: str, num_layers: int) -> tuple[int, list]:
    from modeling_dint import DintConfig, DintForCausalLM

    layout = {"differential_attention": differential_attention}
    layout["num_key_value_heads"] = 2 if differential_attention == "v1" else 1
    config = DintConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                        num_attention_heads=4, **layout)
    model = DintForCausalLM(config).eval()
    model.config._attn_implementation = attn
    cache = DynamicCache(config=model.config)
    input_ids = torch.randint(2, 128, (1, 8))
    crossings = []

    def profiler(frame, event, arg):
        if event != "call":
            return
        callee = package_file(frame)
        if callee is None:
            return
        caller, caller_function = nearest_package_caller(frame)
        if caller is not None and caller != callee:
            crossings.append((f"{caller}:{caller_function}", f"{callee}:{frame.f_code.co_name}"))

    with torch.no_grad():
        model(input_ids[:, :7], cache=cache, use_cache=True)  # prefill (not counted)
        sys.setprofile(profiler)
        try:
            model(input_ids[:, 7:], cache=cache, use_cache=True)
        finally:
            sys.setprofile(None)
    return len(crossings), crossings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    for layout in ("v1", "v2"):
        total, crossings = count(layout, args.attn, args.layers)
        edges = collections.Counter(crossings)
        print(f"\n{layout}, {args.attn}, {args.layers} layers: {total} crossings in one decoding step")
        for (caller, callee), times in sorted(edges.items(), key=lambda item: -item[1]):
            per = f"{times / args.layers:g} per layer" if times % args.layers == 0 and times >= args.layers else "once"
            print(f"  {times:3d} x  {caller} -> {callee}  ({per})")


if __name__ == "__main__":
    main()
