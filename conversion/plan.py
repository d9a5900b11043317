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
