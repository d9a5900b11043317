# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""What moved between transformers releases for the package's tools, tests and examples: not remote code.

`transformers_compat.py` travels with every checkpoint (`save_pretrained` copies it beside `modeling_dint.py`) and holds
only what a checkpoint needs to load and run. The bridges here serve code around the model: the test suite, the
benches and the README's recipes (sharding a model under `torchrun`, activation checkpointing, compiled decoding on a
CPU, assisted decoding). No file of the remote code imports this module, so `save_pretrained` never copies it
(`tests/test_hub.py` checks that the saved files name none of these bridges). Each bridge says the releases it
serves: when the floor passes them, delete the bridge and use the transformers name directly.
`transformers_compat.installed_release()` reads the installed version; `tests/test_transformers_compat.py` checks
these bridges on the installed release too.
"""

import inspect

import transformers

from ..transformers_compat import installed_release


# --- assisted and prompt-lookup decoding roll a DINT cache back over the rejected tokens only where `generate()`
# records past states and crops by a count of tokens (from 5.14). On 5.5 - 5.13 it crops to an absolute length
# without recording, which a DINT cache layer refuses with a ValueError (its integral cannot be rolled back). ---
GENERATE_RECORDS_PAST_FOR_CROP = installed_release() >= (5, 14)
"""Whether `generate(prompt_lookup_num_tokens=...)` / `generate(assistant_model=...)` can run a DINT model (5.14+)."""


# --- tensor parallelism with the model's own plan: `from_pretrained(distributed_config=DistributedConfig(tp_plan=
# "auto"))` from 5.17, which deprecates the direct `tp_plan="auto"` of 5.5 - 5.16; this bridge serves 5.5 - 5.16. ---
HAS_DISTRIBUTED_CONFIG_TP_PLAN = installed_release() >= (5, 17)


def tensor_parallel_arguments() -> dict:
    """`from_pretrained`'s keyword arguments that shard a model with its own tensor-parallel plan (under `torchrun`):
    `distributed_config=DistributedConfig(tp_plan="auto")` from 5.17, `tp_plan="auto"` before."""
    if HAS_DISTRIBUTED_CONFIG_TP_PLAN:
        from transformers.distributed import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_plan="auto")}
    return {"tp_plan": "auto"}


# --- activation checkpointing: named so from 5.23 (`activation_checkpointing_enable`, TrainingArguments'
# `activation_checkpointing`), where `gradient_checkpointing` is a deprecated alias; this bridge serves 5.5 - 5.22. ---
def activation_checkpointing_arguments() -> dict:
    """`TrainingArguments`' switch for activation checkpointing under the installed release's name."""
    from transformers import TrainingArguments

    if "activation_checkpointing" in inspect.signature(TrainingArguments).parameters:
        return {"activation_checkpointing": True}
    return {"gradient_checkpointing": True}


def enable_activation_checkpointing(model, **checkpointing_kwargs) -> None:
    """Non-reentrant activation checkpointing of `model` under the installed release's name."""
    kwargs = {"use_reentrant": False, **checkpointing_kwargs}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# --- compiled decoding on a CPU: generate() compiles the decode step of a static cache by itself on accelerators
# only; `CompileConfig._compile_all_devices` (a private attribute, every 5.x release) extends it to every device. ---
def compile_on_every_device(compile_config):
    """Returns `compile_config` (a `transformers.CompileConfig`) set so that `generate()` compiles the decode step on
    every device, the CPU included. transformers has no public switch for it (5.5 - 5.24): this sets the private
    `_compile_all_devices`, which `tests/test_transformers_compat.py` checks on the installed release."""
    if not hasattr(compile_config, "_compile_all_devices"):
        raise AttributeError(
            f"transformers {transformers.__version__} has no `CompileConfig._compile_all_devices`: update "
            "`modeling_dint.integrations.release_bridges.compile_on_every_device`."
        )
    compile_config._compile_all_devices = True
    return compile_config


__all__ = [
    "GENERATE_RECORDS_PAST_FOR_CROP",
    "HAS_DISTRIBUTED_CONFIG_TP_PLAN",
    "tensor_parallel_arguments",
    "activation_checkpointing_arguments",
    "enable_activation_checkpointing",
    "compile_on_every_device",
]
