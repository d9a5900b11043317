# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The research harness's models: a Transformer (transformers' Llama), DIFF and DINT (the package's `DintForCausalLM`)
of the same size, and the attention maps each really mixes values with."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_dint import DintConfig, DintForCausalLM, dint_attention_map
from settings import ABLATIONS, ARCHITECTURES, COMPARISON, CONTROLS, VARIANTS, Settings


def transformer_shape(kind: str, settings: Settings, hidden: int) -> tuple[int, int]:
    """The (heads, SwiGLU width) per layer of a Transformer `kind`. Its heads have head_dim channels:
    "transformer_per_map" has one per softmax map of DIFF (the DIFF paper's pairing; the same projections as DIFF),
    "transformer" one per differential head (half as many: at this size a single head per layer learns key matching
    where two do not reliably, see the README), its SwiGLU widened by the channels (3 * hidden parameters each) that
    make up the attention projections of the heads it has fewer (4 * hidden * head_dim parameters each), rounded
    down: DIFF's parameter count to within one channel per layer."""
    heads = settings.attention_heads if kind == "transformer_per_map" else settings.attention_heads // 2
    missing = settings.attention_heads - heads
    return heads, settings.mlp_ratio * hidden + (4 * hidden * settings.head_dim * missing) // (3 * hidden)


def v1_attention_parameters(settings: Settings, hidden: int) -> int:
    """Per layer, DIFF-V1/DINT-V1's attention parameters: q, k, v of `attention_heads` x head_dim each and o_proj
    (4 * hidden * maps * head_dim), the four lambda vectors (4 * head_dim) and the head norm's weight (2 * head_dim)."""
    return 4 * hidden * settings.attention_heads * settings.head_dim + 6 * settings.head_dim


def v2_attention_parameters(settings: Settings, hidden: int) -> int:
    """Per layer, DIFF-V2/DINT-V2's attention parameters: q of `attention_heads` = 2h query heads of head_dim, k and v
    of h KV heads (`v2_key_value_heads`), o_proj from h * head_dim, lambda_proj (hidden -> h)."""
    query_heads, differential_heads = settings.attention_heads, settings.attention_heads // 2
    key_value_heads = v2_key_value_heads(settings)
    return hidden * settings.head_dim * (query_heads + 2 * key_value_heads + differential_heads) + hidden * differential_heads


def v2_key_value_heads(settings: Settings) -> int:
    """V2's KV heads: one per differential head (h, the package's default; h must be a multiple of it)."""
    return settings.attention_heads // 2


def v2_intermediate_size(settings: Settings, hidden: int) -> int:
    """V2's SwiGLU width: DIFF-V1's (mlp_ratio * hidden) widened by the channels (3 * hidden parameters each) that
    make up the attention parameters V2 has fewer than V1 (`v1_attention_parameters` - `v2_attention_parameters`),
    rounded down: DIFF-V1's parameter count to within one channel per layer, as the Transformer's
    (`transformer_shape`)."""
    missing = v1_attention_parameters(settings, hidden) - v2_attention_parameters(settings, hidden)
    return settings.mlp_ratio * hidden + missing // (3 * hidden)


def build_model(kind: str, vocab_size: int, max_positions: int, settings: Settings, hidden: int, seed: int):
    """A Llama ("transformer") or DINT model of the same size; `kind` is an architecture or an ablation name."""
    heads = settings.attention_heads
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=settings.mlp_ratio * hidden,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=settings.head_dim,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": settings.rope_theta},
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,
    )
    torch.manual_seed(seed)
    if kind in ("transformer", *CONTROLS):
        transformer_heads, intermediate_size = transformer_shape(kind, settings, hidden)
        common.update(num_attention_heads=transformer_heads, num_key_value_heads=transformer_heads,
                      intermediate_size=intermediate_size)
        return LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
    if kind in VARIANTS:
        overrides = dict(VARIANTS[kind])
    elif kind in ABLATIONS:
        overrides = ABLATIONS[kind]
    else:
        raise ValueError(
            f"`kind` must be one of {tuple(dict.fromkeys(ARCHITECTURES + COMPARISON + CONTROLS + tuple(ABLATIONS)))}, "
            f"got {kind!r}."
        )
    settings_for_kind = {"integral": "mean", "one_pass_attention": settings.one_pass_attention}
    if overrides.get("differential_attention") == "v2":  # DIFF V2's layout: no head norm, lambda_init or one pass
        settings_for_kind["one_pass_attention"] = None
        common.update(num_key_value_heads=v2_key_value_heads(settings),
                      intermediate_size=v2_intermediate_size(settings, hidden))
    config = DintConfig(**{**common, **settings_for_kind, **overrides}, attn_implementation="sdpa")
    return DintForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def final_attention_maps(model, kind: str, attentions, attention_mask=None, hidden_states=None) -> list[torch.Tensor]:
    """Per layer, the maps the model really mixes values with: `[B, heads, T, T]` fp32 (Llama: its softmax maps;
    DINT/DIFF: A_final of each differential head, from the package's `dint_attention_map`; V2 needs the layers'
    inputs, `hidden_states` of `output_hidden_states=True`, for its lambda per token)."""
    if not isinstance(model, DintForCausalLM):
        return [layer_maps.float() for layer_maps in attentions]
    if model.config.differential_attention == "v2":
        return [
            dint_attention_map(
                layer_maps,
                layer.self_attn.differential_lambda(layer.input_layernorm(layer_input)).squeeze(-1).detach(),
                attention_mask, integral=model.config.integral, differential_attention="v2",
            )
            for layer_maps, layer, layer_input in zip(attentions, model.model.layers, hidden_states)
        ]
    return [
        dint_attention_map(
            layer_maps, layer.self_attn.lambda_full().detach(), attention_mask, integral=model.config.integral
        )
        for layer_maps, layer in zip(attentions, model.model.layers)
    ]
