# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT under transformers' continuous batching (`model.generate_batch`, `transformers serve --continuous-batching`).

Continuous batching flattens every scheduled request into one row `[1, T]` (`cu_seq_lens_q` delimits them, position
ids continue each request's past) and keeps K and V in a paged cache that the attention backend writes. DINT needs two
more things, both here:

- the integral state of each request, carried from one scheduling step to the next: the fp32 running sum of the
  signal output `O1` per layer (`[H/2, 2d]`; its count is the request's position + 1, since a request has no padding).
  It lives beside the paged K/V, one state per cache block and layer: the state after the last token written in that
  block. A request's carry is the state of the block that holds its previous token, so the state is allocated and
  freed with the request's blocks, follows block forks (parallel sampling) and prefix sharing (a shared complete
  block holds the state after the shared prefix) with no bookkeeping of its own;
- K and V written once per layer and step: the fast path calls the backend twice (the two halves of V), and a
  backend that writes the paged cache would write each half as V. The DINT step writes K/V itself
  (`PagedAttentionCache.update`), then calls the backend with a cache that writes nothing.

Every transformers internal this depends on is used in this module only (listed in `TRANSFORMERS_INTERNALS`), read in
transformers 5.23 and 5.24; `tests/test_serving.py` checks each of them and fails loudly when one changes.
"""

import inspect

import torch
import transformers
from transformers.generation.continuous_batching import cache as continuous_batching_cache
from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR, PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, FullAttentionCacheAllocator
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .configuration_dint import DINT_LAYER_TYPE
from .integral_dint import DintIntegralLayout, segmented_running_sum


WRITTEN_FOR_TRANSFORMERS = ("5.23", "5.24")
"""The transformers releases (major.minor) whose continuous-batching internals this module was written against. From
5.24 the model writes the paged K/V itself (`cache.update` in the attention, as Llama) and the paged backends write
nothing; on 5.23 they write the cache they are given, so a DINT layer gives them one that writes nothing."""

PAGED_BACKENDS_WRITE_THE_CACHE = "cache" in inspect.signature(sdpa_attention_forward).parameters
"""5.23: the paged backends (sdpa, `paged|eager`, flash) write the K/V of the paged cache they are given as `cache`;
from 5.24 the attention module writes it (`cache.update`) and they take no cache."""

TRANSFORMERS_INTERNALS = {
    "continuous_batching.cache.ATTN_TYPE_TO_ALLOCATOR": "registry of cache allocators by layer type (DINT's is added)",
    "continuous_batching.cache.PagedAttentionCache.__init__": "wrapped: the DINT group is keyed as full attention",
    "continuous_batching.cache.PagedAttentionCache.update(key_states, value_states, layer_idx, kwargs)": "K/V write",
    "continuous_batching.cache_allocators.FullAttentionCacheAllocator": "subclassed (register_cache_tensor, "
    "copy_blocks, block_physical_stride, tokens_per_page, layer_indices, _copy_view)",
    "integrations.sdpa_attention.sdpa_attention_forward(cache=...)": "whether the paged backends write K/V (5.23) "
    "or the attention module does (5.24): PAGED_BACKENDS_WRITE_THE_CACHE",
    "model forward kwargs cache / read_index / write_index / cu_seq_lens_q / cu_seq_lens_k / max_length_k": "the "
    "step's layout (PagedAttentionArgs)",
}
"""Each transformers internal the integration touches, and what for (the closing note and the test list them)."""


def installed_release() -> str:
    """The installed transformers' minor release, e.g. "5.24"."""
    return ".".join(transformers.__version__.split(".")[:2])


def check_transformers_release() -> None:
    """Fails with both versions named when the installed transformers is not the release this module was read in."""
    if installed_release() not in WRITTEN_FOR_TRANSFORMERS:
        releases = " or ".join(f"{release}.x" for release in WRITTEN_FOR_TRANSFORMERS)
        raise RuntimeError(
            f"DINT's continuous-batching integration (modeling_dint/serving.py) was written for the internals of "
            f"transformers {releases}; transformers {transformers.__version__} is installed. Install "
            f"transformers=={WRITTEN_FOR_TRANSFORMERS[-1]}.* to serve DINT with continuous batching, or port the "
            "module (tests/test_serving.py names what to check)."
        )


class _KeysValuesWritten:
    """Stands in for the paged cache in the backend calls of a DINT layer, whose K/V the DINT step has written: the
    `paged|eager` backend calls `update` (returns the states as given); `sdpa` and flash, which write only into a
    `PagedAttentionCache`, skip it."""

    @staticmethod
    def update(key_states, value_states, layer_idx=None, kwargs=None):
        return key_states, value_states


class DintPagedCacheAllocator(FullAttentionCacheAllocator):
    """The paged K/V of full attention, plus DINT's integral state per cache block: `integral_sums`
    `[blocks, layers, H/2, 2*head_dim]` (fp32), the running sum of O1 after the last token written in the block.

    The decode fast path is off (`supports_block_table`): its kernel writes the K/V it is given, and DINT calls the
    backend with the two halves of V.
    """

    supports_block_table = False
    # The step's inputs (cu_seq_lens_k, max_length_k, the attention mask) are built for full and sliding attention
    # groups only; DINT reads them as full attention.
    layer_type = FULL_ATTENTION

    def __init__(self, config, **allocator_kwargs):
        super().__init__(config=config, **allocator_kwargs)
        self.integral = config.integral
        self.num_differential_heads = config.num_attention_heads // 2
        self.layer_slot = {layer_idx: slot for slot, layer_idx in enumerate(self.layer_indices)}
        self.integral_sums: torch.Tensor | None = None

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        super().register_cache_tensor(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        if self.integral == "none":
            return
        # One state per block of the whole tensor (trash blocks included: padding tokens write theirs there)
        num_blocks = self._copy_view.shape[0]
        self.integral_sums = torch.zeros(
            num_blocks,
            len(self.layer_indices),
            self.num_differential_heads,
            2 * self.head_dim,
            dtype=torch.float32,
            device=cache_tensor.device,
        )

    def copy_blocks(self, source_block_ids: list[int], dest_block_ids: list[int]) -> None:
        """Forks copy the integral state of the blocks with their keys and values."""
        super().copy_blocks(source_block_ids, dest_block_ids)
        if self.integral_sums is not None and source_block_ids:
            device = self.integral_sums.device
            source = torch.tensor(source_block_ids, dtype=torch.long, device=device)
            dest = torch.tensor(dest_block_ids, dtype=torch.long, device=device)
            self.integral_sums.index_copy_(0, dest, self.integral_sums.index_select(0, source))


class DintPagedLayer:
    """What a DINT layer reads of its cache in one continuous-batching step: the running sum of O1 over each request,
    carried from the request's earlier steps."""

    def __init__(self, step: "DintPagedStep", layer_idx: int):
        self.step = step
        self.layer_idx = layer_idx

    def update_integral(self, integral: str, *args, **kwargs) -> None:
        """What the attention calls for integral "none": nothing is carried (for "mean", `running_signal_sum`
        stores the state)."""
        if integral != "none":
            raise RuntimeError("A DINT paged layer stores integral statistics in `running_signal_sum` only.")

    def running_signal_sum(self, integral: str, signal_output: torch.Tensor, layout: DintIntegralLayout) -> torch.Tensor:
        """The running sum of `signal_output` (`[1, T, H/2, 2d]`) over each request's rows, its earlier steps included
        (fp32, same shape); the state after the last row of each request and each completed block is stored."""
        step = self.step
        running_sum = segmented_running_sum(signal_output, layout)  # restarts at each request's first row
        slot = step.allocator.layer_slot[self.layer_idx]
        sums = step.allocator.integral_sums
        if step.carry_rows is not None:
            carry = sums[step.carry_blocks, slot]  # [T, H/2, 2d]
            running_sum = running_sum + torch.where(step.carry_rows[:, None, None], carry, 0.0)[None]
        sums[step.store_blocks, slot] = running_sum[0].to(sums.dtype)
        return running_sum


class DintPagedStep:
    """A DINT model's view of one continuous-batching step: the cache its layers see (K/V written once into the
    paged cache, each request's integral state read and stored per block) and the integral layout of the flattened
    row. Built by `dint_paged_step` from the forward's keyword arguments."""

    is_compileable = False

    def __init__(self, paged_cache: PagedAttentionCache, allocator: DintPagedCacheAllocator, config, position_ids, kwargs):
        self.paged_cache = paged_cache
        self.allocator = allocator
        # What `PagedAttentionCache.update` reads (it resolves the group's entries in a copy, per layer)
        self.cache_kwargs = {name: kwargs[name] for name in ("read_index", "write_index", "cu_seq_lens_k", "max_length_k")}
        self.layers = [DintPagedLayer(self, layer_idx) for layer_idx in range(config.num_hidden_layers)]

        positions = position_ids[0].long()  # [T]
        num_rows = positions.shape[0]
        device = positions.device
        cu_seq_lens_q = kwargs["cu_seq_lens_q"].long()
        # The request of each row (rows past the last request are padding: they join the last one and store in trash)
        row_index = torch.arange(num_rows, device=device)
        row_request = torch.searchsorted(cu_seq_lens_q[1:], row_index, right=True).clamp(max=cu_seq_lens_q.shape[0] - 2)
        request_start = cu_seq_lens_q[:-1]
        restart_row = request_start[row_request].clamp(max=num_rows - 1)
        # Each request is one document of valid rows from position 0, so the count of a row is its position + 1
        running_query_count = (positions + 1).float()[None]
        self.layout = DintIntegralLayout(
            query_valid=None,
            restart_row=restart_row[None],
            in_carried_document=torch.zeros(1, num_rows, dtype=torch.bool, device=device),
            running_query_count=running_query_count,
            inverse_query_count=running_query_count.clamp(min=1.0).reciprocal()[:, :, None, None],
        )

        group = allocator.index
        write_index = kwargs["write_index"][group][:num_rows]
        # Store after each request's last row of the step and after the last token of each block it completes; the
        # other rows write into a trash block (no row selection: no host synchronization, CUDA-graph friendly)
        last_row = torch.zeros(num_rows, dtype=torch.bool, device=device)
        last_row[(cu_seq_lens_q[1:] - 1).clamp(min=0, max=num_rows - 1)] = True
        store = last_row | ((positions + 1) % allocator.tokens_per_page == 0)
        trash_block = allocator.write_trash_index // allocator.block_physical_stride
        self.store_blocks = torch.where(store, write_index // allocator.block_physical_stride, trash_block)

        # A request that continues (its first row is past position 0) carries the state of its previous token's block
        # (no read index: no request of the step has a past)
        read_index = kwargs["read_index"][group]
        self.carry_rows, self.carry_blocks = None, None
        if allocator.integral_sums is not None and read_index.numel() > 0:
            first_position = positions[request_start.clamp(max=num_rows - 1)]
            cu_seq_lens_k = kwargs["cu_seq_lens_k"][allocator.layer_type].long()
            previous_token = (cu_seq_lens_k[:-1] + first_position - 1).clamp(min=0, max=read_index.numel() - 1)
            carry_blocks = read_index[previous_token] // allocator.block_physical_stride
            self.carry_rows = (first_position > 0)[row_request]
            self.carry_blocks = carry_blocks[row_request]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # each request's past is in its position ids; the flattened row has no common past

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        """Writes the step's K/V of layer `layer_idx` into the paged cache and returns each request's keys and values
        `[1, kv_heads, past + new (all requests), head_dim]`."""
        return self.paged_cache.update(key_states, value_states, layer_idx, kwargs=dict(self.cache_kwargs))


def dint_paged_step(paged_cache: PagedAttentionCache, config, position_ids, kwargs) -> tuple:
    """The DINT model's entry into a continuous-batching step (`DintModel.forward` calls it through the paged cache).

    Returns the cache the layers see, the integral layout, and the keyword arguments for the layers: the backend gets
    a cache that writes nothing and the full-attention group's `cu_seq_lens_k` / `max_length_k`.
    """
    check_transformers_release()
    if config.integral == "softmax":
        raise NotImplementedError(
            "DINT with integral='softmax' does not run under continuous batching yet: its integral needs the per-key "
            "column sums of each request, which the paged cache does not keep. Use model.generate(), or a model with "
            "integral='mean' or 'none'."
        )
    if kwargs.get("block_table") is not None:
        raise RuntimeError("DINT disables the decode fast path (block table) of continuous batching; got a block table.")
    allocator = next(iter(paged_cache.cache_allocators.values()))
    step = DintPagedStep(paged_cache, allocator, config, position_ids, kwargs)
    layer_kwargs = dict(kwargs)
    if PAGED_BACKENDS_WRITE_THE_CACHE:
        layer_kwargs["cache"] = _KeysValuesWritten()
    layer_kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type]
    layer_kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
    return step, step.layout, layer_kwargs


def _init_paged_cache_with_dint(paged_cache: PagedAttentionCache, *args, **kwargs) -> None:
    """`PagedAttentionCache.__init__`, then the DINT group keyed as full attention (the step's inputs know full and
    sliding attention only) and the DINT step attached for the model's forward."""
    _original_paged_cache_init(paged_cache, *args, **kwargs)
    dint_allocators = [ca for ca in paged_cache.cache_allocators.values() if isinstance(ca, DintPagedCacheAllocator)]
    if not dint_allocators:
        return
    if len(paged_cache.cache_allocators) > 1:
        raise ValueError(
            "A DINT model's layers must all be DINT layers under continuous batching; got the cache groups "
            f"{list(paged_cache.cache_allocators)}."
        )
    paged_cache.cache_allocators = {FULL_ATTENTION: dint_allocators[0]}

    def step(config, position_ids, kwargs):
        return dint_paged_step(paged_cache, config, position_ids, kwargs)

    paged_cache.dint_paged_step = step


_original_paged_cache_init = PagedAttentionCache.__init__


def enable_continuous_batching() -> None:
    """Registers DINT with transformers' continuous batching (idempotent; importing `modeling_dint` calls it). On
    another release nothing is patched: its internals were not read (`check_transformers_release` says so)."""
    if installed_release() not in WRITTEN_FOR_TRANSFORMERS:
        return
    ATTN_TYPE_TO_ALLOCATOR[DINT_LAYER_TYPE] = DintPagedCacheAllocator
    if continuous_batching_cache.PagedAttentionCache.__init__ is not _init_paged_cache_with_dint:
        continuous_batching_cache.PagedAttentionCache.__init__ = _init_paged_cache_with_dint


__all__ = [
    "DintPagedCacheAllocator",
    "DintPagedStep",
    "check_transformers_release",
    "installed_release",
    "dint_paged_step",
    "enable_continuous_batching",
    "TRANSFORMERS_INTERNALS",
    "WRITTEN_FOR_TRANSFORMERS",
]
