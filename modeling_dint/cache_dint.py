# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""KV-cache layers that carry DINT's integral statistics beside the keys and values.

A new token's integral term needs the signal maps of all earlier query rows of its document, which no key or value
holds. The integral statistics are a recurrent state beside K/V, the same kind of thing as a linear-attention layer's
state, so the DINT layers are transformers' own layers for that (`LinearAttentionAndFullAttentionLayer` and its
static variant): they keep, per layer and in fp32, the recurrent states

- `QUERY_COUNT` `[B]`: the number of valid query rows seen so far in the current document of each batch row (kept in
  layer 0 only: every layer has the same);
- `SIGNAL_SUM` `[B, H/2, C]`: the sum of the signal attention outputs `O1 = A1 V` over those rows (the fast path,
  integral "mean"), C = `config.differential_head_dim` (v1: 2*head_dim, v2: head_dim): O(1) in the sequence length;
- `COLUMN_SUMS` `[B, H/2, K]`: the sum of the signal maps `A1` over those rows, one value per cached key (the
  materializing path: eager attention, or integral "softmax"),

This file is storage, and the check that a cache can carry a model's states (`check_dint_cache`, once per cache): the
integral reads and writes the states through `integral_dint.CacheIntegralState` (`get_integral_state`,
`update_recurrent_state` of these layers, on every supported release). `reset`, `reorder_cache` (beam search),
offloading and the static layer's fixed addresses are transformers'. DINT adds `batch_repeat_interleave` /
`batch_select_indices` for the states, and a `crop` that rolls the states back over the rows recorded since
`activate_past_recording()` (assisted and prompt-lookup decoding), where transformers' linear-attention layers refuse.

Setting `_layer_type` registers the classes in transformers' cache-layer mappings, so `DynamicCache(config=...)` and
`StaticCache(config=...)` (what `generate()` builds) create them for a config whose `layer_types` name
`dint_attention`.
"""

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

from .configuration_dint import DINT_LAYER_TYPE, uses_materializing_path
from .transformers_compat import (
    RecurrentStateAndFullAttentionLayer,
    RecurrentStateAndStaticFullAttentionLayer,
    build_dint_cache_layers,
)


QUERY_COUNT, SIGNAL_SUM, COLUMN_SUMS = 0, 1, 2
"""The `state_idx` of each integral statistic in a DINT cache layer's recurrent states."""
INTEGRAL_STATE_NAMES = ("query_count", "signal_sum", "column_sums")


class DintIntegralStateMixin:
    """What the dynamic and the static DINT layer add to transformers' recurrent-state layers: the recording of the
    running states for `crop`, which statistics the layer keeps (`integral_kind`), and read-only views of the states."""

    # Keys and values can be allocated ahead of time (`Cache.early_initialization`, torch.export recipes); the integral
    # states are allocated at their first update (`integral_state_buffers` allocates them for export).
    supports_early_init = True

    def _init_integral_state(self) -> None:
        # (integral mode, state_idx of the sums) of the model that filled the layer: None while it holds no token.
        self.integral_kind: tuple[str, int | None] | None = None
        # Since recording (re)started: per state, the running values of every new query row `[B, t, *state]`, and the
        # state before the first of them (None where there was none).
        self._recorded_rows: dict[int, list[torch.Tensor]] = {}
        self._recorded_start: dict[int, torch.Tensor | None] = {}

    def get_integral_state(self, state_idx: int) -> torch.Tensor | None:
        """The state `state_idx`, None before its first update (the rule of `Cache.get_recurrent_state`)."""
        return self.recurrent_states[state_idx] if self.has_previous_state[state_idx] else None

    @property
    def query_count(self) -> torch.Tensor | None:
        return self.get_integral_state(QUERY_COUNT)

    @property
    def signal_sum(self) -> torch.Tensor | None:
        return self.get_integral_state(SIGNAL_SUM)

    @property
    def column_sums(self) -> torch.Tensor | None:
        return self.get_integral_state(COLUMN_SUMS)

    def integral_state(self) -> tuple[torch.Tensor | None, ...]:
        """`(query_count [B], signal_sum [B, H/2, 2d], column_sums [B, H/2, K])`, each None if never set."""
        return tuple(self.get_integral_state(state_idx) for state_idx in range(len(INTEGRAL_STATE_NAMES)))

    def check_integral_kind(self, integral: str, state_idx: int | None) -> None:
        """Refuses to continue a layer filled by a model that keeps other integral statistics (another integral mode,
        or the other path), or by a model that keeps none.

        Args:
            integral (`str`): the continuing model's `config.integral`.
            state_idx (`int` or None): the sums its path carries (`integral_state_index`).
        """
        kind = (integral, state_idx)
        if self.integral_kind is None:
            # A static layer's length can be a tensor (torch.export's buffers): checked on dynamic layers only.
            if isinstance(self, DynamicLayer) and self.get_seq_length() > 0:
                raise ValueError(
                    f"This DINT cache layer holds {self.get_seq_length()} tokens but no integral statistics: it was "
                    f"filled by a model that is not DINT. Start a new cache (`DynamicCache(config=model.config)`)."
                )
        elif self.integral_kind != kind:
            raise ValueError(
                f"This DINT cache was filled by a model with {_describe_integral_kind(*self.integral_kind)}; this "
                f"model has {_describe_integral_kind(*kind)}, so the integral would cover only the new tokens. "
                "Continue a cache with the integral mode and attention implementation that filled it, or start a new "
                "cache."
            )

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, running_rows: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        """Stores the state after the last new query row.

        Args:
            recurrent_states (`torch.Tensor`): the new state, `[B, *state]` (fp32).
            state_idx (`int`): `QUERY_COUNT`, `SIGNAL_SUM` or `COLUMN_SUMS`.
            running_rows (`torch.Tensor` of shape `[B, T, *state]`, *optional*): the state after each new row, of which
                `recurrent_states` is the last; recorded while the layer records its past, so that `crop` can roll
                the state back.
        """
        if self.record_past and running_rows is not None:
            if state_idx not in self._recorded_start:
                previous = self.get_integral_state(state_idx)
                self._recorded_start[state_idx] = None if previous is None else previous.clone()
            self._recorded_rows.setdefault(state_idx, []).append(running_rows)
        state = self._store_recurrent_state(recurrent_states, state_idx)
        self.has_previous_state[state_idx] = True
        return state

    def activate_past_recording(self) -> None:
        """Records the running states of every new query row, so that `crop(-n)` can roll the integral back."""
        self.record_past = True

    def _integral_after_crop(self, rows_to_remove: int) -> dict[int, torch.Tensor | None]:
        """The states `rows_to_remove` query rows back, computed without changing the layer, so that a refused crop
        changes nothing. Raises where the rows were not recorded."""
        kept_states = [state_idx for state_idx in self.has_previous_state if self.has_previous_state[state_idx]]
        if rows_to_remove == 0 or not kept_states:
            return {}
        states_after_crop = {}
        for state_idx in kept_states:
            chunks = self._recorded_rows.get(state_idx, [])
            recorded = sum(chunk.shape[1] for chunk in chunks)
            if not self.record_past or rows_to_remove > recorded:
                raise ValueError(
                    f"Cannot crop {rows_to_remove} tokens from a DINT cache layer: its integral statistics can be "
                    f"rolled back only over the {recorded} tokens recorded since `activate_past_recording()` or the "
                    f"last `crop` (record_past={self.record_past}). Rolling back further would give a wrong state; "
                    "the cache is left as it was."
                )
            kept = recorded - rows_to_remove  # the state after the `kept`-th recorded row
            if kept == 0:
                states_after_crop[state_idx] = self._recorded_start[state_idx]
                continue
            for chunk in chunks:
                if kept <= chunk.shape[1]:
                    break
                kept -= chunk.shape[1]
            states_after_crop[state_idx] = chunk[:, kept - 1].clone()
        return states_after_crop

    def _crop_integral(self, states_after_crop: dict[int, torch.Tensor | None]) -> None:
        """Sets the states `_integral_after_crop` computed (after the keys and values were cropped), then restarts the
        recording (as transformers' linear-attention layers keep only what the next forward needs after a `crop`)."""
        for state_idx, state in states_after_crop.items():
            if state is None:
                self.has_previous_state[state_idx] = False
                continue
            if state_idx == COLUMN_SUMS:
                state = state[..., : self.get_seq_length()]
            self._store_recurrent_state(state, state_idx)
        self._recorded_rows, self._recorded_start = {}, {}

    def _map_recorded_rows(self, function) -> None:
        """Applies `function` (a batch operation) to the recorded running states."""
        self._recorded_rows = {i: [function(chunk) for chunk in chunks] for i, chunks in self._recorded_rows.items()}
        self._recorded_start = {
            i: None if state is None else function(state) for i, state in self._recorded_start.items()
        }

    def _reset_integral(self) -> None:
        self._init_integral_state()
        self.record_past = False


def _describe_integral_kind(integral: str, state_idx: int | None) -> str:
    path = {
        SIGNAL_SUM: "the fast path",
        COLUMN_SUMS: "the materializing path (eager attention or integral 'softmax')",
        None: "no integral statistics",
    }[state_idx]
    return f"integral={integral!r} ({path})"


class DintDynamicLayer(DintIntegralStateMixin, RecurrentStateAndFullAttentionLayer):
    """A dynamic layer (keys and values grow by concatenation) that also carries the DINT integral statistics as its
    recurrent states; the column sums grow with the keys, so each state is replaced rather than written in place."""

    _layer_type = DINT_LAYER_TYPE
    # `crop` rolls the integral back over the recorded rows (transformers' linear-attention layers cannot be cropped)
    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__(number_of_states=len(INTEGRAL_STATE_NAMES))
        self._init_integral_state()

    def _store_recurrent_state(self, state: torch.Tensor, state_idx: int) -> torch.Tensor:
        # A copy where `state` does not own its storage (a row of a call's running sums, `[B, T, ...]`): a view would
        # keep the whole running tensor alive in the cache. A decoding step adds to the stored tensor in place.
        if not state.is_contiguous() or state.untyped_storage().nbytes() != state.numel() * state.element_size():
            state = state.clone(memory_format=torch.contiguous_format)
        self.recurrent_states[state_idx] = state
        self.is_recurrent_states_initialized[state_idx] = True
        return self.recurrent_states[state_idx]

    def reset(self) -> None:
        super().reset()
        self._reset_integral()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"`crop` takes 0 or a negative number of tokens to remove, got {tokens_to_remove} (the legacy "
                "absolute length is not supported by DINT cache layers)."
            )
        states_after_crop = self._integral_after_crop(-tokens_to_remove)  # raises before anything is cropped
        DynamicLayer.crop(self, tokens_to_remove)
        self._crop_integral(states_after_crop)

    def _map_integral_state(self, function) -> None:
        for state_idx, state in self.recurrent_states.items():
            if self.is_recurrent_states_initialized[state_idx]:
                self.recurrent_states[state_idx] = function(state)
        self._map_recorded_rows(function)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_recorded_rows(lambda state: state.index_select(0, beam_idx.to(state.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_integral_state(lambda state: state.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_integral_state(lambda state: state[indices.to(state.device) if torch.is_tensor(indices) else indices])


class DintStaticLayer(DintIntegralStateMixin, RecurrentStateAndStaticFullAttentionLayer):
    """A static layer (preallocated keys and values, for `torch.compile` and `cache_implementation="static"`) that
    also carries the DINT integral statistics as its recurrent states, allocated at their first update and then
    written in place, so that their addresses stay fixed under compilation."""

    _layer_type = DINT_LAYER_TYPE
    # transformers 5.24 gives `StaticLayer` a crop that rewinds K/V only and lets generate() crop static caches
    # (assisted and prompt-lookup decoding): a DINT static layer says it cannot be cropped, and refuses a crop.
    is_croppable = False

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, number_of_states=len(INTEGRAL_STATE_NAMES))
        self._init_integral_state()

    def _store_recurrent_state(self, state: torch.Tensor, state_idx: int) -> torch.Tensor:
        current = self.recurrent_states[state_idx]
        if current is not None and current.shape != state.shape:  # another batch size: allocated anew
            self.is_recurrent_states_initialized[state_idx] = False
        # transformers' storage: allocated at the first update (a static address), then written in place
        return RecurrentStateAndStaticFullAttentionLayer.update_recurrent_state(self, state, state_idx)

    def get_max_length(self) -> int:
        # The recurrent-state parent answers first in the MRO (-1: a recurrent state has no sequence axis); the keys
        # and values have a fixed length, which generate()'s callers read as `StaticLayer` answers it.
        return StaticLayer.get_max_length(self)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "A DINT static cache cannot be cropped: it keeps no per-token record to roll the integral statistics "
            "back. Use a dynamic cache (the default) for assisted and prompt-lookup decoding."
        )

    def reset(self) -> None:
        super().reset()
        self._reset_integral()


def integral_state_index(integral: str, materializing: bool) -> int | None:
    """The sums a model carries from call to call: `SIGNAL_SUM` (fast path), `COLUMN_SUMS` (materializing path), None
    for integral "none" (besides the sums, layer 0 keeps `QUERY_COUNT`)."""
    if integral == "none":
        return None
    return COLUMN_SUMS if materializing else SIGNAL_SUM


def check_dint_cache(cache, config, materializing: bool) -> None:
    """Fails early, with the fix, when a cache cannot carry the integral statistics of a model with `config`: it has
    none (e.g. a bare `DynamicCache()`), fewer DINT layers than the model, or was filled by a model with another
    integral mode or path. Nothing in the cache changes then; otherwise each layer records which statistics it keeps.

    The whole check runs when a cache is new to the model (or found wrong); after that, one look at layer 0's record
    (O(1) per forward). For transformers' caches; DINT's own holders (`integral_dint.DintIntegralState`) carry every
    layer's state themselves and are not checked here.
    """
    kind = (config.integral, integral_state_index(config.integral, materializing))
    layers = getattr(cache, "layers", None)
    if layers and len(layers) >= config.num_hidden_layers and getattr(layers[0], "integral_kind", None) == kind:
        return  # checked when this model first used it
    build_dint_cache_layers(cache, DintDynamicLayer, DintStaticLayer)  # transformers < 5.14
    if layers is None or not all(isinstance(layer, DintIntegralStateMixin) for layer in layers):
        raise ValueError(
            f"DINT needs its integral statistics in the cache, and this {type(cache).__name__} has none "
            f"(layers: {[type(layer).__name__ for layer in (layers or [])][:3]}...). Build it from the model config: "
            "`DynamicCache(config=model.config)` or `StaticCache(config=model.config, max_cache_len=...)`, or let "
            "the model / generate() create it."
        )
    if not layers:  # `DynamicCache()`: its layers would be added, as plain K/V layers, by the first update
        raise ValueError(
            f"This {type(cache).__name__} was built without a config, so it has no layer to carry DINT's integral "
            "statistics in. Build it from the model config: `DynamicCache(config=model.config)`, or let the model / "
            "generate() create it."
        )
    if len(layers) < config.num_hidden_layers:
        raise ValueError(
            f"This cache has {len(layers)} DINT layers and the model {config.num_hidden_layers}: it was built for "
            "another model. Build it from this model's config: `DynamicCache(config=model.config)`."
        )
    layers = layers[: config.num_hidden_layers]
    for layer in layers:  # every layer first, so that a refusal leaves the cache as it was
        layer.check_integral_kind(*kind)
    for layer in layers:
        if layer.integral_kind is None:
            layer.integral_kind = kind


def integral_state_buffers(cache, config) -> dict[str, torch.Tensor]:
    """Allocates the integral states of a static cache whose keys and values are allocated
    (`Cache.early_initialization`), as zeros (an empty document), and returns them by name
    (`dint_query_count_{layer}`, `dint_signal_sum_{layer}`): what an export recipe registers as buffers beside the
    keys and values, so that the exported program updates them in place from step to step (fast path, integral
    "mean")."""
    if config.integral != "mean" or uses_materializing_path(config):
        raise ValueError(
            f"Exporting the decode step needs the fast path with integral 'mean' (O(1) state per layer); this model has "
            f"integral={config.integral!r} and attn_implementation={config._attn_implementation!r}."
        )
    buffers = {}
    state_shape = (config.num_differential_heads, config.differential_head_dim)
    for layer_idx, layer in enumerate(cache.layers[: config.num_hidden_layers]):
        if not layer.is_initialized:
            raise ValueError("Allocate the cache's keys and values first (`cache.early_initialization(...)`).")
        batch_size, device = layer.keys.shape[0], layer.keys.device
        zeros = {SIGNAL_SUM: torch.zeros(batch_size, *state_shape, device=device)}
        if layer_idx == 0:  # the count of valid rows is kept once, in layer 0
            zeros[QUERY_COUNT] = torch.zeros(batch_size, device=device)
        for state_idx, state in zeros.items():
            cache.update_recurrent_state(state, layer_idx, state_idx=state_idx)
            buffers[f"dint_{INTEGRAL_STATE_NAMES[state_idx]}_{layer_idx}"] = layer.get_integral_state(state_idx)
    return buffers


__all__ = [
    "DintDynamicLayer",
    "DintStaticLayer",
    "DintIntegralStateMixin",
    "QUERY_COUNT",
    "SIGNAL_SUM",
    "COLUMN_SUMS",
    "INTEGRAL_STATE_NAMES",
    "check_dint_cache",
    "integral_state_buffers",
    "integral_state_index",
]
