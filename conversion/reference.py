# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Microsoft's reference Diff-Transformer attention (`multihead_diffattn.py` layout) -> DINT, by a head permutation.

The reference module (`MultiheadDiffAttn(embed_dim, depth, num_heads, num_kv_heads)`) holds, with `n` = its
`num_heads` (differential heads), `m` = its `num_kv_heads`, `d` = head_dim and `r = n // m`:
- `q_proj` with `2n` heads of `d` rows; heads `(2i, 2i+1)` are the signal and noise queries of differential head i;
- `k_proj` with `2m` heads of `d` rows, repeated `r` times each (`repeat_kv`): query head `h` reads key head `h // r`;
- `v_proj` with `m` heads of `2d` rows: differential head i reads value head `i // r`;
- `out_proj`, `lambda_q1/k1/q2/k2` (`[d]`), `subln.weight` (`[2d]`, an RMSNorm with eps 1e-5), and the output is
  multiplied by `(1 - lambda_init)`; RoPE rotates interleaved channel pairs `(2j, 2j+1)` (`interleaved=True`).

DINT (DiffLlama's layout) reads signal query i and noise query `i + n`, key heads `g` and `g + Hkv/2` and value heads
`g` and `g + Hkv/2` (the two `d`-halves of the value), `g = i // (2n / Hkv)`, and rotates channel pairs `(j, j + d/2)`.
The converter moves query/key heads to those slots, splits each reference value head in its two halves, permutes the
channels inside every query/key head from interleaved to half-split RoPE, and puts `subln.weight * (1 - lambda_init)`
into `head_norm.weight`. With `integral="none"` the DINT model computes the reference model's outputs exactly.

When `r = 1` this is a permutation. With grouped keys (`r > 1`) the reference gives a differential head's signal and
noise maps the same key head for even `r`, a sharing DiffLlama's grouping cannot express with `2m` key heads; the
converter then picks the smallest number of DINT key/value heads that expresses it exactly, duplicating key/value
rows (documented in the plan's notes).

Checkpoint layout this converter reads: everything outside attention under Llama's names (`model.embed_tokens`,
`model.layers.{i}.input_layernorm`, `...mlp.{gate,up,down}_proj`, `model.norm`, `lm_head`), and each reference
attention module under `model.layers.{i}.self_attn.` with its own names (`q_proj`, `k_proj`, `v_proj`, `out_proj`,
`lambda_*`, `subln.weight`). The model's dimensions come from a `DintConfig` whose `num_attention_heads` is `2n`,
`num_key_value_heads` is `2m` (the key heads of `k_proj`) and `head_dim` is `d`.
"""

import torch

from modeling_dint import DintConfig, DintForCausalLM

from .plan import LAMBDA_NAMES, ConversionPlan, integral_outcome


ROTARY_LAYOUTS = ("interleaved", "half")
"""`interleaved`: the reference code's RoPE (pairs (2j, 2j+1)); `half`: a checkpoint trained with Llama's
rotate_half (pairs (j, j + d/2))."""

REFERENCE_ATTENTION_NAMES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight", "subln.weight")


def reference_head_mapping(
    num_heads: int, num_kv_heads: int
) -> tuple[int, list[int], list[int], list[tuple[int, int]]]:
    """Where each DINT head comes from in the reference layout.

    Args:
        num_heads: the reference `num_heads` (differential heads, `n`).
        num_kv_heads: the reference `num_kv_heads` (`m`; `k_proj` has `2m` key heads, `v_proj` `m` value heads).

    Returns:
        `(dint_num_kv_heads, query_sources, key_sources, value_sources)`: DINT query head `h` (of `2n`) is reference
        query head `query_sources[h]`; DINT key head `s` is reference key head `key_sources[s]`; DINT value head `s`
        is half `value_sources[s][1]` (0: first `d` rows, 1: second) of reference value head `value_sources[s][0]`.
        `dint_num_kv_heads` is the smallest even divisor of `2n` for which this is exact.
    """
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"The reference num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}).")
    group = num_heads // num_kv_heads
    num_maps = 2 * num_heads
    # DINT query head h: signal of differential head h (h < n) or noise of differential head h - n.
    query_sources = [2 * h if h < num_heads else 2 * (h - num_heads) + 1 for h in range(num_maps)]
    key_of_query = [query_sources[h] // group for h in range(num_maps)]
    value_of_head = [i // group for i in range(num_heads)]
    for dint_num_kv_heads in range(2, num_maps + 1, 2):
        if num_maps % dint_num_kv_heads != 0:
            continue
        dint_group = num_maps // dint_num_kv_heads
        key_sources = [None] * dint_num_kv_heads
        value_sources = [None] * dint_num_kv_heads
        consistent = True
        for h in range(num_maps):
            slot = h // dint_group
            if key_sources[slot] not in (None, key_of_query[h]):
                consistent = False
                break
            key_sources[slot] = key_of_query[h]
        for i in range(num_heads):
            slot = i // dint_group
            for half, value_slot in ((0, slot), (1, slot + dint_num_kv_heads // 2)):
                if value_sources[value_slot] not in (None, (value_of_head[i], half)):
                    consistent = False
                value_sources[value_slot] = (value_of_head[i], half)
        if consistent:
            return dint_num_kv_heads, query_sources, key_sources, value_sources
    raise AssertionError("unreachable: one key/value head per query head is always exact")


def interleaved_to_half_permutation(head_dim: int) -> torch.Tensor:
    """Channel order that turns interleaved RoPE pairs (2j, 2j+1) into half-split pairs (j, j + d/2):
    new channel `c` is old channel `perm[c]`, `perm = [0, 2, 4, ..., 1, 3, 5, ...]`."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def plan_reference_diff_to_dint(
    source, reference_config: DintConfig, integral: str = "mean", rotary: str = "interleaved"
) -> ConversionPlan:
    """Plans a reference Diff-Transformer checkpoint -> `DintForCausalLM` (see the module docstring for the layout).

    Args:
        source: mapping name -> tensor (a state dict or a `CheckpointReader`).
        reference_config: the model's dimensions as a `DintConfig` (`num_attention_heads = 2n`,
            `num_key_value_heads = 2m`, `head_dim = d`, `lambda_init` as the reference model used).
        integral: the DINT model's integral mode; `"none"` reproduces the reference outputs.
        rotary: `"interleaved"` (the reference code) or `"half"` (no channel permutation).
    """
    num_heads = reference_config.num_attention_heads // 2
    num_kv_heads = reference_config.num_key_value_heads // 2
    dint_num_kv_heads, query_sources, key_sources, value_sources = reference_head_mapping(num_heads, num_kv_heads)
    plan, channel_order = reference_plan(
        source, reference_config, integral, rotary,
        num_key_value_heads=dint_num_kv_heads, head_norm=True, head_norm_affine=True,
    )
    config, head_dim = plan.config, plan.config.head_dim
    for layer_idx in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer_idx}.self_attn."
        missing = [prefix + n for n in REFERENCE_ATTENTION_NAMES if prefix + n not in source]
        if missing:
            raise ValueError(
                f"Not a reference Diff-Transformer checkpoint: missing {missing} (expected the reference attention "
                f"names {REFERENCE_ATTENTION_NAMES} under 'model.layers.{{i}}.self_attn.')."
            )
        plan.derive(prefix + "q_proj.weight", gathered_heads, prefix + "q_proj.weight", head_sources=query_sources,
                    head_dim=head_dim, channel_order=channel_order)
        plan.derive(prefix + "k_proj.weight", gathered_heads, prefix + "k_proj.weight", head_sources=key_sources,
                    head_dim=head_dim, channel_order=channel_order)
        plan.derive(prefix + "v_proj.weight", gathered_value_halves, prefix + "v_proj.weight",
                    value_sources=value_sources, head_dim=head_dim)
        plan.copy(prefix + "o_proj.weight", prefix + "out_proj.weight")
        for name in LAMBDA_NAMES:  # only the dot products lq1.lk1 and lq2.lk2 matter: no channel permutation
            plan.copy(prefix + name)
        plan.derive(prefix + "head_norm.weight", scaled, prefix + "subln.weight",
                    factor=1.0 - config.lambda_init_for_layer(layer_idx))
    plan.notes.append(
        f"reference layout: {num_heads} differential heads, {2 * num_kv_heads} key heads -> DINT "
        f"{config.num_attention_heads} softmax maps, {dint_num_kv_heads} key/value heads"
        + (" (key/value rows duplicated to express the reference's key sharing exactly)."
           if dint_num_kv_heads > 2 * num_kv_heads else " (a pure permutation).")
    )
    return plan


def reference_plan(
    source, reference_config: DintConfig, integral: str, rotary: str, **overrides
) -> tuple[ConversionPlan, torch.Tensor]:
    """Where the planners of both Microsoft formats start (this one and `reference_v2.py`'s).

    Returns:
        `(plan, channel_order)`: the plan of a `DintForCausalLM` whose config is the reference model's fields with
        `integral`, no attention bias and `overrides`, holding every tensor outside attention (attention is each
        planner's, layer by layer); and the channel order `[head_dim]` that every query and key head gets for
        `rotary` (`interleaved_to_half_permutation`, or none for `"half"`).
    """
    if rotary not in ROTARY_LAYOUTS:
        raise ValueError(f"`rotary` must be one of {ROTARY_LAYOUTS}, got {rotary!r}.")
    config = DintConfig(**{
        **reference_config.to_dict(), "integral": integral, "attention_bias": False,
        "architectures": ["DintForCausalLM"], **overrides,
    })
    head_dim = config.head_dim
    channel_order = interleaved_to_half_permutation(head_dim) if rotary == "interleaved" else torch.arange(head_dim)
    plan = ConversionPlan(config, DintForCausalLM, source, integral_outcome(integral))
    plan.copy_source_tensors(skip=lambda name: ".self_attn." in name)
    return plan, channel_order


def scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return tensor * factor


def gathered_heads(
    weight: torch.Tensor, head_sources: list[int], head_dim: int, channel_order: torch.Tensor
) -> torch.Tensor:
    """Rows of heads `head_sources` of a `[heads*d, hidden]` projection, channels reordered inside each head."""
    per_head = weight.reshape(-1, head_dim, weight.shape[-1])
    return per_head[torch.tensor(head_sources)][:, channel_order].reshape(-1, weight.shape[-1])


def gathered_value_halves(weight: torch.Tensor, value_sources: list[tuple[int, int]], head_dim: int) -> torch.Tensor:
    """DINT value heads from halves of the reference `[m * 2d, hidden]` value projection."""
    halves = weight.reshape(-1, 2, head_dim, weight.shape[-1])  # [m, 2, d, hidden]
    return torch.cat([halves[head, half] for head, half in value_sources], dim=0)
