# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The result of a converter: the target config and, per target tensor, a recipe that computes it from the source.

Every converter builds its plan the same way: `ConversionPlan(config, model_class, source, outcome)`, then
`copy_source_tensors()` for everything it keeps under the same name, and `copy`, `derive` and `constant` for what
it changes or adds. A new source format is one more such planner.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedConfig, PreTrainedModel


LAMBDA_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
"""The four lambda vectors of a differential attention layer (DINT, DiffLlama and the reference share the names)."""

DECODER_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
)
"""Config fields that DINT, DiffLlama and Llama share unchanged (sizes, norms, tokens); see `shared_decoder_fields`."""

SAME_LOGITS = "logits equal the source's"
INTEGRAL_ADDED = "the source's logits plus the integral term (`--integral none` gives the source's)"
"""`ConversionPlan.outcome` of a converter whose target computes the source's function with `integral="none"`
(DiffLlama, Microsoft's layouts) and adds the integral term to it in the other modes; see `integral_outcome`."""

HEAD_LAYOUT_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias")
"""Config fields of the attention heads, which DINT and DiffLlama share and a Llama-family conversion changes."""


@dataclass
class TensorRecipe:
    """How one target tensor is computed: `function(*the source tensors named source_names, **options)`, when it is
    written (`recipe()`). The converter checks every recipe on the meta device first (`function` on the source
    tensors' shapes and dtypes alone), so a mismatch is refused before anything is written."""

    source: Mapping[str, torch.Tensor]
    function: Callable[..., torch.Tensor]
    source_names: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)

    def __call__(self) -> torch.Tensor:
        return self.function(*(self.source[name] for name in self.source_names), **self.options)


@dataclass
class ConversionPlan:
    """What a converter produces, before anything is written.

    Attributes:
        config: the target config (`DintConfig`, or `DiffLlamaConfig` for DINT -> DiffLlama).
        model_class: the target model class, e.g. `DintForCausalLM`; the writer checks names and shapes against it.
        source: the source tensors, a mapping name -> tensor (a state dict or a `CheckpointReader`).
        outcome: what the converted model computes against the source, in a few words (e.g. "logits equal the
            source's"): the CLI's last line, and the "exact?" column of docs/conversion.md's table.
        tensors: target tensor name -> its `TensorRecipe` (computed lazily, one at a time, so a large checkpoint
            never has to fit in memory twice). Filled with the recipe methods below.
        notes: human-readable remarks about the conversion (logged by `convert_checkpoint`).
    """

    config: PreTrainedConfig
    model_class: type[PreTrainedModel]
    source: Mapping[str, torch.Tensor]
    outcome: str
    tensors: dict[str, TensorRecipe] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def copy_source_tensors(self, skip: Callable[[str], bool] | None = None) -> None:
        """Plans every source tensor under its own name, except `lm_head.weight` when the target ties it to the
        embeddings and the names for which `skip(name)` is true."""
        for name in self.source.keys():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if skip is not None and skip(name):
                continue
            self.copy(name)

    def copy(self, name: str, source_name: str | None = None) -> None:
        """Target tensor `name` is the source tensor `source_name` (default: the same name), unchanged."""
        self.derive(name, _unchanged, source_name or name)

    def derive(self, name: str, function: Callable[..., torch.Tensor], *source_names: str, **options) -> None:
        """Target tensor `name` is `function(*source tensors named source_names, **options)`, computed when written."""
        self.tensors[name] = TensorRecipe(self.source, function, source_names, options)

    def constant(self, name: str, value: torch.Tensor) -> None:
        """Target tensor `name` is `value` (a new tensor: lambda vectors, head norms, biases); each call gets a copy."""
        self.tensors[name] = TensorRecipe(self.source, _copy_of, options={"value": value})

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Computes every target tensor (in memory): for tests and small models."""
        return {name: compute() for name, compute in self.tensors.items()}

    def build_model(self, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
        """The target model with the converted weights, in memory (`strict` loading: every weight must be there)."""
        model = self.model_class(self.config)
        state_dict = self.state_dict()
        if self.config.tie_word_embeddings and "lm_head.weight" not in state_dict:
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        model.load_state_dict(state_dict, strict=True)
        return model.to(dtype).eval()


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _copy_of(value: torch.Tensor) -> torch.Tensor:
    return value.clone()


def integral_outcome(integral: str) -> str:
    """The outcome of a converter whose target is the source's function plus the integral term (`INTEGRAL_ADDED`)."""
    return SAME_LOGITS if integral == "none" else INTEGRAL_ADDED


def attention_sizes(config: PreTrainedConfig) -> tuple[int, int, int]:
    """`(num_attention_heads, num_key_value_heads, head_dim)` of a Llama-style config, where the key/value heads
    default to the attention heads and `head_dim` to `hidden_size // num_attention_heads`, as in Llama's config."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return num_heads, num_kv_heads, head_dim


def shared_decoder_fields(source_config: PreTrainedConfig, *extra_fields: str) -> dict:
    """The `DECODER_FIELDS` of `source_config` (plus `extra_fields`, e.g. `HEAD_LAYOUT_FIELDS`), its RoPE parameters
    and no attention dropout: the keyword arguments a converted config starts from. Head counts, head_dim, biases and
    the architecture-specific fields are each converter's own."""
    fields = {name: getattr(source_config, name) for name in (*DECODER_FIELDS, *extra_fields)}
    fields["rope_parameters"] = dict(source_config.rope_parameters) if source_config.rope_parameters else None
    fields["attention_dropout"] = 0.0
    return fields
