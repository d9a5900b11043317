# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The fast path's integral as Triton kernels, forward and backward: what CUDA runs (`integral_dint`'s plan).

Per batch row b and differential head h, the integral's tail is a running sum over the query rows followed by a
pointwise combination (`integral_dint.combine_with_integral`, then v1's head norm):

    S[n] = sum of O1[m] over the valid rows m <= n of n's document (the cache's carry first)      fp32
    out[n] = head_norm(O1[n] - lambda[n] * (O2[n] - S[n] / c_n))                                   the model's dtype

Eager torch runs it as several passes over `[B, T, heads, C]` (a fp32 copy with the rows last, the scan, two
multiply-adds, the norm, the cast back) and as many again in backward. Here the rows are cut into chunks of
`CHUNK_ROWS`, and every kernel reads O1 and O2 where the attention call left them (by stride: v2's even and odd query
heads, v1's two halves; no copy):

- forward: `_chunk_tails_kernel` sums each chunk's valid rows after its last document start (what it passes on);
  `_chunk_scan_kernel` runs the running sum over the chunks (the cache's carry first, restarting after a chunk in
  which a document starts); `_integral_forward_kernel` runs the running sum inside each chunk from what enters it,
  combines, normalizes and casts, and stores the sum after the call's last row (the cache's state) and, where asked,
  after every row (a cache that records its past for `crop`). A call of one chunk (a decoding step, a short prefill)
  is that last kernel alone.
- backward: the gradient of S at row n reaches O1 at every valid row m <= n of n's document, a running sum from the
  last row back. `_integral_backward_kernel` with `HEADS_ONLY` gives what each chunk passes to the chunks before it,
  `_chunk_scan_kernel` runs those sums from the right, and `_integral_backward_kernel` recomputes the forward's
  combination and writes dO1 and dO2 (into one gradient of the attention output where they are views of one), dlambda
  per row and head, the head-norm weight's gradient per chunk and the carry's. Nothing the size of the rows is saved
  for backward but the inputs.

The running sums are fp32 in registers, each document's its own cumulative sum (`tl.cumsum`, forward or reverse; no
sum is subtracted from another, so nothing cancels); a padding row adds nothing to them (`tl.where`, never a product:
it may hold NaN) and combines its own O1 and O2, as the eager ops do. A launch depends on the length only through `CHUNK_ROWS` (three sizes) and the number of
chunks, which is not specialized on, so a new length or batch size compiles nothing.

Without Triton (a CPU-only install) this file defines no kernel and `triton_available()` is False. On a machine
without a GPU, `TRITON_INTERPRET=1` (set before Triton is imported) runs the same kernels on CPU tensors: that is how
the tests check them against the eager ops (`tests/test_integral_triton_kernel.py`). The interpreter runs
`tl.cumsum` at numpy's speed and any other scan (`tl.associative_scan` with a combine of one's own) element by element
in Python, so the kernels scan with `tl.cumsum` only.

This file travels with the remote code (`save_pretrained`): it imports nothing but torch and (guarded) Triton.
"""

import contextlib
from collections import namedtuple

import torch

from .integral_cpu_kernel import DOCUMENT_START, ROW_VALID


try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: `DintIntegral` runs the eager ops (or the CPU kernel)
    triton = None

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

SCAN_BLOCK_CHUNKS = 64
"""Chunks per step of `_chunk_scan_kernel`'s loop over the chunks (a segmented scan of that many at once)."""
SCAN_BLOCK_CHANNELS = 64
"""Channels per program of `_chunk_scan_kernel`."""


def triton_available() -> bool:
    """Whether Triton is importable (the kernels are defined)."""
    return triton is not None


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (`TRITON_INTERPRET=1` when Triton was imported), on CPU
    tensors."""
    return INTERPRETED


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`: CUDA (Triton's compiler), or CPU under the interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def chunk_rows_for(query_length: int, channels: int) -> int:
    """`CHUNK_ROWS`, the rows of one program's tile: 16 or 32 for a call that short (decoding, a short prefill: one
    chunk), else as many as keep the backward's tiles in registers (rows x channels <= 4096, at least 8)."""
    block_channels = max(16, 1 << (channels - 1).bit_length())
    longest = max(8, min(64, 4096 // block_channels))
    for chunk_rows in (16, 32):
        if query_length <= chunk_rows <= longest:
            return chunk_rows
    return longest


if triton is not None:
    _BATCH_STRIDES = ("signal_stride_b", "noise_stride_b", "lambda_stride_b", "inverse_stride_b", "flags_stride_b")
    _ROW_VALID = tl.constexpr(ROW_VALID)
    _DOCUMENT_START = tl.constexpr(DOCUMENT_START)

    @triton.jit
    def _program_chunk(chunks):
        """`(batch row * heads + head, chunk)` of this program: one program per chunk of each (batch row, head), on one
        grid axis (the only one not capped at 65535 programs), a (batch row, head)'s chunks side by side."""
        program = tl.program_id(0)
        return program // chunks, program % chunks

    @triton.jit
    def _broadcast(scalar, BLOCK: tl.constexpr):
        """A program's scalar (`tl.program_id`) as a block `[BLOCK]`: a mask built from it with `&` stays boolean under
        Triton's interpreter (a block & a scalar comparison is int32 there)."""
        return tl.zeros((BLOCK,), dtype=tl.int32) + scalar

    @triton.jit
    def _row_tiles(
        chunk, rows, row_flags_ptr, flags_stride_b, flags_stride_t, batch, CHUNK_ROWS: tl.constexpr,
        BLOCK_CHANNELS: tl.constexpr, channels,
    ):
        """The chunk's rows `[CHUNK_ROWS]` (int64), which are in the call, valid, start a document; the channels."""
        row = chunk.to(tl.int64) * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
        in_rows = row < rows
        flags = tl.load(row_flags_ptr + batch * flags_stride_b + row * flags_stride_t, mask=in_rows, other=0)
        flags = flags.to(tl.int32)
        channel = tl.arange(0, BLOCK_CHANNELS)
        return row, in_rows, (flags & _ROW_VALID) != 0, (flags & _DOCUMENT_START) != 0, channel, channel < channels

    @triton.jit
    def _running_sum(values, restarts, entering):
        """The inclusive running sum of `values` `[N, C]` (fp32) over axis 0, restarting at 0 at each row where
        `restarts` `[N]` (bool) holds, `entering` `[C]` added to the rows before the first restart: a cumulative sum
        per document (each its own, so that nothing cancels). Triton's interpreter scans with `tl.cumsum` at numpy's
        speed, and with any other combine (a segmented scan) element by element."""
        document = tl.cumsum(restarts.to(tl.int32), axis=0)  # 0 for the rows before the first restart
        running = tl.cumsum(tl.where((document == 0)[:, None], values, 0.0), axis=0) + entering[None, :]
        for index in range(1, tl.max(document, axis=0) + 1):
            in_document = (document == index)[:, None]
            running = tl.where(in_document, tl.cumsum(tl.where(in_document, values, 0.0), axis=0), running)
        return running

    @triton.jit
    def _reverse_running_sum(values, restarts):
        """The running sum of `values` `[N, C]` (fp32) over axis 0 from the last row back, each row's sum stopping
        before the next row where `restarts` `[N]` holds (the rows of its document from it on), a reverse cumulative
        sum per document; and which rows' sums reach the last row (their document goes on after the N rows)."""
        document = tl.cumsum(restarts.to(tl.int32), axis=0)
        documents = tl.max(document, axis=0)
        in_last = (document == documents)[:, None]
        running = tl.cumsum(tl.where(in_last, values, 0.0), axis=0, reverse=True)
        for index in range(0, documents):
            in_document = (document == index)[:, None]
            document_sum = tl.cumsum(tl.where(in_document, values, 0.0), axis=0, reverse=True)
            running = tl.where(in_document, document_sum, running)
        return running, document == documents

    @triton.jit(do_not_specialize=["rows", "chunks", "signal_stride_b", "flags_stride_b"])
    def _chunk_tails_kernel(
        signal_ptr, row_flags_ptr, tails_ptr, restarts_ptr,
        rows, heads, chunks, channels,
        signal_stride_b, signal_stride_t, signal_stride_h, flags_stride_b, flags_stride_t,
        CHUNK_ROWS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr,
    ):
        """Per (batch row, head) and chunk (`_program_chunk`): the sum of the valid O1 rows from the chunk's last
        document start (all of them without one) `[C]`, and whether a document starts in the chunk."""
        batch_head, chunk = _program_chunk(chunks)
        batch, head = batch_head // heads, batch_head % heads
        row, in_rows, valid, starts, channel, in_channels = _row_tiles(
            chunk, rows, row_flags_ptr, flags_stride_b, flags_stride_t, batch, CHUNK_ROWS, BLOCK_CHANNELS, channels
        )
        last_start = tl.max(tl.where(starts, row, -1), axis=0)
        counted = valid & (row >= last_start)
        signal_rows = signal_ptr + batch.to(tl.int64) * signal_stride_b + head * signal_stride_h
        signal = tl.load(
            signal_rows + row[:, None] * signal_stride_t + channel[None, :],
            mask=counted[:, None] & in_channels[None, :], other=0.0,
        ).to(tl.float32)
        chunk_index = batch_head.to(tl.int64) * chunks + chunk
        tl.store(tails_ptr + chunk_index * channels + channel, tl.sum(signal, axis=0), mask=in_channels)
        tl.store(restarts_ptr + chunk_index, (last_start >= 0).to(tl.int8))

    @triton.jit(do_not_specialize=["chunks"])
    def _chunk_scan_kernel(
        values_ptr, restarts_ptr, initial_ptr, inclusive_ptr,
        heads, chunks, channels, initial_stride_b, initial_stride_h,
        REVERSE: tl.constexpr, HAS_INITIAL: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr,
    ):
        """The running sum over the chunks of (batch row, head) `program_id(0)`, channels block `program_id(1)`:
        inclusive[k] = values[k] + (inclusive[k - 1] unless a document starts in chunk k), from `initial` (or 0)
        before the first chunk; with `REVERSE`, from the last chunk back."""
        batch_head = tl.program_id(0)
        channel = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
        in_channels = channel < channels
        carry = tl.zeros((BLOCK_CHANNELS,), dtype=tl.float32)
        if HAS_INITIAL:
            batch, head = batch_head // heads, batch_head % heads
            initial = initial_ptr + batch.to(tl.int64) * initial_stride_b + head * initial_stride_h + channel
            carry += tl.load(initial, mask=in_channels, other=0.0).to(tl.float32)
        for first in range(0, chunks, BLOCK_CHUNKS):
            step = first + tl.arange(0, BLOCK_CHUNKS)
            in_chunks = step < chunks
            chunk = (chunks - 1 - step) if REVERSE else step
            chunk_index = batch_head.to(tl.int64) * chunks + chunk
            mask = in_chunks[:, None] & in_channels[None, :]
            values = tl.load(values_ptr + chunk_index[:, None] * channels + channel[None, :], mask=mask, other=0.0)
            restarts = tl.load(restarts_ptr + chunk_index, mask=in_chunks, other=0) != 0
            inclusive = _running_sum(values, restarts, carry)
            tl.store(inclusive_ptr + chunk_index[:, None] * channels + channel[None, :], inclusive, mask=mask)
            last_step = tl.minimum(first + BLOCK_CHUNKS, chunks) - 1
            carry = tl.sum(tl.where((step == last_step)[:, None], inclusive, 0.0), axis=0)

    @triton.jit
    def _combination(
        inputs, strides, signal_stride_b, noise_stride_b, lambda_stride_b, inverse_stride_b, flags_stride_b,
        rows, heads, chunks, channels, eps, CHUNK_ROWS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr,
        HAS_CARRY: tl.constexpr, MULTI_CHUNK: tl.constexpr, NORMALIZE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ):
        """The forward of this program's chunk (`_program_chunk`), shared by both directions, from `inputs`
        (`IntegralInputs`: pointers), `strides` (`RowStrides`) and the inputs' batch strides: the program's
        (batch row * heads + head, chunk), batch row (int64) and head, the rows' tiles, O1 and O2 (fp32), lambda and
        1 / c per row, S, the combination before the norm, the norm's scale per row (1 without it) and its weight."""
        batch_head, chunk = _program_chunk(chunks)
        batch, head = batch_head // heads, batch_head % heads
        row, in_rows, valid, starts, channel, in_channels = _row_tiles(
            chunk, rows, inputs.row_flags, flags_stride_b, strides.row_flags_t, batch, CHUNK_ROWS,
            BLOCK_CHANNELS, channels,
        )
        batch = batch.to(tl.int64)
        mask = in_rows[:, None] & in_channels[None, :]
        signal_rows = inputs.signal + batch * signal_stride_b + head * strides.signal_h + row * strides.signal_t
        noise_rows = inputs.noise + batch * noise_stride_b + head * strides.noise_h + row * strides.noise_t
        signal = tl.load(signal_rows[:, None] + channel[None, :], mask=mask, other=0.0).to(tl.float32)
        noise = tl.load(noise_rows[:, None] + channel[None, :], mask=mask, other=0.0).to(tl.float32)
        lambda_rows = inputs.lambda_ + batch * lambda_stride_b + head * strides.lambda_h + row * strides.lambda_t
        lambda_ = tl.load(lambda_rows, mask=in_rows, other=0.0)
        inverse_rows = inputs.inverse_count + batch * inverse_stride_b + row * strides.inverse_count_t
        inverse = tl.load(inverse_rows, mask=in_rows, other=0.0)
        # What enters the chunk: the cache's carry (chunk 0), or the running sum after the chunk before
        entering = tl.zeros((BLOCK_CHANNELS,), dtype=tl.float32)
        if HAS_CARRY:
            carry = inputs.carry + batch * strides.carry_b + head * strides.carry_h + channel
            first_chunk = _broadcast(chunk, BLOCK_CHANNELS) == 0
            entering += tl.load(carry, mask=in_channels & first_chunk, other=0.0).to(tl.float32)
        if MULTI_CHUNK:
            previous = inputs.inclusive + (batch_head.to(tl.int64) * chunks + chunk - 1) * channels + channel
            entering += tl.load(previous, mask=in_channels & (_broadcast(chunk, BLOCK_CHANNELS) > 0), other=0.0)
        running = _running_sum(tl.where(valid[:, None], signal, 0.0), starts, entering)
        combined = signal - lambda_[:, None] * (noise - running * inverse[:, None])  # combine_with_integral's
        scale = tl.full((CHUNK_ROWS,), 1.0, dtype=tl.float32)
        if NORMALIZE:
            scale = 1.0 / tl.sqrt(tl.sum(combined * combined, axis=1) / channels + eps)
        weight = tl.full((BLOCK_CHANNELS,), 1.0, dtype=tl.float32)
        if HAS_WEIGHT:
            weight = tl.load(inputs.weight + channel, mask=in_channels, other=0.0).to(tl.float32)
        return (batch_head, chunk, batch, head, row, in_rows, valid, starts, channel, in_channels, mask, signal, noise,
                lambda_, inverse, running, combined, scale, weight)

    @triton.jit(do_not_specialize=["rows", "chunks", *_BATCH_STRIDES, "output_stride_b"])
    def _integral_forward_kernel(
        inputs, strides, signal_stride_b, noise_stride_b, lambda_stride_b, inverse_stride_b, flags_stride_b,
        output_ptr, last_sum_ptr, running_ptr, rows, heads, chunks, channels, eps,
        output_stride_b, output_stride_t, output_stride_h,
        CHUNK_ROWS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr, HAS_CARRY: tl.constexpr, MULTI_CHUNK: tl.constexpr,
        NORMALIZE: tl.constexpr, HAS_WEIGHT: tl.constexpr, STORE_RUNNING: tl.constexpr,
    ):
        """Per (batch row, head) and chunk (`_program_chunk`): `out = head_norm(O1 - lambda (O2 - S / c))` in the
        output's dtype; the sum after the call's last row `[B, heads, C]` (fp32), and with `STORE_RUNNING` after every
        row `[B, T, heads, C]` (fp32)."""
        (batch_head, chunk, batch, head, row, in_rows, valid, starts, channel, in_channels, mask, signal, noise,
         lambda_, inverse, running, combined, scale, weight) = _combination(
            inputs, strides, signal_stride_b, noise_stride_b, lambda_stride_b, inverse_stride_b, flags_stride_b,
            rows, heads, chunks, channels, eps, CHUNK_ROWS, BLOCK_CHANNELS, HAS_CARRY, MULTI_CHUNK, NORMALIZE,
            HAS_WEIGHT,
        )
        output = combined * scale[:, None] * weight[None, :]
        output_rows = output_ptr + batch * output_stride_b + head * output_stride_h + row * output_stride_t
        tl.store(output_rows[:, None] + channel[None, :], output.to(output_ptr.dtype.element_ty), mask=mask)
        last_sum = last_sum_ptr + batch_head.to(tl.int64) * channels + channel
        last_row = (row == rows - 1)[:, None] & in_channels[None, :]
        tl.store(tl.broadcast_to(last_sum[None, :], (CHUNK_ROWS, BLOCK_CHANNELS)), running, mask=last_row)
        if STORE_RUNNING:  # [B, T, heads, C], contiguous
            running_rows = running_ptr + ((batch * rows + row) * heads + head) * channels
            tl.store(running_rows[:, None] + channel[None, :], running, mask=mask)

    @triton.jit(
        do_not_specialize=[
            "rows", "chunks", *_BATCH_STRIDES, "grad_output_stride_b", "grad_signal_stride_b", "grad_noise_stride_b",
        ]
    )
    def _integral_backward_kernel(
        inputs, strides, signal_stride_b, noise_stride_b, lambda_stride_b, inverse_stride_b, flags_stride_b,
        grad_output_ptr, grad_last_ptr, right_inclusive_ptr,
        grad_signal_ptr, grad_noise_ptr, grad_lambda_ptr, grad_weight_ptr, grad_carry_ptr, heads_sum_ptr,
        rows, heads, chunks, channels, eps,
        grad_output_stride_b, grad_output_stride_t, grad_output_stride_h,
        grad_signal_stride_b, grad_signal_stride_t, grad_signal_stride_h,
        grad_noise_stride_b, grad_noise_stride_t, grad_noise_stride_h,
        CHUNK_ROWS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr, HAS_CARRY: tl.constexpr, MULTI_CHUNK: tl.constexpr,
        NORMALIZE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GRAD_LAST: tl.constexpr, HEADS_ONLY: tl.constexpr,
    ):
        """Per (batch row, head) and chunk (`_program_chunk`), the forward recomputed, then the gradients: with
        `HEADS_ONLY`, only the sum of dS over the chunk's rows before its first document start (what reaches the
        chunks before); else dO1, dO2, dlambda per row `[B, T, heads]`, the norm weight's per program
        `[B * heads * chunks, C]` and, from chunk 0, the carry's `[B, heads, C]` (all fp32 but dO1, dO2)."""
        (batch_head, chunk, batch, head, row, in_rows, valid, starts, channel, in_channels, mask, signal, noise,
         lambda_, inverse, running, combined, scale, weight) = _combination(
            inputs, strides, signal_stride_b, noise_stride_b, lambda_stride_b, inverse_stride_b, flags_stride_b,
            rows, heads, chunks, channels, eps, CHUNK_ROWS, BLOCK_CHANNELS, HAS_CARRY, MULTI_CHUNK, NORMALIZE,
            HAS_WEIGHT,
        )
        grad_rows = grad_output_ptr + batch * grad_output_stride_b + head * grad_output_stride_h
        grad_output = tl.load(
            grad_rows + row[:, None] * grad_output_stride_t + channel[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        weighted = grad_output * weight[None, :]
        if NORMALIZE:  # y = z * scale * w, scale = (mean(z^2) + eps)^-1/2: dz = scale g - z scale^3 mean(g z)
            mean_product = tl.sum(weighted * combined, axis=1) / channels
            grad_combined = scale[:, None] * weighted - combined * (scale * scale * scale * mean_product)[:, None]
        else:
            grad_combined = weighted
        # dS[n] = lambda_n / c_n dz[n] (+ the gradient of the state after the last row)
        grad_running = grad_combined * (lambda_ * inverse)[:, None]
        if HAS_GRAD_LAST:
            grad_last_row = grad_last_ptr + batch_head.to(tl.int64) * channels + channel
            grad_last = tl.load(grad_last_row, mask=in_channels, other=0.0)
            grad_running += tl.where((row == rows - 1)[:, None], grad_last[None, :], 0.0)
        # dO1[m] gets dS[n] of every row n >= m of m's document: a running sum from the last row back
        from_later_rows, in_last_document = _reverse_running_sum(grad_running, starts)
        first_start = tl.min(tl.where(starts, row, rows), axis=0)  # `rows`: no document starts in the chunk
        before_first_start = tl.sum(tl.where((row < first_start)[:, None], grad_running, 0.0), axis=0)
        if HEADS_ONLY:  # what reaches the chunks before: the rows before the chunk's first document start
            heads_sum = heads_sum_ptr + (batch_head.to(tl.int64) * chunks + chunk) * channels + channel
            tl.store(heads_sum, before_first_start, mask=in_channels)
        else:
            if MULTI_CHUNK:  # the sums the chunks after this one pass back, up to this chunk's last document start
                later = right_inclusive_ptr + (batch_head.to(tl.int64) * chunks + chunk + 1) * channels + channel
                later_mask = in_channels & (_broadcast(chunk + 1, BLOCK_CHANNELS) < chunks)
                from_later_chunks = tl.load(later, mask=later_mask, other=0.0)
                from_later_rows = tl.where(in_last_document[:, None], from_later_rows + from_later_chunks[None, :],
                                           from_later_rows)
                if HAS_CARRY:
                    before_first_start += tl.where(first_start >= rows, from_later_chunks, 0.0)
            grad_signal = grad_combined + tl.where(valid[:, None], from_later_rows, 0.0)
            grad_noise = -lambda_[:, None] * grad_combined
            grad_signal_rows = grad_signal_ptr + batch * grad_signal_stride_b + head * grad_signal_stride_h
            grad_noise_rows = grad_noise_ptr + batch * grad_noise_stride_b + head * grad_noise_stride_h
            tl.store(
                grad_signal_rows + row[:, None] * grad_signal_stride_t + channel[None, :],
                grad_signal.to(grad_signal_ptr.dtype.element_ty), mask=mask,
            )
            tl.store(
                grad_noise_rows + row[:, None] * grad_noise_stride_t + channel[None, :],
                grad_noise.to(grad_noise_ptr.dtype.element_ty), mask=mask,
            )
            # dlambda[n] = sum over channels of dz * (S / c - O2); [B, T, heads], contiguous
            grad_lambda = tl.sum(grad_combined * (running * inverse[:, None] - noise), axis=1)
            tl.store(grad_lambda_ptr + (batch * rows + row) * heads + head, grad_lambda, mask=in_rows)
            if HAS_WEIGHT:
                grad_weight = tl.sum(grad_output * combined * scale[:, None], axis=0)
                grad_weight_row = grad_weight_ptr + tl.program_id(0).to(tl.int64) * channels
                tl.store(grad_weight_row + channel, grad_weight, mask=in_channels)
            if HAS_CARRY:  # the carry enters every row before the call's first document start
                grad_carry = grad_carry_ptr + batch_head.to(tl.int64) * channels + channel
                tl.store(grad_carry, before_first_start, mask=in_channels & (_broadcast(chunk, BLOCK_CHANNELS) == 0))

INTERPRETED = triton is not None and type(_integral_forward_kernel).__name__ == "InterpretedFunction"
"""Whether Triton's interpreter runs the kernels (`triton.jit` gives its functions where `TRITON_INTERPRET=1`)."""


def _on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' (a model split over GPUs, `device_map`, runs
    its layers on several while the current device stays the first)."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


def _launch_shape(signal: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """`(B, T, heads, C, CHUNK_ROWS, chunks)` of a call on `signal` `[B, T, heads, C]`."""
    batch_size, query_length, heads, channels = signal.shape
    chunk_rows = chunk_rows_for(query_length, channels)
    return batch_size, query_length, heads, channels, chunk_rows, -(-query_length // chunk_rows)


def _block_channels(channels: int) -> int:
    return max(16, triton.next_power_of_2(channels))


FORWARD_ELEMENTS_PER_THREAD = 16
"""Tile elements per thread of the forward kernels (`_num_warps`): 4 warps for a 16 x 128 tile, 8 for 32 x 128."""
BACKWARD_ELEMENTS_PER_THREAD = 8
"""Tile elements per thread of the backward kernel (`_num_warps`), half the forward's: it holds about twice the
forward's tiles at once (the gradients beside the recomputed forward). Read off the sm_90 cubins
(`python tests/test_integral_triton_compile.py 90`, bf16, Triton 3.6): at 16 elements per thread its variants took up
to 255 registers (8 warps per SM by registers), at 8 they take up to 159 (16 x 128 tiles, 8 warps) and 128 (32 x 128
tiles, 16 warps: twice the warps per SM), with small stack spills (at most 32 bytes) in some v1 head-norm variants
either way; 8 timed no slower than 16 on a GPU (docs/performance.md, "The integral on a GPU")."""
MAX_WARPS = {"forward": 8, "backward": 16}


def _num_warps(chunk_rows: int, block_channels: int, elements_per_thread: int, max_warps: int) -> int:
    """Warps per program for a tile of `chunk_rows` x `block_channels` at `elements_per_thread` (4 to `max_warps`)."""
    return min(max_warps, max(4, chunk_rows * block_channels // (32 * elements_per_thread)))


def _per_row(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` broadcast to `shape` (a scalar lambda to `[B, T, heads]`, `[B, T, heads, 1]` without its 1)."""
    if tensor.dim() == len(shape) + 1 and tensor.shape[-1] == 1:
        tensor = tensor.squeeze(-1)
    return tensor.expand(shape)


def _common_arguments(signal, noise, lambda_, inverse_count, row_flags, carry):
    """The inputs both directions read, as the kernels take them: tensors broadcast to their per-row shapes."""
    batch_size, query_length, heads, channels, _, _ = _launch_shape(signal)
    lambda_rows = _per_row(lambda_, (batch_size, query_length, heads))
    inverse_count = _per_row(inverse_count, (batch_size, query_length))
    row_flags = _per_row(row_flags, (batch_size, query_length))
    if carry is not None:
        carry = carry.expand(batch_size, heads, channels)
        if carry.stride(-1) != 1:
            carry = carry.contiguous()
    return lambda_rows, inverse_count, row_flags, carry


def _carry_strides(carry: torch.Tensor | None) -> tuple[int, int]:
    return (carry.stride(0), carry.stride(1)) if carry is not None else (0, 0)


IntegralInputs = namedtuple(
    "IntegralInputs", ["signal", "noise", "lambda_", "inverse_count", "row_flags", "carry", "inclusive", "weight"]
)
"""The tensors both directions' kernels read (`_combination`; None where absent), passed as one tuple argument."""
RowStrides = namedtuple(
    "RowStrides",
    ["signal_t", "signal_h", "noise_t", "noise_h", "lambda_t", "lambda_h", "inverse_count_t", "row_flags_t", "carry_b",
     "carry_h"],
)
"""Their strides along the rows and heads, and the carry's (whose batch stride does not change with the length), one
tuple argument: Triton specializes on them as on any integer (channels are contiguous). The other batch strides change
with the length, so they are separate arguments the kernels do not specialize on (Triton specializes a tuple's
integers whatever `do_not_specialize` says): a new length compiles nothing."""


def _kernel_inputs(signal, noise, lambda_rows, inverse_count, row_flags, carry, inclusive, weight) -> tuple:
    """The kernels' first arguments from `_common_arguments`' tensors, the chunks' inclusive sums and the head norm's
    weight: `IntegralInputs`, `RowStrides`, then the batch strides of signal, noise, lambda, 1 / c and the flags."""
    inputs = IntegralInputs(signal, noise, lambda_rows, inverse_count, row_flags, carry, inclusive, weight)
    strides = RowStrides(
        *signal.stride()[1:3], *noise.stride()[1:3], *lambda_rows.stride()[1:3], inverse_count.stride(1),
        row_flags.stride(1), *_carry_strides(carry),
    )
    return inputs, strides, *(tensor.stride(0) for tensor in inputs[:5])


def _chunk_scan(values, restarts, initial, batch_heads, heads, chunks, channels, reverse) -> torch.Tensor:
    """`_chunk_scan_kernel` over `values` `[B * heads, chunks, C]` (fp32): the inclusive running sums."""
    inclusive = torch.empty_like(values)
    grid = (batch_heads, triton.cdiv(channels, SCAN_BLOCK_CHANNELS))
    _chunk_scan_kernel[grid](
        values, restarts, initial, inclusive, heads, chunks, channels, *_carry_strides(initial),
        REVERSE=reverse, HAS_INITIAL=initial is not None, BLOCK_CHUNKS=SCAN_BLOCK_CHUNKS,
        BLOCK_CHANNELS=SCAN_BLOCK_CHANNELS,
    )
    return inclusive


def integral_forward(
    signal: torch.Tensor,
    noise: torch.Tensor,
    lambda_: torch.Tensor,
    inverse_count: torch.Tensor,
    row_flags: torch.Tensor,
    carry: torch.Tensor | None,
    weight: torch.Tensor | None,
    normalize: bool,
    eps: float,
    store_running: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The forward kernels, without autograd (`TritonIntegral` wraps them for training).

    Args:
        signal, noise (`[B, T, heads, C]`, fp32, bf16 or fp16, channels contiguous, any other strides): O1 and O2.
        lambda_ (fp32): a scalar, or `[B, T, heads(, 1)]` (broadcastable).
        inverse_count (`[B, T]` fp32, broadcastable): 1 / c_n (`DintIntegralLayout.inverse_query_count`).
        row_flags (`[B, T]` uint8, broadcastable): `ROW_VALID | DOCUMENT_START` per row
            (`DintIntegralLayout.row_flags`).
        carry (`[B, heads, C]` fp32, broadcastable, *optional*): the sum the cache carries into row 0.
        weight (`[C]`, *optional*), normalize, eps: the head norm (`integral_dint.kernel_head_norm`).
        store_running (`bool`): also return the sum after every row (a cache recording its past).

    Returns:
        output (`[B, T, heads, C]`, O1's dtype, contiguous), last_sum (`[B, heads, C]` fp32: the state after the last
        row), running (`[B, T, heads, C]` fp32, or None), and for backward the inclusive sums after each chunk
        (`[B * heads, chunks, C]` fp32) and each chunk's restarts (`[B * heads, chunks]` int8), None for one chunk.
    """
    batch_size, query_length, heads, channels, chunk_rows, chunks = _launch_shape(signal)
    lambda_rows, inverse_count, row_flags, carry = _common_arguments(
        signal, noise, lambda_, inverse_count, row_flags, carry
    )
    batch_heads = batch_size * heads
    output = torch.empty(signal.shape, dtype=signal.dtype, device=signal.device)
    last_sum = torch.empty(batch_size, heads, channels, dtype=torch.float32, device=signal.device)
    running = None
    if store_running:
        running = torch.empty(signal.shape, dtype=torch.float32, device=signal.device)
    inclusive = restarts = None
    block_channels = _block_channels(channels)
    num_warps = _num_warps(chunk_rows, block_channels, FORWARD_ELEMENTS_PER_THREAD, MAX_WARPS["forward"])
    with _on_device(signal):
        if chunks > 1:
            tails = torch.empty(batch_heads, chunks, channels, dtype=torch.float32, device=signal.device)
            restarts = torch.empty(batch_heads, chunks, dtype=torch.int8, device=signal.device)
            _chunk_tails_kernel[(batch_heads * chunks,)](
                signal, row_flags, tails, restarts, query_length, heads, chunks, channels,
                *signal.stride()[:3], *row_flags.stride(),
                CHUNK_ROWS=chunk_rows, BLOCK_CHANNELS=block_channels, num_warps=num_warps,
            )
            inclusive = _chunk_scan(tails, restarts, carry, batch_heads, heads, chunks, channels, reverse=False)
        _integral_forward_kernel[(batch_heads * chunks,)](
            *_kernel_inputs(signal, noise, lambda_rows, inverse_count, row_flags, carry, inclusive, weight),
            output, last_sum, running, query_length, heads, chunks, channels, eps, *output.stride()[:3],
            CHUNK_ROWS=chunk_rows, BLOCK_CHANNELS=block_channels, HAS_CARRY=carry is not None,
            MULTI_CHUNK=chunks > 1, NORMALIZE=normalize, HAS_WEIGHT=weight is not None, STORE_RUNNING=store_running,
            num_warps=num_warps,
        )
    return output, last_sum, running, inclusive, restarts


def integral_backward(
    grad_output: torch.Tensor,
    grad_last: torch.Tensor | None,
    inputs: IntegralInputs,
    restarts: torch.Tensor | None,
    normalize: bool,
    eps: float,
    grad_signal: torch.Tensor,
    grad_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward kernels: writes dO1 and dO2 into `grad_signal`, `grad_noise` (O1's shape and dtype, channels
    contiguous: views of one gradient where O1 and O2 are views of one output) and returns dlambda per row
    `[B, T, heads]`, the weight's gradient `[C]` and the carry's `[B, heads, C]` (fp32; None without them).
    `inputs` holds `integral_forward`'s tensor arguments and its `inclusive`; `restarts`, `normalize` and `eps` are
    its too; `grad_output` and `grad_last` are the gradients of its output and of `last_sum` (or None)."""
    signal, noise, lambda_, inverse_count, row_flags, carry, inclusive, weight = inputs
    batch_size, query_length, heads, channels, chunk_rows, chunks = _launch_shape(signal)
    lambda_rows, inverse_count, row_flags, carry = _common_arguments(
        signal, noise, lambda_, inverse_count, row_flags, carry
    )
    batch_heads = batch_size * heads
    if grad_output.stride(-1) != 1:
        grad_output = grad_output.contiguous()
    if grad_last is not None:
        grad_last = grad_last.float().contiguous()
    float_options = dict(dtype=torch.float32, device=signal.device)
    grad_lambda = torch.empty(batch_size, query_length, heads, **float_options)
    grad_weight = torch.empty(batch_heads * chunks, channels, **float_options) if weight is not None else None
    grad_carry = torch.empty(batch_size, heads, channels, **float_options) if carry is not None else None
    block_channels = _block_channels(channels)
    num_warps = _num_warps(chunk_rows, block_channels, BACKWARD_ELEMENTS_PER_THREAD, MAX_WARPS["backward"])

    def launch(heads_only: bool, right_inclusive: torch.Tensor | None, heads_sum: torch.Tensor | None) -> None:
        _integral_backward_kernel[(batch_heads * chunks,)](
            *_kernel_inputs(signal, noise, lambda_rows, inverse_count, row_flags, carry, inclusive, weight),
            grad_output, grad_last, right_inclusive,
            grad_signal, grad_noise, grad_lambda, grad_weight, grad_carry, heads_sum,
            query_length, heads, chunks, channels, eps,
            *grad_output.stride()[:3], *grad_signal.stride()[:3], *grad_noise.stride()[:3],
            CHUNK_ROWS=chunk_rows, BLOCK_CHANNELS=block_channels, HAS_CARRY=carry is not None,
            MULTI_CHUNK=chunks > 1, NORMALIZE=normalize, HAS_WEIGHT=weight is not None,
            HAS_GRAD_LAST=grad_last is not None, HEADS_ONLY=heads_only, num_warps=num_warps,
        )

    right_inclusive = None
    with _on_device(signal):
        if chunks > 1:  # what each chunk passes back to the chunks before it, then their running sum from the right
            heads_sum = torch.empty(batch_heads, chunks, channels, **float_options)
            launch(True, None, heads_sum)
            right_inclusive = _chunk_scan(heads_sum, restarts, None, batch_heads, heads, chunks, channels, reverse=True)
        launch(False, right_inclusive, None)
    return grad_lambda, (grad_weight.sum(dim=0) if grad_weight is not None else None), grad_carry


def shared_output(signal: torch.Tensor, noise: torch.Tensor) -> torch.Tensor | None:
    """The attention output `[B, T, 2 heads, C]` whose query heads O1 and O2 are, where they are views of one: v2's
    even and odd heads (`[:, :, 0::2]`, `[:, :, 1::2]`), v1's first and last halves (`torch.chunk(.., 2, dim=2)`).
    Its gradient is then written in one buffer, without the zero-filled copy autograd makes for each view. None
    where O1 and O2 are not such views."""
    base = signal._base
    if base is None or noise._base is not base or base.requires_grad != signal.requires_grad or base.dim() != 4:
        return None
    if not base.is_contiguous():  # its gradient buffer is made contiguous (`backward`)
        return None
    batch_size, query_length, heads, channels = signal.shape
    if tuple(base.shape) != (batch_size, query_length, 2 * heads, channels) or noise.stride() != signal.stride():
        return None
    outer_strides = [(view.stride(0), view.stride(1), view.stride(3)) for view in (signal, base)]
    if signal.storage_offset() != base.storage_offset() or outer_strides[0] != outer_strides[1]:
        return None
    head_stride, noise_offset = base.stride(2), noise.storage_offset() - base.storage_offset()
    interleaved = signal.stride(2) == 2 * head_stride and noise_offset == head_stride
    halves = signal.stride(2) == head_stride and noise_offset == heads * head_stride
    return base if interleaved or halves else None


class TritonIntegral(torch.autograd.Function):
    """The kernels with autograd: gradients for O1 and O2 (or the attention output they are views of), lambda, the
    head norm's weight and the carry."""

    @staticmethod
    def forward(ctx, signal, noise, attention_output, lambda_, inverse_count, row_flags, carry, weight, normalize,
                eps, store_running):
        ctx.set_materialize_grads(False)
        output, last_sum, running, inclusive, restarts = integral_forward(
            signal, noise, lambda_, inverse_count, row_flags, carry, weight, normalize, eps, store_running
        )
        ctx.save_for_backward(signal, noise, attention_output, lambda_, inverse_count, row_flags, carry, weight,
                              inclusive, restarts)
        ctx.normalize, ctx.eps = normalize, eps
        if running is None:
            running = output.new_empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(running)
        return output, last_sum, running

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' backward has no backward of its own
    def backward(ctx, grad_output, grad_last, grad_running):
        signal, noise, attention_output, lambda_, inverse_count, row_flags, carry, weight, inclusive, restarts = (
            ctx.saved_tensors
        )
        if grad_output is None:
            grad_output = torch.zeros(signal.shape, dtype=signal.dtype, device=signal.device)
        if attention_output is not None:
            grad_attention_output = torch.empty(attention_output.shape, dtype=signal.dtype, device=signal.device)
            start = grad_attention_output.storage_offset() - attention_output.storage_offset()
            grad_signal, grad_noise = (
                grad_attention_output.as_strided(view.shape, view.stride(), view.storage_offset() + start)
                for view in (signal, noise)
            )
        else:
            grad_attention_output = None
            grad_signal = torch.empty(signal.shape, dtype=signal.dtype, device=signal.device)
            grad_noise = torch.empty(noise.shape, dtype=noise.dtype, device=noise.device)
        inputs = IntegralInputs(signal, noise, lambda_, inverse_count, row_flags, carry, inclusive, weight)
        grad_lambda, grad_weight, grad_carry = integral_backward(
            grad_output, grad_last, inputs, restarts, ctx.normalize, ctx.eps, grad_signal, grad_noise
        )
        if lambda_.dim() == grad_lambda.dim() + 1:
            grad_lambda = grad_lambda.unsqueeze(-1)
        grad_lambda = grad_lambda.sum_to_size(lambda_.shape) if lambda_.dim() else grad_lambda.sum()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_carry is not None:
            grad_carry = grad_carry.sum_to_size(carry.shape).to(carry.dtype)
        if attention_output is not None:
            grad_signal = grad_noise = None
        return (grad_signal, grad_noise, grad_attention_output, grad_lambda, None, None, grad_carry, grad_weight, None,
                None, None)


def triton_integral(signal, noise, lambda_, inverse_count, row_flags, carry, weight, normalize, eps, store_running=False):
    """The integral's tail on the kernels (arguments as `integral_forward`'s): `(output, last_sum, running or None)`,
    through autograd where a gradient is wanted."""
    tensors = (signal, noise, lambda_, carry, weight)
    if not (torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors)):
        return integral_forward(signal, noise, lambda_, inverse_count, row_flags, carry, weight, normalize, eps,
                                store_running)[:3]
    output, last_sum, running = TritonIntegral.apply(
        signal, noise, shared_output(signal, noise), lambda_, inverse_count, row_flags, carry, weight, normalize, eps,
        store_running,
    )
    return output, last_sum, running if store_running else None


def rows_last_running_sum(rows: torch.Tensor, restart_row: torch.Tensor | None) -> torch.Tensor:
    """The running sum of the eager ops on CUDA, for the calls the kernels do not take (eval mode, short calls, no
    gradient): `integral_dint.segmented_running_sum`'s scan over an fp32 copy with the rows last, since CUDA's cumsum
    over a dimension other than the last runs a step at a time per column. Same arguments and result as that scan:
    `rows` `[B, T, ...]`, padding rows zeroed, `restart_row` `[B, T]` or None; fp32."""
    rows_last = rows.movedim(1, -1).to(torch.float32, memory_format=torch.contiguous_format)
    running = rows_last.cumsum(-1).movedim(-1, 1)
    if restart_row is None:
        return running
    restart_index = restart_row.view(*restart_row.shape, *[1] * (rows.dim() - 2)).expand(rows.shape)
    return running - (running - rows).gather(1, restart_index)
