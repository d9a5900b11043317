# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""PyTorch DINT Transformer (Cang et al., 2025, arXiv 2501.17486): transformers' Llama with DINT attention.

Per layer and differential head j, `num_attention_heads` = H softmax maps (query heads), H/2 differential heads:

    A_final = A1 - lambda * A2 + lambda * G,  G[n, :] = mean of A1[m, :] over the valid query rows m <= n of n's document
    head_j  = A_final V_j                     (no (1 - lambda_init) factor)

The head layout (`config.differential_attention`) says where A1, A2 and lambda come from: v1 (the paper's, DiffLlama's:
the first H/2 query heads are signal maps, the last H/2 noise maps, V_j 2*head_dim wide, one lambda per layer
`exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`, then an RMSNorm per head; `DintV1Attention`) or v2 (DIFF V2's: query
heads 2i and 2i+1 share a KV head, lambda = sigmoid(lambda_proj(x)) per token and head; `DintV2Attention`). The integral
is the same for both (`integral_dint.DintIntegral`); everything else is Llama's, inherited.

This file is copied next to the weights by `save_pretrained` (remote code): it imports nothing but torch,
transformers and its sibling files.
"""

# First: on an unsupported transformers this fails with one clear message, before any import from inside it fails.
from .transformers_compat import (  # noqa: I001
    CACHE_ARGUMENT,
    LOCAL_REMOTE_CODE_FOLLOWS_IMPORTS,
    accepts_past_key_values,
    unwrapped_forward,
)

import os
import shutil

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_dint import check_dint_cache
from .configuration_dint import BUILT_MODELS, DINT_LAYER_TYPE, MATERIALIZING, ONE_PASS, DintConfig, attention_path
from .integral_dint import DintIntegral, DintIntegralLayout, DintIntegralState, forward_integral_layout, has_hooks
from .masking_dint import DINT_QUERY_VALID_KEY, check_padding_mask_length, create_dint_masks, default_position_ids


REMOTE_CODE_FILES = (
    "configuration_dint.py",
    "modeling_dint.py",
    "masking_dint.py",
    "cache_dint.py",
    "integral_dint.py",
    "integral_cpu_kernel.py",
    "integral_triton_kernel.py",
    "transformers_compat.py",
)
"""The files that travel with a checkpoint (remote code): `save_pretrained` copies exactly these beside the weights.
They are this file and every sibling it and the configuration file reach through relative imports, nothing else
(tests/test_hub.py fails when a shipped module imports a sibling missing here)."""

if not LOCAL_REMOTE_CODE_FOLLOWS_IMPORTS:
    # transformers 5.5 to 5.10.0 copy a local folder's remote code by the relative imports written in this file only:
    # these lines name for them the files above that this file reaches through integral_dint (tests/test_hub.py checks
    # that every one is named). On later releases nothing here runs, and importing this file does not import Triton.
    from .cache_dint import DintDynamicLayer  # noqa: F401
    from .integral_cpu_kernel import integral_kernel  # noqa: F401
    from .integral_triton_kernel import triton_integral  # noqa: F401


class DintRMSNorm(LlamaRMSNorm):
    pass


class DintHeadRMSNorm(nn.RMSNorm):
    """v1's RMSNorm of each differential head (its 2*head_dim channels): torch's fused `rms_norm`, in its input's dtype
    (the combination's, fp32) whatever the weight's; `elementwise_affine=False` drops the weight (the ablation)."""

    fused_by_integral_kernels = True  # what the integral's kernels compute in its place (`integral_dint.kernel_takes`)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != hidden_states.dtype:
            weight = weight.to(hidden_states.dtype)
        return nn.functional.rms_norm(hidden_states, self.normalized_shape, weight, self.eps)


class DintRotaryEmbedding(LlamaRotaryEmbedding):
    pass


def differential_head_values(value_states: torch.Tensor) -> torch.Tensor:
    """The 2*head_dim value channels of each KV head pair, `[V half 1 | V half 2]`: `[B, KV, S, d]` ->
    `[B, KV/2, S, 2d]`. Pair k serves the differential heads whose signal maps read KV head k (noise maps: k + KV/2)."""
    value_first_half, value_second_half = torch.chunk(value_states, 2, dim=1)
    return torch.cat([value_first_half, value_second_half], dim=-1)


def reparameterized_lambda(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init: float) -> torch.Tensor:
    """v1's lambda of a layer, `exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`, a fp32 scalar (vLLM's model too)."""
    lambda_1 = torch.exp(torch.dot(lambda_q1.float(), lambda_k1.float()))
    lambda_2 = torch.exp(torch.dot(lambda_q2.float(), lambda_k2.float()))
    return lambda_1 - lambda_2 + lambda_init


class DintLambdaGate(nn.Module):
    """v2's lambda gate (`config.lambda_gate`, a departure from DIFF V2): one learned factor per differential head on
    lambda, `weight` `[H/2]`, fp32 however the model is built (`_keep_in_fp32_modules_strict`). 1 when built from
    scratch (DIFF V2's lambda); `dint-convert --differential-attention v2` writes 0, so that the converted model starts
    at the source's function. A module (not a bare parameter) so that PEFT can train it: `modules_to_save`."""

    def __init__(self, num_differential_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_differential_heads, dtype=torch.float32))

    def forward(self, lambda_: torch.Tensor) -> torch.Tensor:
        """`[..., H/2]` fp32 -> the gated lambda, `lambda_ * weight`, fp32."""
        return lambda_ * self.weight.float()


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is all of its storage (and the storage is not shared with other processes on the CPU), not a
    view into a larger buffer that its owner writes (FSDP's and DeepSpeed's flat parameters)."""
    storage = tensor.untyped_storage()
    if tensor.device.type == "cpu" and storage.is_shared():
        return False
    return tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()


class DintAttention(nn.Module):
    """Differential-integral attention (DINT, arXiv 2501.17486): what both head layouts share. A layout (`DintV1Attention`,
    `DintV2Attention`) supplies the queries and lambda (`query_and_lambda`) and the signal and noise outputs
    (`differential_outputs`, fast path) or maps (`differential_maps`, materializing path); `DintIntegral` adds the
    integral, the same for both.
    """

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
        self.integral = DintIntegral(config.integral, layer_idx)

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        output_channels = config.num_differential_heads * config.differential_head_dim
        self.o_proj = nn.Linear(output_channels, config.hidden_size, bias=config.attention_bias)
        if config.head_norm:
            self.head_norm = DintHeadRMSNorm(
                config.differential_head_dim, eps=config.rms_norm_eps, elementwise_affine=config.head_norm_affine
            )
        else:
            self.head_norm = nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        integral_layout: DintIntegralLayout | None,
        dint_path: str | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states (`[B, T, hidden_size]`), position_embeddings (cos, sin `[B, T, head_dim]`).
            attention_mask: the backend's mask (fast path), or the boolean `[B, 1, T, K]` mask (materializing path).
            integral_layout (`DintIntegralLayout`): the forward's query rows and documents (None for integral "none").
            dint_path (`str`, *optional*): the forward's `attention_path` (the model's forward decides it once).
            kwargs: the cache (under `transformers_compat.CACHE_ARGUMENT`) and the backend's keyword arguments.

        Returns:
            attn_output `[B, T, hidden_size]`, and on the materializing path the maps `[B, H, T, K]` (one per query head).
        """
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        # DINT: the layout's query projection and lambda (fp32: a scalar, or [B, T, H/2, 1]), one product where it can
        query_states, lambda_ = self.query_and_lambda(hidden_states)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        cache = kwargs.pop(CACHE_ARGUMENT, None)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        # --- DINT: the layout's signal and noise outputs (or maps), then the integral ---
        attn_implementation = self.config._attn_implementation  # read once: a config attribute costs microseconds
        path = dint_path or attention_path(attn_implementation, self.integral.mode, self.config.one_pass_attention)
        if path == MATERIALIZING:
            attn_weights = self.softmax_maps(query_states, key_states, attention_mask)
            signal_weights, noise_weights, head_values = self.differential_maps(attn_weights, value_states)
            final_weights = self.integral.maps(signal_weights, noise_weights, lambda_, integral_layout, attention_mask)
            attn_output = torch.matmul(final_weights, head_values.float()).transpose(1, 2)  # [B, T, H/2, C], fp32
            # The combination is fp32 where the integral enters: the head norm runs on it, then the model's dtype.
            attn_output = self.head_norm(attn_output).to(value_states.dtype)
        else:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation, None)
            signal_output, noise_output = self.differential_outputs(
                attention_interface, path == ONE_PASS, query_states, key_states, value_states, attention_mask,
                **kwargs,
            )
            # The same there: the combination in fp32, normalized, back in the model's dtype (one pass on CPU).
            attn_output = self.integral(signal_output, noise_output, lambda_, integral_layout, self.head_norm)
            attn_weights = None

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def query_and_lambda(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query projection `[B, T, H * d]` and the layout's lambda (`differential_lambda`, fp32)."""
        return self.q_proj(hidden_states), self.differential_lambda(hidden_states)

    def softmax_maps(self, query_states, key_states, key_valid) -> torch.Tensor:
        """The materializing path's softmax maps `[B, H, T, K]`, one per query head; fully masked rows (padding) are 0,
        NaN-free in forward and backward."""
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        attn_scores = torch.matmul(query_states, key_states.transpose(2, 3)).float() * self.scaling
        attn_scores = attn_scores.masked_fill(~key_valid, torch.finfo(torch.float32).min)
        attn_weights = torch.where(key_valid.any(dim=-1, keepdim=True), attn_scores.softmax(dim=-1), 0.0)
        return attn_weights.to(query_states.dtype)


class DintV1Attention(DintAttention):
    """DINT on DIFF V1's head layout, as the paper and DiffLlama have it: the first H/2 query heads are the signal maps,
    the last H/2 the noise maps; differential head j reads the 2*head_dim value channels of its KV head pair; one lambda
    per layer, `exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`."""

    def __init__(self, config: DintConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.lambda_init = config.lambda_init_for_layer(layer_idx)
        # fp32 however the model is built (`_keep_in_fp32_modules_strict`; a default dtype of fp16 included)
        self.lambda_q1 = nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32).normal_(0, config.lambda_std_dev))
        self.lambda_k1 = nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32).normal_(0, config.lambda_std_dev))
        self.lambda_q2 = nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32).normal_(0, config.lambda_std_dev))
        self.lambda_k2 = nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32).normal_(0, config.lambda_std_dev))

    def lambda_full(self) -> torch.Tensor:
        """The layer's lambda, `exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`, a fp32 scalar."""
        return reparameterized_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)

    def differential_lambda(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lambda_full()

    def differential_outputs(
        self, attention_interface, one_pass, query_states, key_states, value_states, attention_mask, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """O1 and O2 `[B, T, H/2, 2d]` from the attention backend: one call over the 2d-wide V where `one_pass`, two
        otherwise."""
        if one_pass:
            # One call over the 2d-wide V (Q.K^T once per map): KV head k reads [V half 1 | V half 2] of pair k mod
            # KV/2, the values the two calls below give it, so the output [B, T, H, 2d] is theirs concatenated.
            wide_values = differential_head_values(value_states).repeat(1, 2, 1, 1)  # [B, KV, S, 2d]
            attn_output, _ = attention_interface(
                self, query_states, key_states, wide_values, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
            )
        else:
            # As DiffLlama: two calls over the two halves of V (each repeated to every KV head), sharing Q and K.
            attn_outputs = [
                attention_interface(
                    self, query_states, key_states, half.repeat(1, 2, 1, 1), attention_mask, dropout=0.0,
                    scaling=self.scaling, **kwargs,
                )[0]
                for half in torch.chunk(value_states, 2, dim=1)
            ]
            attn_output = torch.cat(attn_outputs, dim=-1)
        # [B, T, H, 2d] -> the signal outputs O1 (first H/2 heads) and noise outputs O2 (last H/2)
        signal_output, noise_output = torch.chunk(attn_output, 2, dim=2)
        return signal_output, noise_output

    def differential_maps(self, attn_weights, value_states) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A1, A2 `[B, H/2, T, K]` (the first and last H/2 maps) and each differential head's values `[B, H/2, K, 2d]`."""
        signal_weights, noise_weights = torch.chunk(attn_weights, 2, dim=1)
        head_values = repeat_kv(differential_head_values(value_states), self.num_key_value_groups)
        return signal_weights, noise_weights, head_values


class DintV2Attention(DintAttention):
    """DINT on DIFF V2's head layout (docs/design.md section 10): query heads 2i (signal) and 2i+1 (noise) share one KV
    head, so O1 and O2 come from one ordinary attention call over Llama's K and V; lambda per token and differential
    head, `sigmoid(lambda_proj(x))`; no head norm. With `config.lambda_gate` (a departure from DIFF V2), a learned gate
    per differential head multiplies that lambda: `lambda_gate * sigmoid(lambda_proj(x))`."""

    def __init__(self, config: DintConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.lambda_proj = nn.Linear(config.hidden_size, config.num_differential_heads, bias=False)
        self.lambda_gate = DintLambdaGate(config.num_differential_heads) if config.lambda_gate else None
        self.query_lambda_weight = None  # `fused_query_lambda_weight`'s storage: not saved, set by a call

    def differential_lambda(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[B, T, H/2, 1]` fp32: `sigmoid(lambda_proj(x))`, times `lambda_gate` where the config has it, from the
        attention's input `x` `[B, T, hidden_size]`. The one lambda every integral path reads (fast path, the
        materializing path and `dint_attention_map`, the CPU kernel, continuous batching)."""
        return self.lambda_from_projection(self.lambda_proj(hidden_states))

    def lambda_from_projection(self, lambda_logits: torch.Tensor) -> torch.Tensor:
        """`lambda_proj(x)` `[B, T, H/2]` -> lambda `[B, T, H/2, 1]` fp32 (`differential_lambda`)."""
        lambda_ = torch.sigmoid(lambda_logits.float())
        if self.lambda_gate is not None:
            lambda_ = self.lambda_gate(lambda_)
        return lambda_.unsqueeze(-1)

    def query_and_lambda(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query projection `[B, T, H * d]` and lambda `[B, T, H/2, 1]` (fp32). Without a gradient, one product
        of the weight q_proj's and lambda_proj's share (`fused_query_lambda_weight`); else each module's."""
        weight = None if torch.is_grad_enabled() else self.fused_query_lambda_weight()
        if weight is None:
            return super().query_and_lambda(hidden_states)
        product = nn.functional.linear(hidden_states, weight)  # [B, T, H * d + H/2]
        query_channels = self.num_heads * self.head_dim
        return product[..., :query_channels], self.lambda_from_projection(product[..., query_channels:])

    def fused_query_lambda_weight(self) -> torch.Tensor | None:
        """`[H * d + H/2, hidden_size]`, the one storage q_proj's and lambda_proj's weights are views of, or None where
        their modules must run: compiling or tracing, a bias, hooks, a wrapper (PEFT, quantization, offloading), an
        overridden `differential_lambda`, or weights `fuse_query_lambda` may not rebind. The first call that can fuses
        them (and the first after they were replaced or moved); the saved keys do not change, and a write into either
        weight, in place or through `.data`, is a write into this storage (docs/design.md section 11)."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing():  # a graph would hold the storage as a constant
            return None
        q_proj, lambda_proj, fused = self.q_proj, self.lambda_proj, self.query_lambda_weight
        # the dictionaries, not `q_proj.weight`: nn.Module's __getattr__ is slow
        query_weight, lambda_weight = q_proj._parameters.get("weight"), lambda_proj._parameters.get("weight")
        current = (
            fused is not None
            and type(query_weight) is nn.Parameter  # (before `data_ptr`: torch.func passes tensors without storage)
            and type(lambda_weight) is nn.Parameter
            and query_weight.data_ptr() == fused.data_ptr()  # q at the start, lambda right after it
            and lambda_weight.data_ptr() == fused.data_ptr() + query_weight.numel() * query_weight.element_size()
        )
        if (
            type(q_proj) is not nn.Linear
            or type(lambda_proj) is not nn.Linear
            or has_hooks(q_proj)
            or has_hooks(lambda_proj)
            or q_proj._parameters.get("bias") is not None
            or type(self).differential_lambda is not DintV2Attention.differential_lambda
        ):
            if not current:  # nothing views it any more (offloaded, quantized, replaced): free it
                self.query_lambda_weight = None
            return None
        return fused if current else self.fuse_query_lambda()

    def fuse_query_lambda(self) -> torch.Tensor | None:
        """Makes q_proj's and lambda_proj's weights views of one new storage with their values, or None where that
        could hide a write from their owner: weights that are not plain parameters of one device and dtype, each
        owning all of its storage (a view into a framework's flat buffer: FSDP, DeepSpeed), in a distributed run, or
        in memory shared with other processes."""
        previous, self.query_lambda_weight = self.query_lambda_weight, None
        query_weight, lambda_weight = self.q_proj._parameters.get("weight"), self.lambda_proj._parameters.get("weight")
        if type(query_weight) is not nn.Parameter or type(lambda_weight) is not nn.Parameter:
            return None
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, also when fused in inference mode
            if previous is not None:  # a weight still viewing the old storage takes its own (the other was replaced)
                for weight in (query_weight, lambda_weight):
                    if weight.untyped_storage().data_ptr() == previous.untyped_storage().data_ptr():
                        weight.data = weight.detach().clone()
            if not (
                query_weight.device == lambda_weight.device
                and query_weight.device.type != "meta"
                and query_weight.dtype == lambda_weight.dtype
                and all(owns_its_storage(weight) for weight in (query_weight, lambda_weight))
                and not (torch.distributed.is_available() and torch.distributed.is_initialized())
            ):
                return None
            query_rows = query_weight.shape[0]
            fused = torch.cat([query_weight.detach(), lambda_weight.detach()])
            query_weight.data, lambda_weight.data = fused[:query_rows], fused[query_rows:]
        self.query_lambda_weight = fused
        return fused

    def __getstate__(self):
        # A copy or pickle (`copy.deepcopy`, `torch.save(model)`) holds its weights apart: its first call fuses them.
        state = super().__getstate__()
        state["query_lambda_weight"] = None
        return state

    def _apply(self, fn, recurse=True):
        # `.to()`, `.half()`, ...: each weight moves out of the fused storage; the next call fuses again. Dropping it
        # here frees it at once (a model moved off a GPU keeps nothing there).
        self.query_lambda_weight = None
        return super()._apply(fn, recurse)

    def differential_outputs(
        self, attention_interface, one_pass, query_states, key_states, value_states, attention_mask, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """O1 and O2 `[B, T, H/2, d]`: the even and odd query heads of one attention call."""
        attn_output, _ = attention_interface(
            self, query_states, key_states, value_states, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        signal_output, noise_output = attn_output.unflatten(2, (-1, 2)).unbind(3)  # heads 2i and 2i+1: views
        return signal_output, noise_output

    def differential_maps(self, attn_weights, value_states) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A1, A2 `[B, H/2, T, K]` (the even and odd maps) and each differential head's values `[B, H/2, K, d]`."""
        head_values = repeat_kv(value_states, self.num_key_value_groups)[:, 0::2]
        return attn_weights[:, 0::2], attn_weights[:, 1::2], head_values


DINT_ATTENTION_CLASSES = {"v1": DintV1Attention, "v2": DintV2Attention}  # by `config.differential_attention`


class DintDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (its forward passes `integral_layout` and `dint_path` on) with DINT attention, as DiffLlama."""

    def __init__(self, config: DintConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DINT_ATTENTION_CLASSES[config.differential_attention](config=config, layer_idx=layer_idx)

    forward = unwrapped_forward(LlamaDecoderLayer)  # Llama's, checkpointed by one wrapper (not Llama's and ours)


DINT_AUTO_MAP = {  # what `save_pretrained` writes, so that every Auto class loads a DINT with `trust_remote_code`
    "AutoConfig": "configuration_dint.DintConfig",
    "AutoModel": "modeling_dint.DintModel",
    "AutoModelForCausalLM": "modeling_dint.DintForCausalLM",
    "AutoModelForSequenceClassification": "modeling_dint.DintForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_dint.DintForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_dint.DintForQuestionAnswering",
}


def keep_in_fp32_modules(config: DintConfig) -> list[str]:
    """The modules a model of `config` keeps fp32 in fp16 and bf16 loads (`_keep_in_fp32_modules_strict`; the plain
    list would keep them in fp16 loads only): v1's lambda vectors, v2's lambda gate where the config has one."""
    if config.differential_attention == "v1":
        return ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
    return ["lambda_gate"] if config.lambda_gate else []


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
    _can_record_outputs = {
        "hidden_states": DintDecoderLayer,
        "attentions": DintAttention,
    }

    def __init__(self, config: DintConfig, *inputs, **kwargs):
        # A config changed after construction (`config.integral = "sofmax"`) is validated again here: DINT's own
        # fields only (transformers' checks, such as the rope parameters', ran when the config was built).
        config.validate_architecture()
        super().__init__(config, *inputs, **kwargs)
        # Per model, from its layout: a class-wide list would name modules that a model of the other layout lacks.
        self._keep_in_fp32_modules_strict = keep_in_fp32_modules(config)
        BUILT_MODELS.add(self)  # from here on the config refuses edits of the fields the modules are built from

    def __setstate__(self, state):
        """A copied or unpickled model holds its config as a built one does (`BUILT_MODELS`)."""
        super().__setstate__(state)
        BUILT_MODELS.add(self)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DintV1Attention):
            init.normal_(module.lambda_q1, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_k1, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_q2, 0, self.config.lambda_std_dev)
            init.normal_(module.lambda_k2, 0, self.config.lambda_std_dev)
        elif isinstance(module, DintLambdaGate):
            init.ones_(module.weight)

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
        saved model is for generation and `torch.export` (which refuses a config without caching). The code files
        beside the weights are `REMOTE_CODE_FILES`, copied here whatever transformers' own import scan finds."""
        self.config.auto_map = {**DINT_AUTO_MAP, **(getattr(self.config, "auto_map", None) or {})}
        use_cache = self.config.use_cache
        self.config.use_cache = True
        try:
            saved = super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.config.use_cache = use_cache
        if kwargs.get("is_main_process", True):
            source = os.path.dirname(os.path.abspath(__file__))
            for name in REMOTE_CODE_FILES:
                shutil.copyfile(os.path.join(source, name), os.path.join(save_directory, name))
        return saved


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
        # What each forward's integral plan reads of the config, read once (fields a built model's config refuses)
        row_channels = config.num_differential_heads * config.differential_head_dim
        self.integral_settings = (config.integral, row_channels, config.head_norm)

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
            The cache this forward continues (K/V and the integral statistics), `DynamicCache(config=...)`; also
            accepted as `past_key_values` (`transformers_compat.accepts_past_key_values`).
        integral_layout (`DintIntegralLayout`, *optional*):
            The query rows' documents where the caller built them (continuous batching); else from the inputs.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

        config = self.config
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        path = attention_path(config._attn_implementation, config.integral, config.one_pass_attention)  # once
        if cache is not None and not isinstance(cache, DintIntegralState):
            check_dint_cache(cache, config, path == MATERIALIZING)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            check_padding_mask_length(attention_mask, inputs_embeds.shape[1], cache)
        given_position_ids = position_ids  # the integral's documents restart at the caller's position ids only
        position_ids = default_position_ids(inputs_embeds, cache) if position_ids is None else position_ids
        masks = create_dint_masks(config, inputs_embeds, attention_mask, cache, position_ids, path == MATERIALIZING)
        integral_layout = forward_integral_layout(
            *self.integral_settings, cache, masks[DINT_QUERY_VALID_KEY], given_position_ids, inputs_embeds,
            self.training, kwargs.get("cu_seq_lens_q"), integral_layout,
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers[: config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[DINT_LAYER_TYPE],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                **{CACHE_ARGUMENT: cache},
                integral_layout=integral_layout,
                dint_path=path,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_ARGUMENT: cache})


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
        """transformers' continuous batching (`generate_batch`, `transformers serve --continuous-batching`), each
        request's integral state beside its paged K/V: `modeling_dint.integrations.serving`, of the installed package
        only."""
        try:
            from modeling_dint.integrations.serving import init_continuous_batching
        except ImportError as error:
            raise ImportError(
                "Continuous batching of a DINT model needs the modeling_dint package installed (`pip install -e .` in "
                f"a clone of its repository), whose serving adapter the remote code does not carry ({error})."
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
        """What generate() calls, for a compileable (static) cache, to build the step's masks before the forward."""
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


__all__ = ["DintPreTrainedModel", "DintModel", "DintForCausalLM", "DintForSequenceClassification",
           "DintForTokenClassification", "DintForQuestionAnswering", "DintV1Attention", "DintV2Attention"]
