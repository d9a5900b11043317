# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""KV-cache layers that carry DINT's integral statistics beside the keys and values.

A new token's integral term needs the signal maps of all earlier query rows of its document, which no key or value
holds. Each DINT cache layer therefore keeps, in fp32:

- `query_count` `[B]`: the number of valid query rows seen so far in the current document of each batch row;
- `signal_sum` `[B, H/2, 2*head_dim]`: the sum of the signal attention outputs `O1 = A1 V` over those rows (fast
  path, integral "mean"): O(1) in the sequence length;
- `column_sums` `[B, H/2, K]`: the sum of the signal maps `A1` over those rows, one value per cached key (the
  materializing path: eager attention, or integral "softmax").

Setting `_layer_type` registers the classes in transformers' cache-layer mappings, so `DynamicCache(config=...)` and
`StaticCache(config=...)` (what `generate()` builds) create them for a config whose `layer_types` name
`dint_attention`. The state follows every cache operation of transformers: `reorder_cache` (beam search),
`batch_repeat_interleave` / `batch_select_indices`, `reset`, and `crop` (assisted / prompt-lookup decoding), for which
the per-token running values are recorded after `activate_past_recording()`.
"""

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

from .configuration_dint import DINT_LAYER_TYPE
from .integral_dint import DintIntegralLayout, segmented_running_sum, uses_materializing_path


def _state_at_row(running_state: tuple, row: int) -> tuple:
    """The state after query row `row` of running values `(query_count [B, T], signal_sum [B, H/2, T, C] or None,
    column_sums [B, H/2, T, K] or None)`. A row of several is copied: a view would keep the whole running tensor
    (O(T) per layer, O(T * K) for the column sums) alive in the cache."""
    rows = []
    for running, query_dim in zip(running_state, (-1, -2, -2)):
        if running is None:
            rows.append(None)
            continue
        row_state = running.select(query_dim, row)
        rows.append(row_state.clone() if running.shape[query_dim] > 1 else row_state)
    return tuple(rows)


class DintIntegralStateMixin:
    """The integral statistics of one DINT layer, shared by the dynamic and the static cache layer. The model reads
    and writes them through methods only: `check_integral_kind`, `past_query_count`, `running_signal_sum` (fast
    path), `integral_carry` and `update_integral` (materializing path). Continuous batching's paged layer
    (`serving.py`) offers the same `running_signal_sum`."""

    def _init_integral_state(self) -> None:
        self.query_count: torch.Tensor | None = None
        self.signal_sum: torch.Tensor | None = None
        self.column_sums: torch.Tensor | None = None
        # (integral mode, state name) of the model that filled the layer: None while it holds no token.
        self.integral_kind: tuple[str, str | None] | None = None
        self.record_past = False
        # Running values of every query row since recording (re)started, as chunks of
        # (query_count [B, t], signal_sum [B, H/2, t, C] or None, column_sums [B, H/2, t, K] or None).
        self._recorded_rows: list[tuple] = []
        self._recorded_start: tuple | None = None

    def integral_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Returns `(query_count [B], signal_sum [B, H/2, 2d], column_sums [B, H/2, K])`, each None if never set."""
        return self.query_count, self.signal_sum, self.column_sums

    def check_integral_kind(self, integral: str, state_name: str | None) -> None:
        """Refuses, before anything changes, to continue a layer filled by a model that keeps other integral
        statistics (another integral mode, or the other path), or by a model that keeps none.

        Args:
            integral (`str`): the continuing model's `config.integral`.
            state_name (`str` or None): the state its path carries: "signal_sum" (fast path), "column_sums"
                (materializing path), None for integral "none".
        """
        if self.integral_kind is None:
            # A static layer's length can be a tensor (torch.export's buffers): checked on dynamic layers only.
            if not self.is_compileable and self.get_seq_length() > 0:
                raise ValueError(
                    f"This DINT cache layer holds {self.get_seq_length()} tokens but no integral statistics: it was "
                    f"filled by a model that is not DINT. Start a new cache (`DynamicCache(config=model.config)`)."
                )
            return
        if self.integral_kind != (integral, state_name):
            raise ValueError(
                f"This DINT cache was filled by a model with {_describe_integral_kind(*self.integral_kind)}; this "
                f"model has {_describe_integral_kind(integral, state_name)}, so the integral would cover only the new "
                "tokens. Continue a cache with the integral mode and attention implementation that filled it, or start "
                "a new cache."
            )

    def past_query_count(self) -> torch.Tensor | None:
        """The count `[B]` (fp32) of valid query rows of each batch row's current document; None before the first."""
        return self.query_count

    def running_signal_sum(
        self, integral: str, signal_output: torch.Tensor, layout: DintIntegralLayout
    ) -> torch.Tensor:
        """The fast path's running sum of the signal outputs `[B, T, H/2, 2d]` over each document's valid rows, the
        sum this layer carries from earlier calls included (fp32, same shape); stores the state after the last row."""
        running_sum = segmented_running_sum(signal_output, layout, self.integral_carry("signal_sum"))
        self.update_integral(integral, layout.running_query_count, running_sum.transpose(1, 2))
        return running_sum

    def integral_carry(self, state_name: str) -> torch.Tensor | None:
        """The sums `[B, H/2, C]` over the current document's rows that this layer carries into a call: "signal_sum"
        (fast path, C = 2*head_dim) or "column_sums" (materializing path, C = cached keys); None before the first."""
        return getattr(self, state_name)

    def update_integral(
        self,
        integral: str,
        running_query_count: torch.Tensor | None = None,
        running_signal_sum: torch.Tensor | None = None,
        running_column_sums: torch.Tensor | None = None,
    ) -> None:
        """Stores the state after the last new query row, and which integral statistics the layer keeps.

        Args:
            integral (`str`): the model's `config.integral` ("none" keeps no statistics: only the kind is recorded).
            running_query_count (`torch.Tensor` of shape `[B, T]`): running count after each new row (fp32).
            running_signal_sum (`torch.Tensor` of shape `[B, H/2, T, 2d]`, *optional*): running sum of O1.
            running_column_sums (`torch.Tensor` of shape `[B, H/2, T, K]`, *optional*): running column sums of A1.
        """
        state_name = "signal_sum" if running_signal_sum is not None else "column_sums"
        self.integral_kind = (integral, None if integral == "none" else state_name)
        if integral == "none":
            return
        if self.record_past:
            if self._recorded_start is None:
                self._recorded_start = self._snapshot()
            self._recorded_rows.append((running_query_count, running_signal_sum, running_column_sums))
        self._set_state(*_state_at_row((running_query_count, running_signal_sum, running_column_sums), -1))

    def _set_state(self, query_count, signal_sum, column_sums) -> None:
        self.query_count, self.signal_sum, self.column_sums = query_count, signal_sum, column_sums

    def _snapshot(self) -> tuple:
        return tuple(None if state is None else state.clone() for state in self.integral_state())

    def _map_integral_state(self, function) -> None:
        """Applies `function` (a batch operation) to every state tensor, the recorded rows included."""

        def apply(state):
            return None if state is None else function(state)

        self._set_state(*(apply(state) for state in self.integral_state()))
        self._recorded_rows = [tuple(apply(state) for state in rows) for rows in self._recorded_rows]
        if self._recorded_start is not None:
            self._recorded_start = tuple(apply(state) for state in self._recorded_start)

    def activate_past_recording(self) -> None:
        """Records the running state of every new query row, so that `crop(-n)` can roll the integral back."""
        self.record_past = True

    def _integral_after_crop(self, tokens_to_remove: int) -> tuple | None:
        """The integral state `-tokens_to_remove` query rows back (None: unchanged), computed without changing the
        layer, so that a refused crop changes nothing. Raises where the rows were not recorded."""
        rows_to_remove = -tokens_to_remove
        if rows_to_remove <= 0 or self.integral_kind is None or self.integral_kind[1] is None:
            return None
        recorded = sum(rows[0].shape[-1] for rows in self._recorded_rows)
        if not self.record_past or rows_to_remove > recorded:
            raise ValueError(
                f"Cannot crop {rows_to_remove} tokens from a DINT cache layer: its integral statistics can be "
                f"rolled back only over the {recorded} tokens recorded since `activate_past_recording()` or the "
                f"last `crop` (record_past={self.record_past}). Rolling back further would give a wrong state; "
                "the cache is left as it was."
            )
        if rows_to_remove == recorded:
            return self._recorded_start
        kept = recorded - rows_to_remove  # the state after the `kept`-th recorded row
        for chunk in self._recorded_rows:  # (query_count [B, t], signal_sum, column_sums)
            if kept <= chunk[0].shape[-1]:
                break
            kept -= chunk[0].shape[-1]
        return _state_at_row(chunk, kept - 1)

    def _crop_integral(self, state_after_crop: tuple | None) -> None:
        """Sets the state `_integral_after_crop` computed (after the keys and values were cropped), then restarts the
        recording (as transformers' linear-attention layers do, the recorded rows are dropped after each `crop`)."""
        if state_after_crop is not None:
            self._set_state(*state_after_crop)
            if self.column_sums is not None:
                self.column_sums = self.column_sums[..., : self.get_seq_length()]
        self._recorded_rows = []
        self._recorded_start = None


def _describe_integral_kind(integral: str, state_name: str | None) -> str:
    path = {"signal_sum": "the fast path", "column_sums": "the materializing path (eager attention or integral "
            "'softmax')", None: "no integral statistics"}[state_name]
    return f"integral={integral!r} ({path})"


class DintDynamicLayer(DintIntegralStateMixin, DynamicLayer):
    """A `DynamicLayer` (keys and values grow by concatenation) that also carries the DINT integral statistics.

    The integral state stays on the compute device when the cache offloads keys and values: it is O(1) per layer for
    integral "mean" (and one fp32 value per key and head for the materializing path).
    """

    _layer_type = DINT_LAYER_TYPE

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._init_integral_state()

    def reset(self) -> None:
        super().reset()
        self._init_integral_state()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"`crop` takes 0 or a negative number of tokens to remove, got {tokens_to_remove} (the legacy "
                "absolute length is not supported by DINT cache layers)."
            )
        state_after_crop = self._integral_after_crop(tokens_to_remove)  # raises before anything is cropped
        super().crop(tokens_to_remove)
        self._crop_integral(state_after_crop)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_integral_state(lambda state: state.index_select(0, beam_idx.to(state.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_integral_state(lambda state: state.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_integral_state(lambda state: state[indices.to(state.device) if torch.is_tensor(indices) else indices])


class DintStaticLayer(DintIntegralStateMixin, StaticLayer):
    """A `StaticLayer` (preallocated keys and values, for `torch.compile` and `cache_implementation="static"`) that
    also carries the DINT integral statistics, allocated at the first update and then written in place so that their
    addresses stay fixed under compilation."""

    _layer_type = DINT_LAYER_TYPE
    # transformers 5.24 gives `StaticLayer` a crop that rewinds K/V only and lets generate() crop static caches
    # (assisted and prompt-lookup decoding): a DINT static layer says it cannot be cropped, and refuses a crop.
    is_croppable = False

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self._init_integral_state()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "A DINT static cache cannot be cropped: it keeps no per-token record to roll the integral statistics "
            "back. Use a dynamic cache (the default) for assisted and prompt-lookup decoding."
        )

    def _set_state(self, query_count, signal_sum, column_sums) -> None:
        if self.query_count is None or self.query_count.shape != query_count.shape:
            super()._set_state(
                query_count.clone(),
                None if signal_sum is None else signal_sum.clone(),
                None if column_sums is None else column_sums.clone(),
            )
            return
        self.query_count.copy_(query_count)
        for name, value in (("signal_sum", signal_sum), ("column_sums", column_sums)):
            current = getattr(self, name)
            if value is None or current is None or current.shape != value.shape:
                setattr(self, name, None if value is None else value.clone())
            else:
                current.copy_(value)

    def reset(self) -> None:
        super().reset()
        for state in self.integral_state():
            if state is not None:
                state.zero_()
        self.integral_kind = None
        self.record_past = False
        self._recorded_rows = []
        self._recorded_start = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        for state in self.integral_state():
            if state is not None:
                state.copy_(state.index_select(0, beam_idx.to(state.device)))


def check_dint_cache(cache, config) -> None:
    """Fails early, with the fix, when a cache cannot carry the integral statistics of a model with `config`: it has
    none (e.g. a bare `DynamicCache()`), fewer DINT layers than the model, or was filled by a model with another
    integral mode or path. Nothing in the cache changes."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(isinstance(layer, DintIntegralStateMixin) for layer in layers):
        raise ValueError(
            f"DINT needs its integral statistics in the cache, and this {type(cache).__name__} has none "
            f"(layers: {[type(layer).__name__ for layer in (layers or [])][:3]}...). Build it from the model config: "
            "`DynamicCache(config=model.config)` or `StaticCache(config=model.config, max_cache_len=...)`, or let "
            "the model / generate() create it."
        )
    if len(layers) < config.num_hidden_layers:
        raise ValueError(
            f"This cache has {len(layers)} DINT layers and the model {config.num_hidden_layers}: it was built for "
            "another model. Build it from this model's config: `DynamicCache(config=model.config)`."
        )
    state_name = None
    if config.integral != "none":
        state_name = "column_sums" if uses_materializing_path(config) else "signal_sum"
    for layer in layers[: config.num_hidden_layers]:
        layer.check_integral_kind(config.integral, state_name)


__all__ = ["DintDynamicLayer", "DintStaticLayer", "DintIntegralStateMixin", "check_dint_cache"]
