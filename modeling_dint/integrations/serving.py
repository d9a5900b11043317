# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT under transformers' continuous batching (`model.generate_batch`, `transformers serve --continuous-batching`).

Continuous batching flattens every scheduled request into one row `[1, T]` (`cu_seq_lens_q` delimits them, position
ids continue each request's past) and keeps K and V in a paged cache. DINT needs two more things, both here:

- the integral state of each request, carried from one scheduling step to the next: the fp32 running sum of the
  signal output `O1` per layer (`[H/2, 2d]`; its count is the request's position + 1, since a request has no padding).
  It lives beside the paged K/V, one state per cache block and layer: the state after the last token written in that
  block. A request's carry is the state of the block that holds its previous token, so the state is allocated and
  freed with the request's blocks, follows block forks (parallel sampling) and prefix sharing (a shared complete
  block holds the state after the shared prefix) with no bookkeeping of its own;
- K and V written once per layer and step: the fast path calls the backend twice (the two halves of V), so the DINT
  layer writes the paged K/V in `cache.update`, as Llama's attention does, and the backends read it.

How it is enabled: `DintForCausalLM.init_continuous_batching` (transformers' entry point of continuous batching)
calls `init_continuous_batching` here, which refuses what cannot run (another transformers release, integral
"softmax": `DintConfig.check_paged_serving`), registers DINT's cache allocator for the `dint_attention` layers, and returns a continuous-batching
manager whose paged cache is `DintPagedAttentionCache`. Each step, a forward pre-hook of the model turns that cache
into a `DintPagedStep`: a cache object that writes K/V into the paged cache and holds the integral's state
(`integral_dint.DintIntegralState`), and the step's `DintIntegralLayout.for_packed_requests`. Nothing happens at import.

Every transformers internal this depends on is used in this module only (listed in `TRANSFORMERS_INTERNALS`), read in
transformers 5.24; `tests/test_serving.py` checks each of them and fails loudly when one changes.
"""

import contextlib

import torch
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR, PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, FullAttentionCacheAllocator

from ..cache_dint import QUERY_COUNT, SIGNAL_SUM
from ..configuration_dint import DINT_LAYER_TYPE
from ..integral_dint import DintIntegralLayout, DintIntegralState, packed_request_rows
from ..transformers_compat import CACHE_ARGUMENT, installed_release


WRITTEN_FOR_TRANSFORMERS = ((5, 24),)
"""The transformers releases (major, minor) whose continuous-batching internals this module was written against. From
5.24 the attention module writes the paged K/V itself (`cache.update`, as Llama's) and the paged backends only read
it; on 5.23 the backends write the cache they are given, once per call, which DINT's two calls per layer cannot use."""

TRANSFORMERS_INTERNALS = {
    "continuous_batching.cache.ATTN_TYPE_TO_ALLOCATOR": "registry of cache allocators by layer type (DINT's is added)",
    "continuous_batching.cache.PagedAttentionCache": "subclassed: the DINT group is keyed as full attention",
    "continuous_batching.cache.PagedAttentionCache.update(key_states, value_states, layer_idx, kwargs)": "K/V write",
    "continuous_batching.cache_allocators.FullAttentionCacheAllocator": "subclassed (register_cache_tensor, "
    "copy_blocks, block_physical_stride, tokens_per_page, layer_indices, write_trash_index, _copy_view, index)",
    "continuous_batching.continuous_api.ContinuousBatchingManager": "subclassed: _create_batch_processor builds the "
    "paged cache by the module's name `PagedAttentionCache`, which DINT's subclass stands in for during that call",
    "continuous_batching.continuous_api.ContinuousMixin.init_continuous_batching": "builds the manager by the "
    "module's name `ContinuousBatchingManager`, which DINT's subclass stands in for during that call",
    "model forward kwargs cache / read_index / write_index / cu_seq_lens_q / cu_seq_lens_k / max_length_k / "
    "block_table": "the step's layout (PagedAttentionArgs)",
}
"""Each transformers internal the integration touches, and what for (the closing note and the test list them)."""


def check_transformers_release() -> None:
    """Fails with both versions named when the installed transformers is not a release this module was read in."""
    if installed_release()[:2] not in WRITTEN_FOR_TRANSFORMERS:
        import transformers

        releases = " or ".join(f"{major}.{minor}.x" for major, minor in WRITTEN_FOR_TRANSFORMERS)
        raise RuntimeError(
            f"DINT's continuous-batching integration (modeling_dint/integrations/serving.py) was written for the "
            f"internals of transformers {releases}; transformers {transformers.__version__} is installed. Install "
            f"transformers=={releases.split(' or ')[-1][:-2]}.* to serve DINT with continuous batching, or use "
            "`generate()`."
        )


class DintPagedCacheAllocator(FullAttentionCacheAllocator):
    """The paged K/V of full attention, plus DINT's integral state per cache block: `integral_sums`
    `[blocks, layers, H/2, C]` (fp32, C = `config.differential_head_dim`), the running sum of O1 after the last token
    written in the block.

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
        self.state_shape = (config.num_differential_heads, config.differential_head_dim)
        self.layer_slot = {layer_idx: slot for slot, layer_idx in enumerate(self.layer_indices)}
        self.integral_sums: torch.Tensor | None = None

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        super().register_cache_tensor(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        if self.integral == "none":
            return
        # One state per block of the whole tensor (trash blocks included: padding tokens write theirs there)
        num_blocks = self._copy_view.shape[0]
        self.integral_sums = torch.zeros(
            num_blocks, len(self.layer_indices), *self.state_shape, dtype=torch.float32, device=cache_tensor.device
        )

    def copy_blocks(self, source_block_ids: list[int], dest_block_ids: list[int]) -> None:
        """Forks copy the integral state of the blocks with their keys and values."""
        super().copy_blocks(source_block_ids, dest_block_ids)
        if self.integral_sums is not None and source_block_ids:
            device = self.integral_sums.device
            source = torch.tensor(source_block_ids, dtype=torch.long, device=device)
            dest = torch.tensor(dest_block_ids, dtype=torch.long, device=device)
            self.integral_sums.index_copy_(0, dest, self.integral_sums.index_select(0, source))


class DintPagedAttentionCache(PagedAttentionCache):
    """transformers' paged cache, with the group of DINT layers keyed as full attention (the step's inputs know full
    and sliding attention only). For a model without DINT layers it is `PagedAttentionCache` itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dint_allocators = [ca for ca in self.cache_allocators.values() if isinstance(ca, DintPagedCacheAllocator)]
        if not dint_allocators:
            return
        if len(self.cache_allocators) > 1:
            raise ValueError(
                "A DINT model's layers must all be DINT layers under continuous batching; got the cache groups "
                f"{list(self.cache_allocators)}."
            )
        self.cache_allocators = {FULL_ATTENTION: dint_allocators[0]}
        self.dint_allocator = dint_allocators[0]


class DintPagedStep(DintIntegralState):
    """The cache a DINT model sees in one continuous-batching step: K/V written once into the paged cache
    (`update`), and each request's integral state read and stored per block, the integral's state holder
    (`DintIntegralState`). Its `layout` is the step's `DintIntegralLayout.for_packed_requests`. Built by the model's
    forward pre-hook from the step's arguments."""

    is_compileable = False
    records_rows = True  # a request stores its sum after each block it completes, not only after its last row
    keeps_state_table = True

    def __init__(self, paged_cache: DintPagedAttentionCache, position_ids: torch.Tensor, kwargs: dict):
        self.paged_cache = paged_cache
        self.allocator = allocator = paged_cache.dint_allocator
        # What `PagedAttentionCache.update` reads (it resolves the group's entries in a copy, per layer)
        self.cache_kwargs = {name: kwargs[name] for name in ("read_index", "write_index", "cu_seq_lens_k", "max_length_k")}
        request_rows = packed_request_rows(position_ids, kwargs["cu_seq_lens_q"])
        self.layout = DintIntegralLayout.for_packed_requests(position_ids, kwargs["cu_seq_lens_q"], request_rows)
        positions, row_request, request_start = request_rows
        num_rows, device = positions.shape[0], positions.device
        cu_seq_lens_q = kwargs["cu_seq_lens_q"].long().to(device)

        group = allocator.index
        write_index = kwargs["write_index"][group][:num_rows]
        # Store after each request's last row of the step and after the last token of each block it completes; the
        # other rows write into a trash block (no row selection: no host synchronization, CUDA-graph friendly)
        last_row = torch.zeros(num_rows, dtype=torch.bool, device=device)
        last_row[(cu_seq_lens_q[1:] - 1).clamp(min=0, max=num_rows - 1)] = True
        store = last_row | ((positions + 1) % allocator.tokens_per_page == 0)
        trash_block = allocator.write_trash_index // allocator.block_physical_stride
        self.store_rows, write_blocks = store, write_index // allocator.block_physical_stride
        self.store_blocks = torch.where(store, write_blocks, trash_block)

        # A request that continues (its first row is past position 0) carries the state of its previous token's block
        # (no read index: no request of the step has a past). Rows of the other requests read a block they ignore.
        read_index = kwargs["read_index"][group]
        self.carry_blocks = None
        if allocator.integral_sums is not None and read_index.numel() > 0:
            cu_seq_lens_k = kwargs["cu_seq_lens_k"][allocator.layer_type].long()
            previous_token = (cu_seq_lens_k[:-1] + positions[request_start] - 1).clamp(min=0, max=read_index.numel() - 1)
            self.carry_blocks = (read_index[previous_token] // allocator.block_physical_stride)[row_request]
        self.kernel_blocks = None  # `state_table`'s per-row blocks, built by the first layer that asks

    def model_kwargs(self, kwargs: dict) -> dict:
        """The model's keyword arguments for this step: this object as the cache, the step's layout, and the
        full-attention entries of the per-group `cu_seq_lens_k` / `max_length_k` for the attention backend."""
        layer_type = self.allocator.layer_type
        return {
            **kwargs,
            CACHE_ARGUMENT: self,
            "integral_layout": self.layout,
            "cu_seq_lens_k": kwargs["cu_seq_lens_k"][layer_type],
            "max_length_k": kwargs["max_length_k"][layer_type],
        }

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # each request's past is in its position ids; the flattened row has no common past

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Writes the step's K/V of layer `layer_idx` into the paged cache and returns each request's keys and values
        `[1, kv_heads, past + new (all requests), head_dim]`."""
        return self.paged_cache.update(key_states, value_states, layer_idx, kwargs=dict(self.cache_kwargs))

    def carried(self, layer_idx: int, state_idx: int) -> torch.Tensor | None:
        """`SIGNAL_SUM`: the sum each row's request carries from its earlier steps, per query row `[1, T, H/2, 2d]`
        (`layout.carry_per_row`); None where no request of the step has a past. The count is the layout's."""
        if state_idx != SIGNAL_SUM or self.carry_blocks is None:
            return None
        return self.allocator.integral_sums[self.carry_blocks, self.allocator.layer_slot[layer_idx]][None]

    def state_table(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the CPU kernel, which reads and stores the sums in place: the layer's sums per block `[blocks, H/2, C]`
        (fp32, a view of `integral_sums`), and per row `[1, T]` (int64, -1 for none) the block whose sum the row
        starts from (a continuing request's first row: its previous token's block) and the block it stores its sum
        in (each request's last row, each row that completes a block: as `store`). No row stores
        into a block that a later request of the step reads (a request reads its own previous block; shared blocks
        are complete), so reading in place gives what the eager path's gather before its scatter gives."""
        if self.kernel_blocks is None:
            num_rows, device = self.store_rows.shape[0], self.store_rows.device
            carry_slot = torch.full((num_rows,), -1, dtype=torch.long, device=device)
            if self.carry_blocks is not None:
                first_row_of_continuing = self.layout.document_first_rows()[0] & self.layout.in_carried_document[0]
                carry_slot = torch.where(first_row_of_continuing, self.carry_blocks, carry_slot)
            store_slot = torch.where(self.store_rows, self.store_blocks, -1)
            self.kernel_blocks = (carry_slot[None], store_slot[None])
        table = self.allocator.integral_sums[:, self.allocator.layer_slot[layer_idx]]
        return (table, *self.kernel_blocks)

    def store(self, state, layer_idx, state_idx, running_rows=None) -> None:
        """Stores the running sum after each request's last row and after each block it completes (from
        `running_rows`, `[1, T, H/2, 2d]`). The count of a request is its position + 1: nothing to store."""
        if state_idx == QUERY_COUNT:
            return
        sums = self.allocator.integral_sums
        sums[self.store_blocks, self.allocator.layer_slot[layer_idx]] = running_rows[0].to(sums.dtype)


def _enter_paged_step(model, args: tuple, kwargs: dict):
    """The DINT model's forward pre-hook: in a continuous-batching step (its cache is a `DintPagedAttentionCache`),
    the model gets the step's cache object and layout instead of the paged cache; any other call is left alone."""
    paged_cache = kwargs.get(CACHE_ARGUMENT)
    if not isinstance(paged_cache, DintPagedAttentionCache):
        return None
    if kwargs.get("block_table") is not None:
        raise RuntimeError("DINT disables the decode fast path (block table) of continuous batching; got a block table.")
    step = DintPagedStep(paged_cache, kwargs["position_ids"], kwargs)
    return args, step.model_kwargs(kwargs)


@contextlib.contextmanager
def _stands_in(name: str, replacement: type):
    """While the block runs, `continuous_api.<name>` is DINT's subclass `replacement` (which behaves as the original
    for other models): the name by which transformers builds the object."""
    original = getattr(continuous_api, name)
    setattr(continuous_api, name, replacement)
    try:
        yield
    finally:
        setattr(continuous_api, name, original)


class DintContinuousBatchingManager(continuous_api.ContinuousBatchingManager):
    """transformers' manager, whose paged cache is `DintPagedAttentionCache`."""

    def _create_batch_processor(self):
        with _stands_in("PagedAttentionCache", DintPagedAttentionCache):
            return super()._create_batch_processor()


def init_continuous_batching(model, *args, **kwargs):
    """`ContinuousMixin.init_continuous_batching` for a DINT model (what `DintForCausalLM.init_continuous_batching`
    calls): refuses what cannot run, registers DINT's allocator and the model's step hook (once), and returns a
    `DintContinuousBatchingManager`."""
    check_transformers_release()
    model.config.check_paged_serving()
    ATTN_TYPE_TO_ALLOCATOR[DINT_LAYER_TYPE] = DintPagedCacheAllocator
    if getattr(model, "_dint_paged_step_hook", None) is None:
        model._dint_paged_step_hook = model.register_forward_pre_hook(_enter_paged_step, with_kwargs=True)
    with _stands_in("ContinuousBatchingManager", DintContinuousBatchingManager):
        return continuous_api.ContinuousMixin.init_continuous_batching(model, *args, **kwargs)


__all__ = [
    "DintPagedCacheAllocator",
    "DintPagedAttentionCache",
    "DintPagedStep",
    "DintContinuousBatchingManager",
    "check_transformers_release",
    "init_continuous_batching",
    "TRANSFORMERS_INTERNALS",
    "WRITTEN_FOR_TRANSFORMERS",
]
