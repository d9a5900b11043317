# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Silences four known-harmless lines that importing transformers prints when torchao is installed.

transformers imports torchao as soon as any model class is imported (`transformers.modeling_utils` ->
`integrations.finegrained_fp8` -> `quantizers.quantizer_torchao`, which imports
`torchao.prototype.safetensors` whenever torchao is installed), so no DINT code path can keep it out. On a CPU-only
torch (torchao 0.18, torch 2.13) that import logs:

- through the `torchao` logger, "Failed to load .../torchao/_C_mxfp8...so" and ".../_C_cutlass_90a...so": torchao's
  CUDA kernels (MX-FP8 and sm90a CUTLASS), which cannot load without CUDA and which CPU quantization
  (`Int8WeightOnlyConfig`) does not use;
- through the `torch.utils._pytree` logger, "<enum 'KernelPreference'> is an Enum subclass ... Calling
  register_constant() on Enum subclasses is deprecated" (and the same for `ScaleCalculationMode`): torchao registers
  two of its enums the way older torch versions needed; torch still accepts it.

A newcomer reads these as a broken install. The filter drops exactly these records (the named kernel files, and the
deprecation notice only for torchao's enums); every other message of both loggers still prints. It must be installed
before transformers imports its model classes, so `modeling_dint/__init__.py` installs it first.
"""

import logging


TORCHAO_CUDA_ONLY_KERNELS = ("_C_mxfp8", "_C_cutlass_90a")
"""torchao's compiled CUDA kernels that fail to load on a CPU-only torch (file names start with these)."""

_TORCH_ENUM_DEPRECATION = "is an Enum subclass and is now natively supported by torch.compile"


class KnownImportNoiseFilter(logging.Filter):
    """Drops the records described in the module docstring; keeps every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if record.name == "torchao" and message.startswith("Failed to load "):
            return not any(f"/torchao/{kernel}" in message for kernel in TORCHAO_CUDA_ONLY_KERNELS)
        if record.name == "torch.utils._pytree" and _TORCH_ENUM_DEPRECATION in message:
            registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not str(getattr(registered, "__module__", "")).startswith("torchao")
        return True


def silence_known_import_noise() -> None:
    """Installs `KnownImportNoiseFilter` on the `torchao` and `torch.utils._pytree` loggers (once)."""
    for logger_name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(logger_name)
        if not any(isinstance(existing, KnownImportNoiseFilter) for existing in logger.filters):
            logger.addFilter(KnownImportNoiseFilter())
