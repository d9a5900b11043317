# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""transformers' DiffLlama <-> DINT.

DINT has DiffLlama's head layout and parameter names, so the tensors map one to one. The one difference is the
output of a differential head: DiffLlama computes `(1 - lambda_init) * RMSNorm(O)` with a weightless norm, DINT
computes `head_norm.weight * RMSNorm(O)`. So:
- DiffLlama -> DINT fills `head_norm.weight` with `(1 - lambda_init)` of each layer. With `integral="none"` the DINT
  model then computes DiffLlama's logits exactly; with `"mean"`/`"softmax"` it adds the integral term.
- DINT -> DiffLlama needs `integral="none"` (DiffLlama has no integral term), the head norm on and the depth schedule
  of lambda_init (DiffLlama hardcodes both). Any `head_norm.weight` is folded into `o_proj`'s columns:
  `W_o diag(w) RMSNorm(O) = [W_o diag(w / (1 - lambda_init))] ((1 - lambda_init) RMSNorm(O))`.
"""

import torch
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, PreTrainedConfig

from modeling_dint import DintConfig, DintForCausalLM

from .plan import HEAD_LAYOUT_FIELDS, SAME_LOGITS, ConversionPlan, integral_outcome, shared_decoder_fields


def dint_config_from_diffllama(source_config: PreTrainedConfig, integral: str = "mean") -> DintConfig:
    """The DINT config of a converted DiffLlama: same fields, the depth schedule, an affine head norm."""
    if source_config.model_type != "diffllama":
        raise ValueError(f"Expected a DiffLlama config (model_type 'diffllama'), got {source_config.model_type!r}.")
    return DintConfig(
        **shared_decoder_fields(source_config, *HEAD_LAYOUT_FIELDS),
        mlp_bias=False,
        integral=integral,
        lambda_init=None,
        lambda_std_dev=source_config.lambda_std_dev if source_config.lambda_std_dev is not None else 0.1,
        head_norm=True,
        head_norm_affine=True,
        architectures=["DintForCausalLM"],
    )


def plan_diffllama_to_dint(source, source_config: PreTrainedConfig, integral: str = "mean") -> ConversionPlan:
    """Plans DiffLlama -> `DintForCausalLM`: tensors copied, `head_norm.weight = (1 - lambda_init)` per layer.

    Args:
        source: mapping name -> tensor with DiffLlama's names (a state dict or a `CheckpointReader`).
        source_config: the `DiffLlamaConfig`.
        integral: the DINT model's integral mode; `"none"` reproduces DiffLlama's logits.
    """
    config = dint_config_from_diffllama(source_config, integral)
    plan = ConversionPlan(config, DintForCausalLM, source, integral_outcome(integral))
    plan.copy_source_tensors()
    for layer_idx in range(config.num_hidden_layers):
        scale = 1.0 - config.lambda_init_for_layer(layer_idx)
        plan.constant(f"model.layers.{layer_idx}.self_attn.head_norm.weight", torch.full((2 * config.head_dim,), scale))
    return plan


def diffllama_config_from_dint(source_config: DintConfig) -> DiffLlamaConfig:
    """The DiffLlama config of a DINT model; refuses a DINT model that DiffLlama cannot represent.

    Raises:
        ValueError: the v2 head layout, `integral` other than "none", no head norm, a constant `lambda_init`, or an
            MLP bias.
    """
    if source_config.model_type != "dint":
        raise ValueError(f"Expected a DINT config (model_type 'dint'), got {source_config.model_type!r}.")
    if source_config.differential_attention != "v1":
        raise ValueError(
            f"Cannot convert a DINT model with differential_attention={source_config.differential_attention!r} to "
            "DiffLlama: DiffLlama has DIFF V1's head layout only (the first half of the query heads are signal maps, "
            "each differential head reads 2*head_dim value channels, one lambda per layer); DIFF V2's layout (pairs "
            "of query heads over one KV head, lambda per token) has no DiffLlama equivalent. Only v1 models convert. "
            "A checkpoint of Microsoft's DIFF V2 attention (MultiheadFlashDiffV2) whose config.json says model_type "
            "'dint' converts to DINT-V2 with --source-format reference-diff-v2 (source_format='reference-diff-v2')."
        )
    if source_config.integral != "none":
        raise ValueError(
            f"Cannot convert a DINT model with integral={source_config.integral!r} to DiffLlama: DiffLlama has no "
            f"integral term, so its outputs would differ. Only integral='none' models convert."
        )
    if not source_config.head_norm:
        raise ValueError(
            "Cannot convert a DINT model with head_norm=False to DiffLlama: DiffLlama always normalizes each head."
        )
    if source_config.lambda_init is not None:
        raise ValueError(
            f"Cannot convert a DINT model with a constant lambda_init={source_config.lambda_init!r} to DiffLlama: "
            f"DiffLlama always uses the depth schedule 0.8 - 0.6*exp(-0.3*layer) (lambda_init=None)."
        )
    if source_config.mlp_bias:
        raise ValueError("Cannot convert a DINT model with mlp_bias=True to DiffLlama: DiffLlama's MLP has no bias.")
    return DiffLlamaConfig(
        **shared_decoder_fields(source_config, *HEAD_LAYOUT_FIELDS),
        lambda_std_dev=source_config.lambda_std_dev,
        architectures=["DiffLlamaForCausalLM"],
    )


def plan_dint_to_diffllama(source, source_config: DintConfig) -> ConversionPlan:
    """Plans `DintForCausalLM` (integral "none") -> `DiffLlamaForCausalLM`, folding `head_norm.weight` into o_proj.

    Args:
        source: mapping name -> tensor with DINT's names (a state dict or a `CheckpointReader`).
        source_config: the `DintConfig`.
    """
    config = diffllama_config_from_dint(source_config)
    plan = ConversionPlan(config, DiffLlamaForCausalLM, source, SAME_LOGITS)
    plan.copy_source_tensors(skip=lambda name: name.endswith(".self_attn.head_norm.weight"))
    for layer_idx in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer_idx}.self_attn."
        # A weightless head norm is a weight of ones: only o_proj is read then.
        head_norm_names = [prefix + "head_norm.weight"] if source_config.head_norm_affine else []
        plan.derive(prefix + "o_proj.weight", folded_output_projection, prefix + "o_proj.weight", *head_norm_names,
                    diffllama_scale=1.0 - source_config.lambda_init_for_layer(layer_idx))
    return plan


def folded_output_projection(
    weight: torch.Tensor, head_norm_weight: torch.Tensor | None = None, *, diffllama_scale: float
) -> torch.Tensor:
    """o_proj `[hidden, (H/2) * 2d]` with column c of every head scaled by `head_norm_weight[c] / (1 - lambda_init)`
    (`diffllama_scale` is `1 - lambda_init`; no `head_norm_weight` scales every column by `1 / diffllama_scale`)."""
    if head_norm_weight is None:
        return (weight.float() / diffllama_scale).to(weight.dtype)
    channel_scale = head_norm_weight.float()  # [2d]
    hidden_size = weight.shape[0]
    per_head = weight.float().reshape(hidden_size, -1, channel_scale.numel())  # [hidden, H/2, 2d]
    folded = per_head * (channel_scale / diffllama_scale)
    return folded.reshape(hidden_size, -1).to(weight.dtype)
