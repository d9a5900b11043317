# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Reading and writing checkpoint folders for the converters: lazy tensor access, sharded safetensors, atomic output.

Reading: a folder with `model.safetensors`, sharded safetensors (`model.safetensors.index.json`), `pytorch_model.bin`
or sharded `.bin` (`pytorch_model.bin.index.json`); or one weights file (`.safetensors`, `.bin`, `.pt`, `.pth`).
`.bin`/`.pt` files load with `torch.load(weights_only=True)`, so a checkpoint can never run code.

Writing: `ShardedSafetensorsWriter` streams tensors into shards of at most `max_shard_size` bytes, named as
`save_pretrained` names them. `atomic_output_dir` builds the output in a temporary folder next to the target and
renames it into place only when everything succeeded: a failed run leaves nothing behind.
"""

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TORCH_WEIGHTS_NAME = "pytorch_model.bin"
TORCH_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

TOKENIZER_AND_GENERATION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""Files copied verbatim from the source folder to the converted one, when present."""

TOKENIZER_FOLDERS = ("additional_chat_templates",)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The `--dtype` choices besides `auto` (keep the source checkpoint's dtype)."""


class CheckpointReader:
    """Lazy, read-only access to the tensors of a checkpoint (folder or single weights file).

    Safetensors are memory-mapped and read one tensor at a time; `.bin` files are loaded with
    `torch.load(weights_only=True, mmap=True)`, one shard at a time.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._key_to_file: dict[str, Path] = {}
        self._open_safetensors: dict[Path, object] = {}
        self._loaded_bin: tuple[Path, dict] | None = None
        for weights_file in self._weights_files():
            for key in self._keys_of_file(weights_file):
                self._key_to_file[key] = weights_file

    def _weights_files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if not self.path.is_dir():
            raise FileNotFoundError(f"Checkpoint path {str(self.path)!r} does not exist.")
        for index_name in (SAFE_WEIGHTS_INDEX_NAME, TORCH_WEIGHTS_INDEX_NAME):
            index_file = self.path / index_name
            if index_file.is_file():
                weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
                return [self.path / name for name in sorted(set(weight_map.values()))]
        for single_name in (SAFE_WEIGHTS_NAME, TORCH_WEIGHTS_NAME):
            if (self.path / single_name).is_file():
                return [self.path / single_name]
        found = sorted(p.name for p in self.path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        if len(found) == 1:
            return [self.path / found[0]]
        raise FileNotFoundError(
            f"No weights found in {str(self.path)!r}: expected {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, "
            f"{TORCH_WEIGHTS_NAME} or {TORCH_WEIGHTS_INDEX_NAME} (or exactly one .safetensors/.bin/.pt file), "
            f"found {found or 'none'}."
        )

    def _keys_of_file(self, weights_file: Path) -> list[str]:
        if weights_file.suffix == ".safetensors":
            return list(self._safetensors_handle(weights_file).keys())
        return list(self._bin_state_dict(weights_file).keys())

    def _safetensors_handle(self, weights_file: Path):
        if weights_file not in self._open_safetensors:
            self._open_safetensors[weights_file] = safe_open(str(weights_file), framework="pt", device="cpu")
        return self._open_safetensors[weights_file]

    def _bin_state_dict(self, weights_file: Path) -> dict:
        if self._loaded_bin is None or self._loaded_bin[0] != weights_file:
            try:
                state_dict = torch.load(weights_file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # files in torch's legacy (non-zip) format cannot be memory-mapped
                state_dict = torch.load(weights_file, map_location="cpu", weights_only=True)
            if not isinstance(state_dict, dict):
                raise ValueError(f"{str(weights_file)!r} holds a {type(state_dict).__name__}, not a state dict.")
            if "state_dict" in state_dict and isinstance(state_dict["state_dict"], dict):
                state_dict = state_dict["state_dict"]
            elif "model" in state_dict and isinstance(state_dict["model"], dict):
                state_dict = state_dict["model"]
            self._loaded_bin = (weights_file, state_dict)
        return self._loaded_bin[1]

    def keys(self) -> list[str]:
        return list(self._key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self._key_to_file

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get(key)

    def get(self, key: str) -> torch.Tensor:
        """The tensor named `key`, on CPU, in its stored dtype."""
        if key not in self._key_to_file:
            raise KeyError(f"Tensor {key!r} is missing from the checkpoint {str(self.path)!r}.")
        weights_file = self._key_to_file[key]
        if weights_file.suffix == ".safetensors":
            return self._safetensors_handle(weights_file).get_tensor(key)
        return self._bin_state_dict(weights_file)[key]

    def floating_dtype(self) -> torch.dtype:
        """The dtype of the first floating-point tensor (what `--dtype auto` keeps)."""
        for key in self._key_to_file:
            tensor = self.get(key)
            if tensor.is_floating_point():
                return tensor.dtype
        return torch.float32


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string such as `"5GB"`, `"500MB"`, `"2GiB"` (decimal and binary units)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", size, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"`max_shard_size` must be bytes or a size such as '5GB' or '500MiB', got {size!r}.")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    powers = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    powers.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    return int(number * powers[unit])


class ShardedSafetensorsWriter:
    """Streams named tensors into safetensors shards of at most `max_shard_size` bytes (one oversized tensor gets a
    shard of its own). `close()` names them like `save_pretrained`: `model.safetensors` for one shard, else
    `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`.
    """

    def __init__(self, folder: str | os.PathLike, max_shard_size: int | str = "5GB"):
        self.folder = Path(folder)
        self.max_shard_size = parse_size(max_shard_size)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written_shards: list[tuple[Path, list[str]]] = []
        self.total_size = 0
        self.total_parameters = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in keys for _, keys in self._written_shards):
            raise ValueError(f"Tensor {name!r} was written twice.")
        # A fresh, contiguous copy: safetensors refuses views that share storage.
        tensor = tensor.detach().to("cpu").contiguous().clone()
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_size:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_size += size
        self.total_parameters += tensor.numel()

    def _flush(self) -> None:
        shard_path = self.folder / f".shard-{len(self._written_shards):05d}.safetensors"
        save_file(self._pending, str(shard_path), metadata={"format": "pt"})
        self._written_shards.append((shard_path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Writes the last shard and the index; returns the weight file names."""
        if self._pending or not self._written_shards:
            self._flush()
        count = len(self._written_shards)
        if count == 1:
            self._written_shards[0][0].rename(self.folder / SAFE_WEIGHTS_NAME)
            return [SAFE_WEIGHTS_NAME]
        weight_map, names = {}, []
        for shard_index, (shard_path, keys) in enumerate(self._written_shards):
            name = f"model-{shard_index + 1:05d}-of-{count:05d}.safetensors"
            shard_path.rename(self.folder / name)
            names.append(name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {
            "metadata": {"total_size": self.total_size, "total_parameters": self.total_parameters},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return names


@contextlib.contextmanager
def atomic_output_dir(output_dir: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yields a fresh temporary folder next to `output_dir`; on success it becomes `output_dir`.

    An existing `output_dir` is an error unless `force`; with `force` it is replaced only after the new output is
    complete. On any error the temporary folder is removed and `output_dir` is left as it was.
    """
    output_dir = Path(output_dir).absolute()
    if output_dir.exists() and not force:
        raise FileExistsError(
            f"Output directory {str(output_dir)!r} already exists: pass --force (force=True) to replace it."
        )
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        yield staging
        if output_dir.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
            os.rename(output_dir, retired / "old")
            os.rename(staging, output_dir)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def copy_tokenizer_and_generation_files(source_dir: str | os.PathLike, output_dir: str | os.PathLike) -> list[str]:
    """Copies the tokenizer files and `generation_config.json` that exist in `source_dir`; returns their names."""
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    if not source_dir.is_dir():
        return []
    copied = []
    for name in TOKENIZER_AND_GENERATION_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, output_dir / name)
            copied.append(name)
    for name in TOKENIZER_FOLDERS:
        if (source_dir / name).is_dir():
            shutil.copytree(source_dir / name, output_dir / name)
            copied.append(name)
    return copied


def resolve_dtype(dtype: str | torch.dtype | None, reader: CheckpointReader) -> torch.dtype:
    """`None`/`"auto"` keeps the source's floating dtype; otherwise one of `DTYPES` (or a torch dtype)."""
    if dtype is None or dtype == "auto":
        return reader.floating_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}.")
    return DTYPES[dtype]
