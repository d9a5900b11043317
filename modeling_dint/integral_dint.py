# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The DINT integral, in one place: where its running mean counts and restarts, the state it carries between calls,
the choice of implementation, and the combination with the differential outputs.

Per differential head, `A_final = A1 - lambda * A2 + lambda * G`, where row n of G is the mean of the signal map A1
over the valid query rows m <= n of n's document (c_n of them). A head layout (`config.differential_attention`)
supplies the signal and noise outputs O1, O2 (or maps A1, A2) and lambda; `DintIntegral` does the rest, the same code
for both layouts and every caller (transformers' attention, the continuous-batching step, vLLM's attention):

- the fast path (any attention backend, integral "mean"): since V does not depend on the query row, `G V` is the
  running mean of `O1 = A1 V`, so `out = O1 - lambda * (O2 - S / c)` with S the running sum of O1. The reference is
  `segmented_running_sum` and `combine_with_integral`, called by `DintIntegral.__call__`; the kernels
  (`integral_cpu_kernel`, `integral_triton_kernel`) compute the same and are tested against it;
- the materializing path (eager attention, or integral "softmax", which needs G itself): A1, A2, G and A_final as the
  paper writes them (`compose_final_attention`).

A forward pass decides everything once (`DintIntegralLayout`, built by `forward_integral_layout`): which rows count and
where documents restart, c_n, and the plan (`plan_integral`): which implementation runs, whether a call is a decoding
step, which state holder (`DintIntegralState`) carries the sums. A layer's call only runs the plan. Padding rows are
excluded with `torch.where`, never by a product (a padding row may hold NaN).

This file travels with the remote code (`save_pretrained`): it imports nothing but torch and transformers (Triton only
where the plan takes its kernel).
"""

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from .cache_dint import COLUMN_SUMS, QUERY_COUNT, SIGNAL_SUM, DintDynamicLayer, DintIntegralStateMixin, DintStaticLayer
from .integral_cpu_kernel import (
    DOCUMENT_START,
    KERNEL_DTYPES,
    ROW_VALID,
    blocked_running_sum,
    blocked_scan_is_exact,
    built_integral_kernel,
    environment_variable,
    integral_kernel,
)
from .transformers_compat import build_dint_cache_layers


def valid_query_rows(
    attention_mask: torch.Tensor | None, batch_size: int, query_length: int
) -> torch.Tensor | None:
    """The query rows that are not padding, `[B, T]` bool (None without a mask: every row counts), from a 2D padding
    mask `[B, past + T]` or a 4D mask `[B, 1, T, K]` (bool, or float with 0 where attention is allowed; a row with
    no allowed key is not valid)."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        # A new contiguous [B, T] tensor. `.bool()` keeps the mask's row stride (a bool mask's view; at batch 1 a copy
        # with the same strides), which grows at every decoding step, and a compiled step guards on strides: with
        # transformers 5.5 to 5.17, whose static-cache generate() passes the growing mask, it recompiled every token.
        return attention_mask[:, -query_length:] != 0
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        return allowed.any(dim=-1)[:, 0, -query_length:].expand(batch_size, query_length)
    raise TypeError(
        f"DINT derives the valid query rows from a 2D or 4D tensor `attention_mask`, got {type(attention_mask)}."
    )


def document_starts(
    query_valid: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch_size: int,
    query_length: int,
    cu_seq_lens_q: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The valid query rows that start a document, `[B, T]` bool: a position id 0 (packed sequences restart positions
    at 0) or a flash-attention packing offset `cu_seq_lens_q`. None without either: no row starts a document."""
    document_start = None
    if position_ids is not None:
        document_start = (position_ids == 0).expand(batch_size, query_length)
    if cu_seq_lens_q is not None:
        if document_start is None:
            document_start = torch.zeros(batch_size, query_length, dtype=torch.bool, device=cu_seq_lens_q.device)
        else:
            document_start = document_start.clone()
        document_start[:, cu_seq_lens_q[:-1].long()] = True
    if document_start is not None and query_valid is not None:
        # Only a valid row starts a document: generate() writes position id 0 on padding, and pads may sit inside a
        # row (a batched multi-turn chat appends the next turn after the pads of a row that finished early).
        document_start = document_start & query_valid.to(document_start.device)
    return document_start


class DintIntegralState(ABC):
    """What carries the integral's sums from one call to the next, for `DintIntegral`: the one protocol of every holder
    (`CacheIntegralState` over transformers' caches on every supported release, `integrations.serving.DintPagedStep`
    for continuous batching, the vLLM step's `VllmIntegralStep`). States: `QUERY_COUNT` `[B]`, `SIGNAL_SUM`
    `[B, heads, C]` (per query row `[1, T, heads, C]` for requests packed into one row), `COLUMN_SUMS` `[B, heads, K]`,
    all fp32.

    Attributes:
        records_rows (`bool`): whether `store` needs the state after every new row (`running_rows`), not only the last:
            a cache that records its past for `crop`, or one that stores per block. Kernels that keep only the last
            row's sum are not taken then.
        keeps_state_table (`bool`): whether `state_table` gives a table (packed requests).
    """

    records_rows: bool = False
    keeps_state_table: bool = False

    @abstractmethod
    def carried(self, layer_idx: int, state_idx: int) -> torch.Tensor | None:
        """The state `state_idx` of layer `layer_idx` before this call, None where there is none. A decoding step
        adds to the returned tensor in place: it must be the holder's own, not a copy."""

    @abstractmethod
    def store(
        self, state: torch.Tensor, layer_idx: int, state_idx: int, running_rows: torch.Tensor | None = None
    ) -> None:
        """Keeps `state`, the state after the call's last row; `running_rows` `[B, T, ...]` holds it after every row."""

    def state_table(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For requests packed into one row: the layer's sums `[slots, heads, C]` and per row `[1, T]` the slot it
        reads before it and the slot it stores after it (-1 for none), which the CPU kernel reads and writes in place.
        None where the holder keeps no such table."""
        return None


class CacheIntegralState(DintIntegralState):
    """transformers' caches (`DynamicCache`, `StaticCache`, offloaded ones) whose layers are DINT's (`cache_dint`,
    checked by `check_dint_cache`), on every supported release: the states are the layers' recurrent states."""

    def __init__(self, cache):
        self.layers = cache.layers
        self.records_rows = any(layer.record_past for layer in self.layers)  # recording for `crop`

    def carried(self, layer_idx: int, state_idx: int) -> torch.Tensor | None:
        return self.layers[layer_idx].get_integral_state(state_idx)

    def store(self, state, layer_idx, state_idx, running_rows=None) -> None:
        self.layers[layer_idx].update_recurrent_state(state, state_idx, running_rows=running_rows)


INTEGRAL_KERNEL_VARIABLE = "DINT_INTEGRAL_KERNEL"
EAGER, CPU_KERNEL, TRITON_KERNEL = "eager", "cpu", "triton"
INTEGRAL_KERNEL_CHOICES = ("auto", EAGER, TRITON_KERNEL)
"""The values of `DINT_INTEGRAL_KERNEL`: "auto" (unset: by device, `choose_implementation`), "eager" (the eager ops
everywhere) or "triton" (the Triton kernel wherever it can compute a call, CPU tensors under `TRITON_INTERPRET=1`
included: how machines without a GPU test it)."""

TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT = 1 << 23
"""Unforced, a CUDA forward in eval mode without a gradient takes the Triton kernel only from this many elements of O1
per layer (`B * T * heads * C`); below it (a decoding step, a short prefill) the eager ops cost the host less
(docs/performance.md, "The integral on a GPU")."""


@dataclass
class DintIntegralLayout:
    """Where the integral's running mean counts and restarts over the T query rows of one forward pass, and how every
    layer's call runs: built once per forward (`forward_integral_layout`) for all layers.

    A field that is None stands for a case known without reading tensor values, and the work it would cost is skipped.

    Attributes:
        query_valid (`torch.Tensor` of shape `[B, T]`, bool, or None when every row counts): the rows that are not
            padding.
        restart_row (`torch.Tensor` of shape `[B, T]`, long, or None when no document starts after row 0): the row of
            this call where row n's document starts (0 for the rows of a document that started before this call).
        in_carried_document (`torch.Tensor` of shape `[B, T]`, bool, or None with `restart_row`): the rows whose
            document started before this call, into which the carried sums enter.
        carry_per_row (`bool`): whether the carried sums come per query row `[B, T, ...]` (requests packed into one
            row by continuous batching, each with its own past: `for_packed_requests`) instead of per batch row.
        carry_kept (`bool`, or a bool `torch.Tensor` of shape `[B]`): for a call with no `restart_row`, whether row 0
            continues the carried document (False where row 0 starts one: a position id 0).
        running_query_count (`torch.Tensor` of shape `[B, T]`, fp32): `c_n`, the carried count included.
        inverse_query_count (`torch.Tensor` of shape `[B, T, 1, 1]`, fp32): `1 / max(c_n, 1)`.

        The plan (`plan_integral`):
        implementation (`str`, or None until planned): `EAGER`, `CPU_KERNEL` or `TRITON_KERNEL`.
        decoding_step (`bool`): one new row per sequence continuing the carried sums, in eager mode without a
            gradient: `DintIntegral` adds O1 to the holder's state in place (`step_carry_factor`, `step_valid`: where
            a row restarts or is padding, else None).
        state (`DintIntegralState` or None): what carries the sums between calls.
        running_sum (callable or None): the eager ops' scan tuned for the device (`blocked_running_sum` on CPU,
            `rows_last_running_sum` on CUDA), None for `segmented_running_sum`'s own cumsum.
        kernel_row_flags (`[B, T]` uint8), kernel_inverse_count (`[B, T]` fp32): what the kernels read per row, where
            the plan takes one.
        plan_inputs (`tuple`): what `choose_implementation` read besides the device, kept for `to`.
    """

    query_valid: torch.Tensor | None = None
    restart_row: torch.Tensor | None = None
    in_carried_document: torch.Tensor | None = None
    carry_per_row: bool = False
    carry_kept: torch.Tensor | bool = True
    running_query_count: torch.Tensor | None = None
    inverse_query_count: torch.Tensor | None = None
    implementation: str | None = None
    decoding_step: bool = False
    step_carry_factor: torch.Tensor | None = None
    step_valid: torch.Tensor | None = None
    state: DintIntegralState | None = None
    running_sum: Callable | None = None
    kernel_row_flags: torch.Tensor | None = None
    kernel_inverse_count: torch.Tensor | None = None
    plan_inputs: tuple = ()

    def document_first_rows(self) -> torch.Tensor:
        """`[B, T]` bool: each document's first row in this call (with `in_carried_document`: where the carried sums
        enter; packed requests: each request's first row). Needs `restart_row`."""
        return self.restart_row == torch.arange(self.restart_row.shape[-1], device=self.restart_row.device)

    def row_flags(self) -> torch.Tensor:
        """The kernels' flags per row, `[B, T]` uint8 (`integral_cpu_kernel.ROW_VALID | DOCUMENT_START`): the rows that
        count, and the rows where the running sum restarts before adding (a document's first row; row 0 where the
        carried sums do not carry; with `carry_per_row`, every request's first row, whose carried sum the kernel reads
        from the holder's table after the restart)."""
        batch_size, query_length = self.running_query_count.shape
        device = self.running_query_count.device
        if self.restart_row is not None:
            starts = self.document_first_rows()
            if not self.carry_per_row:
                starts &= ~self.in_carried_document
        else:
            starts = torch.zeros(batch_size, query_length, dtype=torch.bool, device=device)
            starts[:, 0] = ~self.carry_kept.to(device) if isinstance(self.carry_kept, torch.Tensor) else not self.carry_kept
        valid = torch.ones_like(starts) if self.query_valid is None else self.query_valid.to(torch.bool)
        return valid.to(torch.uint8) * ROW_VALID + starts.to(torch.uint8) * DOCUMENT_START

    @classmethod
    def build(
        cls,
        query_valid: torch.Tensor | None,
        document_start: torch.Tensor | None,
        past_query_count: torch.Tensor | None,
        batch_size: int,
        query_length: int,
        device: torch.device,
        carry_kept: torch.Tensor | bool = True,
    ) -> "DintIntegralLayout":
        """
        Args:
            query_valid, document_start: from `valid_query_rows` and `document_starts`.
            past_query_count (`torch.Tensor` of shape `[B]`, *optional*): the carried count of valid rows of the
                current document of each batch row.
            carry_kept (`bool` or bool `torch.Tensor`): without `document_start`, whether row 0 continues the carried
                document (without a caller's position ids: whether the cache holds tokens).
        """
        if not isinstance(carry_kept, torch.Tensor):
            carry_kept = bool(carry_kept)  # `segmented_running_sum` tests identity with True / False
        if query_valid is not None:
            query_valid = query_valid.to(device)  # a padding mask may come on another device, as for Llama
        if document_start is not None:
            document_start = document_start.to(device)
        layout = cls(query_valid=query_valid, carry_kept=carry_kept)
        if document_start is not None and query_length == 1:
            layout.carry_kept = ~document_start[:, 0]
        elif document_start is not None:
            row_index = torch.arange(query_length, device=document_start.device)
            start_index = torch.where(document_start, row_index, -1).cummax(dim=-1).values
            layout.restart_row, layout.in_carried_document = start_index.clamp(min=0), start_index < 0
        rows = torch.ones(batch_size, query_length, device=device)
        layout.running_query_count = segmented_running_sum(rows, layout, past_query_count)
        layout.inverse_query_count = layout.running_query_count.clamp(min=1.0).reciprocal()[:, :, None, None]
        return layout

    @classmethod
    def for_packed_requests(
        cls, position_ids: torch.Tensor, cu_seq_lens_q: torch.Tensor, request_rows: tuple | None = None
    ) -> "DintIntegralLayout":
        """The layout of requests packed into one row, as continuous batching (transformers' and vLLM's) runs them:
        each request is one document of valid rows whose position ids continue its own past (its count of rows is its
        position + 1), and a request whose first row is past position 0 continues the sums of its earlier steps, which
        the holder gives per query row (`carry_per_row`). Rows past the last request (padding) join the last one.

        Args:
            position_ids (`torch.Tensor` of shape `[1, T]` or `[T]`): each row's position in its request.
            cu_seq_lens_q (`torch.Tensor` of shape `[R + 1]`): where each of the R requests starts in the row.
            request_rows (`tuple`, *optional*): `packed_request_rows(position_ids, cu_seq_lens_q)`, where the caller
                has it already.
        """
        positions, row_request, request_start = request_rows or packed_request_rows(position_ids, cu_seq_lens_q)
        continues_past = positions[request_start] > 0
        running_query_count = (positions + 1).float()[None]
        return cls(
            query_valid=None,
            restart_row=request_start[row_request][None],
            in_carried_document=continues_past[row_request][None],
            carry_per_row=True,
            running_query_count=running_query_count,
            inverse_query_count=running_query_count.reciprocal()[:, :, None, None],
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "DintIntegralLayout":
        """The layout with its tensors on `device`. Accelerate's hooks call it to move a layer's arguments to the
        layer's device when a model is split over devices (`device_map`); on another kind of device the
        implementation is chosen again, for that device, from the same plan inputs."""
        device = torch.device(device)
        if self.running_query_count is None or self.running_query_count.device == device:
            return self
        moved = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                moved[field.name] = value.to(device, non_blocking=non_blocking)
        layout = replace(self, **moved)
        if self.implementation is not None and device.type != self.running_query_count.device.type:
            implementation = choose_implementation(device, *self.plan_inputs, self.carry_per_row, self.state)
            _choose(layout, device, implementation, compiling=self.plan_inputs[-1])
        return layout


def packed_request_rows(
    position_ids: torch.Tensor, cu_seq_lens_q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Requests packed into one row: each row's position `[T]` (long), each row's request `[T]` (rows past the last
    request join it), and each request's first row `[R]` (clamped into the row), from the position ids `[1, T]` or
    `[T]` and the offsets `cu_seq_lens_q` `[R + 1]`."""
    positions = position_ids.reshape(-1).long()
    num_rows, device = positions.shape[0], positions.device
    cu_seq_lens_q = cu_seq_lens_q.long().to(device)
    row_index = torch.arange(num_rows, device=device)
    row_request = torch.searchsorted(cu_seq_lens_q[1:], row_index, right=True).clamp(max=cu_seq_lens_q.shape[0] - 2)
    request_start = cu_seq_lens_q[:-1].clamp(max=num_rows - 1)
    return positions, row_request, request_start


def segmented_running_sum(
    rows: torch.Tensor, layout: DintIntegralLayout, carry=None, running_sum: Callable | None = None, query_dim: int = 1
) -> torch.Tensor:
    """Inclusive running sum over the query rows of `rows`, in fp32, counting valid rows only, restarting at each
    document start, the carried sum first.

    Args:
        rows (`torch.Tensor`): one value per query row along `query_dim`: the signal outputs `[B, T, heads, C]`
            (query_dim 1), the signal maps `[B, heads, T, K]` (query_dim 2), or `[B, T]`.
        layout (`DintIntegralLayout`): which rows count and where documents start.
        carry (`torch.Tensor`, *optional*): the sum over the current document's rows before this call: `rows`' shape
            without the query dimension, or with it where `layout.carry_per_row`.
        running_sum (callable, *optional*): a scan tuned for the device, `running_sum(rows, restart_row)`, query_dim 1
            (`layout.running_sum`); by default the cumsum below.

    Returns:
        `torch.Tensor` of `rows`' shape, fp32: row n holds the sum of the valid rows m <= n of n's document.
    """

    def along_rows(per_row: torch.Tensor) -> torch.Tensor:  # [B, T] -> broadcastable against `rows`
        return per_row.view(per_row.shape[0], *[1] * (query_dim - 1), per_row.shape[1], *[1] * (rows.dim() - query_dim - 1))

    if layout.query_valid is not None:  # `where`, never a product: a padding row may hold anything, NaN included
        rows = torch.where(along_rows(layout.query_valid), rows, 0.0)
    if running_sum is not None:
        running = running_sum(rows, layout.restart_row)
    else:  # cast, then scan: `cumsum(dtype=torch.float32)` would run its backward scan in the input's dtype (bf16)
        running = rows.float().cumsum(query_dim)
        if layout.restart_row is not None:  # each row subtracts the sum before its document's first row
            running = running - (running - rows).gather(query_dim, along_rows(layout.restart_row).expand(rows.shape))
    if carry is None or (layout.restart_row is None and layout.carry_kept is False):
        return running
    carry = carry.float() if layout.carry_per_row else carry.float().unsqueeze(query_dim)
    if layout.restart_row is not None:  # a row of a document that started before this call adds the carry
        return running + torch.where(along_rows(layout.in_carried_document), carry, 0.0)
    if layout.carry_kept is True:
        return running + carry
    # One multiply-add: the carry is a sum of valid rows (finite), so a 0/1 factor drops it exactly.
    return torch.addcmul(running, layout.carry_kept.view(-1, *[1] * (rows.dim() - 1)).to(carry.dtype), carry)


def combine_with_integral(signal_output, noise_output, lambda_, running_signal_sum, inverse_query_count):
    """The fast path's DINT output, `A1 V - lambda * A2 V + lambda * G V = O1 - lambda * (O2 - S / c)` (fp32).

    Args:
        signal_output, noise_output (`[..., T, heads, C]`): O1 and O2, fp32 or the model's dtype (each op reads them
            as fp32).
        lambda_ (`torch.Tensor`, fp32): a scalar (v1) or one per row and head `[..., T, heads, 1]` (v2).
        running_signal_sum (`[..., T, heads, C]`, fp32): S, the running sum of O1 over the rows of each document.
        inverse_query_count (broadcastable to `[..., T, 1, 1]`, fp32): 1 / c_n.
    """
    noise_minus_integral = torch.addcmul(noise_output, running_signal_sum, inverse_query_count, value=-1)
    return torch.addcmul(signal_output, lambda_, noise_minus_integral, value=-1)


def compose_final_attention(
    signal_weights: torch.Tensor,
    noise_weights: torch.Tensor,
    lambda_full: torch.Tensor,
    integral: str,
    layout: DintIntegralLayout | None,
    key_valid: torch.Tensor,
    past_column_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The DINT map `A_final = A1 - lambda * A2 + lambda * G` (`G` itself, or its softmax for integral "softmax").

    Args:
        signal_weights, noise_weights (`torch.Tensor` of shape `[B, H/2, T, K]`): the maps A1 and A2.
        lambda_full (`torch.Tensor`): the layer's lambda, a scalar (v1) or one per head and row `[B, H/2, T, 1]` (v2).
        integral (`str`): "mean", "softmax" or "none".
        layout (`DintIntegralLayout`): which query rows count and where documents start (unused for "none").
        key_valid (`torch.Tensor` broadcastable to `[B, 1, T, K]`, bool): the keys each row may attend to (the
            support of the "softmax" integral's softmax).
        past_column_sums (`torch.Tensor` of shape `[B, H/2, K']`, *optional*): the summed signal maps of the current
            document's rows before this call (from the cache); `K' <= K`, keys cached since count as 0.

    Returns:
        final_weights (`[B, H/2, T, K]`, fp32) and running_column_sums (`[B, H/2, T, K]`, fp32, None for "none"),
        what the cache keeps.
    """
    lambda_full = lambda_full.float()
    signal_weights, noise_weights = signal_weights.float(), noise_weights.float()
    if integral == "none":
        return signal_weights - lambda_full * noise_weights, None
    if past_column_sums is not None:
        past_column_sums = nn.functional.pad(past_column_sums, (0, signal_weights.shape[-1] - past_column_sums.shape[-1]))
    running_column_sums = segmented_running_sum(signal_weights, layout, past_column_sums, query_dim=2)
    integral_weights = running_column_sums * layout.inverse_query_count.transpose(1, 2)  # [B, 1, T, 1]
    if integral == "softmax":
        key_valid = key_valid.expand_as(integral_weights)
        integral_weights = integral_weights.masked_fill(~key_valid, torch.finfo(torch.float32).min).softmax(dim=-1)
        integral_weights = torch.where(key_valid.any(dim=-1, keepdim=True), integral_weights, 0.0)
    final_weights = signal_weights - lambda_full * noise_weights + lambda_full * integral_weights
    return final_weights, running_column_sums


def requested_integral_kernel() -> str:
    """`DINT_INTEGRAL_KERNEL`, read once per forward (a test or benchmark may change it between forwards)."""
    requested = environment_variable(INTEGRAL_KERNEL_VARIABLE) or "auto"
    if requested not in INTEGRAL_KERNEL_CHOICES:
        raise ValueError(
            f"{INTEGRAL_KERNEL_VARIABLE}={requested!r} is not one of {', '.join(INTEGRAL_KERNEL_CHOICES)} "
            "(unset: auto)."
        )
    return requested


def _triton_kernel_module():
    """`integral_triton_kernel`, imported where a forward may take it (Triton reads `TRITON_INTERPRET` when it is
    imported, so `import modeling_dint` does not import it). Written `from .x import y`, the form transformers'
    remote-code loaders follow."""
    from .integral_triton_kernel import triton_integral  # noqa: PLC0415

    return sys.modules[triton_integral.__module__]


def choose_implementation(
    device: torch.device,
    requested: str,
    dtype: torch.dtype,
    elements: int,
    gradient: bool,
    training: bool,
    compiling: bool,
    carry_per_row: bool,
    state: DintIntegralState | None,
) -> str:
    """Which implementation computes a forward's calls of the fast path, decided here only:

    - `TRITON_KERNEL` (`integral_triton_kernel`, forward and backward): CUDA, where Triton is importable, fp32, bf16 or
      fp16, with a gradient, in training mode (a reentrant checkpoint's forward and its recomputation round alike), or
      from `TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT` elements of O1 per layer; with `DINT_INTEGRAL_KERNEL=triton` every
      call it can compute (CPU tensors under `TRITON_INTERPRET=1`), and a clear error for what it cannot;
    - `CPU_KERNEL` (`integral_cpu_kernel`, no backward): CPU, fp32 or bf16, no gradient, where the op builds, and a
      holder that keeps the state after the last row only, or a table (packed requests);
    - `EAGER`, the eager ops, everywhere else: `DINT_INTEGRAL_KERNEL=eager`, compiling or exporting (the compiler fuses
      them itself), requests packed into one row on a GPU.
    """
    if compiling or requested == EAGER:
        return EAGER
    if requested == TRITON_KERNEL or device.type == "cuda":
        if carry_per_row:
            return EAGER
        triton_kernel = _triton_kernel_module()
        runs = triton_kernel.runs_on(device)
        if requested != TRITON_KERNEL:
            pays_off = gradient or training or elements >= TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT
            return TRITON_KERNEL if runs and pays_off and dtype in triton_kernel.TRITON_DTYPES else EAGER
        if not runs:
            raise RuntimeError(
                f"{INTEGRAL_KERNEL_VARIABLE}=triton, but Triton cannot run on {device.type} tensors here: "
                + ("it is not installed." if not triton_kernel.triton_available() else "CPU tensors need "
                   "TRITON_INTERPRET=1, set before Triton is imported (its interpreter).")
            )
        if dtype not in triton_kernel.TRITON_DTYPES:
            raise ValueError(
                f"{INTEGRAL_KERNEL_VARIABLE}=triton, but the Triton kernel takes "
                f"{', '.join(str(allowed) for allowed in triton_kernel.TRITON_DTYPES)} and this forward computes in "
                f"{dtype}: unset {INTEGRAL_KERNEL_VARIABLE} or set it to eager."
            )
        return TRITON_KERNEL
    if device.type != "cpu" or gradient or dtype not in KERNEL_DTYPES:
        return EAGER
    if state is not None and not (state.keeps_state_table if carry_per_row else not state.records_rows):
        return EAGER
    return CPU_KERNEL if integral_kernel() is not None else EAGER


def _choose(layout: DintIntegralLayout, device: torch.device, implementation: str, compiling: bool) -> None:
    """Sets the layout's implementation, the eager ops' scan for `device`, and the rows a kernel reads where one runs
    the calls (`plan_integral`, `DintIntegralLayout.to`)."""
    layout.implementation, layout.running_sum = implementation, None
    if not compiling:  # (a compiler traces the plain cumsum and fuses it); a kernel's plan too: `kernel_takes` may refuse
        if device.type == "cpu" and blocked_scan_is_exact():
            layout.running_sum = blocked_running_sum
        elif device.type == "cuda":
            layout.running_sum = _triton_kernel_module().rows_last_running_sum
    if implementation != EAGER and not layout.decoding_step:  # (a caller may have built them: vLLM's step)
        if layout.kernel_row_flags is None:
            layout.kernel_row_flags = layout.row_flags()
        if layout.kernel_inverse_count is None:
            layout.kernel_inverse_count = layout.inverse_query_count[:, :, 0, 0]


def _writable_here(state: torch.Tensor | None) -> bool:
    """Whether a decoding step may add to `state` in place: a state made under `torch.inference_mode()` (a pipeline's
    prefill) cannot be written outside it."""
    return state is not None and not (state.is_inference() and not torch.is_inference_mode_enabled())


def plan_integral(
    layout: DintIntegralLayout,
    state: DintIntegralState | None,
    device: torch.device,
    dtype: torch.dtype,
    elements: int,
    training: bool,
    carried_tokens: bool | torch.Tensor,
    head_norm: bool = False,
) -> DintIntegralLayout:
    """The plan every layer's call of one forward runs (written into `layout`): the implementation
    (`choose_implementation`, from the device, the dtype, grad and training mode, compiling, `DINT_INTEGRAL_KERNEL` and
    the holder), and whether the call is a decoding step: one row per sequence continuing carried sums
    (`carried_tokens`), without a gradient, in eager mode, where the holder keeps only the last state, and where no
    kernel costs the host less: the CPU op, which fuses the head norm's six ops too, does for layers that normalize
    each head (`head_norm`, v1); without a head norm the in-place ops do. What varies per layer (a head norm's hooks) is
    checked at the call (`kernel_takes`), and a layer on another device re-plans in `DintIntegralLayout.to`.

    Args:
        elements (`int`): the elements of O1 per layer, `B * T * heads * C`.
        training (`bool`): the model's training mode.
        carried_tokens (`bool`, or a bool `torch.Tensor` where a static cache's length is one): whether the holder
            carries sums of earlier calls.
        head_norm (`bool`): whether the layers normalize each head (`config.head_norm`).
    """
    compiling, gradient = torch.compiler.is_compiling(), torch.is_grad_enabled()
    layout.state = state
    layout.plan_inputs = (requested_integral_kernel(), dtype, elements, gradient, training, compiling)
    implementation = choose_implementation(device, *layout.plan_inputs, layout.carry_per_row, state)
    layout.decoding_step = (
        carried_tokens is not False  # (a static cache's length may be a tensor: its rows' factor then decides)
        and implementation != TRITON_KERNEL
        and not (implementation == CPU_KERNEL and head_norm)
        and not (compiling or gradient or layout.carry_per_row)
        and state is not None
        and not state.records_rows
        and layout.running_query_count.shape[1] == 1
        and _writable_here(state.carried(0, SIGNAL_SUM))
    )
    _choose(layout, device, implementation, compiling)
    if layout.decoding_step and isinstance(layout.carry_kept, torch.Tensor):
        layout.step_carry_factor = layout.carry_kept.to(torch.float32).view(-1, 1, 1, 1)
    if layout.decoding_step and layout.query_valid is not None:
        layout.step_valid = layout.query_valid.view(-1, 1, 1, 1)
    return layout


def forward_integral_layout(
    integral: str,
    channels: int,
    head_norm: bool,
    cache,
    query_valid: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor,
    training: bool,
    cu_seq_lens_q: torch.Tensor | None = None,
    layout: DintIntegralLayout | None = None,
) -> DintIntegralLayout | None:
    """The planned `DintIntegralLayout` of one forward pass, shared by all layers (None for integral "none"). It reads
    the count of valid rows that the cache carries and stores the new one (in layer 0: the only place it is kept).
    `integral`, `channels` (`heads * C` of O1 per row) and `head_norm` are the model's (`DintModel.integral_settings`,
    read from the config once: a config attribute costs microseconds, and a built model's refuses edits of them).

    Without the caller's `position_ids` no row after row 0 starts a document, and row 0 continues the cache's
    document if the cache holds tokens (a static cache rewound to 0, as ExecuTorch's recipe does, restarts). A caller
    that builds its layout (continuous batching: `layout`) passes its own holder as `cache`.
    """
    if integral == "none":
        requested_integral_kernel()  # validated in every forward, though no integral runs
        return None
    state = cache if cache is None or isinstance(cache, DintIntegralState) else CacheIntegralState(cache)
    batch_size, query_length = inputs_embeds.shape[:2]
    device, carried_tokens = inputs_embeds.device, False
    if layout is None:
        document_start = document_starts(query_valid, position_ids, batch_size, query_length, cu_seq_lens_q)
        past_query_count = None
        if state is not None:
            past_query_count, carried_tokens = state.carried(0, QUERY_COUNT), cache.get_seq_length() > 0
        layout = DintIntegralLayout.build(
            query_valid, document_start, past_query_count, batch_size, query_length, device, carried_tokens
        )
        if state is not None:
            state.store(layout.running_query_count[:, -1], 0, QUERY_COUNT, layout.running_query_count)
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else inputs_embeds.dtype
    return plan_integral(layout, state, device, dtype, batch_size * query_length * channels, training, carried_tokens, head_norm)


FP32_EPS = torch.finfo(torch.float32).eps
"""torch's RMSNorm eps where the module has none (the combination it normalizes is fp32)."""


def kernel_head_norm(head_norm: nn.Module | None) -> tuple:
    """The kernels' head-norm arguments `(weight, normalize, eps)` for `head_norm` (torch's `nn.RMSNorm` over the
    channels, or `nn.Identity` / None: no norm)."""
    if not isinstance(head_norm, nn.RMSNorm):
        return None, False, FP32_EPS
    return head_norm.weight, True, FP32_EPS if head_norm.eps is None else head_norm.eps


_GLOBAL_FORWARD_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)
"""torch's global hooks (`register_module_forward_hook`, `..._pre_hook`): dictionaries it fills in place."""


def has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` does more than its class's `forward`: its own or global hooks, or a replaced `forward`
    (Accelerate's offloading hooks): then a kernel or a fused product cannot stand in for the call."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in module.__dict__
        or _GLOBAL_FORWARD_HOOKS[0]
        or _GLOBAL_FORWARD_HOOKS[1]
    )


def kernel_takes(signal_output, noise_output, lambda_, head_norm: nn.Module | None, dtype: torch.dtype) -> bool:
    """What the plan cannot know of one layer's call, and every kernel needs (arguments as `DintIntegral.__call__`'s):
    plain tensors of the planned `dtype` with contiguous channels, an fp32 lambda on their device, and a head norm that computes
    torch's RMSNorm over the channels (`nn.RMSNorm`, or a class that says so with `fused_by_integral_kernels`) or
    nothing (`nn.Identity`), with no hooks to run (a kernel does not call the module) and its weight beside the
    outputs (not offloaded)."""
    if (
        type(signal_output) is not torch.Tensor
        or head_norm is None
        or signal_output.dtype != dtype
        or noise_output.dtype != dtype
        or lambda_.dtype != torch.float32
        or lambda_.device != signal_output.device
        or signal_output.stride(-1) != 1
        or noise_output.stride(-1) != 1
        or has_hooks(head_norm)
    ):
        return False
    norm_class = type(head_norm)
    if norm_class is nn.Identity:
        return True
    if not (norm_class is nn.RMSNorm or norm_class.__dict__.get("fused_by_integral_kernels", False)):
        return False
    if tuple(head_norm.normalized_shape) != (signal_output.shape[-1],):
        return False
    return head_norm.weight is None or head_norm.weight.device == signal_output.device


def normalized(combined: torch.Tensor, head_norm: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """`head_norm(combined)` in `dtype`, without a module call where it has no hook to run."""
    if has_hooks(head_norm):
        return head_norm(combined).to(dtype)
    if type(head_norm) is nn.Identity:
        return combined.to(dtype)
    return head_norm.forward(combined).to(dtype)


class DintIntegral:
    """The integral term of one DINT layer, for every head layout and caller: given the differential outputs (or maps)
    and lambda, it runs the forward's plan (`DintIntegralLayout`) and returns the combined output (or map). A plain
    object, no module: no call overhead.

    Args:
        integral (`str`): the model's `config.integral`.
        layer_idx (`int`): the layer whose state it reads and writes.
    """

    def __init__(self, integral: str, layer_idx: int):
        self.mode = integral
        self.layer_idx = layer_idx

    def __call__(
        self, signal_output, noise_output, lambda_, layout: DintIntegralLayout | None, head_norm=None, state=None
    ) -> torch.Tensor:
        """The fast path: `head_norm(O1 - lambda * O2 + lambda * running_mean(O1))`.

        Args:
            signal_output, noise_output (`[B, T, heads, C]`): O1 and O2, in the model's dtype.
            lambda_ (`torch.Tensor`, fp32): a scalar, or `[B, T, heads, 1]`.
            layout (`DintIntegralLayout`): the forward's planned layout (None for integral "none"; a caller that builds
                its own layouts, vLLM's, may pass one unplanned: the first call plans it).
            head_norm (`nn.Module`, *optional*): the attention's head norm (`DintHeadRMSNorm`, or `nn.Identity`).
            state (`DintIntegralState`, *optional*): the holder of this call's sums, where it is not the layout's.

        Returns:
            `[B, T, heads, C]`: with `head_norm`, the normalized combination in O1's dtype; without, the combination in
            fp32 (the model's dtype for integral "none"), for a caller that normalizes it itself.
        """
        if self.mode == "none":  # DIFF: v1 as DiffLlama, op for op (bit for bit); v2 in one op (rounded once if fused)
            if lambda_.dim() == 0:
                combined = signal_output - lambda_ * noise_output
            else:
                combined = torch.addcmul(signal_output, lambda_, noise_output, value=-1)
            return combined if head_norm is None else normalized(combined, head_norm, signal_output.dtype)
        state = layout.state if state is None else state
        if layout.implementation is None:  # a caller's own layout (vLLM's): planned by its first call
            plan_integral(layout, state, signal_output.device, signal_output.dtype, signal_output.numel(), False, False)
        combined = self._decoding_step(signal_output, noise_output, lambda_, layout, state) if layout.decoding_step else None
        if combined is None and layout.implementation != EAGER and kernel_takes(
            signal_output, noise_output, lambda_, head_norm, layout.plan_inputs[1]
        ):
            return kernel_integral(self.layer_idx, signal_output, noise_output, lambda_, layout, state, head_norm)
        if combined is None:  # the reference
            carry = None if state is None else state.carried(self.layer_idx, SIGNAL_SUM)
            running_signal_sum = segmented_running_sum(signal_output, layout, carry, layout.running_sum)
            if state is not None:
                state.store(running_signal_sum[:, -1], self.layer_idx, SIGNAL_SUM, running_signal_sum)
            combined = combine_with_integral(
                signal_output.float(), noise_output.float(), lambda_, running_signal_sum, layout.inverse_query_count
            )
        return combined if head_norm is None else normalized(combined, head_norm, signal_output.dtype)

    def _decoding_step(self, signal_output, noise_output, lambda_, layout, state) -> torch.Tensor | None:
        """A decoding step (`layout.decoding_step`; arguments as `__call__`'s): `S += O1` in the holder's own state, in
        place (`S = O1 + S * factor` in one op where a row may start a document, factor 0 there; O1 zeroed where it
        is padding), then the combination: the reference's arithmetic at one row, in its fewest ops (no casts: each
        op reads O1 and O2 as fp32). None where the holder keeps no state of this batch (one kept for the batch
        broadcasts): the reference runs."""
        signal_sum = state.carried(self.layer_idx, SIGNAL_SUM)
        if signal_sum is None or signal_sum.shape[0] != signal_output.shape[0]:
            return None
        running_signal_sum = signal_sum.unsqueeze(1)  # [B, 1, heads, C], a view of the state
        new_rows = signal_output if layout.step_valid is None else torch.where(layout.step_valid, signal_output, 0.0)
        if layout.step_carry_factor is None:
            running_signal_sum.add_(new_rows)
        else:  # (the factor is 0 or 1 and S finite: exactly `S * factor + O1`, rounded once as the two ops round it)
            torch.addcmul(new_rows, running_signal_sum, layout.step_carry_factor, out=running_signal_sum)
        return combine_with_integral(signal_output, noise_output, lambda_, running_signal_sum, layout.inverse_query_count)

    def maps(
        self,
        signal_weights: torch.Tensor,
        noise_weights: torch.Tensor,
        lambda_: torch.Tensor,
        layout: DintIntegralLayout | None,
        key_valid: torch.Tensor,
    ) -> torch.Tensor:
        """The materializing path: A_final `[B, heads, T, K]` (fp32) from the maps A1, A2 `[B, heads, T, K]` and
        lambda (a scalar, or `[B, T, heads, 1]`), carrying the column sums of A1 in the layout's holder."""
        if lambda_.dim() > 0:
            lambda_ = lambda_.transpose(1, 2)  # [B, heads, T, 1]
        state = None if layout is None else layout.state
        carry = None if state is None else state.carried(self.layer_idx, COLUMN_SUMS)
        final_weights, running_column_sums = compose_final_attention(
            signal_weights, noise_weights, lambda_, self.mode, layout, key_valid, carry
        )
        if state is not None and running_column_sums is not None:  # [B, heads, T, K], stored with the rows first
            running_rows = running_column_sums.transpose(1, 2)
            state.store(running_rows[:, -1], self.layer_idx, COLUMN_SUMS, running_rows)
        return final_weights


def kernel_integral(layer_idx: int, signal_output, noise_output, lambda_, layout, state, head_norm) -> torch.Tensor:
    """The plan's kernel (arguments as `DintIntegral.__call__`'s): the combination `[B, T, heads, C]` in O1's dtype;
    stores the sum after the last row `[B, heads, C]` (fp32), after every row where the holder records them
    (Triton), or each packed request's in the holder's table, in place (the CPU op)."""
    if layout.implementation == CPU_KERNEL and layout.carry_per_row and state is not None:
        table, carry_slot, store_slot = state.state_table(layer_idx)
        return packed_requests_kernel(
            signal_output, noise_output, lambda_, layout.kernel_inverse_count, layout.kernel_row_flags, table,
            carry_slot, store_slot, head_norm,
        )
    carry = None if state is None else state.carried(layer_idx, SIGNAL_SUM)
    if carry is not None and carry.shape[0] != signal_output.shape[0]:
        carry = carry.expand(signal_output.shape[0], *carry.shape[1:])  # kept once for the batch: it broadcasts
    arguments = (signal_output, noise_output, lambda_, layout.kernel_inverse_count, layout.kernel_row_flags, carry)
    running_signal_sum = None
    if layout.implementation == TRITON_KERNEL:
        recording = state is not None and state.records_rows
        output, last_signal_sum, running_signal_sum = _triton_kernel_module().triton_integral(
            *arguments, *kernel_head_norm(head_norm), store_running=recording
        )
    else:
        output, last_signal_sum = built_integral_kernel()(*arguments, *kernel_head_norm(head_norm))
    if state is not None:
        state.store(last_signal_sum, layer_idx, SIGNAL_SUM, running_signal_sum)
    return output


def packed_requests_kernel(
    signal_output: torch.Tensor,
    noise_output: torch.Tensor,
    lambda_: torch.Tensor,
    inverse_count: torch.Tensor,
    row_flags: torch.Tensor,
    state_table: torch.Tensor,
    carry_slot: torch.Tensor,
    store_slot: torch.Tensor,
    head_norm: nn.Module,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """`integral_cpu_kernel`'s one pass over requests packed into one row, each reading and storing its sums in
    `state_table` in place: `DintIntegral`'s CPU kernel for packed requests, and vLLM's integral op with the rows its
    step prepared once for every layer (where `takes_cpu_kernel` holds).

    Args:
        signal_output, noise_output (`[1, T, heads, C]` or `[T, heads, C]`): O1 and O2.
        lambda_ (fp32): a scalar, or per row and head `[(1,) T, heads(, 1)]`.
        inverse_count (`[(1,) T]` fp32), row_flags (`[(1,) T]` uint8): the layout's `1 / c_n` and `row_flags`.
        state_table (`[slots, heads, C]` fp32), carry_slot, store_slot (`[(1,) T]` int64, -1 for none): the sums,
            the slot each row reads before it and stores after it.
        head_norm (`nn.RMSNorm` or `nn.Identity`): the attention's head norm.
        output (*optional*): written in place (contiguous, O1's shape and dtype).

    Returns:
        The normalized combination in O1's dtype and shape (`output` where given).
    """
    combined, _ = built_integral_kernel()(
        signal_output, noise_output, lambda_, inverse_count, row_flags, None, *kernel_head_norm(head_norm),
        state_table, carry_slot, store_slot, output,
    )
    return combined if output is None else output


def takes_cpu_kernel(signal_output, noise_output, lambda_, layout, state, head_norm) -> bool:
    """Whether `integral_cpu_kernel` computes a call (arguments as `DintIntegral.__call__`'s; vLLM's integral op asks
    once per engine)."""
    implementation = choose_implementation(
        signal_output.device, requested_integral_kernel(), signal_output.dtype, signal_output.numel(),
        torch.is_grad_enabled(), False, torch.compiler.is_compiling(), layout.carry_per_row, state,
    )
    return implementation == CPU_KERNEL and kernel_takes(
        signal_output, noise_output, lambda_, head_norm, signal_output.dtype
    )


def dint_attention_map(
    attentions: torch.Tensor,
    lambda_full: torch.Tensor | float,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    integral: str = "mean",
    differential_attention: str = "v1",
) -> torch.Tensor:
    """A_final per differential head, from the maps a DINT model returns with `output_attentions=True` (eager).

    Args:
        attentions (`torch.Tensor` of shape `[B, H, T, T]`): one layer's maps over a whole sequence (no cache), one per
            query head: v1, the H/2 signal maps then the H/2 noise maps (as DiffLlama returns them); v2, signal and
            noise maps alternating (query heads 2i and 2i+1).
        lambda_full (`torch.Tensor` or `float`): the layer's lambda: v1, a scalar,
            `model.model.layers[i].self_attn.lambda_full()`; v2, one per row and differential head `[B, T, H/2]`,
            `layer.self_attn.differential_lambda(layer.input_layernorm(outputs.hidden_states[i]))`.
        attention_mask (`torch.Tensor` of shape `[B, T]`, *optional*): the 2D padding mask (1 = token, 0 = padding).
        position_ids (`torch.Tensor` of shape `[B, T]`, *optional*): positions restarting at 0 start a new document
            (packed sequences); by default one document per row.
        integral (`str`): the model's `config.integral`.
        differential_attention (`str`): the model's `config.differential_attention`, "v1" or "v2".

    Returns:
        `torch.Tensor` of shape `[B, H/2, T, T]`, fp32: A_final; every valid row sums to 1.

    ```python
    >>> outputs = model(input_ids, attention_mask=attention_mask, output_attentions=True)  # attn_implementation="eager"
    >>> a_final = dint_attention_map(outputs.attentions[0], model.model.layers[0].self_attn.lambda_full(),
    ...                              attention_mask, integral=model.config.integral)
    ```
    """
    batch_size, num_maps, query_length, key_length = attentions.shape
    if query_length != key_length:
        raise ValueError(
            f"`dint_attention_map` composes maps over a whole sequence (query length == key length); got "
            f"{query_length} queries and {key_length} keys. With a cache, gather the rows of all steps first."
        )
    query_valid = valid_query_rows(attention_mask, batch_size, query_length)
    document_start = document_starts(query_valid, position_ids, batch_size, query_length)
    layout = DintIntegralLayout.build(query_valid, document_start, None, batch_size, query_length, attentions.device)
    key_valid = torch.ones(query_length, key_length, dtype=torch.bool, device=attentions.device).tril()[None, None]
    if attention_mask is not None:
        key_valid = key_valid & attention_mask.bool()[:, None, None, :]
    if document_start is not None:
        segment = document_start.long().cumsum(-1)
        key_valid = key_valid & (segment[:, None, :, None] == segment[:, None, None, :])
    lambda_full = torch.as_tensor(lambda_full, dtype=torch.float32, device=attentions.device)
    if differential_attention == "v1":
        signal_weights, noise_weights = attentions.chunk(2, dim=1)
    else:
        signal_weights, noise_weights = attentions[:, 0::2], attentions[:, 1::2]
        lambda_full = lambda_full.reshape(batch_size, query_length, num_maps // 2, 1)
    return DintIntegral(integral, layer_idx=0).maps(signal_weights, noise_weights, lambda_full, layout, key_valid)


__all__ = [
    "CacheIntegralState",
    "DintIntegral",
    "DintIntegralLayout",
    "DintIntegralState",
    "combine_with_integral",
    "compose_final_attention",
    "dint_attention_map",
    "document_starts",
    "forward_integral_layout",
    "packed_request_rows",
    "plan_integral",
    "segmented_running_sum",
    "valid_query_rows",
]
