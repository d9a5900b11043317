# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT on vLLM, as an out-of-tree model plugin.

`pip install -e ".[vllm]"` in the repository's root (or the CPU build, see the README's "Serving at scale: vLLM")
installs the `vllm.general_plugins` entry point `dint = modeling_dint.integrations.vllm:register`, which vLLM calls in
each of its processes before it reads a model: then `LLM("path/to/dint-checkpoint")` and vLLM's OpenAI server load a
DINT checkpoint (`architectures: ["DintForCausalLM"]`) with no user code and without `trust_remote_code`.

The model itself is in `modeling_dint_vllm.py` (imported by vLLM when it builds the model, never by this package's
`import modeling_dint`).
"""

VLLM_ARCHITECTURE = "DintForCausalLM"
VLLM_MODEL_CLASS = "modeling_dint.integrations.vllm.modeling_dint_vllm:DintForCausalLM"


def register() -> None:
    """vLLM's plugin hook: DintConfig with transformers' AutoConfig (`import modeling_dint` registers the Auto classes,
    so vLLM reads the checkpoint's config.json without remote code) and the model class with vLLM's registry (by
    name: vLLM imports it when it builds a model)."""
    import modeling_dint  # noqa: F401  (registers model_type "dint" with the Auto classes)
    from vllm import ModelRegistry

    if VLLM_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(VLLM_ARCHITECTURE, VLLM_MODEL_CLASS)
