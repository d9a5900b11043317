# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Reading and writing checkpoint folders for the converters: lazy tensor access, sharded safetensors, atomic output.

Reading: a folder with `model.safetensors`, sharded safetensors (`model.safetensors.index.json`), `pytorch_model.bin`
or sharded `.bin` (`pytorch_model.bin.index.json`); or one weights file (`.safetensors`, `.bin`, `.pt`, `.pth`).
`.bin`/`.pt` files load with `torch.load(weights_only=True)`, so a checkpoint can never run code.

Writing: `ShardedSafetensorsWriter` streams tensors into shards of at most `max_shard_size` bytes, named as
`save_pretrained` names them. `atomic_output_dir` refuses an output that would replace the source or an existing
folder (without `force`), builds the output in a hidden folder next to the target and renames it into place only
when everything succeeded: a failed run leaves nothing behind, and a killed run's hidden folders are removed by the
next run for the same output.
"""

import contextlib
import errno
import json
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
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
            try:
                handle = safe_open(str(weights_file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as error:
                raise ValueError(
                    f"Cannot read {str(weights_file)!r}: not a complete safetensors file (truncated or corrupted?): "
                    f"{_one_line(error)}"
                ) from error
            self._open_safetensors[weights_file] = handle
        return self._open_safetensors[weights_file]

    def _bin_state_dict(self, weights_file: Path) -> dict:
        if self._loaded_bin is None or self._loaded_bin[0] != weights_file:
            state_dict = _load_weights_only(weights_file)
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
        weights_file = self._file_of(key)
        if weights_file.suffix == ".safetensors":
            return self._safetensors_handle(weights_file).get_tensor(key)
        return self._bin_state_dict(weights_file)[key]

    def get_meta(self, key: str) -> torch.Tensor:
        """The tensor named `key` on the meta device: its shape and stored dtype, read from the safetensors header
        (an empty slice carries the dtype and reads no data) or the memory-mapped `.bin` shard."""
        weights_file = self._file_of(key)
        if weights_file.suffix == ".safetensors":
            tensor_slice = self._safetensors_handle(weights_file).get_slice(key)
            shape = tensor_slice.get_shape()
            stored = tensor_slice[:0] if shape else self.get(key)  # a 0-d tensor cannot be sliced: one number read
            return torch.empty(shape, dtype=stored.dtype, device="meta")
        return self._bin_state_dict(weights_file)[key].to("meta")

    def _file_of(self, key: str) -> Path:
        if key not in self._key_to_file:
            raise KeyError(f"Tensor {key!r} is missing from the checkpoint {str(self.path)!r}.")
        return self._key_to_file[key]


def meta_tensor(source, key: str) -> torch.Tensor:
    """Tensor `key` of `source` (a state dict or a `CheckpointReader`) on the meta device: shape and dtype only."""
    if isinstance(source, CheckpointReader):
        return source.get_meta(key)
    return source[key].to("meta")


def floating_dtype(source) -> torch.dtype:
    """The dtype of the first floating-point tensor of `source` (a state dict or a `CheckpointReader`)."""
    for key in source.keys():
        tensor = meta_tensor(source, key)
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def read_config_json(source_dir: str | os.PathLike) -> dict:
    """The fields of `source_dir`'s config.json.

    Raises:
        ValueError: no config.json, or one that is not a JSON object; the message names the file.
    """
    config_file = Path(source_dir) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"No config.json in {str(source_dir)!r}: cannot tell the source architecture.")
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"Invalid {str(config_file)!r}: not valid JSON ({error}).") from error
    if not isinstance(fields, dict):
        raise ValueError(f"Invalid {str(config_file)!r}: expected a JSON object of config fields, got a "
                         f"{type(fields).__name__}.")
    return fields


def _load_weights_only(weights_file: Path) -> object:
    """`torch.load(weights_only=True)` of a `.bin`/`.pt` file, memory-mapped where its format allows; a file that
    holds anything but tensors and plain containers, or is not a complete torch file, is a one-line `ValueError`."""
    try:
        try:
            return torch.load(weights_file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # files in torch's legacy (non-zip) format cannot be memory-mapped
            return torch.load(weights_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = [line.strip() for line in str(error).splitlines() if "Unsupported global" in line]
        raise ValueError(
            f"Weights only load failed for {str(weights_file)!r}: it holds objects other than tensors, and the "
            f"converter never runs code from a checkpoint ({refused[0] if refused else _one_line(error)}). Save its "
            f"state dict as safetensors where you trust it."
        ) from error
    except (RuntimeError, EOFError, OSError) as error:
        raise ValueError(
            f"Cannot read {str(weights_file)!r}: not a complete PyTorch checkpoint (truncated or corrupted?): "
            f"{_one_line(error)}"
        ) from error


def _one_line(error: BaseException) -> str:
    """The first line of an error's message (library messages can run over many lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


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
        try:
            save_file(self._pending, str(shard_path), metadata={"format": "pt"})
        except SafetensorError as error:  # safetensors reports a failed write (a full disk) as its own error
            found = re.search(r"os error (\d+)", str(error))
            number = int(found[1]) if found else errno.EIO
            reason = os.strerror(number) if found else _one_line(error)
            raise OSError(number, reason, str(shard_path)) from error
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


def existing_source_dir(source_dir: str | os.PathLike) -> Path:
    """`source_dir` as a `Path`, once it is known to be a folder.

    Raises:
        FileNotFoundError: nothing is at `source_dir`.
        NotADirectoryError: `source_dir` is a file (the converter reads a folder with config.json and the weights).
    """
    source_dir = Path(source_dir)
    if not source_dir.exists():
        raise FileNotFoundError(f"Source checkpoint {str(source_dir)!r} does not exist.")
    if not source_dir.is_dir():
        raise NotADirectoryError(
            f"Source checkpoint {str(source_dir)!r} is not a folder: expected a folder with config.json and weights."
        )
    return source_dir


def refuse_output_in_source(output_dir: str | os.PathLike, source_dir: str | os.PathLike) -> None:
    """Refuses an output folder that is the source folder, contains it or lies inside it, compared after resolving
    symlinks and relative parts: replacing or writing it would delete or change the source.

    Raises:
        ValueError: naming both folders and how they overlap.
    """
    source, output = Path(source_dir).resolve(), Path(output_dir).resolve()
    if output == source:
        relation = "is"
    elif source.is_relative_to(output):
        relation = "contains"
    elif output.is_relative_to(source):
        relation = "lies inside"
    else:
        return
    raise ValueError(
        f"Output directory {str(output_dir)!r} {relation} the source checkpoint {str(source_dir)!r}: writing it "
        f"would replace or change the source. Choose an output folder outside the source."
    )


STAGING_KINDS = ("staging", "old")
"""The converter's hidden folders next to an output `NAME`: `.NAME.dint-convert-staging-PID-TOKEN` holds the output
being written; `.NAME.dint-convert-old-PID-TOKEN` holds, for a moment, the output that `force` replaces."""


def _staging_name_pattern(output_dir: Path) -> re.Pattern:
    kinds = "|".join(STAGING_KINDS)
    return re.compile(rf"\.{re.escape(output_dir.name)}\.dint-convert-(?P<kind>{kinds})-(?P<pid>\d+)-[0-9a-f]{{8}}")


def _make_staging_dir(output_dir: Path, kind: str) -> Path:
    """A new, empty folder next to `output_dir`, named for `kind` and this process. Plain `mkdir` (not `mkdtemp`'s
    0700), so the folder gets the permissions the umask gives, as `save_pretrained`'s folders do."""
    while True:
        folder = output_dir.parent / f".{output_dir.name}.dint-convert-{kind}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def _process_is_running(pid: int) -> bool:
    """Whether process `pid` (on this machine) still runs; where this cannot be asked, assumed to run."""
    if pid == os.getpid() or os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def remove_leftovers(output_dir: str | os.PathLike) -> list[Path]:
    """Removes the converter's hidden folders for `output_dir` (see `STAGING_KINDS`) that a killed or failed earlier
    run left, and returns them. Only folders with exactly those names, whose process no longer runs, are touched.

    A run killed while replacing an output with `force` leaves the previous output in its `old` folder and nothing
    at `output_dir`: that previous output is moved back to `output_dir` instead of being removed.
    """
    output_dir = Path(output_dir).absolute()
    if not output_dir.parent.is_dir():
        return []
    pattern = _staging_name_pattern(output_dir)
    removed = []
    for entry in sorted(output_dir.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir() or _process_is_running(int(match["pid"])):
            continue
        previous_output = entry / "old"
        if match["kind"] == "old" and os.path.lexists(previous_output) and not os.path.lexists(output_dir):
            os.rename(previous_output, output_dir)
        shutil.rmtree(entry)
        removed.append(entry)
    return removed


@contextlib.contextmanager
def atomic_output_dir(
    output_dir: str | os.PathLike, force: bool = False, source_dir: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Yields a fresh hidden folder next to `output_dir`; on success it becomes `output_dir`.

    Before anything is written: `refuse_output_in_source` (when `source_dir` is given), `remove_leftovers` of earlier
    runs, and the refusal of an existing `output_dir` without `force`. With `force` an existing `output_dir` is
    replaced only after the new output is complete. On any error the hidden folders are removed and `output_dir` is
    left as it was. A killed run leaves its hidden folders; the next run for the same output removes them.

    Raises:
        ValueError: `output_dir` is, contains or lies inside `source_dir`.
        FileExistsError: `output_dir` is a file (with or without `force`), or a folder and not `force`.
        OSError: the folder next to `output_dir` cannot be written, or a file in it (a full disk): one message
            naming `output_dir` and the reason.
    """
    output_dir = Path(output_dir).absolute()
    if source_dir is not None:
        refuse_output_in_source(output_dir, source_dir)
    remove_leftovers(output_dir)  # first: it may move back the output of a run killed while replacing it
    if os.path.lexists(output_dir) and not output_dir.is_dir():
        raise FileExistsError(
            f"Output path {str(output_dir)!r} is a file, not a folder: choose a folder path (the converter writes a "
            "folder of config.json and weights), or remove the file first; --force replaces a folder, never a file."
        )
    if os.path.lexists(output_dir) and not force:
        raise FileExistsError(
            f"Output directory {str(output_dir)!r} already exists: pass --force (force=True) to replace it."
        )
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = _make_staging_dir(output_dir, "staging")
    except OSError as error:
        raise OSError(f"Cannot write the output directory {str(output_dir)!r}: {error.strerror or error}.") from error
    try:
        try:
            yield staging
        except OSError as error:
            if not _names_a_path_in(error, staging):
                raise
            raise OSError(
                f"Cannot write the output directory {str(output_dir)!r}: {error.strerror or _one_line(error)}. "
                "Nothing was written."
            ) from error
        if os.path.lexists(output_dir):
            _replace(output_dir, staging)
        else:
            os.rename(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _names_a_path_in(error: OSError, folder: Path) -> bool:
    """Whether `error` is about a path inside `folder` (a copy names its source first and its destination second)."""
    return any(isinstance(name, (str, os.PathLike)) and Path(name).absolute().is_relative_to(folder)
               for name in (error.filename, error.filename2))


def _replace(output_dir: Path, staging: Path) -> None:
    """Moves `output_dir` aside, `staging` into its place, then removes the old output; a failed rename puts the
    old output back and leaves no folder of its own."""
    retired = _make_staging_dir(output_dir, "old")
    try:
        os.rename(output_dir, retired / "old")
    except BaseException:
        retired.rmdir()
        raise
    try:
        os.rename(staging, output_dir)
    except BaseException:
        os.rename(retired / "old", output_dir)
        retired.rmdir()
        raise
    shutil.rmtree(retired, ignore_errors=True)


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


def resolve_dtype(dtype: str | torch.dtype | None, source) -> torch.dtype:
    """`None`/`"auto"` keeps the floating dtype of `source` (a state dict or a `CheckpointReader`); otherwise one of
    `DTYPES` (or a torch dtype)."""
    if dtype is None or dtype == "auto":
        return floating_dtype(source)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}.")
    return DTYPES[dtype]
