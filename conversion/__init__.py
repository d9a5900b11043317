# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Converters from existing checkpoints to DINT (and DINT -> DiffLlama), with the `dint-convert` CLI.

```python
from modeling_dint.conversion import convert_checkpoint

convert_checkpoint("path/to/llama", "path/to/dint", integral="mean", dtype="bfloat16")
```

The conversion's choices (`integral`, `head_init`, `differential_attention`, ...) are keyword arguments, listed with
their defaults in `ConversionOptions`. A plan's `outcome` says what the converted model computes against the source.

Library functions that work on in-memory state dicts return a `ConversionPlan` (`plan.state_dict()`,
`plan.build_model()`): `plan_llama_to_dint`, `plan_diffllama_to_dint`, `plan_dint_to_diffllama`,
`plan_reference_diff_to_dint`, `plan_reference_diff_v2_to_dint`.
"""

from .checkpoint import CheckpointReader, ShardedSafetensorsWriter, atomic_output_dir, remove_leftovers
from .convert import SOURCE_FORMATS, ConversionOptions, convert_checkpoint, detect_source_format, plan_conversion
from .diffllama import (
    diffllama_config_from_dint,
    dint_config_from_diffllama,
    plan_diffllama_to_dint,
    plan_dint_to_diffllama,
)
from .llama import (
    DIFFERENTIAL_ATTENTIONS,
    HEAD_INITS,
    LLAMA_FAMILY_MODEL_TYPES,
    dint_config_from_llama,
    paired_query_heads,
    plan_llama_to_dint,
    sliding_window_layers,
)
from .plan import ConversionPlan
from .reference import (
    ROTARY_LAYOUTS,
    interleaved_to_half_permutation,
    plan_reference_diff_to_dint,
    reference_head_mapping,
)
from .reference_v2 import plan_reference_diff_v2_to_dint


__all__ = [
    "CheckpointReader",
    "ConversionOptions",
    "ConversionPlan",
    "DIFFERENTIAL_ATTENTIONS",
    "HEAD_INITS",
    "LLAMA_FAMILY_MODEL_TYPES",
    "ROTARY_LAYOUTS",
    "SOURCE_FORMATS",
    "ShardedSafetensorsWriter",
    "atomic_output_dir",
    "convert_checkpoint",
    "detect_source_format",
    "diffllama_config_from_dint",
    "dint_config_from_diffllama",
    "dint_config_from_llama",
    "interleaved_to_half_permutation",
    "paired_query_heads",
    "plan_conversion",
    "plan_diffllama_to_dint",
    "plan_dint_to_diffllama",
    "plan_llama_to_dint",
    "plan_reference_diff_to_dint",
    "plan_reference_diff_v2_to_dint",
    "reference_head_mapping",
    "remove_leftovers",
    "sliding_window_layers",
]
