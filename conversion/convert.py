# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""`convert_checkpoint`: one checkpoint folder in, one converted `save_pretrained`-style folder out.

Source formats:
- `llama` (model_type llama, mistral or qwen2) -> DINT: v1 (`head_init="copy"` or `"duplicate"`) or, with
  `differential_attention="v2"`, DIFF V2's layout at the source's KV cache and function (see `llama.py`); a source
  that attends within a sliding window only with `accept_sliding_window_difference`;
- `diffllama` -> DINT (see `diffllama.py`);
- `dint` -> DiffLlama, for a DINT model with `integral="none"` (see `diffllama.py`);
- `reference-diff`: Microsoft's reference Diff-Transformer layout -> DINT (see `reference.py`); never auto-detected;
- `reference-diff-v2`: Microsoft's DIFF V2 attention (`MultiheadFlashDiffV2`) -> DINT v2 (see `reference_v2.py`);
  never auto-detected.
"""

import contextlib
import logging
import re
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
    meta_tensor,
    read_config_json,
    resolve_dtype,
)
from .diffllama import plan_diffllama_to_dint, plan_dint_to_diffllama
from .llama import LLAMA_FAMILY_MODEL_TYPES, plan_llama_to_dint
from .plan import ConversionPlan, attention_sizes
from .reference import plan_reference_diff_to_dint
from .reference_v2 import plan_reference_diff_v2_to_dint


logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ConversionOptions:
    """The choices of a conversion, the keyword arguments `**options` of `plan_conversion` and `convert_checkpoint`
    (and the CLI's options of the same names). Each planner reads its own.

    Attributes:
        integral: the DINT model's integral mode (ignored for DINT -> DiffLlama).
        head_init: Llama-family sources to v1: `"copy"` (None means it) or `"duplicate"`.
        lambda_std_dev: Llama-family sources to v1: std of the new lambda vectors (None: 0.1).
        seed: Llama-family sources: seed of the new lambda vectors (v1) or `lambda_proj` (v2).
        rotary: reference-diff and reference-diff-v2 sources: `"interleaved"` (the reference code's RoPE) or
            `"half"`.
        differential_attention: Llama-family sources: the DINT head layout, `"v1"` (None means it) or `"v2"` (DIFF
            V2's, at the source's KV cache, starting at the source's function with `lambda_gate` at 0). Other
            sources convert to their own layout (None, or that layout).
        accept_sliding_window_difference: Llama-family sources that attend within a sliding window (Mistral's
            `sliding_window`, Qwen2's `use_sliding_window`): convert them although DINT attends to the whole causal
            prefix (the logits then equal the source's only up to the window's length); without it they are refused.
    """

    integral: str = "mean"
    head_init: str | None = None
    lambda_std_dev: float | None = None
    seed: int = 0
    rotary: str = "interleaved"
    differential_attention: str | None = None
    accept_sliding_window_difference: bool = False


def _plan_llama(source: CheckpointReader, source_config, options: ConversionOptions) -> ConversionPlan:
    return plan_llama_to_dint(
        source, source_config, options.integral, options.head_init, options.lambda_std_dev, options.seed,
        options.differential_attention or "v1", options.accept_sliding_window_difference,
    )


def _plan_diffllama(source: CheckpointReader, source_config, options: ConversionOptions) -> ConversionPlan:
    _refuse_another_layout("diffllama", "v1", options)
    return plan_diffllama_to_dint(source, source_config, options.integral)


def _plan_dint(source: CheckpointReader, source_config, options: ConversionOptions) -> ConversionPlan:
    if options.differential_attention is not None:
        raise ValueError(
            "`differential_attention` chooses the head layout of a DINT model converted from Llama-family sources; a "
            "DINT model converts to DiffLlama, whose layout is fixed. Leave it unset."
        )
    return plan_dint_to_diffllama(source, source_config)


def _plan_reference_diff(source: CheckpointReader, source_config, options: ConversionOptions) -> ConversionPlan:
    _refuse_another_layout("reference-diff", "v1", options)
    return plan_reference_diff_to_dint(source, source_config, options.integral, options.rotary)


def _plan_reference_diff_v2(source: CheckpointReader, source_config, options: ConversionOptions) -> ConversionPlan:
    _refuse_another_layout("reference-diff-v2", "v2", options)
    return plan_reference_diff_v2_to_dint(source, source_config, options.integral, options.rotary)


def _refuse_another_layout(source_format: str, layout: str, options: ConversionOptions) -> None:
    """A source format whose head layout is fixed converts to that layout only."""
    if options.differential_attention not in (None, layout):
        raise ValueError(
            f"A {source_format!r} source converts to differential_attention={layout!r} (its own head layout), got "
            f"differential_attention={options.differential_attention!r}. Only Llama-family sources choose the layout."
        )


PLANNERS = {
    "llama": _plan_llama,
    "diffllama": _plan_diffllama,
    "dint": _plan_dint,
    "reference-diff": _plan_reference_diff,
    "reference-diff-v2": _plan_reference_diff_v2,
}
"""Source format -> planner `(CheckpointReader of the source folder, source config, ConversionOptions) ->
ConversionPlan`; a new source format is one more entry."""

SOURCE_FORMATS = ("auto", *PLANNERS)

LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
"""The decoder-layer prefix that every source format's tensor names share."""

SHAPES_FROM_CONFIG = {
    "model.embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "model.norm.weight": ("hidden_size",),
    "model.layers.{}.input_layernorm.weight": ("hidden_size",),
    "model.layers.{}.post_attention_layernorm.weight": ("hidden_size",),
    "model.layers.{}.self_attn.q_proj.weight": ("num_attention_heads * head_dim", "hidden_size"),
    "model.layers.{}.self_attn.k_proj.weight": ("num_key_value_heads * head_dim", "hidden_size"),
    "model.layers.{}.self_attn.v_proj.weight": ("num_key_value_heads * head_dim", "hidden_size"),
    "model.layers.{}.mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "model.layers.{}.mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "model.layers.{}.mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
}
"""Tensors that every source format names alike (Llama's names; `{}` is a layer index), with their shapes in the
source config's sizes: what `check_source_matches_config` compares before anything is planned or built."""


def load_source_config(source_dir: Path, source_format: str):
    """The source config: transformers' config class for its `model_type` (a `DintConfig` of the reference model's
    dimensions for `reference-diff` and `reference-diff-v2`, which have no config class of their own; v2's is a v2
    `DintConfig`: `num_attention_heads` = 2h query heads, `head_dim` defaulting to `hidden_size / h` as Microsoft's).

    Raises:
        ValueError: a config.json that is not a JSON object or fails its config class's validation, naming the file.
    """
    config_file = source_dir / "config.json"
    fields = read_config_json(source_dir)
    try:
        if source_format in ("reference-diff", "reference-diff-v2"):
            fields = {key: value for key, value in fields.items()
                      if key not in ("model_type", "architectures", "auto_map")}
            if source_format == "reference-diff-v2":
                fields.setdefault("differential_attention", "v2")
            return DintConfig(**fields)
        return AutoConfig.from_pretrained(source_dir)
    except StrictDataclassError as error:  # a config validator's error, wrapped over several lines
        reason = error.__cause__ or error
        raise ValueError(f"Invalid config {str(config_file)!r}: {' '.join(str(reason).split())}") from error
    except ArithmeticError as error:  # transformers 5.24's Llama validator divides by num_attention_heads first
        raise ValueError(f"Invalid config {str(config_file)!r}: {error} (a size of 0?)") from error


def check_source_matches_config(source: CheckpointReader, source_config, config_file: Path) -> None:
    """The checkpoint holds the layers its config counts and the sizes it names (`SHAPES_FROM_CONFIG`), compared on
    names and shapes alone (nothing is read) before anything is planned or built: a config that claims 10**6 layers
    or a hidden size its tensors do not have is refused at once, not after building a model of that size.

    Raises:
        ValueError: naming the config file, the field and the tensor that disagree.
    """
    num_layers = source_config.num_hidden_layers
    layers = sorted({int(found[1]) for name in source.keys() if (found := LAYER_NAME.match(name))})
    if len(layers) != num_layers or (layers and layers[-1] != num_layers - 1):  # sorted, distinct, >= 0: 0..L-1
        held = f"layers {layers[0]} to {layers[-1]} ({len(layers)} layers)" if layers else "no layer tensors"
        raise ValueError(
            f"{str(config_file)!r} says num_hidden_layers={num_layers}, but the checkpoint {str(source.path)!r} holds "
            f"{held}: the config does not match its weights."
        )
    num_heads, num_kv_heads, head_dim = attention_sizes(source_config)
    sizes = {
        "vocab_size": source_config.vocab_size,
        "hidden_size": source_config.hidden_size,
        "intermediate_size": source_config.intermediate_size,
        "num_attention_heads * head_dim": num_heads * head_dim,
        "num_key_value_heads * head_dim": num_kv_heads * head_dim,
    }
    for template, fields in SHAPES_FROM_CONFIG.items():
        for name in dict.fromkeys(template.format(layer_idx) for layer_idx in range(num_layers)):
            if name not in source:
                continue  # the planner and the target's names decide what must be there
            shape = tuple(meta_tensor(source, name).shape)
            expected = tuple(sizes[field] for field in fields)
            if shape != expected:
                raise ValueError(
                    f"Tensor {name!r} has shape {shape}, but {str(config_file)!r} gives ({', '.join(fields)}) = "
                    f"{expected}: the config does not match its weights."
                )


def detect_source_format(source_dir: str | Path) -> str:
    """The converter for a checkpoint folder, from its config.json's `model_type`.

    Raises:
        FileNotFoundError: `source_dir` does not exist.
        ValueError: no config.json, or a `model_type` no converter supports.
    """
    config_file = existing_source_dir(source_dir) / "config.json"
    model_type = read_config_json(source_dir).get("model_type")
    if model_type in LLAMA_FAMILY_MODEL_TYPES:
        return "llama"
    if model_type in ("diffllama", "dint"):
        return model_type
    raise ValueError(
        f"Unsupported architecture: model_type={model_type!r} in {str(config_file)!r}. Supported: "
        f"{LLAMA_FAMILY_MODEL_TYPES} (-> DINT), 'diffllama' (-> DINT), 'dint' (-> DiffLlama), and Microsoft's "
        f"reference Diff-Transformer layout with --source-format reference-diff (its DIFF V2 attention: "
        f"--source-format reference-diff-v2)."
    )


def plan_conversion(source_dir: str | Path, source_format: str = "auto", **options) -> ConversionPlan:
    """Reads the source config, checks the checkpoint against it (`check_source_matches_config`), and plans the
    conversion (no tensor is computed yet; `plan.source` is the one `CheckpointReader` of the source folder).

    Args:
        source_dir: a `save_pretrained` folder (safetensors, or `.bin` read with `weights_only=True`).
        source_format: `"auto"` (from config.json's model_type) or one of `SOURCE_FORMATS`.
        **options: the conversion's choices by name, the fields of `ConversionOptions` (`integral`, `head_init`,
            `seed`, `differential_attention`, ...), each with its default there.

    Raises:
        FileNotFoundError: `source_dir` does not exist.
        ValueError: an unsupported source, a config that fails validation (source or converted), a checkpoint
            whose layers or sizes are not those of its config, or a conversion its planner refuses.
        TypeError: an option that `ConversionOptions` does not have, named.
    """
    options = ConversionOptions(**options)
    if source_format not in SOURCE_FORMATS:
        raise ValueError(f"`source_format` must be one of {SOURCE_FORMATS}, got {source_format!r}.")
    source_dir = existing_source_dir(source_dir)
    if source_format == "auto":
        source_format = detect_source_format(source_dir)
    source_config = load_source_config(source_dir, source_format)
    source = CheckpointReader(source_dir)
    check_source_matches_config(source, source_config, source_dir / "config.json")
    try:
        return PLANNERS[source_format](source, source_config, options)
    except StrictDataclassError as error:  # the converted config's validator, wrapped over several lines
        reason = " ".join(str(error.__cause__ or error).split())
        raise ValueError(f"Invalid converted config for {str(source_dir)!r}: {reason}") from error


def convert_checkpoint(
    source_dir: str | Path,
    output_dir: str | Path,
    source_format: str = "auto",
    dtype: str | torch.dtype | None = "auto",
    max_shard_size: int | str = "5GB",
    force: bool = False,
    progress: bool = True,
    **options,
) -> ConversionPlan:
    """Converts the checkpoint in `source_dir` and writes it to `output_dir`, loadable with `from_pretrained`.

    The output holds the config (and, for DINT, the remote-code files that `save_pretrained` writes), the weights as
    safetensors (sharded above `max_shard_size`), and the source's tokenizer files and generation config. It is built
    in a hidden folder next to `output_dir` and renamed into place at the end: a failed run leaves nothing (see
    `atomic_output_dir`).

    Args:
        source_dir: a `save_pretrained` folder (safetensors, or `.bin` read with `weights_only=True`).
        output_dir: where to write; must not exist unless `force`, and must not be a file, nor be, contain or lie
            inside `source_dir`. Hidden folders that a killed earlier run left next to it are removed first.
        source_format: `"auto"` (from config.json's model_type) or one of `SOURCE_FORMATS`.
        dtype: `"auto"` (the source's), `"float32"`, `"float16"` or `"bfloat16"`. The lambda vectors stay fp32.
        max_shard_size: largest shard, e.g. `"5GB"`.
        force: replace an existing `output_dir` folder.
        progress: show a progress bar, one step per tensor.
        **options: the conversion's choices by name, the fields of `ConversionOptions` (`integral`, `head_init`,
            `lambda_std_dev`, `seed`, `rotary`, `differential_attention`, `accept_sliding_window_difference`), each
            with its meaning and default there.

    Returns:
        The `ConversionPlan` that was written (its `config` is the output config; its `outcome` says what the
        converted model computes against the source).

    Raises:
        ValueError: an unsupported or unreadable source, a config that fails validation, a conversion its planner
            refuses (e.g. a sliding-window source without `accept_sliding_window_difference`), or an output that is,
            contains or lies inside the source.
        FileNotFoundError: `source_dir` does not exist.
        FileExistsError: `output_dir` is a file, or a folder and not `force`.
        OSError: the output cannot be written.
        TypeError: an option that `ConversionOptions` does not have, named.
    """
    plan = plan_conversion(source_dir, source_format, **options)
    reader_dtype = resolve_dtype(dtype, plan.source)
    plan.config.dtype = str(reader_dtype).removeprefix("torch.")
    with torch.device("meta"):
        reference_model = plan.model_class(plan.config)
    expected = dict(reference_model.state_dict())
    if plan.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    check_plan(plan, expected)
    keep_in_fp32 = tuple(getattr(reference_model, "_keep_in_fp32_modules_strict", None) or ())  # per layout
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


def check_plan(plan: ConversionPlan, expected: dict[str, torch.Tensor]) -> None:
    """Before anything is written: every weight of the target model (`expected`, name -> its tensor on the meta
    device) is planned, and nothing else; every planned tensor, computed on the meta device from the source tensors'
    shapes and dtypes alone, has the target's shape; and a floating-point weight is computed from floating-point
    source tensors only.

    Integer source tensors in floating-point weights are refused, with `--dtype auto` and any other dtype: such a
    weight is quantized (its scales and zero points are not read here) or not a weight at all, and casting it would
    write a model that loads and computes nonsense without an error.

    Raises:
        ValueError: naming the tensor and what is wrong with it.
    """
    planned = set(plan.tensors)
    if planned != set(expected):
        unexpected, missing = sorted(planned - set(expected)), sorted(set(expected) - planned)
        raise ValueError(
            f"The source checkpoint does not match a {plan.model_class.__name__}: "
            f"{len(unexpected)} unexpected tensors {unexpected[:8]}, {len(missing)} missing tensors {missing[:8]}. "
            f"Unsupported architecture or layout (e.g. a base model without the 'model.' prefix, extra norms)."
        )
    for name, recipe in plan.tensors.items():
        inputs = [meta_tensor(recipe.source, source_name) for source_name in recipe.source_names]
        if expected[name].is_floating_point():
            integer = {n: str(t.dtype) for n, t in zip(recipe.source_names, inputs) if not t.is_floating_point()}
            if integer:
                raise ValueError(
                    f"Cannot convert {name!r}: the source tensors {integer} are not floating point. The converter "
                    "does not cast integer tensors into floating-point weights (quantized weights need their scales "
                    "and zero points); dequantize the checkpoint first."
                )
        try:
            shape = tuple(recipe.function(*inputs, **recipe.options).shape)
        except (RuntimeError, IndexError) as error:  # e.g. a reshape that the source tensor's size does not allow
            raise ValueError(
                f"Cannot convert {name!r} from the source tensors {list(recipe.source_names)} "
                f"{[tuple(t.shape) for t in inputs]}: {str(error).splitlines()[0]}. The source config does not match "
                "its weights."
            ) from error
        if shape != tuple(expected[name].shape):
            raise ValueError(
                f"Converted tensor {name!r} has shape {shape}, but the target model expects "
                f"{tuple(expected[name].shape)}: the source config does not match its weights."
            )
