# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""`convert_checkpoint`: one checkpoint folder in, one converted `save_pretrained`-style folder out.

Source formats:
- `llama` (model_type llama, mistral or qwen2) -> DINT (`head_init="copy"` or `"duplicate"`, see `llama.py`);
- `diffllama` -> DINT (see `diffllama.py`);
- `dint` -> DiffLlama, for a DINT model with `integral="none"` (see `diffllama.py`);
- `reference-diff`: Microsoft's reference Diff-Transformer layout -> DINT (see `reference.py`); never auto-detected.
"""

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from tqdm.auto import tqdm
from transformers import AutoConfig
from transformers.utils import logging as transformers_logging

from modeling_dint import DintConfig

from .checkpoint import (
    CheckpointReader,
    ShardedSafetensorsWriter,
    atomic_output_dir,
    copy_tokenizer_and_generation_files,
    existing_source_dir,
    resolve_dtype,
)
from .diffllama import plan_diffllama_to_dint, plan_dint_to_diffllama
from .llama import LLAMA_FAMILY_MODEL_TYPES, plan_llama_to_dint
from .plan import ConversionPlan
from .reference import plan_reference_diff_to_dint


logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ConversionOptions:
    """The choices a planner may read (each reads its own; see `convert_checkpoint` for their meaning)."""

    integral: str = "mean"
    head_init: str = "copy"
    lambda_std_dev: float | None = None
    seed: int = 0
    rotary: str = "interleaved"


def _plan_llama(source: CheckpointReader, options: ConversionOptions) -> ConversionPlan:
    source_config = AutoConfig.from_pretrained(source.path)
    return plan_llama_to_dint(
        source, source_config, options.integral, options.head_init, options.lambda_std_dev, options.seed
    )


def _plan_diffllama(source: CheckpointReader, options: ConversionOptions) -> ConversionPlan:
    return plan_diffllama_to_dint(source, AutoConfig.from_pretrained(source.path), options.integral)


def _plan_dint(source: CheckpointReader, options: ConversionOptions) -> ConversionPlan:
    return plan_dint_to_diffllama(source, AutoConfig.from_pretrained(source.path))


def _plan_reference_diff(source: CheckpointReader, options: ConversionOptions) -> ConversionPlan:
    # The reference layout has no config class of its own: its dimensions are read as a DintConfig.
    fields = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
    fields = {key: value for key, value in fields.items() if key not in ("model_type", "architectures", "auto_map")}
    return plan_reference_diff_to_dint(source, DintConfig(**fields), options.integral, options.rotary)


PLANNERS = {"llama": _plan_llama, "diffllama": _plan_diffllama, "dint": _plan_dint, "reference-diff": _plan_reference_diff}
"""Source format -> planner `(CheckpointReader of the source folder, ConversionOptions) -> ConversionPlan`; a new
source format is one more entry."""

SOURCE_FORMATS = ("auto", *PLANNERS)


def detect_source_format(source_dir: str | Path) -> str:
    """The converter for a checkpoint folder, from its config.json's `model_type`.

    Raises:
        FileNotFoundError: `source_dir` does not exist.
        ValueError: no config.json, or a `model_type` no converter supports.
    """
    config_file = existing_source_dir(source_dir) / "config.json"
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
    """Reads the source config, checks it, and plans the conversion (no tensor is computed yet; `plan.source` is
    the one `CheckpointReader` of the source folder).

    Raises:
        FileNotFoundError: `source_dir` does not exist.
        ValueError: an unsupported source, or a config that fails validation (source or converted).
    """
    if source_format not in SOURCE_FORMATS:
        raise ValueError(f"`source_format` must be one of {SOURCE_FORMATS}, got {source_format!r}.")
    source_dir = existing_source_dir(source_dir)
    if source_format == "auto":
        source_format = detect_source_format(source_dir)
    options = ConversionOptions(integral, head_init, lambda_std_dev, seed, rotary)
    try:
        return PLANNERS[source_format](CheckpointReader(source_dir), options)
    except StrictDataclassError as error:  # a config validator's error, wrapped over several lines
        reason = error.__cause__ or error
        raise ValueError(f"Invalid config converting {str(source_dir)!r}: {' '.join(str(reason).split())}") from error


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
    in a hidden folder next to `output_dir` and renamed into place at the end: a failed run leaves nothing (see
    `atomic_output_dir`).

    Args:
        source_dir: a `save_pretrained` folder (safetensors, or `.bin` read with `weights_only=True`).
        output_dir: where to write; must not exist unless `force`, and must not be, contain or lie inside
            `source_dir`. Hidden folders that a killed earlier run left next to it are removed first.
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

    Raises:
        ValueError: an unsupported or unreadable source, a config that fails validation, or an output that is,
            contains or lies inside the source.
        FileNotFoundError: `source_dir` does not exist.
        FileExistsError: `output_dir` exists and not `force`.
        OSError: the output cannot be written.
    """
    plan = plan_conversion(source_dir, source_format, integral, head_init, lambda_std_dev, seed, rotary)
    reader_dtype = resolve_dtype(dtype, plan.source)
    plan.config.dtype = str(reader_dtype).removeprefix("torch.")
    with torch.device("meta"):
        reference_model = plan.model_class(plan.config)
    expected_shapes = {name: tuple(tensor.shape) for name, tensor in reference_model.state_dict().items()}
    if plan.config.tie_word_embeddings:
        expected_shapes.pop("lm_head.weight", None)
    _check_names(plan, expected_shapes)
    keep_in_fp32 = tuple(getattr(plan.model_class, "_keep_in_fp32_modules_strict", None) or ())
    with atomic_output_dir(output_dir, force=force, source_dir=source_dir) as staging:
        # Config, generation config and (for DINT) the remote-code files, exactly as `save_pretrained` writes them;
        # first, because `save_pretrained` removes weight files it did not write itself. Its progress bar would
        # count zero shards: off.
        with _transformers_progress_bar_off():
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


@contextlib.contextmanager
def _transformers_progress_bar_off():
    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


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
