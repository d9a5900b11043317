# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""PyTorch DINT Transformer (Cang et al., 2025, arXiv 2501.17486): transformers' Llama with DINT attention.

Per layer and differential head j (the head layout is DiffLlama's: `num_attention_heads` = H softmax maps, the first
H/2 are signal maps A1 and the last H/2 noise maps A2; each differential head reads 2*head_dim value channels):

    A_final = A1 - lambda * A2 + lambda * G,  G[n, :] = mean of A1[m, :] over the valid query rows m <= n of n's document
    head_j  = RMSNorm(A_final V_j)            (no (1 - lambda_init) factor)
    lambda  = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init   (fp32, one per layer)

Everything else is Llama's (pre-RMSNorm decoder layers, SwiGLU MLP, RoPE, the LM head), inherited. The integral's
math (the fast path's running mean, the materializing reference, where documents restart) is in `integral_dint.py`,
its state between calls in the cache layers of `cache_dint.py`.

This file is copied next to the weights by `save_pretrained` (remote code): it imports nothing but torch,
transformers and its sibling files.
"""

# First: on an unsupported transformers this fails with one clear message, before any import from inside it fails.
from .transformers_compat import (  # noqa: I001
    CACHE_ARGUMENT,
    accepts_past_key_values,
    build_dint_cache_layers,
    get_recurrent_state,
)

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_dint import (
    COLUMN_SUMS,
    QUERY_COUNT,
    SIGNAL_SUM,
    DintDynamicLayer,
    DintStaticLayer,
    check_dint_cache,
    store_integral_state,
)
from .configuration_dint import DINT_LAYER_TYPE, DintConfig
from .integral_dint import (
    DINT_QUERY_VALID_KEY,
    MATERIALIZING,
    ONE_PASS,
    DintIntegralLayout,
    attention_path,
    compose_final_attention,
    create_dint_masks,
    default_position_ids,
    document_starts,
    segmented_running_sum,
)


class DintRMSNorm(LlamaRMSNorm):
    pass


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


def differential_head_values(value_states: torch.Tensor) -> torch.Tensor:
    """The 2*head_dim value channels of each KV head pair, `[V half 1 | V half 2]`: `[B, KV, S, d]` ->
    `[B, KV/2, S, 2d]`. Pair k serves the differential heads whose signal maps read KV head k (noise maps: k + KV/2)."""
    value_first_half, value_second_half = torch.chunk(value_states, 2, dim=1)
    return torch.cat([value_first_half, value_second_half], dim=-1)


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
        self.lambda_q1 = nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32).normal_(0, config.lambda_std_dev))
        self.lambda_k1 = nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32).normal_(0, config.lambda_std_dev))
        self.lambda_q2 = nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32).normal_(0, config.lambda_std_dev))
        self.lambda_k2 = nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32).normal_(0, config.lambda_std_dev))
        if config.head_norm:
            self.head_norm = DintHeadRMSNorm(
                2 * self.head_dim, eps=config.rms_norm_eps, elementwise_affine=config.head_norm_affine
            )
        else:
            self.head_norm = nn.Identity()

    def lambda_full(self) -> torch.Tensor:
        """The layer's lambda, `exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`, a fp32 scalar."""
        lambda_1 = torch.exp(torch.dot(self.lambda_q1.float(), self.lambda_k1.float()))
        lambda_2 = torch.exp(torch.dot(self.lambda_q2.float(), self.lambda_k2.float()))
        return lambda_1 - lambda_2 + self.lambda_init

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        integral_layout: DintIntegralLayout | None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states (`[B, T, hidden_size]`), position_embeddings (cos, sin `[B, T, head_dim]`).
            attention_mask: the backend's mask (fast path), or the boolean `[B, 1, T, K]` mask (materializing path).
            integral_layout (`DintIntegralLayout`): the forward's query rows and documents (None for integral "none").
            kwargs: the cache, under the name the installed transformers' decoder layer passes it
                (`transformers_compat.CACHE_ARGUMENT`), and the attention backend's keyword arguments.

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

        cache = kwargs.pop(CACHE_ARGUMENT, None)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attn_implementation = self.config._attn_implementation  # read once: a config attribute costs microseconds
        path = attention_path(attn_implementation, self.integral, self.config.one_pass_attention)
        if path == MATERIALIZING:
            attn_output, attn_weights = self._materialized_attention(
                query_states, key_states, value_states, attention_mask, integral_layout, cache
            )
        else:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation, None)
            attn_output = self._fast_attention(
                attention_interface, path == ONE_PASS, query_states, key_states, value_states, attention_mask,
                integral_layout, cache, **kwargs,
            )
            attn_weights = None

        # The combination is fp32 where the integral enters: the head norm runs on it, then the model's dtype again.
        attn_output = self.head_norm(attn_output)
        if attn_output.dtype != value_states.dtype:
            attn_output = attn_output.to(value_states.dtype)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def _fast_attention(
        self, attention_interface, one_pass, query_states, key_states, value_states, attention_mask, integral_layout,
        cache, **kwargs,
    ) -> torch.Tensor:
        """O1 and O2 from the attention backend's `attention_interface` (one call over the 2d-wide V where `one_pass`,
        two otherwise), then `O1 - lambda * O2 + lambda * running_mean(O1)`: `[B, T, H/2, 2d]`, fp32 (the model's dtype
        for integral "none")."""
        if one_pass:
            # One call over the 2d-wide V (Q.K^T once per map): KV head k reads [V half 1 | V half 2] of pair k mod
            # KV/2, the values the two calls below give it, so the output [B, T, H, 2d] is theirs concatenated.
            wide_values = differential_head_values(value_states).repeat(1, 2, 1, 1)  # [B, KV, S, 2d]
            attn_output, _ = attention_interface(
                self, query_states, key_states, wide_values, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
            )
        else:
            # As DiffLlama: two calls over the two halves of V (each repeated to every KV head), sharing Q and K.
            value_states1, value_states2 = (v.repeat(1, 2, 1, 1) for v in torch.chunk(value_states, 2, dim=1))
            attn_output1, _ = attention_interface(
                self, query_states, key_states, value_states1, attention_mask, dropout=0.0, scaling=self.scaling,
                **kwargs,
            )
            attn_output2, _ = attention_interface(
                self, query_states, key_states, value_states2, attention_mask, dropout=0.0, scaling=self.scaling,
                **kwargs,
            )
            attn_output = torch.cat([attn_output1, attn_output2], dim=-1)
        # [B, T, H, 2d] -> the signal outputs O1 (first H/2 heads) and noise outputs O2 (last H/2), [B, T, H/2, 2d]
        lambda_full = self.lambda_full()
        if self.integral == "none":  # DiffLlama's arithmetic, op for op (a fused addcmul rounds differently)
            signal_output, noise_output = torch.chunk(attn_output, 2, dim=2)
            return signal_output - lambda_full * noise_output
        # The integral's sums and the combination are fp32: both outputs cast once here (exact; a no-op in fp32). An op
        # with bf16 and fp32 operands casts its bf16 ones in copies of its own: the running sum and the two
        # multiply-adds below made three (issue 31: DINT / DiffLlama op time 1.12 -> 1.07 in a bf16 CPU prefill).
        signal_output, noise_output = torch.chunk(attn_output.float(), 2, dim=2)

        # --- the DINT integral: G V is the running mean of O1 over the valid query rows of each document, the sum
        # the cache carries from earlier calls included ---
        carry = get_recurrent_state(cache, self.layer_idx, SIGNAL_SUM) if cache is not None else None
        running_signal_sum = segmented_running_sum(signal_output, integral_layout, carry)  # [B, T, H/2, 2d], fp32
        if cache is not None:
            store_integral_state(cache, self.layer_idx, SIGNAL_SUM, running_signal_sum, integral_layout)
        # A1 - lambda * A2 + lambda * G = A1 - lambda * (A2 - G), and G V = running_signal_sum / c_n
        noise_minus_integral = torch.addcmul(
            noise_output, running_signal_sum, integral_layout.inverse_query_count, value=-1
        )
        return torch.addcmul(signal_output, lambda_full, noise_minus_integral, value=-1)

    def _materialized_attention(
        self, query_states, key_states, value_states, key_valid, integral_layout, cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The paper's formulas with explicit maps A1, A2, G and A_final (the reference). Returns the output
        `[B, T, H/2, 2d]` (fp32) and the maps `[B, H, T, K]` (signal maps then noise maps)."""
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        attn_scores = torch.matmul(query_states, key_states.transpose(2, 3)).float() * self.scaling
        # A finite fill keeps fully masked rows (padding) NaN-free in forward and backward; they are zeroed below.
        attn_scores = attn_scores.masked_fill(~key_valid, torch.finfo(torch.float32).min)
        attn_weights = torch.where(key_valid.any(dim=-1, keepdim=True), attn_scores.softmax(dim=-1), 0.0)
        attn_weights = attn_weights.to(query_states.dtype)
        signal_weights, noise_weights = torch.chunk(attn_weights, 2, dim=1)  # A1, A2: [B, H/2, T, K]

        carry = None
        if cache is not None and self.integral != "none":
            carry = get_recurrent_state(cache, self.layer_idx, COLUMN_SUMS)
        final_weights, running_column_sums = compose_final_attention(
            signal_weights, noise_weights, self.lambda_full(), self.integral, integral_layout, key_valid, carry
        )
        if cache is not None and running_column_sums is not None:  # [B, H/2, T, K], stored with the rows first
            store_integral_state(
                cache, self.layer_idx, COLUMN_SUMS, running_column_sums.transpose(1, 2), integral_layout
            )

        head_values = repeat_kv(differential_head_values(value_states), self.num_key_value_groups)  # [B, H/2, K, 2d]
        attn_output = torch.matmul(final_weights, head_values.float())
        return attn_output.transpose(1, 2), attn_weights


class DintDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (its forward passes `integral_layout` on to the attention) with DINT attention."""

    def __init__(self, config: DintConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # Llama's __init__ would build a Llama attention first
        self.hidden_size = config.hidden_size
        self.self_attn = DintAttention(config=config, layer_idx=layer_idx)
        self.mlp = DintMLP(config)
        self.input_layernorm = DintRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DintRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


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
    _skip_keys_device_placement = [CACHE_ARGUMENT]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    # The strict list keeps the lambda vectors fp32 in fp16 and bf16 loads (the plain list acts on fp16 only; a module
    # may be in one list only).
    _keep_in_fp32_modules_strict = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
    _can_record_outputs = {
        "hidden_states": DintDecoderLayer,
        "attentions": DintAttention,
    }

    def __init__(self, config: DintConfig, *inputs, **kwargs):
        # A config changed after construction (`config.integral = "sofmax"`) is validated again here: DINT's own
        # fields only (transformers' checks, such as the rope parameters', ran when the config was built).
        config.validate_architecture()
        super().__init__(config, *inputs, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DintAttention):
            init.normal_(module.lambda_q1, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_k1, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_q2, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_k2, 0, self.config.lambda_std_dev)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """As `PreTrainedModel.maybe_distribute_model` (what `from_pretrained(tp_plan="auto")` calls before it loads
        the weights), after checking that DINT's tensor-parallel plan can shard this config."""
        tp_size = getattr(distributed_config, "tp_size", None) or 1
        if mesh_manager is not None and tp_size > 1:
            model.config.check_tensor_parallel_size(tp_size)
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """As `PreTrainedModel.save_pretrained`; the config's `auto_map` names every DINT class, so that each Auto
        class loads the saved model with `trust_remote_code=True` where this package is not installed. The saved
        config has `use_cache: true` whatever the model's is now: Trainer turns the cache off while it trains, and a
        saved model is for generation and `torch.export` (which refuses a config without caching)."""
        self.config.auto_map = {**DINT_AUTO_MAP, **(getattr(self.config, "auto_map", None) or {})}
        use_cache = self.config.use_cache
        self.config.use_cache = True
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.config.use_cache = use_cache


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

    @accepts_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        integral_layout: DintIntegralLayout | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        cache (`Cache`, *optional*):
            The cache this forward continues (K/V and the DINT integral statistics), e.g. `DynamicCache(config=...)`;
            `past_key_values` before transformers 5.24, still accepted (`transformers_compat.accepts_past_key_values`).
        integral_layout (`DintIntegralLayout`, *optional*):
            Where the integral counts and restarts over the query rows, where the caller has built it (e.g.
            `DintIntegralLayout.for_packed_requests`, continuous batching); built from the inputs otherwise.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None:
            build_dint_cache_layers(cache, DintDynamicLayer, DintStaticLayer)  # transformers < 5.14
            check_dint_cache(cache, self.config)

        given_position_ids = position_ids
        if position_ids is None:
            position_ids = default_position_ids(inputs_embeds, cache)

        masks = create_dint_masks(self.config, inputs_embeds, attention_mask, cache, position_ids)
        if integral_layout is None:
            query_valid, cu_seq_lens_q = masks[DINT_QUERY_VALID_KEY], kwargs.get("cu_seq_lens_q")
            integral_layout = self.integral_layout(inputs_embeds, query_valid, given_position_ids, cache, cu_seq_lens_q)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[DINT_LAYER_TYPE],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                **{CACHE_ARGUMENT: cache},
                integral_layout=integral_layout,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_ARGUMENT: cache})

    def integral_layout(
        self,
        inputs_embeds: torch.Tensor,
        query_valid: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: Cache | None,
        cu_seq_lens_q: torch.Tensor | None = None,
    ) -> DintIntegralLayout | None:
        """The forward's `DintIntegralLayout`, shared by all layers (None for integral "none").

        Without the caller's `position_ids` no row after row 0 starts a document, and row 0 continues the cache's
        document if the cache holds tokens (a static cache rewound to 0, as ExecuTorch's recipe does, restarts).
        """
        if self.config.integral == "none":
            return None
        batch_size, query_length = inputs_embeds.shape[:2]
        document_start = document_starts(query_valid, position_ids, batch_size, query_length, cu_seq_lens_q)
        past_query_count, carry_kept = None, False
        if cache is not None:
            past_query_count = get_recurrent_state(cache, 0, QUERY_COUNT)
            carry_kept = cache.get_seq_length() > 0
        return DintIntegralLayout.build(
            query_valid, document_start, past_query_count, batch_size, query_length, inputs_embeds.device, carry_kept
        )


@auto_docstring
class DintForCausalLM(DintPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: DintConfig):
        super().__init__(config)
        self.model = DintModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    # Llama's: the decoder's last hidden states (those of `logits_to_keep`) through the LM head, and the loss.
    forward = LlamaForCausalLM.forward

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `transformers serve --continuous-batching`), with each
        request's integral state kept beside its paged keys and values: the adapter `modeling_dint.serving`, which
        the installed package provides (the remote code does not carry it)."""
        try:
            from modeling_dint.serving import init_continuous_batching
        except ImportError as error:
            raise ImportError(
                "Continuous batching of a DINT model needs the modeling_dint package (`pip install modeling-dint`), "
                f"whose serving adapter the remote code does not carry ({error})."
            ) from error
        return init_continuous_batching(self, *args, **kwargs)

    @accepts_past_key_values
    def create_masks_for_generate(
        self,
        config: DintConfig,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> dict[str, torch.Tensor | None]:
        """What generate() calls, for a compileable (static) cache, to build the step's masks before the forward: the
        DINT masks (`create_dint_masks`), whose shapes do not change from one decoding step to the next."""
        if position_ids is None:
            position_ids = default_position_ids(inputs_embeds, cache)
        return create_dint_masks(config, inputs_embeds, attention_mask, cache, position_ids)


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
]
