# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The DINT integral, in one place: where its running mean counts and restarts, the running sums, the state it carries
in the cache, and the combination with the differential outputs.

Per differential head, `A_final = A1 - lambda * A2 + lambda * G`, where row n of G is the mean of the signal map A1
over the valid query rows m <= n of n's document (c_n of them). Every head layout (`config.differential_attention`)
supplies the signal and noise outputs O1, O2 (or maps A1, A2) and lambda; `DintIntegral` does the rest, the same code
for both layouts and for every caller (transformers' attention, the continuous-batching step, vLLM's attention):

- the fast path (any attention backend, integral "mean"): since V does not depend on the query row, `G V` is the
  running mean of the signal output `O1 = A1 V`, so `out = O1 - lambda * (O2 - S / c)` with `S` the running sum of
  O1 (`segmented_running_sum`, `combine_with_integral`): O(N d) on top of DIFF attention, no N x N matrix;
- the materializing path (eager attention, or integral "softmax", which needs G itself): A1, A2, G and A_final as
  the paper writes them (`compose_final_attention`), the reference the fast path is tested against.

Both read one `DintIntegralLayout` per forward pass (which rows count, where documents restart, c_n), and both carry
the sums of earlier calls in the cache, which `DintIntegral` alone reads and writes, through transformers' Cache-level
methods (`get_recurrent_state`, `update_recurrent_state`; the layers that store them are in `cache_dint.py`). Padding
rows are excluded with `torch.where`, never by a product (a padding row may hold NaN).

This file travels with the remote code (`save_pretrained`): it imports nothing but torch and transformers.
"""

import functools
import os
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from .cache_dint import COLUMN_SUMS, QUERY_COUNT, SIGNAL_SUM, DintDynamicLayer, DintIntegralStateMixin, DintStaticLayer
from .integral_cpu_kernel import DOCUMENT_START, KERNEL_DTYPES, ROW_VALID, integral_kernel
from .integral_triton_kernel import TRITON_DTYPES, triton_available, triton_integral
from .integral_triton_kernel import runs_on as triton_kernel_runs_on
from .transformers_compat import HAS_GET_RECURRENT_STATE, build_dint_cache_layers, get_recurrent_state


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


@dataclass
class DintIntegralLayout:
    """Where the integral's running mean counts and restarts over the T query rows of one forward pass.

    It depends on the inputs only, so `DintModel.forward` builds it once (`DintIntegralLayout.build`) for all layers.
    A field that is None stands for a case known without reading tensor values, and the work it would cost is skipped.

    Attributes:
        query_valid (`torch.Tensor` of shape `[B, T]`, bool, or None when every row counts): the rows that are not
            padding.
        restart_row (`torch.Tensor` of shape `[B, T]`, long, or None when no document starts after row 0): the row of
            this call where row n's document starts (0 for the rows of a document that started before this call).
        in_carried_document (`torch.Tensor` of shape `[B, T]`, bool, or None with `restart_row`): the rows whose
            document started before this call, into which the cache's sums carry.
        carry_per_row (`bool`): whether the cache's sums come per query row `[B, T, ...]` (the requests packed into
            one row by continuous batching, each with its own past: `for_packed_requests`) instead of per batch row
            `[B, ...]`.
        carry_kept (`bool`, or a bool `torch.Tensor` of shape `[B]` or `[]`): for a call with no `restart_row`,
            whether row 0 continues the cache's document, so that the cache's sums carry into the call (False where
            row 0 starts a document: a position id 0).
        running_query_count (`torch.Tensor` of shape `[B, T]`, fp32): `c_n`, the valid rows m <= n of row n's
            document, the cache's count included.
        inverse_query_count (`torch.Tensor` of shape `[B, T, 1, 1]`, fp32, broadcastable against the fast path's
            `[B, T, H/2, 2d]`): `1 / max(c_n, 1)` (a document with no valid row yet has G = 0).
        kernel_row_flags (`torch.Tensor` of shape `[B, T]`, uint8, or None until `row_flags` builds it): the fused
            kernels' per-row flags, built by the first layer that needs them and kept for the others.
        kernel_inverse_count (`torch.Tensor` of shape `[B, T]`, fp32, or None until `inverse_count_rows` takes it):
            `inverse_query_count` as the fused kernels read it.
    """

    query_valid: torch.Tensor | None = None
    restart_row: torch.Tensor | None = None
    in_carried_document: torch.Tensor | None = None
    carry_per_row: bool = False
    carry_kept: torch.Tensor | bool = True
    running_query_count: torch.Tensor | None = None
    inverse_query_count: torch.Tensor | None = None
    kernel_row_flags: torch.Tensor | None = None
    kernel_inverse_count: torch.Tensor | None = None

    def document_first_rows(self) -> torch.Tensor:
        """`[B, T]` bool: each document's first row in this call (with `in_carried_document`: where the cache's sums
        enter; packed requests: each request's first row). Needs `restart_row`."""
        return self.restart_row == torch.arange(self.restart_row.shape[-1], device=self.restart_row.device)

    def row_flags(self, batch_size: int, query_length: int, device: torch.device) -> torch.Tensor:
        """The fused kernels' flags per row, `[B, T]` uint8 (`integral_cpu_kernel.ROW_VALID | DOCUMENT_START`): the rows
        that count, and the rows where the running sum restarts before adding (a document's first row; row 0 where the
        cache's sums do not carry; with `carry_per_row`, every request's first row, whose carried sum the kernel reads
        from the cache's table after the restart). Computed on the first layer's call, then kept for the others."""
        decoding_step = query_length == 1 and self.query_valid is None and self.restart_row is None
        if self.kernel_row_flags is None and decoding_step and not self.carry_per_row:
            if isinstance(self.carry_kept, torch.Tensor):
                kept = self.carry_kept.to(device).view(-1, 1)
                flags = torch.where(kept, ROW_VALID, ROW_VALID | DOCUMENT_START).to(torch.uint8)
            else:
                value = ROW_VALID if self.carry_kept else ROW_VALID | DOCUMENT_START
                flags = torch.full((1, 1), value, dtype=torch.uint8, device=device)
            self.kernel_row_flags = flags.expand(batch_size, 1)
        if self.kernel_row_flags is None:
            if self.restart_row is not None:
                starts = self.document_first_rows()
                if not self.carry_per_row:
                    starts &= ~self.in_carried_document
            else:
                starts = torch.zeros(batch_size, query_length, dtype=torch.bool, device=device)
                if isinstance(self.carry_kept, torch.Tensor):
                    starts[:, 0] = ~self.carry_kept.to(device)
                else:
                    starts[:, 0] = not self.carry_kept
            valid = torch.ones_like(starts) if self.query_valid is None else self.query_valid.to(torch.bool)
            flags = valid.to(torch.uint8) * ROW_VALID + starts.to(torch.uint8) * DOCUMENT_START
            self.kernel_row_flags = flags
        return self.kernel_row_flags

    def inverse_count_rows(self) -> torch.Tensor:
        """`1 / c_n` as the fused kernels read it, `[B, T]` fp32: a view of `inverse_query_count`, made once."""
        if self.kernel_inverse_count is None:
            self.kernel_inverse_count = self.inverse_query_count[:, :, 0, 0]
        return self.kernel_inverse_count

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
            past_query_count (`torch.Tensor` of shape `[B]`, *optional*): the cache's count of valid rows of the
                current document of each batch row.
            carry_kept (`bool` or bool `torch.Tensor`): without `document_start`, whether row 0 continues the
                cache's document, so that its sums carry (without a caller's position ids: whether the cache holds
                tokens).
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
        layout.running_query_count = segmented_running_sum(rows, layout, past_query_count, query_dim=1)
        layout.inverse_query_count = layout.running_query_count.clamp(min=1.0).reciprocal()[:, :, None, None]
        return layout

    @classmethod
    def for_packed_requests(
        cls, position_ids: torch.Tensor, cu_seq_lens_q: torch.Tensor, request_rows: tuple | None = None
    ) -> "DintIntegralLayout":
        """The layout of requests packed into one row, as continuous batching (transformers' and vLLM's) runs them:
        each request is one document of valid rows whose position ids continue its own past (its count of rows is its
        position + 1), and a request whose first row is past position 0 continues the sums of its earlier steps, which
        the cache gives per query row (`carry_per_row`). Rows past the last request (padding) join the last one.

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
        layer's device when a model is split over devices (`device_map`)."""
        moved = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                moved[field.name] = value.to(device, non_blocking=non_blocking)
        return replace(self, **moved)


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


def _cumsum_over_rows(rows: torch.Tensor, query_dim: int) -> torch.Tensor:
    """fp32 inclusive cumulative sum of `rows` over dimension `query_dim`, in the layout fastest on `rows`' device.

    CPUs scan the dimension in place (the fastest there for a dimension other than the first, forward and backward;
    the fast path's `[B, T, ...]` rows take `_blocked_running_sum` instead). CUDA scans a dimension that is not the
    last one a step at a time per column (12 ms against 0.55 ms per layer at 32K tokens on an H100, bench/README.md),
    so elsewhere the scan runs over an fp32 copy with the rows last.
    """
    if rows.shape[query_dim] == 1:
        return rows.float()
    if rows.device.type == "cpu":
        return _cumsum_in_place(rows, query_dim)
    return _cumsum_rows_last(rows, query_dim)


SCAN_BLOCK_ROWS = 16
"""Query rows per block of `_blocked_running_sum`: its matrix multiply does SCAN_BLOCK_ROWS multiply-adds per value
(16 measured fastest against 32 and 64 at 128 to 8192 rows, bench/README.md)."""


def _scans_in_blocks(rows: torch.Tensor, query_dim: int) -> bool:
    """Whether `segmented_running_sum` takes `_blocked_running_sum`: on CPUs, for rows `[B, T, ...]` with T > 1, in
    eager mode, where fp32 matrix multiplies are exact (a user may have let oneDNN run them in bf16 or tf32:
    `torch.backends.mkldnn.matmul.fp32_precision`, `torch.set_float32_matmul_precision`). torch's CPU cumsum does
    not vectorize the scan: 5-25x the time of one elementwise pass over the rows (bench/README.md)."""
    if query_dim != 1 or rows.shape[1] == 1 or rows.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():  # torch.compile and torch.export (is_compiling covers both): their own scan
        return False
    mkldnn_matmul = getattr(torch.backends.mkldnn, "matmul", None)
    precision = getattr(mkldnn_matmul, "fp32_precision", None)
    if precision is not None:
        return precision in ("none", "ieee")
    return torch.get_float32_matmul_precision() == "highest"


@functools.lru_cache(maxsize=8)
def _lower_triangle(size: int, device: torch.device) -> torch.Tensor:
    """`[size, size]` fp32, ones on and below the diagonal (a block's running sum as a matrix multiply). Built as a
    normal tensor even under `torch.inference_mode()`, so that a later training step may save it for backward."""
    with torch.inference_mode(False):
        return torch.ones(size, size, device=device).tril_()


def _blocked_running_sum(rows: torch.Tensor, restart_row: torch.Tensor | None) -> torch.Tensor:
    if torch.is_autocast_enabled(rows.device.type):  # the sums stay fp32 under a caller's autocast (a Trainer's bf16)
        with torch.autocast(rows.device.type, enabled=False):
            return _blocked_running_sum_fp32(rows, restart_row)
    return _blocked_running_sum_fp32(rows, restart_row)


def _blocked_running_sum_fp32(rows: torch.Tensor, restart_row: torch.Tensor | None) -> torch.Tensor:
    """Inclusive running sum of `rows` `[B, T, ...]` over dimension 1, restarting at each row's `restart_row`, in fp32,
    as matrix multiplies: within each block of `SCAN_BLOCK_ROWS` rows a lower-triangular matrix (masked where a document
    restarts inside the block) sums the block's rows; the sum at each block's last row, over the blocks before, is the
    same running sum one level up (T / SCAN_BLOCK_ROWS rows); a row adds the sum at the previous block's last row where
    its document started before its block.

    Args:
        rows (`torch.Tensor` of shape `[B, T, ...]`): the rows, padding rows already zeroed.
        restart_row (`torch.Tensor` of shape `[B, T]`, long, *optional*): the row where row n's document starts
            (`DintIntegralLayout.restart_row`); None: every row continues row 0's document.

    Returns:
        `torch.Tensor` of `rows`' shape, fp32.
    """
    batch_size, query_length = rows.shape[:2]
    block = min(SCAN_BLOCK_ROWS, query_length)
    num_blocks = -(-query_length // block)
    padded_length = num_blocks * block
    flat_rows = rows.reshape(batch_size, query_length, -1)
    if padded_length != query_length:
        # One pass for the padding to whole blocks (zero rows at the end) and the cast to fp32.
        padded_rows = flat_rows.new_empty(batch_size, padded_length, flat_rows.shape[-1], dtype=torch.float32)
        padded_rows[:, :query_length] = flat_rows
        padded_rows[:, query_length:] = 0.0
        flat_rows = padded_rows
    else:
        flat_rows = flat_rows.float()
    blocks = flat_rows.view(batch_size, num_blocks, block, -1)
    lower_triangle = _lower_triangle(block, rows.device)
    if restart_row is None:
        within_blocks = torch.matmul(lower_triangle, blocks)  # [B, num_blocks, block, C]
    else:
        if padded_length != query_length:  # padding rows continue the last row's document
            restart_row = torch.cat([restart_row, restart_row[:, -1:].expand(-1, padded_length - query_length)], 1)
        row_index = torch.arange(padded_length, device=rows.device)
        # Row i of a block sums the block's rows j <= i that are in its document (j >= restart_row[i]).
        in_document = row_index.view(num_blocks, 1, block) >= restart_row.view(batch_size, num_blocks, block, 1)
        within_blocks = torch.matmul(lower_triangle * in_document, blocks)
    if num_blocks == 1:
        running = within_blocks
    else:
        block_ends = within_blocks[:, :, -1]  # [B, num_blocks, C]: each block's last row, summed inside its block
        block_restart = None if restart_row is None else restart_row[:, block - 1 :: block] // block
        previous_ends = nn.functional.pad(_blocked_running_sum_fp32(block_ends, block_restart)[:, :-1], (0, 0, 1, 0))
        previous_ends = previous_ends.unsqueeze(2)  # [B, num_blocks, 1, C]: at the previous block's last row, 0 for block 0
        if restart_row is None:
            running = within_blocks + previous_ends
        else:
            block_first_row = row_index - row_index % block
            continues = (restart_row < block_first_row).view(batch_size, num_blocks, block, 1)
            running = torch.addcmul(within_blocks, continues.to(torch.float32), previous_ends)
    running = running.view(batch_size, padded_length, -1)
    if padded_length != query_length:
        running = running[:, :query_length]
    return running.view(rows.shape)


def _cumsum_in_place(rows: torch.Tensor, query_dim: int) -> torch.Tensor:
    # Cast, then scan: `cumsum(dtype=torch.float32)` would run its backward scan in the input's dtype (bf16).
    return rows.float().cumsum(query_dim)


def _cumsum_rows_last(rows: torch.Tensor, query_dim: int) -> torch.Tensor:
    rows_last = rows.movedim(query_dim, -1).to(torch.float32, memory_format=torch.contiguous_format)
    return rows_last.cumsum(-1).movedim(-1, query_dim)


def segmented_running_sum(
    rows: torch.Tensor,
    layout: DintIntegralLayout,
    carry: torch.Tensor | None = None,
    query_dim: int = 1,
) -> torch.Tensor:
    """Inclusive running sum over the query rows of `rows`, in fp32, counting valid rows only and restarting at each
    document start.

    Args:
        rows (`torch.Tensor`): one value per query row along `query_dim`: the fast path's signal outputs
            `[B, T, H/2, 2d]` (query_dim 1), the signal maps `[B, H/2, T, K]` (query_dim 2), or `[B, T]`.
        layout (`DintIntegralLayout`): which rows count and where documents start.
        carry (`torch.Tensor`, *optional*): the sum over the rows of the current document before this call (from the
            cache): `rows`' shape without the query dimension, or with it where `layout.carry_per_row`.

    Returns:
        `torch.Tensor` of `rows`' shape, fp32: row n holds the sum of the valid rows m <= n of n's document.
    """

    if (
        query_dim == 1
        and rows.shape[1] == 1
        and carry is not None
        and layout.carry_kept is True
        and layout.query_valid is None
        and layout.restart_row is None
        and not layout.carry_per_row
    ):  # a decoding step: one valid row, which continues the carried document
        return rows + carry.float().unsqueeze(1)

    def along_rows(per_row: torch.Tensor) -> torch.Tensor:  # [B, T] -> broadcastable against `rows`
        return per_row.view(per_row.shape[0], *[1] * (query_dim - 1), per_row.shape[1], *[1] * (rows.dim() - query_dim - 1))

    if layout.query_valid is not None:
        # `where`, never a product: a padding row may hold anything, NaN included.
        rows = torch.where(along_rows(layout.query_valid), rows, 0.0)
    if _scans_in_blocks(rows, query_dim):
        running = _blocked_running_sum(rows, layout.restart_row)
    else:
        running = _cumsum_over_rows(rows, query_dim)
        if layout.restart_row is not None:
            # Every row subtracts the sum before its document's first row (0 for a document that starts at row 0).
            running = running - (running - rows).gather(query_dim, along_rows(layout.restart_row).expand(rows.shape))
    if carry is not None:
        carry = carry.float() if layout.carry_per_row else carry.float().unsqueeze(query_dim)
    if layout.restart_row is None:  # no document starts after row 0
        if carry is None or layout.carry_kept is False:
            return running
        if layout.carry_kept is not True:
            # One multiply-add: the carry is a sum of valid rows (finite), so a 0/1 factor drops it exactly.
            return torch.addcmul(running, layout.carry_kept.view(-1, *[1] * (rows.dim() - 1)).to(carry.dtype), carry)
        return running + carry
    # A row of a document that started before this call adds the carry.
    if carry is None:
        return running
    return running + torch.where(along_rows(layout.in_carried_document), carry, 0.0)


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


def combine_with_integral(
    signal_output: torch.Tensor,
    noise_output: torch.Tensor,
    lambda_: torch.Tensor,
    running_signal_sum: torch.Tensor,
    inverse_query_count: torch.Tensor,
) -> torch.Tensor:
    """The fast path's DINT output, `A1 V - lambda * A2 V + lambda * G V = O1 - lambda * (O2 - S / c)` (fp32).

    Args:
        signal_output, noise_output (`[..., T, heads, C]`, fp32; on CUDA without a gradient also the model's dtype,
            which its ops cast to fp32 as they read it): O1 and O2.
        lambda_ (`torch.Tensor`, fp32): a scalar (v1) or one per row and head `[..., T, heads, 1]` (v2).
        running_signal_sum (`[..., T, heads, C]`, fp32): S, the running sum of O1 over the rows of each document.
        inverse_query_count (broadcastable to `[..., T, 1, 1]`, fp32): 1 / c_n.
    """
    noise_minus_integral = torch.addcmul(noise_output, running_signal_sum, inverse_query_count, value=-1)
    return torch.addcmul(signal_output, lambda_, noise_minus_integral, value=-1)


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
    (O(1) per forward). A cache that declares `is_dint_cache` (DINT's continuous-batching step) carries every DINT
    layer's state itself.
    """
    if getattr(cache, "is_dint_cache", False):
        return
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


def forward_integral_layout(
    query_valid: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache,
    batch_size: int,
    query_length: int,
    device: torch.device,
    cu_seq_lens_q: torch.Tensor | None = None,
) -> DintIntegralLayout:
    """The `DintIntegralLayout` of one forward pass, shared by all layers; it reads the count of valid rows that the
    cache carries and stores the new one (in layer 0's state: the only place the count is kept).

    Without the caller's `position_ids` no row after row 0 starts a document, and row 0 continues the cache's
    document if the cache holds tokens (a static cache rewound to 0, as ExecuTorch's recipe does, restarts).
    """
    document_start = document_starts(query_valid, position_ids, batch_size, query_length, cu_seq_lens_q)
    past_query_count, carry_kept = None, False
    if cache is not None:
        past_query_count = carried_state(cache, 0, QUERY_COUNT)
        carry_kept = cache.get_seq_length() > 0
    layout = DintIntegralLayout.build(
        query_valid, document_start, past_query_count, batch_size, query_length, device, carry_kept
    )
    if cache is not None:
        count = layout.running_query_count
        cache.update_recurrent_state(count[:, -1], 0, state_idx=QUERY_COUNT, running_rows=count)
    return layout


def records_running_rows(cache, layer_idx: int) -> bool:
    """Whether `cache.update_recurrent_state` keeps the state after every new row, not only the last: a DINT cache
    layer recording its past for `crop` (assisted decoding), or a cache of DINT's own steps (`is_dint_cache`)."""
    if getattr(cache, "is_dint_cache", False):
        return True
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return True
    return bool(getattr(layers[layer_idx], "record_past", False))


def carried_state(cache, layer_idx: int, state_idx: int) -> torch.Tensor | None:
    """`cache.get_recurrent_state(layer_idx, state_idx)` (transformers' Cache from 5.23, and DINT's serving steps);
    before 5.23, `transformers_compat.get_recurrent_state`."""
    if HAS_GET_RECURRENT_STATE:
        return cache.get_recurrent_state(layer_idx, state_idx)
    return get_recurrent_state(cache, layer_idx, state_idx)


FP32_EPS = torch.finfo(torch.float32).eps
"""torch's RMSNorm eps where the module has none (the combination it normalizes is fp32)."""


def kernel_head_norm(head_norm: nn.Module) -> tuple:
    """The fused kernels' head-norm arguments `(weight, normalize, eps)` for `head_norm` (torch's `nn.RMSNorm` over the
    channels, or `nn.Identity`: no norm)."""
    if not isinstance(head_norm, nn.RMSNorm):
        return None, False, FP32_EPS
    return head_norm.weight, True, FP32_EPS if head_norm.eps is None else head_norm.eps


INTEGRAL_KERNEL_VARIABLE = "DINT_INTEGRAL_KERNEL"
EAGER, CPU_KERNEL, TRITON_KERNEL = "eager", "cpu", "triton"
INTEGRAL_KERNEL_CHOICES = ("auto", EAGER, TRITON_KERNEL)
"""The values of `DINT_INTEGRAL_KERNEL`: "auto" (unset: by device, `DintIntegral.kernel_for`), "eager" (the eager ops
everywhere: the reference) or "triton" (the Triton kernel wherever it can compute a call, CPU tensors under
`TRITON_INTERPRET=1` included: how machines without a GPU test it)."""


TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT = 1 << 23
"""With `DINT_INTEGRAL_KERNEL` unset, a CUDA call of an attention in eval mode that wants no gradient and has fewer
elements of O1 than this (`B * T * heads * C`: a decoding step, a short prefill) runs the eager ops, not the Triton
kernel. Measured on an H200 (bf16, 1B shape: 16 layers of 16 differential heads x 128 channels;
`bench/results/gpu_bf16_h200`, commit 16dfe23, torch 2.11, transformers 5.17, triton 3.6), the model with the kernel
against the same model with the eager ops: a decoded token 23.3 against 21.1 ms (2048-token prompt) and 20.9 against
16.1 ms (32768); a prefill of 2048 tokens (4.2M elements per call) 26.8 against 22.3 ms, of 8192 (16.8M) 63.4 against
72.5 ms. At those short calls that machine ran the models host-bound (Llama with half the query heads took Llama's
time), and the kernel's calls cost the host more than the eager ops' (one row: 117-122 against 75-99 us per call,
counting the launch; at 2048 rows three launches); why the kernel's model lost 4.5 ms at 2048 tokens, more than its
launches explain, is for the next GPU run's per-call GPU times (`bench/gpu_bf16.py`'s `integral` stage) to show."""


def wants_gradient(signal_output, noise_output, lambda_: torch.Tensor, head_norm: nn.Module) -> bool:
    """Whether autograd records a call of the integral (arguments as `DintIntegral.__call__`'s): grad mode on and O1,
    O2, lambda or the head norm's weight requiring a gradient."""
    weight = getattr(head_norm, "weight", None)
    return torch.is_grad_enabled() and (
        signal_output.requires_grad or noise_output.requires_grad or lambda_.requires_grad
        or (weight is not None and weight.requires_grad)
    )


def triton_kernel_pays_off(signal_output: torch.Tensor, gradient: bool, training: bool) -> bool:
    """Whether `DintIntegral.kernel_for` chooses the Triton kernel for a CUDA call it can compute, unforced: with a
    gradient (`wants_gradient`; whole training steps ran faster through the kernel, 95.0 against 104.6 ms at 4096
    tokens and 525 against 553 at 16384 on the H200), in training mode (`training`: a reentrant checkpoint's first
    forward runs without a gradient and its recomputation with one; both take the kernel, so that they round alike),
    or from `TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT` elements of O1 (`signal_output` `[B, T, heads, C]`)."""
    return gradient or training or signal_output.numel() >= TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT


def requested_integral_kernel() -> str:
    """`DINT_INTEGRAL_KERNEL`, read at every call (a test or benchmark may change it between calls)."""
    requested = os.environ.get(INTEGRAL_KERNEL_VARIABLE) or "auto"
    if requested not in INTEGRAL_KERNEL_CHOICES:
        raise ValueError(
            f"{INTEGRAL_KERNEL_VARIABLE}={requested!r} is not one of {', '.join(INTEGRAL_KERNEL_CHOICES)} "
            "(unset: auto)."
        )
    return requested


def fusable_call(signal_output, noise_output, lambda_, head_norm: nn.Module) -> bool:
    """What every fused kernel needs of a call (arguments as `DintIntegral.__call__`'s): eager (not compiling or
    exporting: the compiler fuses the eager ops itself), plain tensors of one dtype with contiguous channels, an fp32
    lambda on their device, and a head norm that computes torch's RMSNorm over the channels (`nn.RMSNorm` itself, or a
    class that says so with `fused_by_integral_kernels`) or nothing (`nn.Identity`), with no hooks to run (a kernel
    does not call the module) and its weight beside the outputs (not offloaded)."""
    if (
        type(signal_output) is not torch.Tensor
        or noise_output.dtype != signal_output.dtype
        or lambda_.dtype != torch.float32
        or lambda_.device != signal_output.device
        or signal_output.stride(-1) != 1
        or noise_output.stride(-1) != 1
        or head_norm._forward_hooks
        or head_norm._forward_pre_hooks
        or head_norm._backward_hooks
        or head_norm._backward_pre_hooks
        or torch.compiler.is_compiling()
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


class DintIntegral:
    """The integral term of one DINT layer, for every head layout and every caller: given the differential outputs
    (or maps) and lambda, it reads the sums the cache carries, runs the running sum over the query rows, stores the new
    state and returns the combined output (or map). It holds no parameters (a plain object: no module call overhead).

    Args:
        integral (`str`): the model's `config.integral`.
        layer_idx (`int`): the layer whose state it reads and writes.
    """

    def __init__(self, integral: str, layer_idx: int):
        self.mode = integral
        self.layer_idx = layer_idx

    def __call__(
        self,
        signal_output: torch.Tensor,
        noise_output: torch.Tensor,
        lambda_: torch.Tensor,
        layout: DintIntegralLayout | None,
        cache=None,
        head_norm: nn.Module | None = None,
    ) -> torch.Tensor:
        """The fast path: `head_norm(O1 - lambda * O2 + lambda * running_mean(O1))`.

        Args:
            signal_output, noise_output (`[B, T, heads, C]`): O1 and O2, in the model's dtype.
            lambda_ (`torch.Tensor`, fp32): a scalar, or `[B, T, heads, 1]`.
            layout (`DintIntegralLayout`): the forward's layout (None for integral "none").
            cache: the cache this forward continues, or None.
            head_norm (`nn.Module`, *optional*): the attention's head norm (`DintHeadRMSNorm`, or `nn.Identity`).

        Returns:
            `[B, T, heads, C]`: with `head_norm`, the normalized combination in O1's dtype; without, the combination in
            fp32 (the model's dtype for integral "none"), for a caller that normalizes it itself.
        """
        if self.mode == "none":  # DiffLlama's arithmetic, op for op (a fused addcmul rounds differently)
            combined = signal_output - lambda_ * noise_output
            return combined if head_norm is None else head_norm(combined).to(signal_output.dtype)
        kernel = self.kernel_for(signal_output, noise_output, lambda_, layout, cache, head_norm)
        if kernel == TRITON_KERNEL:
            return self._triton_kernel(signal_output, noise_output, lambda_, layout, cache, head_norm)
        if kernel == CPU_KERNEL:
            return self._cpu_kernel(signal_output, noise_output, lambda_, layout, cache, head_norm)
        output_dtype = signal_output.dtype
        # The sums and the combination are fp32. Both outputs are cast once here (a no-op in fp32): on CPU an op with
        # bf16 and fp32 operands casts its bf16 ones in copies of its own (issue 31: three copies, 1.12 -> 1.07 of
        # DiffLlama's time), and with a gradient the one cast sums O1's gradients from its several uses in fp32. CUDA's
        # ops cast each element as they read it, to the same fp32 values, so without a gradient the casts would be two
        # more launches per layer and token there (a decoding step's cost on a GPU) and two fp32 copies.
        if signal_output.device.type != "cuda" or wants_gradient(signal_output, noise_output, lambda_, head_norm):
            signal_output, noise_output = signal_output.float(), noise_output.float()
        carry = carried_state(cache, self.layer_idx, SIGNAL_SUM) if cache is not None else None
        running_signal_sum = segmented_running_sum(signal_output, layout, carry)  # [B, T, heads, C]
        if cache is not None:
            cache.update_recurrent_state(
                running_signal_sum[:, -1], self.layer_idx, state_idx=SIGNAL_SUM, running_rows=running_signal_sum
            )
        combined = combine_with_integral(
            signal_output, noise_output, lambda_, running_signal_sum, layout.inverse_query_count
        )
        return combined if head_norm is None else head_norm(combined).to(output_dtype)

    def kernel_for(self, signal_output, noise_output, lambda_, layout, cache, head_norm) -> str:
        """Which implementation computes a call of the fast path (arguments as `__call__`'s), decided here only:

        - `"triton"` (`integral_triton_kernel`, forward and backward): CUDA tensors where Triton is importable, fp32,
          bf16 or fp16, with a gradient, in training mode, or large enough (`triton_kernel_pays_off`);
          with `DINT_INTEGRAL_KERNEL=triton` every such call, CPU tensors too, under Triton's interpreter;
        - `"cpu"` (`integral_cpu_kernel`, no gradient): CPU tensors, fp32 or bf16, no gradient wanted, where the C++ op
          builds (`takes_cpu_kernel`);
        - `"eager"`, the ops of `__call__` and the kernels' reference, everywhere else: `DINT_INTEGRAL_KERNEL=eager`,
          while compiling or exporting, a caller that normalizes itself (no `head_norm`), what `fusable_call` refuses,
          and on a GPU requests packed into one row (continuous batching).
        """
        if torch.compiler.is_compiling() or head_norm is None:  # (before the environment: a compiler would trace it)
            return EAGER
        requested = requested_integral_kernel()
        if requested == EAGER or not fusable_call(signal_output, noise_output, lambda_, head_norm):
            return EAGER
        device = signal_output.device
        if requested == TRITON_KERNEL or device.type == "cuda":
            if layout.carry_per_row or signal_output.dtype not in TRITON_DTYPES:
                return EAGER
            if triton_kernel_runs_on(device):
                if requested == TRITON_KERNEL:
                    return TRITON_KERNEL
                gradient = wants_gradient(signal_output, noise_output, lambda_, head_norm)
                return TRITON_KERNEL if triton_kernel_pays_off(signal_output, gradient, head_norm.training) else EAGER
            if requested == TRITON_KERNEL:
                raise RuntimeError(
                    f"{INTEGRAL_KERNEL_VARIABLE}=triton, but Triton cannot run on {device.type} tensors here: "
                    + ("it is not installed." if not triton_available() else "CPU tensors need TRITON_INTERPRET=1, "
                       "set before Triton is imported (its interpreter).")
                )
            return EAGER
        if self._cpu_kernel_takes(signal_output, noise_output, lambda_, layout, cache, head_norm):
            return CPU_KERNEL
        return EAGER

    def takes_cpu_kernel(self, signal_output, noise_output, lambda_, layout, cache, head_norm) -> bool:
        """Whether `integral_cpu_kernel` can compute this call (arguments as `__call__`'s; vLLM's integral op asks):
        not `DINT_INTEGRAL_KERNEL=eager`, what `fusable_call` asks, and `_cpu_kernel_takes`."""
        return (
            requested_integral_kernel() != EAGER
            and fusable_call(signal_output, noise_output, lambda_, head_norm)
            and self._cpu_kernel_takes(signal_output, noise_output, lambda_, layout, cache, head_norm)
        )

    def _cpu_kernel_takes(self, signal_output, noise_output, lambda_, layout, cache, head_norm) -> bool:
        """For a call `fusable_call` accepts: on CPU, fp32 or bf16 outputs, no gradient wanted, and nobody needing the
        running sum of every row: a cache stores the state after the last row, or (packed requests: continuous
        batching, vLLM) has `integral_state_table`, the rows where each request reads and stores its state in a
        table."""
        if signal_output.device.type != "cpu" or signal_output.dtype not in KERNEL_DTYPES:
            return False
        if wants_gradient(signal_output, noise_output, lambda_, head_norm):
            return False
        if layout.carry_per_row and cache is not None:
            if not hasattr(cache, "integral_state_table"):
                return False
        elif cache is not None and records_running_rows(cache, self.layer_idx):
            return False
        return integral_kernel() is not None

    def _cpu_kernel(self, signal_output, noise_output, lambda_, layout, cache, head_norm) -> torch.Tensor:
        """`integral_cpu_kernel`'s one pass (arguments as `__call__`'s): the normalized combination `[B, T, heads, C]`
        in O1's dtype; stores the sum after the last row `[B, heads, C]` (fp32) in the cache, or, for packed requests,
        each request's sums in the cache's table in place (`integral_state_table`)."""
        batch_size, query_length, heads, channels = signal_output.shape
        inverse_count = layout.inverse_count_rows()
        row_flags = layout.row_flags(batch_size, query_length, signal_output.device)
        if cache is not None and layout.carry_per_row:
            state_table, carry_slot, store_slot = cache.integral_state_table(self.layer_idx)
            return self.packed_requests_kernel(
                signal_output, noise_output, lambda_, inverse_count, row_flags, state_table, carry_slot, store_slot,
                head_norm,
            )
        carry = carried_state(cache, self.layer_idx, SIGNAL_SUM) if cache is not None else None
        if carry is not None and carry.shape[0] != batch_size:
            carry = carry.expand(batch_size, heads, channels)  # a state kept once for the batch broadcasts, as in eager
        output, last_signal_sum = integral_kernel()(
            signal_output, noise_output, lambda_, inverse_count, row_flags, carry, *kernel_head_norm(head_norm)
        )
        if cache is not None:
            cache.update_recurrent_state(last_signal_sum, self.layer_idx, state_idx=SIGNAL_SUM)
        return output

    def _triton_kernel(self, signal_output, noise_output, lambda_, layout, cache, head_norm) -> torch.Tensor:
        """`integral_triton_kernel` (arguments as `__call__`'s): the normalized combination `[B, T, heads, C]` in O1's
        dtype, through autograd where a gradient is wanted; stores the sum after the last row `[B, heads, C]` (fp32)
        in the cache, and after every row where the cache records its past (`crop`)."""
        batch_size, query_length = signal_output.shape[:2]
        carry = carried_state(cache, self.layer_idx, SIGNAL_SUM) if cache is not None else None
        recording = cache is not None and records_running_rows(cache, self.layer_idx)
        output, last_signal_sum, running_signal_sum = triton_integral(
            signal_output, noise_output, lambda_, layout.inverse_count_rows(),
            layout.row_flags(batch_size, query_length, signal_output.device), carry, *kernel_head_norm(head_norm),
            store_running=recording,
        )
        if cache is not None:
            cache.update_recurrent_state(
                last_signal_sum, self.layer_idx, state_idx=SIGNAL_SUM, running_rows=running_signal_sum
            )
        return output

    def packed_requests_kernel(
        self,
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
        `state_table` in place (where `takes_cpu_kernel` holds): the kernel call of `_cpu_kernel` for packed requests,
        and of vLLM's integral op with the rows its step prepared once for every layer.

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
        combined, _ = integral_kernel()(
            signal_output, noise_output, lambda_, inverse_count, row_flags, None, *kernel_head_norm(head_norm),
            state_table, carry_slot, store_slot, output,
        )
        return combined if output is None else output

    def maps(
        self,
        signal_weights: torch.Tensor,
        noise_weights: torch.Tensor,
        lambda_: torch.Tensor,
        layout: DintIntegralLayout | None,
        key_valid: torch.Tensor,
        cache=None,
    ) -> torch.Tensor:
        """The materializing path: A_final `[B, heads, T, K]` (fp32) from the maps A1, A2 `[B, heads, T, K]` and
        lambda (a scalar, or `[B, T, heads, 1]`), carrying the column sums of A1 in the cache."""
        if lambda_.dim() > 0:
            lambda_ = lambda_.transpose(1, 2)  # [B, heads, T, 1]
        carry = None
        if cache is not None and self.mode != "none":
            carry = carried_state(cache, self.layer_idx, COLUMN_SUMS)
        final_weights, running_column_sums = compose_final_attention(
            signal_weights, noise_weights, lambda_, self.mode, layout, key_valid, carry
        )
        if cache is not None and running_column_sums is not None:  # [B, heads, T, K], stored with the rows first
            running_rows = running_column_sums.transpose(1, 2)
            cache.update_recurrent_state(
                running_rows[:, -1], self.layer_idx, state_idx=COLUMN_SUMS, running_rows=running_rows
            )
        return final_weights


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
    "DintIntegral",
    "DintIntegralLayout",
    "check_dint_cache",
    "combine_with_integral",
    "compose_final_attention",
    "dint_attention_map",
    "document_starts",
    "forward_integral_layout",
    "integral_state_index",
    "packed_request_rows",
    "segmented_running_sum",
    "valid_query_rows",
]
