# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""What moved between the transformers releases DINT supports (every 5.x from 5.5), bridged in one place.

This file travels with the remote code (`save_pretrained` copies it beside `modeling_dint.py`), so a checkpoint loads
with `trust_remote_code=True` on whatever supported transformers a machine has. Each bridge names the releases it
serves: when the floor passes them, delete the bridge and import the transformers name directly.

Importing this module first checks the installed release: below the floor, the package and the remote code fail at
once with `UnsupportedTransformersError`, naming the installed and the minimum version and how to upgrade, instead
of an ImportError from inside transformers. It imports only `transformers`' top level and `packaging` before that
check, so it runs on any transformers.
"""

import functools
import inspect

import torch
import transformers
from packaging.version import Version


MINIMUM_TRANSFORMERS_VERSION = "5.5.0"
"""The oldest transformers release DINT runs on (`setup.py`'s `install_requires` states the same bound)."""

TESTED_TRANSFORMERS_VERSIONS = ("5.5.4", "5.10.4", "5.17.0", "5.20.2", "5.23.0", "5.24.0")
"""The releases `.ci/transformers_matrix.py --full` runs the remote code and the core test suite on."""


class UnsupportedTransformersError(ImportError):
    """The installed transformers is older than `MINIMUM_TRANSFORMERS_VERSION`."""


def _installed_release() -> tuple[int, ...]:
    """The installed transformers release as numbers, e.g. (5, 5, 4) (a `.dev0` suffix is dropped)."""
    return Version(transformers.__version__).release


def check_transformers_version(installed: str | None = None) -> None:
    """Raises `UnsupportedTransformersError` if `installed` (default: the installed transformers) is below the floor."""
    installed = transformers.__version__ if installed is None else installed
    if Version(installed).release < Version(MINIMUM_TRANSFORMERS_VERSION).release:
        raise UnsupportedTransformersError(
            f"DINT needs transformers >= {MINIMUM_TRANSFORMERS_VERSION}, but transformers {installed} is installed. "
            f'Upgrade it with `pip install -U "transformers>={MINIMUM_TRANSFORMERS_VERSION},<6"`.'
        )


check_transformers_version()

from transformers import cache_utils, masking_utils  # noqa: E402  (only on a supported release)


# --- the cache's keyword: `cache` from 5.24 (transformers renamed `past_key_values`, which it still accepts with a
# FutureWarning until 5.40), `past_key_values` on 5.5 - 5.23. DINT's own code says `cache`; this bridge serves
# 5.5 - 5.23.
HAS_CACHE_ARGUMENT = "cache" in inspect.signature(masking_utils.create_causal_mask).parameters
CACHE_ARGUMENT = "cache" if HAS_CACHE_ARGUMENT else "past_key_values"
"""The keyword under which the installed transformers passes the cache between a model, its decoder layers and
`generate()`, and names it in a model output (`BaseModelOutputWithPast.cache` from 5.24)."""


def accepts_past_key_values(function):
    """Decorates a forward (or `create_masks_for_generate`) whose cache parameter is `cache`.

    From 5.24: transformers' own `deprecate_kwarg("past_key_values", new_name="cache")`, as on Llama's forward (a
    caller's `past_key_values=` still works, with transformers' FutureWarning). On 5.5 - 5.23 `past_key_values` is the
    name transformers itself passes, so it is renamed to `cache` silently.
    """
    if HAS_CACHE_ARGUMENT:
        from transformers.utils.deprecation import deprecate_kwarg

        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(function)

    @functools.wraps(function)
    def renamed(*args, **kwargs):
        if "past_key_values" in kwargs:
            past_key_values = kwargs.pop("past_key_values")
            if kwargs.get("cache") is not None and past_key_values is not None:
                raise ValueError("Pass the cache once, as `cache` or as `past_key_values`, not both.")
            kwargs["cache"] = kwargs.get("cache") if past_key_values is None else past_key_values
        return function(*args, **kwargs)

    return renamed


HAS_CAUSAL_SKIP_ARGUMENT = "allow_is_causal_skip" in inspect.signature(masking_utils.create_causal_mask).parameters
"""`create_causal_mask(allow_is_causal_skip=...)` exists from 5.15 (`create_causal_mask_before_5_15` serves
5.5 - 5.14)."""


def create_causal_mask(*, cache, allow_is_causal_skip: bool = True, **kwargs):
    """`transformers.masking_utils.create_causal_mask`, with the cache given as `cache` on every release, and where
    `allow_is_causal_skip=False` always returns a mask (the argument exists from 5.15)."""
    kwargs[CACHE_ARGUMENT] = cache
    if HAS_CAUSAL_SKIP_ARGUMENT:
        return masking_utils.create_causal_mask(allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    return create_causal_mask_before_5_15(allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def create_causal_mask_before_5_15(*, allow_is_causal_skip: bool = True, **kwargs):
    """5.5 - 5.14: sdpa's mask function returns None where the mask is plainly causal (no padding, no packing, a
    dynamic cache or none). The materializing path needs the boolean mask itself: it is then `[B, 1, T, past + T]`,
    True where key j <= past + query row i. `kwargs` are `create_causal_mask`'s, the cache under `CACHE_ARGUMENT`."""
    causal_mask = masking_utils.create_causal_mask(**kwargs)
    if causal_mask is not None or allow_is_causal_skip:
        return causal_mask
    inputs_embeds, cache = kwargs["inputs_embeds"], kwargs.get(CACHE_ARGUMENT)
    batch_size, query_length = inputs_embeds.shape[:2]
    past_length = cache.get_seq_length() if cache is not None else 0
    allowed = torch.ones(query_length, past_length + query_length, dtype=torch.bool, device=inputs_embeds.device)
    return allowed.tril(diagonal=past_length)[None, None].expand(batch_size, 1, -1, -1)


# --- cache layers chosen by `layer_types`: transformers registers a layer class by its `_layer_type` from 5.14 -------
HAS_CACHE_LAYER_REGISTRY = hasattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING")
"""From 5.14, `DynamicCache(config=...)` / `StaticCache(config=...)` build the DINT layers named by `layer_types`."""


def build_dint_cache_layers(cache, dynamic_layer_class: type, static_layer_class: type) -> None:
    """On transformers 5.5 - 5.13 (no cache-layer registry), `DynamicCache(config=...)` / `StaticCache(config=...)`
    build plain layers for the `dint_attention` layers: this replaces them, in place, by `dynamic_layer_class` /
    `static_layer_class` (the DINT layers), so that the caches `generate()` builds carry the integral statistics.
    A no-op from 5.14. The classes are arguments because this module imports no sibling file: a remote-code load of
    the configuration copies only the files it imports."""
    if not HAS_CACHE_LAYER_REGISTRY:
        replace_plain_cache_layers(cache, dynamic_layer_class, static_layer_class)


def replace_plain_cache_layers(cache, dynamic_layer_class: type, static_layer_class: type) -> None:
    """The replacement itself. Only empty `DynamicLayer` / `StaticLayer` objects are replaced, so a filled cache of
    plain layers, or a bare `DynamicCache()` (no layers yet), is still refused by the model; a cache built from
    another config keeps its number of layers, which the model checks."""
    layers = getattr(cache, "layers", None) or []
    for layer_idx, layer in enumerate(layers):
        if type(layer) is cache_utils.DynamicLayer and not layer.is_initialized:
            layers[layer_idx] = dynamic_layer_class()
        elif type(layer) is cache_utils.StaticLayer and not layer.is_initialized:
            layers[layer_idx] = static_layer_class(max_cache_len=layer.max_cache_len)


# --- assisted and prompt-lookup decoding roll a DINT cache back over the rejected tokens only where `generate()`
# records past states and crops by a count of tokens (from 5.14). On 5.5 - 5.13 it crops to an absolute length
# without recording, which a DINT cache layer refuses with a ValueError (its integral cannot be rolled back). ---
GENERATE_RECORDS_PAST_FOR_CROP = _installed_release() >= (5, 14)
"""Whether `generate(prompt_lookup_num_tokens=...)` / `generate(assistant_model=...)` can run a DINT model (5.14+)."""


__all__ = [
    "MINIMUM_TRANSFORMERS_VERSION",
    "TESTED_TRANSFORMERS_VERSIONS",
    "UnsupportedTransformersError",
    "check_transformers_version",
    "create_causal_mask",
    "CACHE_ARGUMENT",
    "HAS_CACHE_ARGUMENT",
    "accepts_past_key_values",
    "HAS_CACHE_LAYER_REGISTRY",
    "GENERATE_RECORDS_PAST_FOR_CROP",
    "build_dint_cache_layers",
]
