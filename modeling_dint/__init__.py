# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT Transformer for Hugging Face transformers.

Importing this package registers the model type `dint` with transformers' Auto classes (AutoConfig, AutoModel,
AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
AutoModelForQuestionAnswering), the DINT cache layers with the cache-layer mappings, and DINT's paged-cache allocator
with continuous batching (`serving.py`).

Import time is transformers' own (`python -X importtime -c "import modeling_dint"`, 2 shared cores: 3.6-5.0 s, of
which torch is 1.0 s; importing the transformers modules the package uses, without it, takes 3.6-4.0 s): torch and
the `transformers.modeling_utils` stack that every model class needs, which itself imports torchao, accelerate,
torch.distributed.tensor and, where installed, scipy. A model type registered with the Auto classes needs its
classes at import, so there is nothing left to defer.
"""

# Before transformers imports torchao: drop the four known-harmless lines that import prints (see import_noise.py).
from .import_noise import silence_known_import_noise


silence_known_import_noise()

# Then: on an unsupported transformers this fails with one clear message, before any import from inside it fails.
from .transformers_compat import MINIMUM_TRANSFORMERS_VERSION, UnsupportedTransformersError  # noqa: E402, I001

from transformers import (  # noqa: E402
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
from .integral_dint import DintIntegralLayout, compose_final_attention, dint_attention_map, segmented_running_sum
from .modeling_dint import (
    DintForCausalLM,
    DintForQuestionAnswering,
    DintForSequenceClassification,
    DintForTokenClassification,
    DintModel,
    DintPreTrainedModel,
)




AutoConfig.register(DintConfig.model_type, DintConfig, exist_ok=True)
AutoModel.register(DintConfig, DintModel, exist_ok=True)
AutoModelForCausalLM.register(DintConfig, DintForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DintConfig, DintForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(DintConfig, DintForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(DintConfig, DintForQuestionAnswering, exist_ok=True)
try:  # continuous batching (generate_batch, `transformers serve --continuous-batching`): modeling_dint/serving.py
    from .serving import enable_continuous_batching
except ImportError:  # a transformers release whose continuous-batching modules moved: everything else still works
    pass
else:
    enable_continuous_batching()

__version__ = "0.1.0"

__all__ = [
    "MINIMUM_TRANSFORMERS_VERSION",
    "UnsupportedTransformersError",
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
