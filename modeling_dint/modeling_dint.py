# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""PyTorch DINT Transformer (Cang et al., 2025, arXiv 2501.17486), in the house style of transformers' Llama.

Per layer and differential head j (the head layout is DiffLlama's: `num_attention_heads` = H softmax maps, the first
H/2 are signal maps A1 and the last H/2 noise maps A2; each differential head reads 2*head_dim value channels):

    A_final = A1 - lambda * A2 + lambda * G,  G[n, :] = mean of A1[m, :] over the valid query rows m <= n of n's document
    head_j  = RMSNorm(A_final V_j)            (no (1 - lambda_init) factor)
    lambda  = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init   (fp32, one per layer)

Every row of G sums to 1 and G is causal, so every row of A_final sums to 1. Since V does not depend on the query
row, `G V` is the running mean over query rows of the signal output `O1 = A1 V`: the fast path computes O1 and O2
with any attention backend of transformers and adds `lambda * running_mean(O1)`, at O(N d) extra cost and O(N)
memory. The materializing path (eager attention, or integral "softmax", which needs G itself) builds A1, A2, G and
A_final as the paper writes them; it is the reference the fast path is tested against.

This file is copied next to the weights by `save_pretrained` (remote code): it imports nothing but torch,
transformers and its sibling files.
"""

# First: on an unsupported transformers this fails with one clear message, before any import from inside it fails.
from .transformers_compat import (  # noqa: I001
    build_dint_cache_layers,
    create_causal_mask,
    create_masks_for_generate,
    slice_logits_to_keep,
)

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_dint import DintDynamicLayer, DintStaticLayer  # importing registers the cache layers (transformers >= 5.14)
from .configuration_dint import DintConfig


logger = logging.get_logger(__name__)


class DintRMSNorm(nn.Module):
    """RMSNorm computed in fp32, as Llama's (the decoder layers' norms and the final norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class DintHeadRMSNorm(nn.RMSNorm):
    """The RMSNorm of each differential head (over its 2*head_dim channels): torch's `rms_norm`, one fused kernel on
    GPUs as DiffLlama's group norm, computed in the dtype of its input (the attention combination, fp32) whatever the
    weight's dtype; `elementwise_affine=False` drops the weight (the head-norm ablation)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != hidden_states.dtype:
            weight = weight.to(hidden_states.dtype)
        return nn.functional.rms_norm(hidden_states, self.normalized_shape, weight, self.eps)


class DintRotaryEmbedding(LlamaRotaryEmbedding):
    pass


class DintMLP(LlamaMLP):
    pass


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
        carry_kept (`bool`, or a bool `torch.Tensor` of shape `[B]` or `[]`): for a call with no `restart_row`,
            whether row 0 continues the cache's document, so that the cache's sums carry into the call (False where
            row 0 starts a document: a position id 0).
        running_query_count (`torch.Tensor` of shape `[B, T]`, fp32): `c_n`, the valid rows m <= n of row n's
            document, the cache's count included.
        inverse_query_count (`torch.Tensor` of shape `[B, T, 1, 1]`, fp32, broadcastable against the fast path's
            `[B, T, H/2, 2d]`): `1 / max(c_n, 1)` (a document with no valid row yet has G = 0).
    """

    query_valid: torch.Tensor | None = None
    restart_row: torch.Tensor | None = None
    in_carried_document: torch.Tensor | None = None
    carry_kept: torch.Tensor | bool = True
    running_query_count: torch.Tensor | None = None
    inverse_query_count: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query_valid: torch.Tensor | None,
        document_start: torch.Tensor | None,
        past_query_count: torch.Tensor | None,
        batch_size: int,
        query_length: int,
        device: torch.device,
        continues_cache: torch.Tensor | bool = True,
    ) -> "DintIntegralLayout":
        """
        Args:
            query_valid, document_start: from `dint_query_layout`.
            past_query_count (`torch.Tensor` of shape `[B]`, *optional*): the cache's count of valid rows of the
                current document of each batch row.
            continues_cache (`bool` or bool `torch.Tensor`): without `document_start`, whether row 0 continues the
                cache's document (without a caller's position ids: whether the cache holds tokens).
        """
        if not isinstance(continues_cache, torch.Tensor):
            continues_cache = bool(continues_cache)  # the checks below test identity with True / False
        if query_valid is not None:
            query_valid = query_valid.to(device)  # a padding mask may come on another device, as for Llama
        if document_start is not None:
            document_start = document_start.to(device)
        layout = cls(query_valid=query_valid, carry_kept=continues_cache)
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

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "DintIntegralLayout":
        """The layout with its tensors on `device`. Accelerate's hooks call it to move a layer's arguments to the
        layer's device when a model is split over devices (`device_map`)."""
        moved = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                moved[field.name] = value.to(device, non_blocking=non_blocking)
        return replace(self, **moved)


def _cumsum_over_rows(rows: torch.Tensor, query_dim: int, scan_rows_last: bool | None = None) -> torch.Tensor:
    """fp32 inclusive cumulative sum of `rows` over dimension `query_dim`.

    CPUs scan the dimension in place (the fastest there, forward and backward). CUDA scans a dimension that is not the
    last one a step at a time per column (12 ms against 0.55 ms per layer at 32K tokens on an H100, bench/README.md),
    so elsewhere (`scan_rows_last`, default: not on CPU) the scan runs over an fp32 copy with the rows last.
    """
    if rows.shape[query_dim] == 1:
        return rows.float()
    if scan_rows_last is None:
        scan_rows_last = rows.device.type != "cpu"
    if not scan_rows_last:
        # Cast, then scan: `cumsum(dtype=torch.float32)` would run its backward scan in the input's dtype (bf16).
        return rows.float().cumsum(query_dim)
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
        carry (`torch.Tensor`, *optional*): `rows`' shape without the query dimension: the sum over the rows of the
            current document before this call (from the cache).

    Returns:
        `torch.Tensor` of `rows`' shape, fp32: row n holds the sum of the valid rows m <= n of n's document.
    """

    def along_rows(per_row: torch.Tensor) -> torch.Tensor:  # [B, T] -> broadcastable against `rows`
        return per_row.view(per_row.shape[0], *[1] * (query_dim - 1), per_row.shape[1], *[1] * (rows.dim() - query_dim - 1))

    if layout.query_valid is not None:
        # `where`, never a product: a padding row may hold anything, NaN included.
        rows = torch.where(along_rows(layout.query_valid), rows, 0.0)
    totals = _cumsum_over_rows(rows, query_dim)
    if carry is not None:
        carry = carry.float().unsqueeze(query_dim)
    if layout.restart_row is None:  # no document starts after row 0
        if carry is None or layout.carry_kept is False:
            return totals
        if layout.carry_kept is not True:
            carry = torch.where(layout.carry_kept.view(-1, *[1] * (rows.dim() - 1)), carry, 0.0)
        return totals + carry
    # A row of a document that started in this call subtracts the sum before that document's first row; a row of the
    # document that started before adds the carry.
    sum_before_restart = (totals - rows).gather(query_dim, along_rows(layout.restart_row).expand(rows.shape))
    carried = 0.0 if carry is None else -carry
    return totals - torch.where(along_rows(layout.in_carried_document), carried, sum_before_restart)


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
        lambda_full (`torch.Tensor`, scalar): the layer's lambda.
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


def dint_attention_map(
    attentions: torch.Tensor,
    lambda_full: torch.Tensor | float,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    integral: str = "mean",
) -> torch.Tensor:
    """A_final per differential head, from the maps a DINT model returns with `output_attentions=True` (eager).

    Args:
        attentions (`torch.Tensor` of shape `[B, H, T, T]`): one layer's maps, the H/2 signal maps then the H/2 noise
            maps (as DiffLlama returns them), over a whole sequence (no cache).
        lambda_full (`torch.Tensor` or `float`): the layer's lambda, `model.model.layers[i].self_attn.lambda_full()`.
        attention_mask (`torch.Tensor` of shape `[B, T]`, *optional*): the 2D padding mask (1 = token, 0 = padding).
        position_ids (`torch.Tensor` of shape `[B, T]`, *optional*): positions restarting at 0 start a new document
            (packed sequences); by default one document per row.
        integral (`str`): the model's `config.integral`.

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
    query_valid, document_start = dint_query_layout(attention_mask, position_ids, batch_size, query_length)
    layout = DintIntegralLayout.build(query_valid, document_start, None, batch_size, query_length, attentions.device)
    key_valid = torch.ones(query_length, key_length, dtype=torch.bool, device=attentions.device).tril()[None, None]
    if attention_mask is not None:
        key_valid = key_valid & attention_mask.bool()[:, None, None, :]
    if document_start is not None:
        segment = document_start.long().cumsum(-1)
        key_valid = key_valid & (segment[:, None, :, None] == segment[:, None, None, :])
    signal_weights, noise_weights = attentions.chunk(2, dim=1)
    final_weights, _ = compose_final_attention(
        signal_weights, noise_weights, torch.as_tensor(lambda_full), integral, layout, key_valid
    )
    return final_weights


def dint_query_layout(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch_size: int,
    query_length: int,
    cu_seq_lens_q: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Which query rows count in the integral, and where documents start, from a forward's inputs.

    Args:
        attention_mask: None, a 2D padding mask `[B, past + T]`, or a 4D mask `[B, 1, T, K]` (bool, or float with
            0 where attention is allowed); a row with no allowed key is not valid.
        position_ids (`[B or 1, T]`): a position 0 starts a document (packed sequences restart positions at 0).
        cu_seq_lens_q (`[documents + 1]`, *optional*): flash-attention packing offsets (batch size 1).

    Returns:
        query_valid (`[B, T]` bool, or None without `attention_mask`: every row counts) and document_start (`[B, T]`
        bool, or None without `position_ids` and `cu_seq_lens_q`: no row starts a document, each continues the
        cache's document or, without a cache, starts the sequence).
    """
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        query_valid = attention_mask[:, -query_length:].bool()
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        query_valid = allowed.any(dim=-1)[:, 0, -query_length:].expand(batch_size, query_length)
    elif attention_mask is None:
        query_valid = None
    else:
        raise TypeError(
            f"DINT derives the valid query rows from a 2D or 4D tensor `attention_mask`, got {type(attention_mask)}."
        )
    document_start = None
    if position_ids is not None:
        document_start = (position_ids == 0).expand(batch_size, query_length)
    if cu_seq_lens_q is not None:
        if document_start is None:
            document_start = torch.zeros(batch_size, query_length, dtype=torch.bool, device=cu_seq_lens_q.device)
        else:
            document_start = document_start.clone()
        document_start[:, cu_seq_lens_q[:-1].long()] = True
    return query_valid, document_start


class _DenseMaskConfig:
    """What `create_causal_mask` reads of a config, set so that it returns the boolean mask `[B, 1, T, K]` of sdpa.
    The materializing path needs that mask whatever backend the model uses for its fast path."""

    _attn_implementation = "sdpa"
    is_causal = True


class DintAttention(nn.Module):
    """Multi-headed differential-integral attention (DINT, arXiv 2501.17486), with DiffLlama's head layout."""

    def __init__(self, config: DintConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = 0.0
        self.is_causal = True
        self.integral = config.integral
        self.lambda_init = config.lambda_init_for_layer(layer_idx)

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.lambda_q1 = nn.Parameter(torch.empty(self.head_dim).normal_(0, config.lambda_std_dev))
        self.lambda_k1 = nn.Parameter(torch.empty(self.head_dim).normal_(0, config.lambda_std_dev))
        self.lambda_q2 = nn.Parameter(torch.empty(self.head_dim).normal_(0, config.lambda_std_dev))
        self.lambda_k2 = nn.Parameter(torch.empty(self.head_dim).normal_(0, config.lambda_std_dev))
        if config.head_norm:
            self.head_norm = DintHeadRMSNorm(
                2 * self.head_dim, eps=config.rms_norm_eps, elementwise_affine=config.head_norm_affine
            )
        else:
            self.head_norm = nn.Identity()

    def lambda_full(self) -> torch.Tensor:
        """The layer's lambda, `exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`, a fp32 scalar."""
        lambda_1 = torch.exp(torch.sum(self.lambda_q1.float() * self.lambda_k1.float()))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2.float() * self.lambda_k2.float()))
        return lambda_1 - lambda_2 + self.lambda_init

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        integral_layout: DintIntegralLayout | None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states (`[B, T, hidden_size]`), position_embeddings (cos, sin `[B, T, head_dim]`).
            attention_mask: the backend's mask (fast path), or the boolean `[B, 1, T, K]` mask (materializing path).
            integral_layout (`DintIntegralLayout`): the forward's query rows and documents (None for integral "none").

        Returns:
            attn_output `[B, T, hidden_size]`, and on the materializing path the maps `[B, H, T, K]` (the H/2 signal
            maps then the H/2 noise maps).
        """
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        cache_layer = None
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
            cache_layer = past_key_values.layers[self.layer_idx]

        if self.config._attn_implementation == "eager" or self.integral == "softmax":
            attn_output, attn_weights = self._materialized_attention(
                query_states, key_states, value_states, attention_mask, integral_layout, cache_layer
            )
        else:
            attn_output = self._fast_attention(
                query_states, key_states, value_states, attention_mask, integral_layout, cache_layer, **kwargs
            )
            attn_weights = None

        # The combination is fp32 where the integral enters: the head norm runs on it, then the model's dtype again.
        attn_output = self.head_norm(attn_output).to(value_states.dtype)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def _fast_attention(
        self, query_states, key_states, value_states, attention_mask, integral_layout, cache_layer, **kwargs
    ) -> torch.Tensor:
        """O1 and O2 from the configured attention backend, then `O1 - lambda * O2 + lambda * running_mean(O1)`:
        `[B, T, H/2, 2d]`, fp32 (the model's dtype for integral "none")."""
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, _unsupported_eager_interface
        )
        # As DiffLlama: two calls over the two halves of V (each repeated to every KV head), sharing Q and K.
        value_states1, value_states2 = (v.repeat(1, 2, 1, 1) for v in torch.chunk(value_states, 2, dim=1))
        attn_output1, _ = attention_interface(
            self, query_states, key_states, value_states1, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        attn_output2, _ = attention_interface(
            self, query_states, key_states, value_states2, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        # [B, T, H, 2d] -> the signal outputs O1 (first H/2 heads) and noise outputs O2 (last H/2), [B, T, H/2, 2d]
        signal_output, noise_output = torch.chunk(torch.cat([attn_output1, attn_output2], dim=-1), 2, dim=2)
        lambda_full = self.lambda_full()
        if self.integral == "none":
            return torch.addcmul(signal_output, lambda_full, noise_output, value=-1)  # O1 - lambda * O2

        # --- the DINT integral: G V is the running mean of O1 over the valid query rows of each document ---
        running_signal_sum = segmented_running_sum(
            signal_output, integral_layout, _integral_carry(cache_layer, "signal_sum")
        )  # [B, T, H/2, 2d], fp32
        if cache_layer is not None:
            cache_layer.update_integral(integral_layout.running_query_count, running_signal_sum.transpose(1, 2), None)
        # A1 - lambda * A2 + lambda * G = A1 - lambda * (A2 - G), and G V = running_signal_sum / c_n
        noise_minus_integral = torch.addcmul(
            noise_output, running_signal_sum, integral_layout.inverse_query_count, value=-1
        )
        return torch.addcmul(signal_output, lambda_full, noise_minus_integral, value=-1)

    def _materialized_attention(
        self, query_states, key_states, value_states, key_mask, integral_layout, cache_layer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The paper's formulas with explicit maps A1, A2, G and A_final (the reference). Returns the output
        `[B, T, H/2, 2d]` (fp32) and the maps `[B, H, T, K]` (signal maps then noise maps)."""
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        attn_scores = torch.matmul(query_states, key_states.transpose(2, 3)).float() * self.scaling
        # A finite fill keeps fully masked rows (padding) NaN-free in forward and backward; they are zeroed below.
        attn_scores = attn_scores.masked_fill(~key_mask, torch.finfo(torch.float32).min)
        attn_weights = torch.where(key_mask.any(dim=-1, keepdim=True), attn_scores.softmax(dim=-1), 0.0)
        attn_weights = attn_weights.to(query_states.dtype)
        signal_weights, noise_weights = torch.chunk(attn_weights, 2, dim=1)  # A1, A2: [B, H/2, T, K]

        final_weights, running_column_sums = compose_final_attention(
            signal_weights,
            noise_weights,
            self.lambda_full(),
            self.integral,
            integral_layout,
            key_mask,
            _integral_carry(cache_layer, "column_sums"),
        )
        if cache_layer is not None and running_column_sums is not None:
            cache_layer.update_integral(integral_layout.running_query_count, None, running_column_sums)

        # Value channels of differential head j: [V half 1 | V half 2] of its KV head, [B, H/2, K, 2d]
        value_first_half, value_second_half = torch.chunk(value_states, 2, dim=1)
        head_values = repeat_kv(torch.cat([value_first_half, value_second_half], dim=-1), self.num_key_value_groups)
        attn_output = torch.matmul(final_weights, head_values.float())
        return attn_output.transpose(1, 2), attn_weights


def _unsupported_eager_interface(*args, **kwargs):
    raise RuntimeError("DINT's eager attention is the materializing path; it never goes through an interface.")


def _integral_carry(cache_layer, state_name: str) -> torch.Tensor | None:
    """The sums `[B, H/2, C]` a DINT cache layer carries into this call, or None without a cache or before its first
    update. `state_name` is "signal_sum" (fast path) or "column_sums" (materializing path)."""
    if cache_layer is None or cache_layer.query_count is None:
        return None
    state = getattr(cache_layer, state_name)
    if state is None:
        other_path = "the fast path" if state_name == "column_sums" else "the materializing path"
        raise RuntimeError(
            f"This DINT cache was filled by {other_path}, which keeps no `{state_name}`: continue it with the same "
            f"attn_implementation and integral mode that filled it (eager attention and integral='softmax' use the "
            f"materializing path; other backends the fast path)."
        )
    return state


class DintDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DintConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = DintAttention(config=config, layer_idx=layer_idx)
        self.mlp = DintMLP(config)
        self.input_layernorm = DintRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DintRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        integral_layout: DintIntegralLayout | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            integral_layout=integral_layout,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


DINT_AUTO_MAP = {
    "AutoConfig": "configuration_dint.DintConfig",
    "AutoModel": "modeling_dint.DintModel",
    "AutoModelForCausalLM": "modeling_dint.DintForCausalLM",
    "AutoModelForSequenceClassification": "modeling_dint.DintForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_dint.DintForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_dint.DintForQuestionAnswering",
}
"""The `auto_map` that `save_pretrained` writes, so every Auto class loads a saved DINT with `trust_remote_code`."""


@auto_docstring
class DintPreTrainedModel(PreTrainedModel):
    config: DintConfig
    config_class = DintConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DintDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _keep_in_fp32_modules = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
    # `_keep_in_fp32_modules` acts on fp16 loads only; the strict list also keeps them fp32 in bf16 loads.
    _keep_in_fp32_modules_strict = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
    _can_record_outputs = {
        "hidden_states": DintDecoderLayer,
        "attentions": DintAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DintAttention):
            init.normal_(module.lambda_q1, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_k1, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_q2, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_k2, 0, self.config.lambda_std_dev)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """As `PreTrainedModel.save_pretrained`; the config's `auto_map` names every DINT class, so that each Auto
        class loads the saved model with `trust_remote_code=True` where this package is not installed."""
        self.config.auto_map = {**DINT_AUTO_MAP, **(getattr(self.config, "auto_map", None) or {})}
        return super().save_pretrained(save_directory, *args, **kwargs)


@auto_docstring
class DintModel(DintPreTrainedModel):
    def __init__(self, config: DintConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [DintDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = DintRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DintRotaryEmbedding(config=config)
        self.gradient_checkpointing = False

        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if past_key_values is not None:
            build_dint_cache_layers(past_key_values, DintDynamicLayer, DintStaticLayer)  # transformers < 5.14
            check_dint_cache(past_key_values, self.config)

        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        given_position_ids = position_ids
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # An empty dynamic cache has the geometry of no cache: let packed sequences (position_ids restarting at 0)
        # get their block-diagonal mask even when `use_cache` created a cache.
        mask_cache = past_key_values
        if past_key_values is not None and not past_key_values.is_compileable and past_seen_tokens == 0:
            mask_cache = None
        materializing = self.config._attn_implementation == "eager" or self.config.integral == "softmax"
        causal_mask = create_causal_mask(
            config=_DenseMaskConfig() if materializing else self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=mask_cache,
            position_ids=position_ids,
            allow_is_causal_skip=not materializing,
        )
        if materializing and causal_mask.dtype != torch.bool:
            causal_mask = causal_mask == 0

        integral_layout = None
        if self.config.integral != "none":
            # For a backend with a mask function, transformers returns no mask only where no key, hence no query row,
            # of this call is padding; a backend without one (TGI, vLLM, ...) gets no mask and handles padding itself,
            # so the integral reads the caller's. Without position ids of the caller's, no row after row 0 starts a
            # document, and row 0 continues the cache's document if the cache holds tokens (a static cache rewound
            # to 0, as ExecuTorch's recipe does, restarts).
            mask_tells_padding = (
                causal_mask is not None or self.config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS
            )
            batch_size, query_length = inputs_embeds.shape[:2]
            query_valid, document_start = dint_query_layout(
                attention_mask if mask_tells_padding else None,
                given_position_ids,
                batch_size,
                query_length,
                kwargs.get("cu_seq_lens_q"),
            )
            past_query_count = past_key_values.layers[0].query_count if past_key_values is not None else None
            integral_layout = DintIntegralLayout.build(
                query_valid,
                document_start,
                past_query_count,
                batch_size,
                query_length,
                inputs_embeds.device,
                continues_cache=past_seen_tokens > 0,
            )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                integral_layout=integral_layout,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values,
        )


def check_dint_cache(past_key_values: Cache, config: DintConfig) -> None:
    """Fails early, with the fix, when a cache has no DINT integral statistics (e.g. a bare `DynamicCache()`)."""
    layers = getattr(past_key_values, "layers", None)
    if (
        layers is None
        or len(layers) < config.num_hidden_layers
        or not all(getattr(layer, "is_dint_layer", False) for layer in layers[: config.num_hidden_layers])
    ):
        raise ValueError(
            f"DINT needs its integral statistics in the cache, and this {type(past_key_values).__name__} has none "
            f"(layers: {[type(layer).__name__ for layer in (layers or [])][:3]}...). Build it from the model config: "
            "`DynamicCache(config=model.config)` or `StaticCache(config=model.config, max_cache_len=...)`, or let "
            "the model / generate() create it."
        )


@auto_docstring
class DintForCausalLM(DintPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    create_masks_for_generate = staticmethod(create_masks_for_generate)  # transformers < 5.13 (see transformers_compat)

    def __init__(self, config: DintConfig):
        super().__init__(config)
        self.model = DintModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        Example:

        ```python
        >>> from transformers import AutoTokenizer, AutoModelForCausalLM
        >>> model = AutoModelForCausalLM.from_pretrained("path/to/dint", trust_remote_code=True)
        >>> tokenizer = AutoTokenizer.from_pretrained("path/to/dint")
        >>> inputs = tokenizer("To be, or not to be", return_tensors="pt")
        >>> tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0])
        ```"""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state
        hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class DintForSequenceClassification(GenericForSequenceClassification, DintPreTrainedModel):
    def __init__(self, config: DintConfig):
        # Builds `DintModel` directly (the generic head uses AutoModel, which a remote-code load has not registered).
        DintPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = DintModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class DintForTokenClassification(GenericForTokenClassification, DintPreTrainedModel):
    def __init__(self, config: DintConfig):
        DintPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = DintModel(config)
        classifier_dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if classifier_dropout is None else classifier_dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class DintForQuestionAnswering(GenericForQuestionAnswering, DintPreTrainedModel):
    def __init__(self, config: DintConfig):
        DintPreTrainedModel.__init__(self, config)
        self.model = DintModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


DintConfig.register_for_auto_class()
DintModel.register_for_auto_class("AutoModel")
DintForCausalLM.register_for_auto_class("AutoModelForCausalLM")
DintForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
DintForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
DintForQuestionAnswering.register_for_auto_class("AutoModelForQuestionAnswering")


__all__ = [
    "DintPreTrainedModel",
    "DintModel",
    "DintForCausalLM",
    "DintForSequenceClassification",
    "DintForTokenClassification",
    "DintForQuestionAnswering",
    "dint_attention_map",
    "DintIntegralLayout",
    "compose_final_attention",
    "segmented_running_sum",
]
