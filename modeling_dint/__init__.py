# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT Transformer for Hugging Face transformers.

Importing this package registers the model type `dint` with transformers' Auto classes (AutoConfig, AutoModel,
AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
AutoModelForQuestionAnswering) and the DINT cache layers with the cache-layer mappings.
"""

# First: on an unsupported transformers this fails with one clear message, before any import from inside it fails.
from .transformers_compat import MINIMUM_TRANSFORMERS_VERSION, UnsupportedTransformersError  # noqa: I001

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .cache_dint import DintDynamicLayer, DintStaticLayer
from .configuration_dint import DintConfig, preset_names
from .hub import dint_model_card, push_dint_to_hub, save_dint_for_hub
from .modeling_dint import (
    DintForCausalLM,
    DintForQuestionAnswering,
    DintForSequenceClassification,
    DintForTokenClassification,
    DintIntegralLayout,
    DintModel,
    DintPreTrainedModel,
    compose_final_attention,
    dint_attention_map,
    segmented_running_sum,
)


AutoConfig.register(DintConfig.model_type, DintConfig, exist_ok=True)
AutoModel.register(DintConfig, DintModel, exist_ok=True)
AutoModelForCausalLM.register(DintConfig, DintForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DintConfig, DintForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(DintConfig, DintForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(DintConfig, DintForQuestionAnswering, exist_ok=True)

__version__ = "0.1.0"

__all__ = [
    "DintConfig",
    "DintModel",
    "DintPreTrainedModel",
    "DintForCausalLM",
    "DintForSequenceClassification",
    "DintForTokenClassification",
    "DintForQuestionAnswering",
    "DintDynamicLayer",
    "DintStaticLayer",
    "DintIntegralLayout",
    "compose_final_attention",
    "dint_attention_map",
    "segmented_running_sum",
    "preset_names",
    "dint_model_card",
    "push_dint_to_hub",
    "save_dint_for_hub",
]
