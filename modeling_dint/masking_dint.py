# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The masks a DINT forward reads, built once per forward (`DintModel.forward`) or ahead of a compiled decoding step
(`DintForCausalLM.create_masks_for_generate`): the attention backend's mask, from transformers' `create_causal_mask`,
and the valid query rows beside it, which the integral's running sums count (`integral_dint.valid_query_rows`); the
default positions; the check of a caller's 2D padding mask.

This file travels with the remote code (`save_pretrained`): it imports nothing but torch, transformers and its sibling
files.
"""

# First: on an unsupported transformers this fails with one clear message, before any import from inside it fails.
from .transformers_compat import create_causal_mask  # noqa: I001

import torch
from transformers.cache_utils import Cache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from .configuration_dint import DINT_LAYER_TYPE, DintConfig, uses_materializing_path
from .integral_dint import valid_query_rows


DINT_QUERY_VALID_KEY = "dint_query_valid"
"""The entry of the masks dict (`create_dint_masks`) holding the valid query rows `[B, T]` beside the backend's mask."""


def create_dint_masks(
    config: DintConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.Tensor,
    materializing: bool | None = None,
) -> dict[str, torch.Tensor | None]:
    """The masks a DINT forward reads, built once per forward, or ahead of a compiled step by generate()
    (`create_masks_for_generate`: fixed shapes, not a 2D padding mask that grows each step), returned as they are.

    Args:
        inputs_embeds (`[B, T, ...]`): only its batch size, length, dtype and device are read.
        attention_mask: the caller's 2D padding mask `[B, past + T]`, a 4D mask, or None.
        cache (`Cache`, *optional*): the cache this forward continues.
        position_ids (`[B or 1, T]`): the positions of this forward's tokens.
        materializing (`bool`, *optional*): `uses_materializing_path(config)`, where the caller has it.

    Returns:
        `{DINT_LAYER_TYPE: the attention backend's mask (the boolean [B, 1, T, K] mask on the materializing path),
        DINT_QUERY_VALID_KEY: the valid query rows [B, T] bool, or None where every row counts}`.
    """
    if isinstance(attention_mask, dict) and DINT_QUERY_VALID_KEY in attention_mask:
        return attention_mask  # prepared by generate() for a compiled step
    # An empty dynamic cache has the geometry of no cache: let packed sequences (position_ids restarting at 0) get
    # their block-diagonal mask even when `use_cache` created a cache.
    mask_cache = cache
    if cache is not None and not cache.is_compileable and cache.get_seq_length() == 0:
        mask_cache = None
    if materializing is None:
        materializing = uses_materializing_path(config)
    causal_mask = create_causal_mask(
        config=_DenseMaskConfig() if materializing else config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache=mask_cache,
        position_ids=position_ids,
        allow_is_causal_skip=not materializing,
    )
    if materializing and causal_mask.dtype != torch.bool:
        causal_mask = causal_mask == 0
    # For a backend with a mask function, transformers returns no mask only where no key, hence no query row, of this
    # call is padding; a backend without one (TGI, vLLM, ...) gets no mask and handles padding itself, so the
    # integral reads the caller's.
    mask_tells_padding = causal_mask is not None or config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS
    batch_size, query_length = inputs_embeds.shape[:2]
    query_valid = valid_query_rows(attention_mask if mask_tells_padding else None, batch_size, query_length)
    return {DINT_LAYER_TYPE: causal_mask, DINT_QUERY_VALID_KEY: query_valid}


def check_padding_mask_length(attention_mask: torch.Tensor, query_length: int, cache: Cache | None) -> None:
    """Refuses a 2D padding mask `[B, past + T]` whose length is not the cached tokens plus this call's T, naming both
    lengths (it would fail deep in the integral's running sum, or in the mask's construction, with a raw size
    mismatch). Integers only, no read of tensor values: it runs on every forward. A compileable (static) cache is not
    asked its length (generate() gives it a prepared mask dict instead)."""
    if cache is not None and cache.is_compileable:
        return
    past_length = cache.get_seq_length() if cache is not None else 0
    if attention_mask.shape[-1] != past_length + query_length:
        cached = f" plus the {past_length} tokens in the cache" if past_length else ""
        raise ValueError(
            f"`attention_mask` has length {attention_mask.shape[-1]}, but the input has {query_length} tokens"
            f"{cached}: a 2D padding mask must cover the cached and the new tokens, shape [batch, "
            f"{past_length + query_length}] (1 = token, 0 = padding)."
        )


def default_position_ids(inputs_embeds: torch.Tensor, cache: Cache | None) -> torch.Tensor:
    """`[1, T]`: the positions that follow the cache's tokens, where the caller gives none (as Llama's forward)."""
    past_seen_tokens = cache.get_seq_length() if cache is not None else 0
    return torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None] + past_seen_tokens


class _DenseMaskConfig:
    """What `create_causal_mask` reads of a config, set so that it returns the boolean mask `[B, 1, T, K]` of sdpa.
    The materializing path needs that mask whatever backend the model uses for its fast path."""

    _attn_implementation = "sdpa"
    is_causal = True


__all__ = ["DINT_QUERY_VALID_KEY", "create_dint_masks", "check_padding_mask_length", "default_position_ids"]
