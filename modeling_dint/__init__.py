# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT Transformer for Hugging Face transformers.

Importing this package registers the model type `dint` with transformers' Auto classes (AutoConfig, AutoModel,
AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
AutoModelForQuestionAnswering) and the DINT cache layers with transformers' cache-layer mappings, and changes nothing
else: continuous batching is enabled when transformers starts it for a DINT model
(`DintForCausalLM.init_continuous_batching`, `integrations/serving.py`), and `dint-serve` adapts transformers' server
when it runs. This folder's top level holds what travels with a checkpoint (`modeling_dint.REMOTE_CODE_FILES`), and the
tools around the model live in `modeling_dint.integrations`; an import by a tool's old path (`modeling_dint.serving`)
fails with a message naming the new one (`integrations.MovedToolsFinder`, which answers for these names only).

Import time is transformers' own (`python -X importtime -c "import modeling_dint"`): torch and the
`transformers.modeling_utils` stack that every model class needs. A model type registered with the Auto classes needs
its classes at import, so there is nothing left to defer.
"""

# First: on an unsupported torch or transformers this fails with one clear message, before any import from inside it.
from .transformers_compat import (  # noqa: I001
    MINIMUM_TORCH_VERSION,
    MINIMUM_TRANSFORMERS_VERSION,
    UnsupportedTransformersError,
)

import sys  # noqa: E402

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .cache_dint import DintDynamicLayer, DintStaticLayer, integral_state_buffers
from .configuration_dint import DintConfig, preset_names, uses_one_pass_attention
from .integral_dint import (
    DintIntegral,
    DintIntegralLayout,
    compose_final_attention,
    dint_attention_map,
    segmented_running_sum,
)
from .modeling_dint import (
    DintForCausalLM,
    DintForQuestionAnswering,
    DintForSequenceClassification,
    DintForTokenClassification,
    DintModel,
    DintPreTrainedModel,
    REMOTE_CODE_FILES,
)
from .integrations import MOVED_TOOLS, MovedToolsFinder, moved_tool_error
from .integrations.hub import dint_model_card, push_dint_to_hub, save_dint_for_hub


AutoConfig.register(DintConfig.model_type, DintConfig, exist_ok=True)
AutoModel.register(DintConfig, DintModel, exist_ok=True)
AutoModelForCausalLM.register(DintConfig, DintForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DintConfig, DintForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(DintConfig, DintForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(DintConfig, DintForQuestionAnswering, exist_ok=True)
if not any(isinstance(finder, MovedToolsFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, MovedToolsFinder())


def __getattr__(name: str):
    """`from modeling_dint import hub` (a tool's old path) fails with the error that names the new one."""
    if f"{__name__}.{name}" in MOVED_TOOLS:
        raise moved_tool_error(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "MINIMUM_TORCH_VERSION",
    "MINIMUM_TRANSFORMERS_VERSION",
    "UnsupportedTransformersError",
    "DintConfig",
    "DintModel",
    "DintPreTrainedModel",
    "DintForCausalLM",
    "DintForSequenceClassification",
    "DintForTokenClassification",
    "DintForQuestionAnswering",
    "REMOTE_CODE_FILES",
    "DintDynamicLayer",
    "DintStaticLayer",
    "integral_state_buffers",
    "DintIntegral",
    "DintIntegralLayout",
    "compose_final_attention",
    "dint_attention_map",
    "segmented_running_sum",
    "preset_names",
    "uses_one_pass_attention",
    "dint_model_card",
    "push_dint_to_hub",
    "save_dint_for_hub",
]
