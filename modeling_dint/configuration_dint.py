# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""DINT Transformer model configuration.

DINT (Cang et al., 2025, arXiv 2501.17486) is a Llama-style decoder whose attention adds an integral term to DIFF
attention (Ye et al., 2024, arXiv 2410.05258): `A1 - lambda * A2 + lambda * G`, where G is the running mean, over the
valid query rows of a document, of the signal map A1. The head layout is the one of transformers' DiffLlama.

This file is copied next to the weights by `save_pretrained` (remote code): it imports nothing but the standard
library, torch (indirectly) and transformers.
"""

# First: on an unsupported transformers this fails with one clear message, before any import from inside it fails.
from .transformers_compat import check_transformers_version  # noqa: F401, I001

import json
import math
import weakref
from dataclasses import FrozenInstanceError
from importlib import resources

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters


DINT_LAYER_TYPE = "dint_attention"
"""The `layer_types` entry of every DINT layer: it selects the DINT cache layers, which carry the integral statistics."""

DIFFERENTIAL_ATTENTIONS = ("v1", "v2")
"""The head layouts of differential attention. `v1`: DIFF V1's, as the DINT paper and transformers' DiffLlama have it
(the first H/2 query heads are signal maps, the last H/2 noise maps; each differential head reads 2*head_dim value
channels; a scalar lambda per layer; a per-head RMSNorm). `v2`: DIFF V2's (docs/design.md section 10): query heads 2i
(signal) and 2i+1 (noise) share one KV head; each differential head reads head_dim value channels; lambda per token
and head, `sigmoid(lambda_proj(x))`; no head norm: one ordinary attention call and Llama's KV cache."""

INTEGRAL_MODES = ("mean", "softmax", "none")
"""`mean`: G as in the paper's eq. 5 (default). `softmax`: the arXiv v2 text, `lambda * softmax(G)` over the valid keys of
each row (materializes the attention maps). `none`: plain DIFF attention. The v1 text's non-causal column mean, repeated
over all rows, leaks future tokens into a causal LM and is not offered."""


def depth_lambda_init(layer_idx: int) -> float:
    """The paper's depth schedule of lambda_init for the 0-based layer index: `0.8 - 0.6 * exp(-0.3 * layer_idx)`."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def default_head_dim(differential_attention: str, hidden_size: int, num_attention_heads: int) -> int | None:
    """`head_dim` where a config gives none: `hidden_size` over the output heads, `num_attention_heads` for v1 (as
    DiffLlama) and `num_attention_heads / 2` for v2 (DIFF V2's `d = hidden_size / h`: 2h query heads, h output heads).
    None where there is no output head (the config's validation then names `num_attention_heads`)."""
    output_heads = num_attention_heads // 2 if differential_attention == "v2" else num_attention_heads
    if not isinstance(output_heads, int) or not isinstance(hidden_size, int) or output_heads < 1:
        return None
    return hidden_size // output_heads


LAYOUT_FIELDS = ("head_norm", "head_norm_affine", "lambda_init", "lambda_std_dev", "one_pass_attention", "lambda_gate")
"""The fields whose value depends on the head layout (`differential_attention`): v1's head norm, lambda_init, lambda
vectors and one pass, v2's lambda gate. `DintConfig.from_preset` gives a preset switched to the other layout that
layout's defaults for them, unless the caller sets them."""


ARCHITECTURE_FIELDS = (
    "differential_attention", "integral", "lambda_init", "head_norm", "head_norm_affine", "lambda_gate",
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "attention_bias", "mlp_bias", "attention_dropout", "rope_parameters",
)
"""The fields a built model reads once, to shape its modules and constants (head layout, integral, lambda, head norm,
sizes, activation, norms' epsilon, biases, RoPE): on a config that a built model holds they cannot change
(`DintConfig.__setattr__`), since the model in memory would ignore the change and `save_pretrained` would write it.
Every other field stays settable: transformers' runtime fields (`_attn_implementation`, `use_cache`,
`output_attentions`, ...), `vocab_size` (`resize_token_embeddings`), `num_hidden_layers` (the forward runs the first
`num_hidden_layers` layers: transformers' early-exit assistant), `tie_word_embeddings` (PEFT's `merge_and_unload`
sets it False where merging untied the weights, so that the config says what the model is), token ids, and
`one_pass_attention` (read at every forward)."""

BUILT_MODELS = weakref.WeakSet()
"""The DINT models alive, each added as it is built or copied (`DintPreTrainedModel`): a config one of them holds as
`.config` refuses edits of `ARCHITECTURE_FIELDS`. A copy of that config is held by no model, so it is free again."""


MATERIALIZING, ONE_PASS, TWO_CALLS = "materializing", "one_pass", "two_calls"
"""The ways DINT attention computes its output (`attention_path`)."""


def attention_path(attn_implementation: str, integral: str, one_pass_attention: bool | None) -> str:
    """How DINT attention computes its output, from the config's `_attn_implementation`, `integral` and
    `one_pass_attention`:

    - `MATERIALIZING`: the maps A1, A2, G and A_final (eager attention, or integral "softmax", which needs G itself);
    - `ONE_PASS`: the fast path, O1 and O2 from one attention call over each KV head's 2*head_dim-wide V
      `[V half 1 | V half 2]` (Q.K^T once per map): `one_pass_attention` True, or None for the backends in
      `ONE_PASS_BY_DEFAULT`;
    - `TWO_CALLS`: the fast path, O1 and O2 from two calls over the halves of V (DiffLlama's).

    The attention asks once per layer and forward, with the fields read once: a config attribute costs microseconds
    (transformers' `__getattribute__`), three times the arithmetic of a decoding step's combination.
    """
    if attn_implementation == "eager" or integral == "softmax":
        return MATERIALIZING
    if one_pass_attention is None:
        return ONE_PASS if attn_implementation in ONE_PASS_BY_DEFAULT else TWO_CALLS
    if one_pass_attention is False:
        return TWO_CALLS
    if attn_implementation not in ONE_PASS_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"`one_pass_attention=True` needs an attention backend whose kernel takes a value head dim other than "
            f"the query/key head dim, got attn_implementation={attn_implementation!r}. Allowed: "
            f"{ONE_PASS_ATTENTION_IMPLEMENTATIONS}, or one_pass_attention=None / False (two calls)."
        )
    return ONE_PASS


def uses_materializing_path(config: "DintConfig") -> bool:
    """Whether DINT attention builds the maps A1, A2, G and A_final (eager attention, or integral "softmax", which
    needs G itself) instead of the fast path's running mean of the signal outputs (`attention_path`)."""
    return attention_path(config._attn_implementation, config.integral, False) == MATERIALIZING


ONE_PASS_ATTENTION_IMPLEMENTATIONS = ("flex_attention", "sdpa")
"""The attention backends whose kernels take a value head dim (2*head_dim, one pass) other than the query/key head dim.
FlashAttention's kernels do not."""

ONE_PASS_BY_DEFAULT = ("flex_attention",)
"""The backends where `one_pass_attention=None` makes one pass: measured faster than two calls (bench/README.md). sdpa
is not: on CPU a wider V sends it to its math kernel (3.5x slower), and on CUDA to other kernels than FlashAttention."""


def uses_one_pass_attention(config: "DintConfig") -> bool:
    """Whether the fast path computes the signal and noise outputs O1, O2 in one attention call: always with v2 (one
    call over all query heads); with v1, over each KV head's 2*head_dim-wide V `[V half 1 | V half 2]` (Q.K^T once per
    map) instead of two calls over the halves (DiffLlama's), as `config.one_pass_attention` decides: None for the
    backends in `ONE_PASS_BY_DEFAULT`, True or False as set (`attention_path`)."""
    if config.differential_attention == "v2":  # one call over all query heads, whatever the backend
        return attention_path(config._attn_implementation, config.integral, None) != MATERIALIZING
    return attention_path(config._attn_implementation, config.integral, config.one_pass_attention) == ONE_PASS


V1_TP_PLAN = {
    # "packed_colwise" gives rank r block r of the signal maps AND of the noise maps (and of both halves of the KV
    # heads), so every differential head lives on one rank; Llama's "colwise" would not. The number of ranks must divide
    # num_key_value_heads / 2; attention_bias=False (a 1-D bias is sharded contiguously).
    "layers.*.self_attn.q_proj": "packed_colwise",
    "layers.*.self_attn.k_proj": "packed_colwise",
    "layers.*.self_attn.v_proj": "packed_colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
V2_TP_PLAN = {
    # Llama's plan: the query heads of each KV head are contiguous and hold whole pairs (2i, 2i+1), so "colwise" keeps
    # each differential head, its KV head and its lambda row (lambda_proj) on one rank; o_proj's input block r is that
    # rank's differential heads. The number of ranks must divide num_key_value_heads.
    **V1_TP_PLAN,
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.lambda_proj": "colwise",
}


@strict
class DintConfig(PreTrainedConfig):
    r"""
    Configuration of a DINT Transformer. It holds Llama's fields (with DiffLlama's head layout) plus the DINT ones.

    Args:
        vocab_size (`int`, defaults to 32000): Size of the vocabulary.
        hidden_size (`int`, defaults to 2048): Dimension of the hidden representations.
        intermediate_size (`int`, defaults to 8192): Dimension of the SwiGLU MLP.
        num_hidden_layers (`int`, defaults to 16): Number of decoder layers.
        num_attention_heads (`int`, defaults to 32): Number of softmax maps (query heads) per layer (`H`), in both
            layouts. It must be even: `H/2` differential heads, each a signal map and a noise map (v1: the first `H/2`
            heads are the signal maps and the last `H/2` the noise maps; v2: heads 2i and 2i+1).
        num_key_value_heads (`int`, *optional*): Number of key/value heads (GQA); defaults to `num_attention_heads`
            (v1) or `num_attention_heads / 2` (v2).
            v1: it must be even (the value heads split into the two halves of each differential head's `2*head_dim`
            channels) and divide `num_attention_heads`. v2: it must divide `H/2` (so that heads 2i and 2i+1 share a
            KV head).
        head_dim (`int`, *optional*): Channels of one softmax map's query/key (`d`). Defaults to
            `hidden_size // num_attention_heads` (v1, DiffLlama's) or `hidden_size // (num_attention_heads / 2)` (v2,
            DIFF V2's `d = hidden_size / h` with h output heads; `default_head_dim`). Each differential head outputs
            `2 * head_dim` channels (v1) or `head_dim` (v2): `differential_head_dim`. A saved config carries its
            `head_dim`, so the default never changes a saved model.
        hidden_act (`str`, defaults to `"silu"`): Activation of the MLP.
        max_position_embeddings (`int`, defaults to 2048): Maximum sequence length used to build RoPE.
        initializer_range (`float`, defaults to 0.02): Standard deviation of the weight initialization.
        rms_norm_eps (`float`, defaults to 1e-5): Epsilon of every RMSNorm.
        use_cache (`bool`, defaults to `True`): Whether the model returns a cache.
        pad_token_id / bos_token_id / eos_token_id: Special token ids.
        tie_word_embeddings (`bool`, defaults to `False`): Tie the input embeddings and the LM head.
        rope_parameters (`dict`, *optional*): RoPE parameters, as for Llama.
        attention_bias (`bool`, defaults to `False`): Bias in the q/k/v/o projections (Qwen2-style checkpoints).
        attention_dropout (`float`, defaults to 0.0): Must be 0: neither paper defines dropout on the combined map.
        mlp_bias (`bool`, defaults to `False`): Bias in the MLP projections.
        differential_attention (`str`, defaults to `"v1"`): The head layout, `"v1"` (the paper's, DiffLlama's) or
            `"v2"` (DIFF V2's: one attention call, Llama's KV cache, lambda per token; see `DIFFERENTIAL_ATTENTIONS`).
        integral (`str`, defaults to `"mean"`): `"mean"`, `"softmax"` or `"none"` (see `INTEGRAL_MODES`).
        lambda_init (`float`, *optional*): v1 only. `None` for the paper's depth schedule
            `0.8 - 0.6 * exp(-0.3 * layer)`; a float in (0, 1) uses that constant in every layer (the paper's Table 6
            ablations use 0.8 and 0.5).
        lambda_std_dev (`float`, defaults to 0.1): Standard deviation of the v1 lambda vectors' initialization.
        head_norm (`bool`, *optional*): Per-differential-head RMSNorm over its `2 * head_dim` channels. Defaults to
            True for v1 and False for v2, which has none (True with v2 is refused).
        head_norm_affine (`bool`, defaults to `True`): Whether that norm has a learned weight (initialized to 1). v1
            only: False with v2 (which has no head norm) is refused.
        lambda_gate (`bool`, defaults to `False`): v2 only, and a departure from DIFF V2 (off by default): a learned
            gate `g` per differential head multiplies lambda, `lambda = g * sigmoid(lambda_proj(x))`, so that
            `out = O1 - g * sigmoid(lambda_proj(x)) * (O2 - S / c)`. Built from scratch, `g` starts at 1 (DIFF V2's
            lambda); the Llama-family converter (`dint-convert --differential-attention v2`) sets it to 0, so that
            the converted model starts exactly at the source's function (a sigmoid is never 0), while `g` gets a
            gradient from the first step and `lambda_proj` from the moment `g` leaves 0. The gate is folded into
            the lambda every integral path reads (`DintV2Attention.differential_lambda`).
        one_pass_attention (`bool`, *optional*): How the fast path computes the signal and noise outputs. `None`
            (default): in one attention call over each KV head's 2*head_dim-wide V where the backend is
            `flex_attention` (Q.K^T once instead of twice; measured faster), in two calls over the two halves of V
            (as DiffLlama) elsewhere. `True`: one call, with `flex_attention` or `sdpa` (the backends whose kernels
            take a value head dim other than the query/key head dim; sdpa's CPU kernel then falls back to its slow
            math kernel). `False`: two calls. The eager backend and integral "softmax" build the maps instead (see
            `uses_one_pass_attention`).

    ```python
    >>> from modeling_dint import DintConfig, DintForCausalLM
    >>> config = DintConfig.from_preset("tiny")
    >>> model = DintForCausalLM(config)
    ```
    """

    model_type = "dint"
    # The cache in a model output, which Trainer's evaluation drops: `cache` from transformers 5.24, before it
    # `past_key_values`.
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int | None = 0.0
    mlp_bias: bool = False
    differential_attention: str = "v1"
    integral: str = "mean"
    lambda_init: float | int | None = None
    lambda_std_dev: float | int = 0.1
    head_norm: bool | None = None
    head_norm_affine: bool = True
    one_pass_attention: bool | None = None
    lambda_gate: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:  # v2: one KV head per differential head
            v1 = self.differential_attention == "v1"
            self.num_key_value_heads = self.num_attention_heads if v1 else self.num_attention_heads // 2
        if self.head_dim is None:
            self.head_dim = default_head_dim(self.differential_attention, self.hidden_size, self.num_attention_heads)
        if self.head_norm is None:
            self.head_norm = self.differential_attention == "v1"
        # `layer_types` is derived from `num_hidden_layers` (see the property): an entry in a saved config is ignored.
        kwargs.pop("layer_types", None)
        super().__post_init__(**kwargs)

    def __setattr__(self, name, value):
        """Refuses, at the assignment, an edit of an `ARCHITECTURE_FIELDS` field on a config that a built model holds
        (assigning the value it has is a no-op and passes); validates DINT's other fields there at once."""
        if name in ARCHITECTURE_FIELDS and self.held_by_model() and getattr(self, name) != value:
            raise FrozenInstanceError(
                f"cannot assign `{name}={value!r}` to the config of a built DINT model (it is "
                f"{getattr(self, name)!r}): "
                f"`{name}` shapes the model's modules or its forward, which were built from it, and save_pretrained "
                f"would write a model other than the one in memory. For that model build a new one from an edited copy "
                f"(`config = copy.deepcopy(model.config); config.{name} = {value!r}; type(model)(config)`, new "
                f"weights), load saved weights under it (`from_pretrained(path, {name}={value!r})`: weights it lacks "
                f"are initialized), or convert a checkpoint (dint-convert)."
            )
        if name in ("one_pass_attention", "lambda_std_dev") and self.held_by_model():
            previous = getattr(self, name)
            super().__setattr__(name, value)
            try:
                self.validate_architecture()
            except ValueError:
                super().__setattr__(name, previous)
                raise
            return
        super().__setattr__(name, value)

    def held_by_model(self) -> bool:
        """Whether a built DINT model holds this config as its `.config` (`BUILT_MODELS`)."""
        return any(model.__dict__.get("config") is self for model in BUILT_MODELS)

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan of the layout (`V1_TP_PLAN` or `V2_TP_PLAN`: each differential head on one rank),
        with the entries of an assigned plan over it (see the setter); a new dict each time."""
        return {**self._layout_tp_plan(), **self.__dict__.get("base_model_tp_plan", {})}

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict[str, str]) -> None:
        """transformers assigns the plan: 5.15 to 5.20's `PreTrainedConfig.__post_init__` adds `embed_tokens` to it when
        `tie_word_embeddings` is set. The entries that differ from the layout's plan are kept, under the class
        attribute's name in `__dict__` (where transformers' own configs keep an assigned plan, and which `to_dict`
        leaves out), over the layout's plan: an assignment adds or changes entries, and the layout's other entries
        still follow `differential_attention`."""
        layout_plan = self._layout_tp_plan()
        self.__dict__["base_model_tp_plan"] = {
            module: style for module, style in (plan or {}).items() if layout_plan.get(module) != style
        }

    def _layout_tp_plan(self) -> dict[str, str]:
        return V1_TP_PLAN if self.differential_attention == "v1" else V2_TP_PLAN

    @property
    def layer_types(self) -> list[str]:
        """Every layer is a DINT attention layer; the name selects the DINT cache layers in `DynamicCache(config=...)`
        and `StaticCache(config=...)`."""
        return [DINT_LAYER_TYPE] * self.num_hidden_layers

    def lambda_init_for_layer(self, layer_idx: int) -> float:
        """lambda_init of the 0-based layer `layer_idx`: the depth schedule, or the configured constant."""
        return depth_lambda_init(layer_idx) if self.lambda_init is None else float(self.lambda_init)

    def validate_layer_type(self):
        """The base check accepts only built-in layer types; DINT layers all have the type `dint_attention`."""
        return

    def validate_architecture(self):
        """Checks the DINT head layout and fields; each error names the field, the value and what is allowed."""
        if self.differential_attention not in DIFFERENTIAL_ATTENTIONS:
            raise ValueError(
                f"`differential_attention` must be one of {DIFFERENTIAL_ATTENTIONS}, got {self.differential_attention!r}."
            )
        if self.integral not in INTEGRAL_MODES:
            raise ValueError(f"`integral` must be one of {INTEGRAL_MODES}, got {self.integral!r}.")
        for name in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.num_attention_heads % 2 != 0:
            raise ValueError(
                f"`num_attention_heads` must be even (it counts softmax maps: a signal map and a noise map per "
                f"differential head), got {self.num_attention_heads}."
            )
        if self.differential_attention == "v1":
            self._validate_v1_layout()
        else:
            self._validate_v2_layout()
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2 != 0:
            raise ValueError(
                f"`head_dim` must be a positive even integer (RoPE rotates channel pairs), got {self.head_dim!r} "
                f"(hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads})."
            )
        if self.lambda_init is not None and not 0.0 < float(self.lambda_init) < 1.0:
            raise ValueError(
                f"`lambda_init` must be None (the depth schedule 0.8 - 0.6*exp(-0.3*layer)) or a float in (0, 1), "
                f"got {self.lambda_init!r}."
            )
        if not math.isfinite(self.lambda_std_dev) or self.lambda_std_dev < 0:
            raise ValueError(f"`lambda_std_dev` must be a finite number >= 0, got {self.lambda_std_dev!r}.")
        if self.one_pass_attention not in (None, True, False):
            raise ValueError(
                f"`one_pass_attention` must be None (one attention call where the backend is flex_attention), True "
                f"or False, got {self.one_pass_attention!r}."
            )
        if self.lambda_gate not in (True, False):
            raise ValueError(
                f"`lambda_gate` must be True or False (a learned gate per differential head on v2's lambda), got "
                f"{self.lambda_gate!r}."
            )
        if self.lambda_gate and self.differential_attention != "v2":
            raise ValueError(
                "`lambda_gate=True` needs differential_attention='v2' (it gates v2's lambda, "
                f"sigmoid(lambda_proj(x))); got differential_attention={self.differential_attention!r}. v1's lambda "
                "can start at 0 without it (dint-convert --head-init duplicate)."
            )
        if self.attention_dropout:
            raise ValueError(
                f"`attention_dropout` must be 0: neither the DIFF nor the DINT paper defines dropout on the combined "
                f"attention map, got {self.attention_dropout!r}."
            )

    def _validate_v1_layout(self):
        if self.num_key_value_heads % 2 != 0:
            raise ValueError(
                f"`num_key_value_heads` must be even (the value heads split into the two halves of each differential "
                f"head's 2*head_dim channels), got {self.num_key_value_heads}."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads})."
            )

    def _validate_v2_layout(self):
        differential_heads = self.num_attention_heads // 2
        if differential_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"With differential_attention='v2', `num_key_value_heads` ({self.num_key_value_heads}) must divide "
                f"num_attention_heads / 2 = {differential_heads} (the differential heads), so that the signal and "
                "noise query heads of each differential head share one KV head."
            )
        if self.head_norm:
            raise ValueError(
                "differential_attention='v2' has no per-head RMSNorm: `head_norm` must be False (or left unset), got "
                "head_norm=True."
            )
        if self.head_norm_affine is not True:
            raise ValueError(
                "differential_attention='v2' has no per-head RMSNorm, so no norm weight to leave out: "
                f"`head_norm_affine` must be True (or left unset), got {self.head_norm_affine!r}."
            )
        if self.lambda_init is not None:
            raise ValueError(
                "differential_attention='v2' has no lambda_init (lambda = sigmoid(lambda_proj(x)) per token and head): "
                f"`lambda_init` must be None, got {self.lambda_init!r}."
            )
        if self.one_pass_attention is not None:
            raise ValueError(
                "differential_attention='v2' always makes one attention call: `one_pass_attention` must be None, got "
                f"{self.one_pass_attention!r}."
            )

    @property
    def num_differential_heads(self) -> int:
        """The differential heads per layer, `num_attention_heads / 2` (each a signal map and a noise map)."""
        return self.num_attention_heads // 2

    @property
    def differential_head_dim(self) -> int:
        """The value channels of one differential head: `2 * head_dim` (v1: `[V half 1 | V half 2]`) or `head_dim`
        (v2). The integral's state per layer is `(num_differential_heads, differential_head_dim)`."""
        return 2 * self.head_dim if self.differential_attention == "v1" else self.head_dim

    def check_paged_serving(self) -> None:
        """Refuses, naming the field, before any request, a model that paged serving (transformers' continuous
        batching, `dint-serve --continuous-batching`, vLLM) cannot run: integral "softmax" needs the per-key column sums
        of the signal maps of each request, which no paged cache keeps and no paged kernel computes."""
        if self.integral == "softmax":
            raise ValueError(
                "DINT with integral='softmax' cannot be served from a paged cache (continuous batching, vLLM): its "
                "integral needs the per-key column sums of the signal maps of each request, which the paged cache does "
                "not keep. Serve it without continuous batching (model.generate(), or dint-serve without "
                "--continuous-batching), or serve a model trained with integral='mean' or 'none' (the same weights "
                "with another integral compute another function)."
            )

    def check_tensor_parallel_heads(self, tp_size: int) -> None:
        """Raises a ValueError unless `tp_size` ranks can each hold whole differential heads (a signal map, its noise
        map and their V): v1: `tp_size` must divide `num_key_value_heads / 2` (a KV head pair holds both halves of V);
        v2: `num_key_value_heads`. The rule of every tensor-parallel layout of DINT (transformers' plans, vLLM)."""
        if self.differential_attention == "v1":
            kv_units, unit = self.num_key_value_heads // 2, "num_key_value_heads / 2"
        else:
            kv_units, unit = self.num_key_value_heads, "num_key_value_heads"
        if kv_units % tp_size != 0:
            allowed = [size for size in range(1, kv_units + 1) if kv_units % size == 0]
            raise ValueError(
                f"Tensor parallelism over {tp_size} processes cannot shard this DINT model "
                f"(differential_attention={self.differential_attention!r}): tensor_parallel_size={tp_size} must divide "
                f"{unit} = {kv_units} (num_key_value_heads={self.num_key_value_heads}), so that each rank holds whole "
                f"differential heads (a signal map, its noise map and their V). Allowed: {allowed}."
            )

    def check_tensor_parallel_size(self, tp_size: int) -> None:
        """Raises a ValueError unless DINT's tensor-parallel plan can shard this config over `tp_size` processes: whole
        differential heads per rank (`check_tensor_parallel_heads`), and for v1 no attention bias (its `packed_colwise`
        plan shards a bias contiguously; v2's `colwise` shards it with its rows)."""
        self.check_tensor_parallel_heads(tp_size)
        if self.lambda_gate:
            raise ValueError(
                "Tensor parallelism cannot shard this DINT model: lambda_gate=True, and transformers' plans shard "
                "linear layers, not the gate's one weight per differential head. Allowed: lambda_gate=False, or serve "
                "the model with vLLM (whose tensor parallelism shards the gate with lambda_proj)."
            )
        if self.attention_bias and self.differential_attention == "v1":
            raise ValueError(
                "Tensor parallelism cannot shard this DINT model: attention_bias=True, and the packed_colwise plan of "
                "q/k/v shards a bias contiguously (it would split signal and noise maps apart). Allowed: "
                "attention_bias=False."
            )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "DintConfig":
        """Builds the config of a preset shipped with the `modeling_dint` package (`preset_names()`: the paper's
        sizes, their DIFF V2 twins `NAME-v2`, `tiny` and `tiny-v2`).

        `overrides` replace preset fields, e.g. `DintConfig.from_preset("tiny", integral="softmax")`. An override
        of `differential_attention` that switches the preset's layout gives the new layout's defaults for the
        fields whose value depends on the layout (`LAYOUT_FIELDS`: v1's head norm, lambda_init, lambda vectors and
        one pass; v2's lambda gate) unless they are overridden too; the sizes stay the preset's, and where they do
        not fit the new layout the error names the twin preset that does.
        """
        available = preset_names()
        if name not in available:
            raise ValueError(f"Unknown preset {name!r}: available presets are {available}.")
        fields = json.loads((resources.files("modeling_dint.presets") / f"{name}.json").read_text(encoding="utf-8"))
        fields.pop("model_type", None)
        layout = fields.get("differential_attention", "v1")
        new_layout = overrides.get("differential_attention", layout)
        if new_layout != layout:
            for field in LAYOUT_FIELDS:
                fields.pop(field, None)
        fields.update(overrides)
        try:
            return cls(**fields)
        except StrictDataclassError as error:
            twin = name.removesuffix("-v2") if layout == "v2" else f"{name}-v2"
            if new_layout == layout or twin not in available:
                raise
            reason = " ".join(str(error.__cause__ or error).split())
            raise ValueError(
                f"Preset {name!r} is a {layout} preset and does not fit differential_attention={new_layout!r} as it "
                f"is: {reason} Use its {new_layout} twin, DintConfig.from_preset({twin!r}), or override the sizes "
                "named above."
            ) from error


def preset_names() -> list[str]:
    """Names of the presets shipped in `modeling_dint.presets` (the repository's `configuration/` folder)."""
    try:
        folder = resources.files("modeling_dint.presets")
    except ModuleNotFoundError as error:
        raise RuntimeError(
            "Presets ship with the installed `modeling_dint` package (pip install the repository); this copy of the "
            "configuration file (e.g. one loaded with trust_remote_code) has none."
        ) from error
    return sorted(entry.name[: -len(".json")] for entry in folder.iterdir() if entry.name.endswith(".json"))


__all__ = [
    "ARCHITECTURE_FIELDS",
    "DintConfig",
    "DINT_LAYER_TYPE",
    "DIFFERENTIAL_ATTENTIONS",
    "INTEGRAL_MODES",
    "LAYOUT_FIELDS",
    "attention_path",
    "default_head_dim",
    "depth_lambda_init",
    "preset_names",
    "uses_materializing_path",
    "uses_one_pass_attention",
]
