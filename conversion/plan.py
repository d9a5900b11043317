# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The result of a converter: the target config and, per target tensor, how to compute it from the source."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedConfig, PreTrainedModel


@dataclass
class ConversionPlan:
    """What a converter produces, before anything is written.

    Attributes:
        config: the target config (`DintConfig`, or `DiffLlamaConfig` for DINT -> DiffLlama).
        model_class: the target model class, e.g. `DintForCausalLM`; the writer checks names and shapes against it.
        tensors: target tensor name -> function returning that tensor (computed lazily, one at a time, so a large
            checkpoint never has to fit in memory twice).
        notes: human-readable remarks about the conversion (printed by the CLI).
    """

    config: PreTrainedConfig
    model_class: type[PreTrainedModel]
    tensors: dict[str, Callable[[], torch.Tensor]]
    notes: list[str] = field(default_factory=list)

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


def shared_decoder_fields(source_config: PreTrainedConfig) -> dict:
    """The Llama-family fields that DINT, DiffLlama and Llama configs share unchanged (sizes, norms, RoPE, tokens).
    Head counts, head_dim, biases and the architecture-specific fields are each converter's own."""
    return dict(
        vocab_size=source_config.vocab_size,
        hidden_size=source_config.hidden_size,
        intermediate_size=source_config.intermediate_size,
        num_hidden_layers=source_config.num_hidden_layers,
        hidden_act=source_config.hidden_act,
        max_position_embeddings=source_config.max_position_embeddings,
        initializer_range=source_config.initializer_range,
        rms_norm_eps=source_config.rms_norm_eps,
        use_cache=source_config.use_cache,
        pad_token_id=source_config.pad_token_id,
        bos_token_id=source_config.bos_token_id,
        eos_token_id=source_config.eos_token_id,
        tie_word_embeddings=source_config.tie_word_embeddings,
        rope_parameters=dict(source_config.rope_parameters) if source_config.rope_parameters else None,
        attention_dropout=0.0,
    )
