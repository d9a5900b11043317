# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""What moved between the transformers releases DINT supports (every 5.x from 5.5) that the model itself needs.

This file travels with the remote code (`save_pretrained` copies it beside `modeling_dint.py`), so a checkpoint loads
with `trust_remote_code=True` on whatever supported transformers a machine has: it holds only what a checkpoint needs
to load and run. The bridges that only the package's tools, tests and examples need live in
`integrations/release_bridges.py` (`dint-serve`'s in `integrations/serve_cli.py`), which do not travel. Each bridge is
a named flag, class or function that says the releases it serves: when the floor passes them, delete the bridge and
use the transformers name directly.
`installed_release()` is the one place that reads an installed version (transformers', or a version string given to
it, such as vLLM's).

Importing this module first checks the installed torch and transformers: below a floor, the package and the remote
code fail at once with one message naming the installed and the minimum version and how to upgrade, instead of an
ImportError from inside transformers. It imports only torch's and transformers' top level and `packaging` before
that check, so it runs on any release.
"""

import functools
import inspect

import torch
import transformers
from packaging.version import Version


MINIMUM_TRANSFORMERS_VERSION = "5.5.0"
"""The oldest transformers release DINT runs on (`setup.py`'s `install_requires` states the same bound)."""

MINIMUM_TORCH_VERSION = "2.9.1"
"""The oldest torch DINT runs on (`setup.py` states the same bound; `.ci/torch_matrix.py` measures it)."""


class UnsupportedTransformersError(ImportError):
    """The installed transformers (or torch) is older than the floor DINT needs."""


def installed_release(version: str | None = None) -> tuple[int, ...]:
    """A release as numbers, e.g. (5, 24, 0) (a local or `.dev0` suffix is dropped); default: the installed
    transformers."""
    return Version(transformers.__version__ if version is None else version).release


def check_transformers_version(installed: str | None = None) -> None:
    """Raises `UnsupportedTransformersError` if `installed` (default: the installed transformers) is below the floor."""
    installed = transformers.__version__ if installed is None else installed
    if installed_release(installed) < installed_release(MINIMUM_TRANSFORMERS_VERSION):
        raise UnsupportedTransformersError(
            f"DINT needs transformers >= {MINIMUM_TRANSFORMERS_VERSION}, but transformers {installed} is installed. "
            f'Upgrade it with `pip install -U "transformers>={MINIMUM_TRANSFORMERS_VERSION},<6"`.'
        )


def check_torch_version(installed: str | None = None) -> None:
    """Raises `UnsupportedTransformersError` if `installed` (default: the installed torch) is below the floor: the
    oldest release on which the default test suite passes (`.ci/torch_matrix.md`: below 2.9, torch's CPU
    flex_attention does not compile, and below 2.7 torch.compile cannot trace transformers 5.24's models)."""
    installed = torch.__version__ if installed is None else installed
    if installed_release(installed) < installed_release(MINIMUM_TORCH_VERSION):
        raise UnsupportedTransformersError(
            f"DINT needs torch >= {MINIMUM_TORCH_VERSION}, but torch {installed} is installed. Upgrade it with "
            f'`pip install -U "torch>={MINIMUM_TORCH_VERSION}"` (for the CPU build: '
            "`--index-url https://download.pytorch.org/whl/cpu`)."
        )


check_torch_version()
check_transformers_version()

from transformers import cache_utils, masking_utils  # noqa: E402  (only on a supported release)


LOCAL_REMOTE_CODE_FOLLOWS_IMPORTS = installed_release() >= (5, 10, 1)
"""Whether transformers, loading remote code from a local folder, copies every file the modeling file reaches through
relative imports (5.10.1 on). 5.5 to 5.10.0 copy only the files the modeling file imports itself, so `modeling_dint.py`
names the other files of its `REMOTE_CODE_FILES` for them."""

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


# --- `create_causal_mask(allow_is_causal_skip=...)` exists from 5.15; this bridge serves 5.5 - 5.14 ----------------
HAS_CAUSAL_SKIP_ARGUMENT = "allow_is_causal_skip" in inspect.signature(masking_utils.create_causal_mask).parameters


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


# --- cache layers chosen by `layer_types`: transformers registers a layer class by its `_layer_type` from 5.14; this
# bridge serves 5.5 - 5.13 ---------------------------------------------------------------------------------------------
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


# --- `GradientCheckpointingLayer.__init_subclass__` wraps each subclass's `forward` (checkpointing), a subclass of a
# layer again: a decoder layer that inherits Llama's forward would run two wrappers per call. Written for 5.24 (the
# wrapper, `forward_with_checkpointing`, sets `__wrapped__`); releases without it return the forward as it is.
def unwrapped_forward(layer_class: type):
    """`layer_class.forward` without transformers' checkpointing wrapper, for a subclass to define as its own forward
    (which transformers then wraps once, as it wraps Llama's own layer)."""
    forward = layer_class.forward
    if forward.__code__.co_name == "forward_with_checkpointing":  # transformers' wrapper (its `__wrapped__`: Llama's)
        return forward.__wrapped__
    return forward


# --- recurrent states beside K/V: transformers' `LinearAttentionAndFullAttentionLayer` (and, from 5.14, its static
# variant) keep per-layer recurrent states that a model reaches through `Cache.update_recurrent_state(states,
# layer_idx, state_idx=...)`. Several states per layer, indexed by `state_idx`, exist from 5.14; this bridge serves
# 5.5 - 5.13, where a layer keeps one state: the classes below give those releases the 5.14 layout. ------------------
HAS_INDEXED_RECURRENT_STATES = "number_of_states" in inspect.signature(
    cache_utils.LinearAttentionCacheLayerMixin.__init__
).parameters


class _IndexedRecurrentStatesBefore5_14:
    """5.5 - 5.13: the 5.14 layout of a linear-attention layer's recurrent states (dicts keyed by `state_idx`, each
    allocated at its first update and then written in place, so that its address stays fixed under compilation), for
    layers that keep recurrent states only (no conv states)."""

    def _init_recurrent_states(self, number_of_states: int) -> None:
        self.number_of_states = number_of_states
        self.recurrent_states = dict.fromkeys(range(number_of_states))
        self.is_recurrent_states_initialized = dict.fromkeys(range(number_of_states), False)
        self.has_previous_state = dict.fromkeys(range(number_of_states), False)
        self.record_past = False

    def lazy_initialization(self, *args, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        if args:  # keys and values
            self._attention_layer_class.lazy_initialization(self, *args)
            return
        self.recurrent_states[state_idx] = torch.zeros_like(recurrent_states)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.recurrent_states[state_idx])
        self.is_recurrent_states_initialized[state_idx] = True

    def update_conv_state(self, conv_states: torch.Tensor, **kwargs) -> torch.Tensor:
        raise TypeError("This cache layer keeps recurrent states only (no conv states).")

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.recurrent_states[state_idx].copy_(recurrent_states)
        return self.recurrent_states[state_idx]

    def _recurrent_state_items(self):
        return [(i, state) for i, state in self.recurrent_states.items() if self.is_recurrent_states_initialized[i]]

    def offload(self):
        cache_utils.CacheLayerMixin.offload(self)
        for i, state in self._recurrent_state_items():
            self.recurrent_states[i] = state.to("cpu", non_blocking=True)

    def prefetch(self):
        cache_utils.CacheLayerMixin.prefetch(self)
        for i, state in self._recurrent_state_items():
            self.recurrent_states[i] = state.to(self.device, non_blocking=True)

    def reset(self) -> None:
        for _, state in self._recurrent_state_items():
            state.zero_()
        self.has_previous_state = dict.fromkeys(range(self.number_of_states), False)
        self._attention_layer_class.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        for i, state in self._recurrent_state_items():
            self.recurrent_states[i] = state.index_select(0, beam_idx.to(state.device))
        self._attention_layer_class.reorder_cache(self, beam_idx)


if HAS_INDEXED_RECURRENT_STATES:
    RecurrentStateAndFullAttentionLayer = cache_utils.LinearAttentionAndFullAttentionLayer
    RecurrentStateAndStaticFullAttentionLayer = cache_utils.LinearAttentionAndStaticFullAttentionLayer
else:

    class RecurrentStateAndFullAttentionLayer(
        _IndexedRecurrentStatesBefore5_14, cache_utils.LinearAttentionCacheLayerMixin, cache_utils.DynamicLayer
    ):
        """5.5 - 5.13: `LinearAttentionAndFullAttentionLayer` as it is from 5.14 (recurrent states only)."""

        _attention_layer_class = cache_utils.DynamicLayer
        is_compileable = False

        def __init__(self, number_of_states: int = 1, **kwargs):
            cache_utils.DynamicLayer.__init__(self)
            self._init_recurrent_states(number_of_states)

    class RecurrentStateAndStaticFullAttentionLayer(
        _IndexedRecurrentStatesBefore5_14, cache_utils.LinearAttentionCacheLayerMixin, cache_utils.StaticLayer
    ):
        """5.5 - 5.13: `LinearAttentionAndStaticFullAttentionLayer` as it is from 5.14 (recurrent states only)."""

        _attention_layer_class = cache_utils.StaticLayer

        def __init__(self, max_cache_len: int, number_of_states: int = 1, **kwargs):
            cache_utils.StaticLayer.__init__(self, max_cache_len)
            self._init_recurrent_states(number_of_states)

        @property
        def is_compileable(self) -> bool:
            return not self.record_past


__all__ = [
    "MINIMUM_TRANSFORMERS_VERSION",
    "MINIMUM_TORCH_VERSION",
    "UnsupportedTransformersError",
    "installed_release",
    "check_transformers_version",
    "check_torch_version",
    "CACHE_ARGUMENT",
    "HAS_CACHE_ARGUMENT",
    "accepts_past_key_values",
    "HAS_CAUSAL_SKIP_ARGUMENT",
    "create_causal_mask",
    "HAS_CACHE_LAYER_REGISTRY",
    "build_dint_cache_layers",
    "HAS_INDEXED_RECURRENT_STATES",
    "RecurrentStateAndFullAttentionLayer",
    "RecurrentStateAndStaticFullAttentionLayer",
    "unwrapped_forward",
]
