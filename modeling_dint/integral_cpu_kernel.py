# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The fast path's integral as one pass over the rows, on CPU, where autograd is off (generate, evaluation).

Eager torch computes `out = head_norm(O1 - lambda * (O2 - S / c))` with `S` the running sum of O1 in about eight passes
over `[B, T, H/2, C]`, in fp32 (the casts of O1 and O2, the running sum, two multiply-adds, the head norm's passes
and the cast back): more than DiffLlama's combination and group norm take. `integral_forward`, a small C++ op compiled
on first use (`torch.utils.cpp_extension.load_inline`, cached per machine), reads O1 and O2 once in the model's dtype
and writes the output once: per (batch row, head), a loop over the rows keeps the running sum of each channel in fp32,
restarts it where a document starts, skips padding rows, and normalizes each row. It returns the sum after the last
row, what the cache carries. For requests packed into one row (continuous batching, vLLM) it reads and writes a state
table in place instead: a row with a `carry_slot` starts from that slot's sum (a continuing request's first row), a row
with a `store_slot` stores its sum there (a request's last row; with transformers' paged cache, each row that ends a
block), so no per-row gather and scatter of the state is needed. The eager path gathers every row's state before it
stores any; the kernel reads in place, which gives the same result because no row of a step stores into a slot that a
later request of the same step reads (a request reads its own earlier block or slot; transformers' paged cache and
vLLM both guarantee it: shared blocks are complete, and only the requests' own current blocks are written; vLLM's
same-step prefix hits run in waves). A second op, `packed_step_rows`, builds a vLLM step's rows (where each request
restarts, counts, reads and stores) from vLLM's metadata in one call, once per step for every layer. Its time against
the eager ops and DiffLlama's tail: docs/performance.md.

The op is an inference kernel: the integral's plan (`integral_dint.choose_implementation`) takes it on CPU for fp32
and bf16 when no gradient is needed, outside torch.compile and export, where the head norm has no hooks, and where
nobody needs the running sum of every row (a cache recording its past for `crop`); a packed-request holder takes it
where it keeps a state table. A decoding step of a layer without a head norm (one row) runs the eager ops in place,
which cost the host less than the op's call. Everywhere else the eager ops run, and the tests compare the two
(`tests/test_integral_cpu_kernel.py`, `tests/test_vllm.py`).
Without a C++ compiler and ninja it warns once and the eager ops run; `DINT_CPU_KERNEL=0` (or `false`, `off`, `no`)
turns it off, read at every forward (`cpu_kernel_enabled`). The first build (a minute or so) says so at the default
log level, and where it caches. The build is cached in torch's extensions folder (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`) under a name that hashes the source, the torch release, torch's installation folder and
the CPU (it is compiled with `-march=native`), so a shared home folder never hands one CPU another's build, and two
virtualenvs with the same torch release never rebuild each other's (torch's build rules name torch's headers and
libraries by path: a changed path rebuilds); the op's namespace hashes the source, so two versions of this file (the
package and a checkpoint's remote code) never share one. A build killed midway leaves torch's lock file in that
folder, on which later builds would wait forever: a lock older than `STALE_LOCK_SECONDS` is reported and removed.

This file travels with the remote code (`save_pretrained`): it imports nothing but torch and transformers.
"""

import functools
import hashlib
import os
import platform
import threading
import time

import torch
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)

KERNEL_TEMPLATE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float to_float(float value) { return value; }
inline float to_float(c10::BFloat16 value) { return static_cast<float>(value); }

// ROW_VALID: the row counts in the running sum; DOCUMENT_START: the sum restarts at 0 before this row.
constexpr uint8_t ROW_VALID = @ROW_VALID@;
constexpr uint8_t DOCUMENT_START = @DOCUMENT_START@;

template <typename scalar_t>
void integral_rows(const at::Tensor& signal, const at::Tensor& noise, const at::Tensor& lambda_,
                   const at::Tensor& inverse_count, const at::Tensor& row_flags, const at::Tensor& carry,
                   const at::Tensor& norm_weight, bool normalize, double eps, const at::Tensor& state,
                   const at::Tensor& carry_slot, const at::Tensor& store_slot, at::Tensor& output,
                   at::Tensor& last_sum) {
  const int64_t batch = signal.size(0), rows = signal.size(1), heads = signal.size(2), channels = signal.size(3);
  const scalar_t* signal_data = signal.data_ptr<scalar_t>();
  const scalar_t* noise_data = noise.data_ptr<scalar_t>();
  const float* lambda_data = lambda_.data_ptr<float>();
  const float* inverse_data = inverse_count.data_ptr<float>();
  const uint8_t* flag_data = row_flags.data_ptr<uint8_t>();
  const float* carry_data = carry.defined() ? carry.data_ptr<float>() : nullptr;
  const float* weight_data = norm_weight.defined() ? norm_weight.data_ptr<float>() : nullptr;
  scalar_t* output_data = output.data_ptr<scalar_t>();
  float* last_data = last_sum.defined() ? last_sum.data_ptr<float>() : nullptr;
  // Packed requests: a state table read where a row's request carries its past and written where it is stored
  float* state_data = state.defined() ? state.data_ptr<float>() : nullptr;
  const int64_t* carry_slot_data = state_data ? carry_slot.data_ptr<int64_t>() : nullptr;
  const int64_t* store_slot_data = state_data ? store_slot.data_ptr<int64_t>() : nullptr;
  const int64_t state_slot_stride = state_data ? state.stride(0) : 0, state_head_stride = state_data ? state.stride(1) : 0;
  const auto signal_stride = signal.strides(), noise_stride = noise.strides(), lambda_stride = lambda_.strides();
  const auto inverse_stride = inverse_count.strides(), flag_stride = row_flags.strides();
  const float epsilon = static_cast<float>(eps);
  const float inverse_channels = 1.0f / static_cast<float>(channels);

  // (batch row, head) pairs: on the calling thread while all of them hold at most PARALLEL_VALUES values (a decoding
  // step's few pairs: waking the thread team costs more than their work), else split over the team
  const int64_t grain = std::max<int64_t>(1, @PARALLEL_VALUES@ / std::max<int64_t>(1, rows * channels));
  at::parallel_for(0, batch * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> running(channels), combined(channels), weight(channels, 1.0f);
    if (weight_data) std::copy(weight_data, weight_data + channels, weight.begin());
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / heads, h = index % heads;
      for (int64_t c = 0; c < channels; ++c) {
        running[c] = carry_data ? carry_data[index * channels + c] : 0.0f;
      }
      for (int64_t t = 0; t < rows; ++t) {
        const uint8_t flags = flag_data[b * flag_stride[0] + t * flag_stride[1]];
        const scalar_t* signal_row = signal_data + b * signal_stride[0] + t * signal_stride[1] + h * signal_stride[2];
        const scalar_t* noise_row = noise_data + b * noise_stride[0] + t * noise_stride[1] + h * noise_stride[2];
        const float lambda_value = lambda_data[b * lambda_stride[0] + t * lambda_stride[1] + h * lambda_stride[2]];
        const float inverse = inverse_data[b * inverse_stride[0] + t * inverse_stride[1]];
        if (flags & DOCUMENT_START) {
          for (int64_t c = 0; c < channels; ++c) running[c] = 0.0f;
        }
        if (state_data && carry_slot_data[b * rows + t] >= 0) {  // the request's sum from its earlier steps
          const float* carried = state_data + carry_slot_data[b * rows + t] * state_slot_stride + h * state_head_stride;
          for (int64_t c = 0; c < channels; ++c) running[c] = carried[c];
        }
        if (flags & ROW_VALID) {
          for (int64_t c = 0; c < channels; ++c) running[c] += to_float(signal_row[c]);
        }
        float square_sum = 0.0f;
#pragma omp simd reduction(+ : square_sum)
        for (int64_t c = 0; c < channels; ++c) {
          // O1 - lambda * (O2 - S / c), as `combine_with_integral`
          const float value =
              to_float(signal_row[c]) - lambda_value * (to_float(noise_row[c]) - running[c] * inverse);
          combined[c] = value;
          square_sum += value * value;
        }
        if (state_data && store_slot_data[b * rows + t] >= 0) {
          float* stored = state_data + store_slot_data[b * rows + t] * state_slot_stride + h * state_head_stride;
          for (int64_t c = 0; c < channels; ++c) stored[c] = running[c];
        }
        scalar_t* output_row = output_data + ((b * rows + t) * heads + h) * channels;
        if (normalize) {
          const float scale = 1.0f / std::sqrt(square_sum * inverse_channels + epsilon);
          for (int64_t c = 0; c < channels; ++c) output_row[c] = static_cast<scalar_t>(combined[c] * scale * weight[c]);
        } else {
          for (int64_t c = 0; c < channels; ++c) output_row[c] = static_cast<scalar_t>(combined[c]);
        }
      }
      if (last_data) {
        for (int64_t c = 0; c < channels; ++c) last_data[index * channels + c] = running[c];
      }
    }
  });
}

std::vector<at::Tensor> integral_forward(const at::Tensor& signal_input, const at::Tensor& noise_input,
                                         const at::Tensor& lambda_input, const at::Tensor& inverse_input,
                                         const at::Tensor& flags_input, const c10::optional<at::Tensor>& carry,
                                         const c10::optional<at::Tensor>& norm_weight, bool normalize, double eps,
                                         const c10::optional<at::Tensor>& state,
                                         const c10::optional<at::Tensor>& carry_slot,
                                         const c10::optional<at::Tensor>& store_slot,
                                         const c10::optional<at::Tensor>& out) {
  // Requests packed into one row may come without the batch dimension ([T, heads, C]: B = 1); the per-row inputs
  // broadcast against [B, T] (lambda against [B, T, heads], with or without a trailing channel dimension of 1)
  TORCH_CHECK((signal_input.dim() == 4 || signal_input.dim() == 3) && noise_input.sizes() == signal_input.sizes(),
              "signal and noise: [B, T, heads, C] or [T, heads, C], the same");
  const at::Tensor signal = signal_input.dim() == 3 ? signal_input.unsqueeze(0) : signal_input;
  const at::Tensor noise = noise_input.dim() == 3 ? noise_input.unsqueeze(0) : noise_input;
  TORCH_CHECK(signal.scalar_type() == noise.scalar_type(), "signal and noise: one dtype");
  TORCH_CHECK(signal.stride(3) == 1 && noise.stride(3) == 1, "signal and noise: contiguous channels");
  const int64_t rows = signal.size(1);
  TORCH_CHECK(lambda_input.scalar_type() == at::kFloat, "lambda: fp32");
  at::Tensor lambda_ = lambda_input;
  if (lambda_.dim() == signal_input.dim() && lambda_.size(-1) == 1) lambda_ = lambda_.squeeze(-1);
  TORCH_CHECK(lambda_.dim() == 0 || (lambda_.dim() == signal_input.dim() - 1 && lambda_.size(-1) == signal.size(2)),
              "lambda: a scalar, or one per row and head (signal's shape without its channels, optionally with a "
              "trailing 1)");
  lambda_ = lambda_.expand({signal.size(0), rows, signal.size(2)});
  TORCH_CHECK(inverse_input.scalar_type() == at::kFloat, "inverse_count: fp32 [B, T] or [T]");
  TORCH_CHECK(flags_input.scalar_type() == at::kByte, "row_flags: uint8 [B, T] or [T]");
  const at::Tensor inverse_count = inverse_input.expand({signal.size(0), rows});
  const at::Tensor row_flags = flags_input.expand({signal.size(0), rows});
  const int64_t batch = signal.size(0), heads = signal.size(2), channels = signal.size(3);
  at::Tensor carry_tensor, weight_tensor;
  if (carry.has_value()) {
    carry_tensor = carry->to(at::kFloat).contiguous();
    TORCH_CHECK(carry_tensor.numel() == batch * heads * channels, "carry: [B, heads, C]");
  }
  if (norm_weight.has_value()) {
    weight_tensor = norm_weight->to(at::kFloat).contiguous();
    TORCH_CHECK(weight_tensor.numel() == channels, "norm_weight: [C]");
  }
  at::Tensor state_tensor, carry_slot_tensor, store_slot_tensor, last_sum;
  if (state.has_value()) {
    // Packed requests: no per-batch-row carry; each row may read (carry_slot >= 0) and store (store_slot >= 0) its
    // request's sum in the table, in place
    TORCH_CHECK(!carry.has_value(), "state and carry: one or the other");
    state_tensor = *state;
    TORCH_CHECK(state_tensor.scalar_type() == at::kFloat && state_tensor.dim() == 3 && state_tensor.size(1) == heads &&
                    state_tensor.size(2) == channels && state_tensor.stride(2) == 1,
                "state: fp32 [slots, heads, C] with contiguous channels");
    TORCH_CHECK(carry_slot.has_value() && store_slot.has_value(), "state needs carry_slot and store_slot");
    TORCH_CHECK(carry_slot->numel() == batch * rows && store_slot->numel() == batch * rows,
                "carry_slot and store_slot: int64 [B, T] or [T]");
    carry_slot_tensor = carry_slot->reshape({batch, rows}).contiguous();
    store_slot_tensor = store_slot->reshape({batch, rows}).contiguous();
    TORCH_CHECK(carry_slot_tensor.scalar_type() == at::kLong && store_slot_tensor.scalar_type() == at::kLong,
                "carry_slot and store_slot: int64 [B, T] or [T]");
    TORCH_CHECK(state_tensor.device().is_cpu() && carry_slot_tensor.device().is_cpu() &&
                    store_slot_tensor.device().is_cpu(),
                "state, carry_slot and store_slot: CPU tensors");
    const int64_t num_slots = state_tensor.size(0);
    for (const at::Tensor* slots : {&carry_slot_tensor, &store_slot_tensor}) {  // the eager path's IndexError
      const int64_t* data = slots->data_ptr<int64_t>();
      for (int64_t i = 0; i < slots->numel(); ++i) {
        TORCH_CHECK(data[i] >= -1 && data[i] < num_slots, "slot ", data[i], " out of range for a state of ", num_slots,
                    " slots (-1: none)");
      }
    }
  } else {
    last_sum = at::empty({batch, heads, channels}, signal.options().dtype(at::kFloat));
  }
  at::Tensor output;
  if (out.has_value()) {  // written in place (its shape: signal's as given); the first tensor returned is then empty
    TORCH_CHECK(out->sizes() == signal_input.sizes() && out->scalar_type() == signal.scalar_type() &&
                    out->is_contiguous() && out->device().is_cpu(),
                "out: contiguous, signal's shape and dtype");
    output = out->view(signal.sizes());
  } else {
    output = at::empty(signal.sizes(), signal.options());
  }
  if (signal.scalar_type() == at::kBFloat16) {
    integral_rows<c10::BFloat16>(signal, noise, lambda_, inverse_count, row_flags, carry_tensor, weight_tensor,
                                 normalize, eps, state_tensor, carry_slot_tensor, store_slot_tensor, output, last_sum);
  } else {
    TORCH_CHECK(signal.scalar_type() == at::kFloat, "signal: fp32 or bf16");
    integral_rows<float>(signal, noise, lambda_, inverse_count, row_flags, carry_tensor, weight_tensor, normalize,
                         eps, state_tensor, carry_slot_tensor, store_slot_tensor, output, last_sum);
  }
  if (!last_sum.defined()) last_sum = at::empty({0}, signal.options().dtype(at::kFloat));
  if (out.has_value()) return {at::empty({0}, signal.options()), last_sum};
  return {signal_input.dim() == 3 ? output.squeeze(0) : output, last_sum};
}

// Requests packed into one row (a vLLM step): per row, where the integral restarts, counts, reads and stores, built
// once per step for every layer (the Python equivalent, for every device: `VllmStepRows`). Request r owns the rows
// query_start_loc[r]:query_start_loc[r + 1] (rows past the last request join it); a request whose first row is past
// position 0 continues from the state in the tail of the block holding its previous token; a row stores its sum in
// its own block's tail where it completes the block or is its request's last row. Returns, each [T]:
//   inverse_count fp32: 1 / (position + 1);  row_flags uint8: ROW_VALID | DOCUMENT_START (each request's first row);
//   carry_slot, store_slot int64: the block the kernel reads before the row and stores after it (-1: none);
//   first_row int64: the row's request's first row;  carry_block int64: the block the row's request continues from
//   (any valid block for a request at position 0: not read);  continues bool: the row's request continues its past;
// and waves int64 [1]: 1 where a continuing request reads a block that another request of the step stores (the step
// must run in waves, writers first: the Python path builds them), else 0.
std::vector<at::Tensor> packed_step_rows(const at::Tensor& positions, const at::Tensor& query_start_loc,
                                         const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                         int64_t block_size) {
  TORCH_CHECK(positions.dim() == 1 && query_start_loc.dim() == 1 && slot_mapping.dim() == 1 && block_table.dim() == 2,
              "positions [T], query_start_loc [R + 1], slot_mapping [>= T], block_table [>= R, blocks]");
  TORCH_CHECK(block_size > 0, "block_size > 0");
  const int64_t num_rows = positions.size(0), num_requests = query_start_loc.size(0) - 1;
  TORCH_CHECK(num_requests >= 1 && num_rows >= 1 && slot_mapping.size(0) >= num_rows &&
                  block_table.size(0) >= num_requests,
              "a step of at least one row and one request, a slot per row and a block table row per request");
  const at::Tensor position = positions.to(at::kLong).contiguous(), start = query_start_loc.to(at::kLong).contiguous();
  const at::Tensor slot = slot_mapping.narrow(0, 0, num_rows).to(at::kLong).contiguous();
  TORCH_CHECK(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong,
              "block_table: int32 or int64");
  const bool table_is_int = block_table.scalar_type() == at::kInt;
  const void* table_data = block_table.data_ptr();
  const int64_t table_row_stride = block_table.stride(0), table_column_stride = block_table.stride(1);
  auto table_entry = [&](int64_t r, int64_t column) -> int64_t {
    const int64_t offset = r * table_row_stride + column * table_column_stride;
    return table_is_int ? static_cast<const int32_t*>(table_data)[offset] : static_cast<const int64_t*>(table_data)[offset];
  };
  const int64_t* position_data = position.data_ptr<int64_t>();
  const int64_t* start_data = start.data_ptr<int64_t>();
  const int64_t* slot_data = slot.data_ptr<int64_t>();
  const auto long_options = positions.options().dtype(at::kLong);
  auto inverse_count = at::empty({num_rows}, positions.options().dtype(at::kFloat));
  auto row_flags = at::empty({num_rows}, positions.options().dtype(at::kByte));
  auto carry_slot = at::empty({num_rows}, long_options), store_slot = at::empty({num_rows}, long_options);
  auto first_row = at::empty({num_rows}, long_options), carry_block = at::empty({num_rows}, long_options);
  auto continues = at::empty({num_rows}, positions.options().dtype(at::kBool));
  auto waves = at::zeros({1}, long_options);
  float* inverse_data = inverse_count.data_ptr<float>();
  uint8_t* flag_data = row_flags.data_ptr<uint8_t>();
  int64_t *carry_slot_data = carry_slot.data_ptr<int64_t>(), *store_slot_data = store_slot.data_ptr<int64_t>();
  int64_t *first_row_data = first_row.data_ptr<int64_t>(), *carry_block_data = carry_block.data_ptr<int64_t>();
  bool* continues_data = continues.data_ptr<bool>();
  std::vector<int64_t> request_of_store, store_blocks, previous_block(num_requests, -1);
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t first = std::min(start_data[r], num_rows - 1);
    const int64_t end = r == num_requests - 1 ? num_rows : std::min(start_data[r + 1], num_rows);
    const int64_t first_position = position_data[first];
    const int64_t previous_index = std::max<int64_t>(first_position - 1, 0) / block_size;
    TORCH_CHECK(previous_index < block_table.size(1), "position ", first_position, " past the block table of request ", r);
    const int64_t previous = table_entry(r, previous_index);
    const bool continuing = first_position > 0;
    if (start_data[r] < end && continuing) previous_block[r] = previous;
    for (int64_t t = start_data[r]; t < end; ++t) {
      const int64_t p = position_data[t];
      inverse_data[t] = 1.0f / static_cast<float>(p + 1);
      flag_data[t] = ROW_VALID | (t == first ? DOCUMENT_START : 0);
      carry_slot_data[t] = (t == first && continuing) ? previous : -1;
      store_slot_data[t] = (p + 1) % block_size == 0 ? 1 : 0;  // a flag here; the block below
      first_row_data[t] = first;
      carry_block_data[t] = previous;
      continues_data[t] = continuing;
    }
  }
  // Each request's last row stores too (the row before the next request's first, clamped into the step, as
  // `VllmStepRows` counts it); a row with no slot (vLLM's -1 padding) stores nothing
  for (int64_t r = 0; r < num_requests; ++r) {
    store_slot_data[std::min(std::max<int64_t>(start_data[r + 1] - 1, 0), num_rows - 1)] = 1;
  }
  std::vector<int64_t> row_request(num_rows, num_requests - 1);
  for (int64_t r = 0; r < num_requests; ++r) {
    for (int64_t t = start_data[r]; t < std::min(start_data[r + 1], num_rows); ++t) row_request[t] = r;
  }
  for (int64_t t = 0; t < num_rows; ++t) {
    const bool stores = store_slot_data[t] == 1 && slot_data[t] >= 0;
    store_slot_data[t] = stores ? slot_data[t] / block_size : -1;
    if (stores) {
      request_of_store.push_back(row_request[t]);
      store_blocks.push_back(store_slot_data[t]);
    }
  }
  for (int64_t r = 0; r < num_requests; ++r) {
    if (previous_block[r] < 0) continue;
    for (size_t s = 0; s < store_blocks.size(); ++s) {
      if (store_blocks[s] == previous_block[r] && request_of_store[s] != r) waves.fill_(1);
    }
  }
  return {inverse_count, row_flags, carry_slot, store_slot, first_row, carry_block, continues, waves};
}

}  // namespace

TORCH_LIBRARY(@NAMESPACE@, m) {
  m.def(
      "integral_forward(Tensor signal, Tensor noise, Tensor lambda_, Tensor inverse_count, Tensor row_flags, "
      "Tensor? carry, Tensor? norm_weight, bool normalize, float eps, Tensor(a!)? state=None, "
      "Tensor? carry_slot=None, Tensor? store_slot=None, Tensor(b!)? out=None) -> Tensor[]");
  m.def(
      "packed_step_rows(Tensor positions, Tensor query_start_loc, Tensor slot_mapping, Tensor block_table, "
      "int block_size) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(@NAMESPACE@, CPU, m) {
  m.impl("integral_forward", &integral_forward);
  m.impl("packed_step_rows", &packed_step_rows);
}
"""

ROW_VALID, DOCUMENT_START = 1, 2
"""The bits of the kernel's per-row flags (`DintIntegralLayout.row_flags`), written into the source below."""

PARALLEL_VALUES = 16384
"""The kernel runs its (batch row, head) pairs on the calling thread while they hold at most this many values (rows x
channels each) in all, and splits them over the thread team above it: below it the work (tens of microseconds) costs
less than waking the team."""

_SOURCE_BODY = (
    KERNEL_TEMPLATE.replace("@ROW_VALID@", str(ROW_VALID))
    .replace("@DOCUMENT_START@", str(DOCUMENT_START))
    .replace("@PARALLEL_VALUES@", str(PARALLEL_VALUES))
)
NAMESPACE = "dint_cpu_" + hashlib.sha256(_SOURCE_BODY.encode()).hexdigest()[:12]
"""The op's namespace, `torch.ops.<NAMESPACE>.integral_forward`: one per version of the source."""
KERNEL_SOURCE = _SOURCE_BODY.replace("@NAMESPACE@", NAMESPACE)

STALE_LOCK_SECONDS = 600
"""A build lock older than this (a build takes about a minute) was left by a killed build."""

KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_state = {"op": None, "tried": False}


CPU_KERNEL_VARIABLE = "DINT_CPU_KERNEL"
"""The environment variable that turns the kernel off (`cpu_kernel_enabled`)."""

SWITCH_SPELLINGS = {
    "1": True, "true": True, "on": True, "yes": True,
    "0": False, "false": False, "off": False, "no": False,
}
"""The values `DINT_CPU_KERNEL` takes, compared without case and surrounding spaces."""


@functools.lru_cache(maxsize=16)
def _parse_cpu_kernel_switch(raw: str) -> bool:
    value = SWITCH_SPELLINGS.get(raw.strip().lower())
    if value is None:
        raise ValueError(
            f"{CPU_KERNEL_VARIABLE}={raw!r} is not a switch. Allowed (any case): {', '.join(SWITCH_SPELLINGS)}; "
            "unset or empty: on."
        )
    return value


def environment_variable(name: str) -> str | None:
    """`os.environ.get(name)` without the KeyError that `os.environ.get` raises and catches for an unset name (read
    once per forward, a decoding step's cost): CPython's `os.environ` keeps its values in `_data`, by encoded key."""
    data = getattr(os.environ, "_data", None)
    if data is None:
        return os.environ.get(name)
    value = data.get(os.environ.encodekey(name))
    return None if value is None else os.environ.decodevalue(value)


def cpu_kernel_enabled() -> bool:
    """Whether the kernel may be used: `DINT_CPU_KERNEL` unset, empty or one of `SWITCH_SPELLINGS`' true spellings;
    a value that is no spelling is refused. Read at every call, so that a test or benchmark can change it between
    forwards; each distinct raw value is parsed once (a dictionary lookup after that)."""
    raw = environment_variable(CPU_KERNEL_VARIABLE)
    return True if not raw else _parse_cpu_kernel_switch(raw)


def _cpu_signature() -> str:
    """What the CPU is and which instructions it has: /proc/cpuinfo's lines that describe the CPU (x86's model name and
    flags, Arm's implementer, part and features, ...), without the ones that change while it runs or number the cores;
    what `platform` knows elsewhere."""
    varying = ("cpu MHz", "bogomips", "BogoMIPS", "processor", "core id", "apicid", "initial apicid", "physical id",
               "siblings", "cpu cores")
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = {line.strip() for line in cpuinfo if line.strip() and not line.startswith(varying)}
        return "\n".join(sorted(lines))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def extension_name() -> str:
    """The build's name: the source, the torch release, torch's installation folder and the CPU, hashed."""
    key = f"{KERNEL_SOURCE}\n{torch.__version__}\n{os.path.dirname(torch.__file__)}\n{_cpu_signature()}".encode()
    return f"dint_cpu_integral_{hashlib.sha256(key).hexdigest()[:16]}"


def integral_kernel():
    """`torch.ops.<NAMESPACE>.integral_forward`, built (or loaded from the cache) on the first call of the process
    where it is enabled, or None where `DINT_CPU_KERNEL` turns it off now (`cpu_kernel_enabled`) or it cannot be built
    (warned once)."""
    if not cpu_kernel_enabled():
        return None
    if _state["tried"]:
        return _state["op"]
    with _lock:
        if not _state["tried"]:
            _state["op"] = _build()
            _state["tried"] = True
    return _state["op"]


def built_integral_kernel():
    """The op `integral_kernel` built: what a layer's call runs once its forward's plan chose the kernel (the plan read
    `DINT_CPU_KERNEL` and built it), without reading the environment again per layer."""
    return _state["op"]


def packed_step_rows_kernel():
    """`torch.ops.<NAMESPACE>.packed_step_rows` (built with `integral_kernel`), or None where the kernel is not:
    the rows of a vLLM step, prepared once for every layer (`modeling_dint_vllm.VllmStepRows.prepared`)."""
    if integral_kernel() is None:
        return None
    return getattr(torch.ops, NAMESPACE).packed_step_rows


def _build():
    if hasattr(getattr(torch.ops, NAMESPACE), "integral_forward"):  # registered earlier in this process
        return getattr(torch.ops, NAMESPACE).integral_forward
    return _compile()


def build_folder(name: str) -> str:
    """Where torch builds and caches the extension `name` (created if missing): `TORCH_EXTENSIONS_DIR/name`, by
    default `~/.cache/torch_extensions/<python>_<accelerator>/name`, as torch's `load_inline` computes it."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def build_message(name: str) -> str | None:
    """What the user is told before the extension `name` is compiled, or None where its cached build is there to load
    (the library torch writes, `<folder>/<name>.so`): a first build takes a minute or so."""
    folder = build_folder(name)
    if os.path.exists(os.path.join(folder, f"{name}.so")):
        return None
    return (
        f"DINT: building the fused CPU integral kernel, once per machine and torch installation (a minute or so), in "
        f"{folder}; later processes load it from there. {CPU_KERNEL_VARIABLE}=0 skips it (the eager ops run)."
    )


def _remove_stale_lock(name: str) -> None:
    """Removes torch's build lock of `name` where a killed build left it (older than `STALE_LOCK_SECONDS`)."""
    lock = os.path.join(build_folder(name), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning(f"DINT: removing {lock}, left {age:.0f} s ago by a build of the CPU integral kernel that stopped")
        try:
            os.remove(lock)
        except OSError:
            pass


def _compile():
    """Compiles (or loads the cached build of) the kernel; None, warned once, where that fails."""
    try:
        from torch.utils.cpp_extension import load_inline

        name = extension_name()
        _remove_stale_lock(name)
        message = build_message(name)
        if message is not None:
            logger.warning(message)
        load_inline(
            name,
            cpp_sources=[KERNEL_SOURCE],
            is_python_module=False,
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        return getattr(torch.ops, NAMESPACE).integral_forward
    except Exception as error:  # no compiler, no ninja, an unusual toolchain: the eager ops are exact too
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        logger.warning_once(
            f"DINT: the fused CPU integral kernel could not be built ({type(error).__name__}: {reason}); the integral "
            "runs as eager torch ops, exact and slower. A C++ compiler and `pip install ninja` enable it; "
            "DINT_CPU_KERNEL=0 silences this."
        )
        return None

# --- The eager ops' running sum on CPU with a gradient (training), where the op above does not run --------------------

SCAN_BLOCK_ROWS = 16
"""Query rows per block of `blocked_running_sum`: its matrix multiply does SCAN_BLOCK_ROWS multiply-adds per value
(the fastest of 16, 32 and 64 measured: docs/performance.md)."""


def blocked_scan_is_exact() -> bool:
    """Whether `blocked_running_sum` gives the running sum exactly: where fp32 matrix multiplies on CPU are fp32 (a
    user may have let oneDNN run them in bf16 or tf32: `torch.backends.mkldnn.matmul.fp32_precision`,
    `torch.set_float32_matmul_precision`). The integral's plan asks once per forward."""
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


def blocked_running_sum(rows: torch.Tensor, restart_row: torch.Tensor | None) -> torch.Tensor:
    """The running sum of the eager ops on CPU where autograd records the call (training; the op above has no
    backward): `integral_dint.segmented_running_sum`'s scan as matrix multiplies over blocks of `SCAN_BLOCK_ROWS`
    rows (`_blocked_running_sum_fp32`), since torch's CPU cumsum does not vectorize the scan over a dimension other
    than the last. Same arguments and result as that scan: `rows` `[B, T, ...]`, padding rows zeroed, `restart_row`
    `[B, T]` or None; fp32."""
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
