# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Llama-family checkpoints (Llama, Mistral, Qwen2) -> DINT.

DINT uses DiffLlama's head layout, in which q/k/v/o have Llama's shapes, so a Llama-family checkpoint maps onto DINT
by copying tensors (`head_init="copy"`, the default): the `num_attention_heads` softmax maps become `H/2` differential
heads (signal map i = Llama head i, noise map i = Llama head i + H/2; the value heads g and g + Hkv/2 form the
`2*head_dim` value channels of a differential head). Only the lambda vectors (normal(0, lambda_std_dev), seeded) and
the head norms (ones) are new. The attention computed is a different function of the same weights: the converted
model starts from Llama's weights, not from Llama's outputs, and needs continued training.

`head_init="duplicate"` instead keeps the function. Every Llama head becomes one differential head whose signal map
and noise map are both copies of that head (q, k, v duplicated, so `H -> 2H` and `Hkv -> 2Hkv`), its value channels
are two copies of the head's value, `o_proj` reads half of the head's output from each copy, the lambda vectors are
drawn and then adjusted so that lambda is exactly 0 (`exp(lq1.lk1) = exp(lq2.lk2) - lambda_init`) and the head norm
is off (`head_norm=False`). Then `A_final = A1 - 0*A2 + 0*G = A1`: the converted DINT computes the Llama model's
logits (up to float rounding) for every integral mode, and training moves lambda away from 0. It works for any head
count (SmolLM2-135M has 9 heads and 3 key/value heads, which `copy` cannot pair), at the price of doubling the
attention projections and the KV cache.

`differential_attention="v2"` converts into DIFF V2's layout (docs/design.md section 10) and keeps the function at
the source's KV cache: q_proj becomes 2h query heads, heads 2i (signal) and 2i+1 (noise) both copies of source head
i, so pair i sits in source head i's GQA group; k_proj, v_proj and o_proj are the source's (the KV cache is the
source's, tensor for tensor); `lambda_proj` is new (normal(0, the source's initializer_range), seeded). V2's lambda,
`sigmoid(lambda_proj(x))`, is never 0, so the converted config turns on `lambda_gate` (a departure from DIFF V2: a
learned gate per differential head on lambda) and the converter writes the gates as 0: `out_i = O1_i - 0 * lambda_i *
(O2_i - S_i / c) = O1_i`, the source head's output, for every integral mode. The gate gets a gradient from the first
step (`-lambda_i (O2_i - S_i / c)`, not 0), and `lambda_proj` and the noise queries as soon as the gate leaves 0.

A source that attends within a sliding window (Mistral's `sliding_window`, Qwen2's sliding `layer_types`:
`sliding_window_layers`) is refused unless `accept_sliding_window_difference`: DINT attends to the whole causal prefix,
so "duplicate" and v2 keep the function only on sequences up to the window's length. `ConversionPlan.outcome` says
which of these holds.
"""

import math

import torch
from transformers import PreTrainedConfig

from modeling_dint import DintConfig, DintForCausalLM

from .plan import LAMBDA_NAMES, SAME_LOGITS, ConversionPlan, attention_sizes, shared_decoder_fields


LLAMA_FAMILY_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""Source `model_type`s this converter accepts: a pre-RMSNorm decoder with RoPE, SwiGLU and Llama's tensor names."""

HEAD_INITS = ("copy", "duplicate")
"""v1's ways to initialize the differential heads (`head_init`); the v2 conversion has one (the module docstring)."""

DIFFERENTIAL_ATTENTIONS = ("v1", "v2")

LAYER_TYPED_WINDOWS = ("qwen2",)
"""Source model types whose layers attend within `sliding_window` only where `layer_types` says "sliding_attention"
(Mistral's modeling reads no `layer_types`: its window, when set, is every layer's)."""

SAME_FUNCTION = f"{SAME_LOGITS}, every integral mode"
SAME_FUNCTION_WITHIN_WINDOW = (
    f"{SAME_LOGITS} up to the sliding window's length, every integral mode, and differ past it"
)
NEW_FUNCTION = "not the source's function: same weights, DINT attention; continue training"
"""`ConversionPlan.outcome` of the Llama-family conversions: `head_init="duplicate"` and v2 keep the function (up to a
sliding window's length, where the source has one), `"copy"` does not."""

SKIPPED_SOURCE_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers that old Llama checkpoints store and DINT recomputes."""


def dint_config_from_llama(
    source_config: PreTrainedConfig,
    integral: str = "mean",
    head_init: str | None = None,
    lambda_std_dev: float | None = None,
    differential_attention: str = "v1",
) -> DintConfig:
    """The DINT config of a converted Llama-family model; checks that its heads can be paired. v1: the source's
    heads (doubled by `head_init="duplicate"`), a head norm with `"copy"`; v2: 2h query heads of the source's
    head_dim over its KV heads (which divide h in any Llama-family config), no head norm, `lambda_gate` on.

    Raises:
        ValueError: an unsupported `model_type`, head counts that `head_init="copy"` cannot pair (odd
            `num_attention_heads` or `num_key_value_heads`), or a v1-only option (`head_init`, `lambda_std_dev`)
            with `differential_attention="v2"`.
    """
    model_type = source_config.model_type
    if model_type not in LLAMA_FAMILY_MODEL_TYPES:
        raise ValueError(
            f"Unsupported architecture for the Llama-family converter: model_type={model_type!r}; supported: "
            f"{LLAMA_FAMILY_MODEL_TYPES} (and 'diffllama', 'dint' through `convert_checkpoint`)."
        )
    if differential_attention not in DIFFERENTIAL_ATTENTIONS:
        raise ValueError(
            f"`differential_attention` must be one of {DIFFERENTIAL_ATTENTIONS}, got {differential_attention!r}."
        )
    num_heads, num_kv_heads, head_dim = attention_sizes(source_config)
    if differential_attention == "v2":
        for name, value in (("head_init", head_init), ("lambda_std_dev", lambda_std_dev)):
            if value is not None:
                raise ValueError(
                    f"`{name}` ({value!r}) is for differential_attention='v1' (its head pairing and lambda vectors); "
                    "the v2 conversion has one initialization: each query head twice, k/v/o_proj as they are, a new "
                    "lambda_proj and the lambda gate at 0 (the source's function). Leave it unset."
                )
        layout = dict(differential_attention="v2", num_attention_heads=2 * num_heads, num_key_value_heads=num_kv_heads,
                      lambda_gate=True)
    else:
        head_init = "copy" if head_init is None else head_init
        if head_init not in HEAD_INITS:
            raise ValueError(f"`head_init` must be one of {HEAD_INITS}, got {head_init!r}.")
        if head_init == "copy" and (num_heads % 2 != 0 or num_kv_heads % 2 != 0):
            raise ValueError(
                f"Cannot pair the heads of this {model_type} checkpoint: num_attention_heads={num_heads}, "
                f"num_key_value_heads={num_kv_heads}. DINT's differential heads pair softmax maps (head i with head "
                f"i + H/2) and value heads (g with g + Hkv/2), so `head_init='copy'` needs both counts even. Use "
                f"`head_init='duplicate'` (CLI: --head-init duplicate), which doubles every head and keeps the "
                f"model's function exactly."
            )
        copies = 2 if head_init == "duplicate" else 1
        layout = dict(num_attention_heads=copies * num_heads, num_key_value_heads=copies * num_kv_heads,
                      lambda_init=None, lambda_std_dev=0.1 if lambda_std_dev is None else lambda_std_dev,
                      head_norm=head_init == "copy", head_norm_affine=True)
    return DintConfig(
        **shared_decoder_fields(source_config),
        **layout,
        head_dim=head_dim,
        # Qwen2 always has q/k/v biases (and no o_proj bias); Llama says so in `attention_bias`.
        attention_bias=True if model_type == "qwen2" else bool(getattr(source_config, "attention_bias", False)),
        mlp_bias=bool(getattr(source_config, "mlp_bias", False)),
        integral=integral,
        architectures=["DintForCausalLM"],
    )


def sliding_window_layers(source_config: PreTrainedConfig) -> list[int]:
    """The layers of a Llama-family source that attend within a sliding window of `source_config.sliding_window`
    tokens: none where `sliding_window` is None (Llama, Mistral from v0.2, Qwen2 without `use_sliding_window`);
    for Qwen2 those whose `layer_types` entry is "sliding_attention"; for Mistral every layer."""
    if getattr(source_config, "sliding_window", None) is None:
        return []
    typed = source_config.model_type in LAYER_TYPED_WINDOWS
    layer_types = getattr(source_config, "layer_types", None) if typed else None
    if layer_types is None:
        return list(range(source_config.num_hidden_layers))
    return [layer_idx for layer_idx, kind in enumerate(layer_types) if kind == "sliding_attention"]


def initial_lambda_vectors(config: DintConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fresh lambda vectors for every layer, drawn from normal(0, config.lambda_std_dev) with a seeded generator.

    Returns:
        `{"model.layers.{i}.self_attn.lambda_{q1,k1,q2,k2}": tensor of shape [head_dim] (fp32)}`.
    """
    generator = torch.Generator().manual_seed(seed)
    vectors = {}
    for layer_idx in range(config.num_hidden_layers):
        for name in LAMBDA_NAMES:
            vectors[f"model.layers.{layer_idx}.self_attn.{name}"] = (
                torch.randn(config.head_dim, generator=generator, dtype=torch.float32) * config.lambda_std_dev
            )
    return vectors


def zero_lambda_vectors(
    lambda_q1: torch.Tensor,
    lambda_k1: torch.Tensor,
    lambda_q2: torch.Tensor,
    lambda_k2: torch.Tensor,
    lambda_init: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adjusts drawn lambda vectors (each of shape [head_dim]) so that the layer's lambda is exactly 0.

    `lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init = 0` needs `lq1 . lk1 = log(exp(lq2 . lk2) - lambda_init)`.
    `lk1`'s component along `lq1` is set to reach that dot product (its other components stay random); if
    `exp(lq2 . lk2)` is too close to `lambda_init`, `lk2`'s component along `lq2` is first raised the same way.
    All four vectors stay non-zero, so each gets gradients in training.
    """
    lambda_q1, lambda_k1, lambda_q2, lambda_k2 = (v.double() for v in (lambda_q1, lambda_k1, lambda_q2, lambda_k2))
    if lambda_q1.norm() == 0 or lambda_q2.norm() == 0:
        raise ValueError("Cannot zero lambda with an all-zero lambda_q1 or lambda_q2 (lambda_std_dev must be > 0).")
    margin = 0.05
    noise_dot = torch.dot(lambda_q2, lambda_k2)
    if math.exp(noise_dot) - lambda_init < margin:
        lambda_k2 = _with_dot_product(lambda_q2, lambda_k2, math.log(lambda_init + margin))
        noise_dot = torch.dot(lambda_q2, lambda_k2)
    signal_dot = math.log(math.exp(noise_dot) - lambda_init)
    lambda_k1 = _with_dot_product(lambda_q1, lambda_k1, signal_dot)
    return tuple(v.float() for v in (lambda_q1, lambda_k1, lambda_q2, lambda_k2))


def _with_dot_product(query: torch.Tensor, key: torch.Tensor, target: float) -> torch.Tensor:
    """`key` with its component along `query` replaced so that `query . key == target`."""
    query_norm_sq = torch.dot(query, query)
    orthogonal = key - torch.dot(query, key) / query_norm_sq * query
    return orthogonal + target / query_norm_sq * query


def plan_llama_to_dint(
    source,
    source_config: PreTrainedConfig,
    integral: str = "mean",
    head_init: str | None = None,
    lambda_std_dev: float | None = None,
    seed: int = 0,
    differential_attention: str = "v1",
    accept_sliding_window_difference: bool = False,
) -> ConversionPlan:
    """Plans the conversion of a Llama-family causal LM to `DintForCausalLM`.

    Args:
        source: the source tensors, a mapping name -> tensor (a state dict or a `CheckpointReader`) with Llama's
            names (`model.layers.{i}.self_attn.q_proj.weight`, ...).
        source_config: the source model's config (`LlamaConfig`, `MistralConfig` or `Qwen2Config`).
        integral: the converted model's `integral` mode.
        head_init: v1: `"copy"` (tensors as they are; None means it) or `"duplicate"` (function-preserving, see the
            module docstring). v2: None (it has one initialization).
        lambda_std_dev: v1: standard deviation of the new lambda vectors (default: DINT's 0.1). v2: None.
        seed: seed of the new lambda vectors (v1) or of `lambda_proj` (v2).
        differential_attention: the converted model's head layout, `"v1"` or `"v2"` (DIFF V2's, at the source's KV
            cache and function: see the module docstring).
        accept_sliding_window_difference: convert a source that attends within a sliding window
            (`sliding_window_layers`) although DINT attends to the whole causal prefix: the converted model's
            logits then equal the source's only up to the window's length. Without it such a source is refused.

    Raises:
        ValueError: what `dint_config_from_llama` refuses, and a sliding-window source without
            `accept_sliding_window_difference`.
    """
    config = dint_config_from_llama(source_config, integral, head_init, lambda_std_dev, differential_attention)
    windowed = sliding_window_layers(source_config)
    window = getattr(source_config, "sliding_window", None)
    where = f"sliding_window={window} in {len(windowed)} of its {config.num_hidden_layers} layers"
    if windowed and not accept_sliding_window_difference:
        raise ValueError(
            f"The source {source_config.model_type} attends within a sliding window ({where}); DINT attends to the "
            f"whole causal prefix, so the converted model would equal the source only up to {window} tokens and "
            "differ past them. Pass --accept-sliding-window-difference (accept_sliding_window_difference=True) to "
            "convert anyway; a later version may carry the window."
        )
    keeps_function = differential_attention == "v2" or not config.head_norm  # v2, or v1's head_init="duplicate"
    if not keeps_function:
        outcome = NEW_FUNCTION
    else:
        outcome = SAME_FUNCTION_WITHIN_WINDOW if windowed else SAME_FUNCTION
    plan = ConversionPlan(config, DintForCausalLM, source, outcome)
    if windowed:
        plan.notes.append(f"The source attends within a sliding window ({where}); the converted DINT attends to the "
                          "whole causal prefix (accept_sliding_window_difference).")
    plan.copy_source_tensors(skip=lambda name: name.endswith(SKIPPED_SOURCE_SUFFIXES))
    for layer_idx in range(config.num_hidden_layers):
        bias_name = f"model.layers.{layer_idx}.self_attn.o_proj.bias"
        if config.attention_bias and bias_name not in plan.tensors:  # Qwen2 has q/k/v biases and no o_proj bias
            plan.constant(bias_name, torch.zeros(config.hidden_size))
    if differential_attention == "v2":
        plan_v2_attention(plan, seed)
    else:
        plan_v1_attention(plan, seed)
    return plan


def plan_v1_attention(plan: ConversionPlan, seed: int) -> None:
    """The v1 attention tensors of `plan`, whose q/k/v/o_proj are the source's already: head norms of ones
    (`head_init="copy"`, the config's head norm on), or each head doubled with lambda at 0 (`"duplicate"`); lambda
    vectors drawn with a generator seeded by `seed`."""
    config = plan.config
    head_init = "copy" if config.head_norm else "duplicate"
    lambda_vectors = initial_lambda_vectors(config, seed)
    for layer_idx in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer_idx}.self_attn."
        if config.head_norm and config.head_norm_affine:
            plan.constant(prefix + "head_norm.weight", torch.ones(2 * config.head_dim))
        lambdas = [lambda_vectors[prefix + name] for name in LAMBDA_NAMES]
        if head_init == "duplicate":
            lambdas = zero_lambda_vectors(*lambdas, config.lambda_init_for_layer(layer_idx))
            for projection in ("q_proj", "k_proj", "v_proj"):
                for kind in ("weight", "bias"):
                    name = f"{prefix}{projection}.{kind}"
                    if name in plan.tensors:
                        plan.derive(name, duplicated_rows, name)
            plan.derive(prefix + "o_proj.weight", split_output_columns, prefix + "o_proj.weight",
                        head_dim=config.head_dim)
        for name, value in zip(LAMBDA_NAMES, lambdas):
            plan.constant(prefix + name, value)
    plan.notes.append(
        f"head_init={head_init!r}: {config.num_attention_heads} softmax maps ({config.num_attention_heads // 2} "
        f"differential heads), {config.num_key_value_heads} key/value heads, head_norm={config.head_norm}."
    )


def plan_v2_attention(plan: ConversionPlan, seed: int) -> None:
    """The v2 attention tensors of `plan`, whose k/v/o_proj are the source's already: each query head twice,
    `lambda_proj` from normal(0, initializer_range) with a generator seeded by `seed`, and the lambda gates at 0."""
    config = plan.config
    num_heads = config.num_differential_heads
    generator = torch.Generator().manual_seed(seed)
    for layer_idx in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer_idx}.self_attn."
        for kind in ("weight", "bias"):
            name = f"{prefix}q_proj.{kind}"
            if name in plan.tensors:
                plan.derive(name, paired_query_heads, name, head_dim=config.head_dim)
        lambda_proj = torch.randn(num_heads, config.hidden_size, generator=generator) * config.initializer_range
        plan.constant(prefix + "lambda_proj.weight", lambda_proj)
        plan.constant(prefix + "lambda_gate.weight", torch.zeros(num_heads))
    plan.notes.append(
        f"differential_attention='v2': {config.num_attention_heads} query heads ({num_heads} differential heads, "
        f"each source query head twice), {config.num_key_value_heads} key/value heads (the source's KV cache), "
        "lambda gates at 0."
    )


def paired_query_heads(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A query projection (or its bias) `[h*d, ...]` -> `[2h*d, ...]`, source head i at 2i (signal) and 2i+1
    (noise)."""
    per_head = rows.reshape(-1, 1, head_dim, *rows.shape[1:])
    return per_head.expand(-1, 2, *per_head.shape[2:]).reshape(-1, *rows.shape[1:])


def duplicated_rows(rows: torch.Tensor) -> torch.Tensor:
    """`[rows; rows]`: a projection (or its bias) whose heads are repeated as a second block of heads."""
    return torch.cat([rows, rows], dim=0)


def split_output_columns(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """o_proj `[hidden, H*d]` -> `[hidden, 2H*d]`: differential head i reads `W_i / 2` from each of its two value
    halves, which both hold Llama head i's output, so the sum is `W_i` times that output."""
    hidden_size = weight.shape[0]
    per_head = weight.reshape(hidden_size, -1, 1, head_dim) / 2
    return per_head.expand(-1, -1, 2, -1).reshape(hidden_size, -1)
