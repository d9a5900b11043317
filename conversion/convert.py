# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""`convert_checkpoint`: one checkpoint folder in, one converted `save_pretrained`-style folder out.

Source formats:
- `llama` (model_type llama, mistral or qwen2) -> DINT (`head_init="copy"` or `"duplicate"`, see `llama.py`);
- `diffllama` -> DINT (see `diffllama.py`);
- `dint` -> DiffLlama, for a DINT model with `integral="none"` (see `diffllama.py`);
- `reference-diff`: Microsoft's reference Diff-Transformer layout -> DINT (see `reference.py`); never auto-detected.
"""

import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from modeling_dint import DintConfig

from .checkpoint import (
    CheckpointReader,
    ShardedSafetensorsWriter,
    atomic_output_dir,
    copy_tokenizer_and_generation_files,
    resolve_dtype,
)
from .diffllama import plan_diffllama_to_dint, plan_dint_to_diffllama
from .llama import LLAMA_FAMILY_MODEL_TYPES, plan_llama_to_dint
from .plan import ConversionPlan
from .reference import plan_reference_diff_to_dint


logger = logging.getLogger(__name__)

SOURCE_FORMATS = ("auto", "llama", "diffllama", "dint", "reference-diff")


def detect_source_format(source_dir: str | Path) -> str:
    """The converter for a checkpoint folder, from its config.json's `model_type`.

    Raises:
        ValueError: no config.json, or a `model_type` no converter supports.
    """
    config_file = Path(source_dir) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"No config.json in {str(source_dir)!r}: cannot tell the source architecture.")
    model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    if model_type in LLAMA_FAMILY_MODEL_TYPES:
        return "llama"
    if model_type in ("diffllama", "dint"):
        return model_type
    raise ValueError(
        f"Unsupported architecture: model_type={model_type!r} in {str(config_file)!r}. Supported: "
        f"{LLAMA_FAMILY_MODEL_TYPES} (-> DINT), 'diffllama' (-> DINT), 'dint' (-> DiffLlama), and Microsoft's "
        f"reference Diff-Transformer layout with --source-format reference-diff."
    )


def plan_conversion(
    source_dir: str | Path,
    source_format: str = "auto",
    integral: str = "mean",
    head_init: str = "copy",
    lambda_std_dev: float | None = None,
    seed: int = 0,
    rotary: str = "interleaved",
) -> ConversionPlan:
    """Reads the source config, checks it, and plans the conversion (no tensor is computed yet)."""
    if source_format not in SOURCE_FORMATS:
        raise ValueError(f"`source_format` must be one of {SOURCE_FORMATS}, got {source_format!r}.")
    source_dir = Path(source_dir)
    if source_format == "auto":
        source_format = detect_source_format(source_dir)
    if source_format == "reference-diff":
        fields = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
        fields = {key: value for key, value in fields.items() if key not in ("model_type", "architectures", "auto_map")}
        reference_config = DintConfig(**fields)
        return plan_reference_diff_to_dint(CheckpointReader(source_dir), reference_config, integral, rotary)
    source_config = AutoConfig.from_pretrained(source_dir)
    reader = CheckpointReader(source_dir)
    if source_format == "llama":
        return plan_llama_to_dint(reader, source_config, integral, head_init, lambda_std_dev, seed)
    if source_format == "diffllama":
        return plan_diffllama_to_dint(reader, source_config, integral)
    return plan_dint_to_diffllama(reader, source_config)


def convert_checkpoint(
    source_dir: str | Path,
    output_dir: str | Path,
    source_format: str = "auto",
    dtype: str | torch.dtype | None = "auto",
    integral: str = "mean",
    head_init: str = "copy",
    lambda_std_dev: float | None = None,
    seed: int = 0,
    rotary: str = "interleaved",
    max_shard_size: int | str = "5GB",
    force: bool = False,
    progress: bool = True,
) -> ConversionPlan:
    """Converts the checkpoint in `source_dir` and writes it to `output_dir`, loadable with `from_pretrained`.

    The output holds the config (and, for DINT, the remote-code files that `save_pretrained` writes), the weights as
    safetensors (sharded above `max_shard_size`), and the source's tokenizer files and generation config. It is built
    in a temporary folder next to `output_dir` and renamed into place at the end: a failed run leaves nothing.

    Args:
        source_dir: a `save_pretrained` folder (safetensors, or `.bin` read with `weights_only=True`).
        output_dir: where to write; must not exist unless `force`.
        source_format: `"auto"` (from config.json's model_type) or one of `SOURCE_FORMATS`.
        dtype: `"auto"` (the source's), `"float32"`, `"float16"` or `"bfloat16"`. The lambda vectors stay fp32.
        integral: the DINT model's integral mode (ignored for DINT -> DiffLlama).
        head_init: Llama-family sources: `"copy"` or `"duplicate"`.
        lambda_std_dev: Llama-family sources: std of the new lambda vectors (default 0.1).
        seed: Llama-family sources: seed of the new lambda vectors.
        rotary: reference-diff sources: `"interleaved"` (the reference code's RoPE) or `"half"`.
        max_shard_size: largest shard, e.g. `"5GB"`.
        force: replace an existing `output_dir`.
        progress: show a progress bar, one step per tensor.

    Returns:
        The `ConversionPlan` that was written (its `config` is the output config).
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not force:
        raise FileExistsError(
            f"Output directory {str(output_dir)!r} already exists: pass --force (force=True) to replace it."
        )
    plan = plan_conversion(source_dir, source_format, integral, head_init, lambda_std_dev, seed, rotary)
    reader_dtype = resolve_dtype(dtype, CheckpointReader(source_dir))
    plan.config.dtype = str(reader_dtype).removeprefix("torch.")
    with torch.device("meta"):
        reference_model = plan.model_class(plan.config)
    expected_shapes = {name: tuple(tensor.shape) for name, tensor in reference_model.state_dict().items()}
    if plan.config.tie_word_embeddings:
        expected_shapes.pop("lm_head.weight", None)
    _check_names(plan, expected_shapes)
    keep_in_fp32 = tuple(getattr(plan.model_class, "_keep_in_fp32_modules_strict", None) or ())
    with atomic_output_dir(output_dir, force=force) as staging:
        # Config, generation config and (for DINT) the remote-code files, exactly as `save_pretrained` writes them;
        # first, because `save_pretrained` removes weight files it did not write itself.
        reference_model.to(reader_dtype).save_pretrained(staging, state_dict={})
        copy_tokenizer_and_generation_files(source_dir, staging)
        writer = ShardedSafetensorsWriter(staging, max_shard_size)
        for name, compute in tqdm(plan.tensors.items(), desc="Converting tensors", unit="tensor", disable=not progress):
            tensor = compute()
            if tuple(tensor.shape) != expected_shapes[name]:
                raise ValueError(
                    f"Converted tensor {name!r} has shape {tuple(tensor.shape)}, but the target model expects "
                    f"{expected_shapes[name]}: the source config does not match its weights."
                )
            if tensor.is_floating_point():
                keep_fp32 = any(part in name.split(".") for part in keep_in_fp32)
                tensor = tensor.to(torch.float32 if keep_fp32 else reader_dtype)
            writer.add(name, tensor)
        writer.close()
    for note in plan.notes:
        logger.info(note)
    return plan


def _check_names(plan: ConversionPlan, expected_shapes: dict[str, tuple]) -> None:
    """Every target weight is planned, and nothing else (an unknown source tensor means an unsupported layout)."""
    planned, expected = set(plan.tensors), set(expected_shapes)
    if planned != expected:
        unexpected, missing = sorted(planned - expected), sorted(expected - planned)
        raise ValueError(
            f"The source checkpoint does not match a {plan.model_class.__name__}: "
            f"{len(unexpected)} unexpected tensors {unexpected[:8]}, {len(missing)} missing tensors {missing[:8]}. "
            f"Unsupported architecture or layout (e.g. a base model without the 'model.' prefix, extra norms)."
        )
