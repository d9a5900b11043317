# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Microsoft's DIFF V2 attention (`MultiheadFlashDiffV2`, unilm `Diff-Transformer/Diff-Transformer-V2`) -> DINT v2.

The module (with `use_diff_v2=True`) holds, with h = its `num_heads` (output heads), m = its `num_kv_heads` and d its
`head_dim` (`d_model // num_heads` in DIFF V2's sizing):
- `q_proj` `[2h*d, d_model]`: 2h query heads; `k_proj`, `v_proj` `[m*d, d_model]`; `o_proj` `[d_model, h*d]`
  (`out_proj` in some checkpoints); `lambda_proj` `[h, d_model]`; no bias;
- RoPE on q and k with interleaved channel pairs `(2j, 2j+1)` (flash-attn's `apply_rotary_emb(interleaved=True)`),
  pair j at frequency `theta^(-2j/d)`;
- one causal `flash_attn_func(q, k, v)` with its default scale `1/sqrt(d)`; query head q reads KV head `q // (2h/m)`;
- `out = O[:, :, 0::2] - sigmoid(lambda_proj(x)) * O[:, :, 1::2]` per token and head, no norm, no other factor, then
  `o_proj`.

That is the package's v2 layout with `integral="none"`, up to one convention: the package rotates Llama's channel
pairs `(j, j + d/2)`. So the converter permutes the channels of every query and key head (package channel j <-
Microsoft's 2j, j + d/2 <- 2j + 1, `interleaved_to_half_permutation`) and copies every other tensor; with
`integral="none"` the DINT model computes Microsoft's outputs exactly. The package's GQA grouping (query heads
contiguous per KV head) is flash-attn's; it needs m to divide h (so that heads 2i and 2i+1 share a KV head), which
the v2 config checks.

Checkpoint layout this converter reads: everything outside attention under Llama's names, and each
`MultiheadFlashDiffV2` under `model.layers.{i}.self_attn.` with its own names. The dimensions come from a v2
`DintConfig` (config.json): `num_attention_heads` = 2h, `num_key_value_heads` = m, `head_dim` = d (default
`hidden_size / h`, as Microsoft's sizing), `rope_parameters` with the model's theta.
"""

from modeling_dint import DintConfig

from .plan import ConversionPlan
from .reference import gathered_heads, reference_plan


REFERENCE_V2_ATTENTION_NAMES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "lambda_proj.weight")
"""The attention tensors every `MultiheadFlashDiffV2` checkpoint holds, besides its output projection."""

OUTPUT_PROJECTION_NAMES = ("o_proj.weight", "out_proj.weight")
"""The output projection's name: `o_proj` (the unilm module), or `out_proj` (DIFF V1's name, which some checkpoints
keep)."""


def plan_reference_diff_v2_to_dint(
    source, reference_config: DintConfig, integral: str = "mean", rotary: str = "interleaved"
) -> ConversionPlan:
    """Plans a DIFF V2 (`MultiheadFlashDiffV2`) checkpoint -> `DintForCausalLM` with `differential_attention="v2"`
    (see the module docstring for the layout).

    Args:
        source: mapping name -> tensor (a state dict or a `CheckpointReader`).
        reference_config: the model's dimensions as a v2 `DintConfig` (`num_attention_heads = 2h`,
            `num_key_value_heads = m`, `head_dim = d`).
        integral: the DINT model's integral mode; `"none"` reproduces Microsoft's outputs.
        rotary: `"interleaved"` (Microsoft's code) or `"half"` (a checkpoint trained with Llama's rotate_half: no
            channel permutation).

    Raises:
        ValueError: a `rotary` not in `ROTARY_LAYOUTS`, a config that is not v2, or a layer whose attention tensors
            are missing, ambiguous (both `o_proj` and `out_proj`) or unknown (a bias, a norm), named.
    """
    if reference_config.differential_attention != "v2":
        raise ValueError(
            "A DIFF V2 (reference-diff-v2) checkpoint has DIFF V2's head layout: its config must have "
            f"differential_attention='v2' (or leave it out), got {reference_config.differential_attention!r}."
        )
    plan, channel_order = reference_plan(source, reference_config, integral, rotary, lambda_gate=False)
    config, head_dim = plan.config, plan.config.head_dim
    query_heads, key_heads = range(config.num_attention_heads), range(config.num_key_value_heads)
    for layer_idx in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer_idx}.self_attn."
        output_projection = _output_projection_name(source, prefix)
        found = {name for name in source.keys() if name.startswith(prefix)}
        known = {prefix + name for name in (*REFERENCE_V2_ATTENTION_NAMES, output_projection)}
        if found - known:
            raise ValueError(
                f"Not a DIFF V2 (MultiheadFlashDiffV2) checkpoint: unexpected attention tensors "
                f"{sorted(found - known)} (the module has {(*REFERENCE_V2_ATTENTION_NAMES, 'o_proj.weight')} and no "
                "bias or norm)."
            )
        plan.derive(prefix + "q_proj.weight", gathered_heads, prefix + "q_proj.weight", head_sources=list(query_heads),
                    head_dim=head_dim, channel_order=channel_order)
        plan.derive(prefix + "k_proj.weight", gathered_heads, prefix + "k_proj.weight", head_sources=list(key_heads),
                    head_dim=head_dim, channel_order=channel_order)
        plan.copy(prefix + "v_proj.weight")
        plan.copy(prefix + "o_proj.weight", prefix + output_projection)
        plan.copy(prefix + "lambda_proj.weight")
    plan.notes.append(
        f"DIFF V2 layout: {config.num_differential_heads} output heads, {config.num_attention_heads} query heads, "
        f"{config.num_key_value_heads} key/value heads; query/key channels "
        + ("de-interleaved for RoPE." if rotary == "interleaved" else "kept (rotary='half').")
    )
    return plan


def _output_projection_name(source, prefix: str) -> str:
    """`o_proj.weight` or `out_proj.weight`, whichever the layer holds, once everything else it needs is there."""
    missing = [prefix + name for name in REFERENCE_V2_ATTENTION_NAMES if prefix + name not in source]
    present = [name for name in OUTPUT_PROJECTION_NAMES if prefix + name in source]
    if missing or len(present) != 1:
        if missing:
            problem = f"missing {missing}"
        elif present:
            problem = f"both {[prefix + name for name in present]}"
        else:
            problem = f"no output projection {OUTPUT_PROJECTION_NAMES}"
        raise ValueError(
            f"Not a DIFF V2 (MultiheadFlashDiffV2) checkpoint: {problem} (expected {REFERENCE_V2_ATTENTION_NAMES} and "
            f"one of {OUTPUT_PROJECTION_NAMES} under 'model.layers.{{i}}.self_attn.')."
        )
    return present[0]
