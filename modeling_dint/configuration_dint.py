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
from importlib import resources

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters


DINT_LAYER_TYPE = "dint_attention"
"""The `layer_types` entry of every DINT layer: it selects the DINT cache layers, which carry the integral statistics."""

INTEGRAL_MODES = ("mean", "softmax", "none")
"""`mean`: G as in the paper's eq. 5 (default). `softmax`: the arXiv v2 text, `lambda * softmax(G)` over the valid keys of
each row (materializes the attention maps). `none`: plain DIFF attention. The v1 text's non-causal column mean, repeated
over all rows, leaks future tokens into a causal LM and is not offered."""


def depth_lambda_init(layer_idx: int) -> float:
    """The paper's depth schedule of lambda_init for the 0-based layer index: `0.8 - 0.6 * exp(-0.3 * layer_idx)`."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


@strict
class DintConfig(PreTrainedConfig):
    r"""
    Configuration of a DINT Transformer. It holds Llama's fields (with DiffLlama's head layout) plus the DINT ones.

    Args:
        vocab_size (`int`, defaults to 32000): Size of the vocabulary.
        hidden_size (`int`, defaults to 2048): Dimension of the hidden representations.
        intermediate_size (`int`, defaults to 8192): Dimension of the SwiGLU MLP.
        num_hidden_layers (`int`, defaults to 16): Number of decoder layers.
        num_attention_heads (`int`, defaults to 32): Number of softmax maps per layer (`H`). It must be even: the
            first `H/2` heads are the signal maps and the last `H/2` the noise maps of the `H/2` differential heads.
        num_key_value_heads (`int`, *optional*): Number of key/value heads (GQA); defaults to `num_attention_heads`.
            It must be even (the value heads split into the two halves of each differential head's `2*head_dim`
            channels) and divide `num_attention_heads`.
        head_dim (`int`, *optional*): Channels of one softmax map's query/key (`d`); defaults to
            `hidden_size // num_attention_heads`. Each differential head outputs `2 * head_dim` channels.
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
        integral (`str`, defaults to `"mean"`): `"mean"`, `"softmax"` or `"none"` (see `INTEGRAL_MODES`).
        lambda_init (`float`, *optional*): `None` for the paper's depth schedule `0.8 - 0.6 * exp(-0.3 * layer)`;
            a float in (0, 1) uses that constant in every layer (the paper's Table 6 ablations use 0.8 and 0.5).
        lambda_std_dev (`float`, defaults to 0.1): Standard deviation of the lambda vectors' initialization.
        head_norm (`bool`, defaults to `True`): Per-differential-head RMSNorm over its `2 * head_dim` channels.
        head_norm_affine (`bool`, defaults to `True`): Whether that norm has a learned weight (initialized to 1).
        one_pass_attention (`bool`, *optional*): How the fast path computes the signal and noise outputs. `None`
            (default): in one attention call over each KV head's 2*head_dim-wide V where the backend is
            `flex_attention` (Q.K^T once instead of twice; measured faster), in two calls over the two halves of V
            (as DiffLlama) elsewhere. `True`: one call, with `flex_attention` or `sdpa` (the backends whose kernels
            take a value head dim other than the query/key head dim; sdpa's CPU kernel then falls back to its slow
            math kernel). `False`: two calls. The eager backend and integral "softmax" build the maps instead (see
            `integral_dint.uses_one_pass_attention`).

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
    # Tensor parallel: "packed_colwise" gives rank r block r of the signal maps AND of the noise maps (and of both
    # halves of the KV heads), so every differential head lives on one rank; Llama's "colwise" would not. The number
    # of ranks must divide num_key_value_heads / 2; attention_bias=False (a 1-D bias is sharded contiguously).
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "packed_colwise",
        "layers.*.self_attn.k_proj": "packed_colwise",
        "layers.*.self_attn.v_proj": "packed_colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
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
    integral: str = "mean"
    lambda_init: float | int | None = None
    lambda_std_dev: float | int = 0.1
    head_norm: bool = True
    head_norm_affine: bool = True
    one_pass_attention: bool | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # `layer_types` is derived from `num_hidden_layers` (see the property): an entry in a saved config is ignored.
        kwargs.pop("layer_types", None)
        super().__post_init__(**kwargs)

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
        if self.attention_dropout:
            raise ValueError(
                f"`attention_dropout` must be 0: neither the DIFF nor the DINT paper defines dropout on the combined "
                f"attention map, got {self.attention_dropout!r}."
            )

    def check_tensor_parallel_heads(self, tp_size: int) -> None:
        """Raises a ValueError unless `tp_size` ranks can each hold whole differential heads (a signal map, its noise
        map and both halves of their V): `tp_size` must divide `num_key_value_heads / 2`. The rule of every
        tensor-parallel layout of DINT (transformers' `packed_colwise` plan, the vLLM model)."""
        kv_head_pairs = self.num_key_value_heads // 2
        if kv_head_pairs % tp_size != 0:
            allowed = [size for size in range(1, kv_head_pairs + 1) if kv_head_pairs % size == 0]
            raise ValueError(
                f"Tensor parallelism over {tp_size} processes cannot shard this DINT model: "
                f"tensor_parallel_size={tp_size} must divide num_key_value_heads / 2 = {kv_head_pairs} "
                f"(num_key_value_heads={self.num_key_value_heads}), so that each rank holds whole differential heads "
                f"(a signal map, its noise map and both halves of their V). Allowed: {allowed}."
            )

    def check_tensor_parallel_size(self, tp_size: int) -> None:
        """Raises a ValueError unless DINT's tensor-parallel plan (`packed_colwise` q/k/v) can shard this config over
        `tp_size` processes: whole differential heads per rank (`check_tensor_parallel_heads`), and no attention bias
        (the plan shards a bias contiguously)."""
        self.check_tensor_parallel_heads(tp_size)
        if self.attention_bias:
            raise ValueError(
                "Tensor parallelism cannot shard this DINT model: attention_bias=True, and the packed_colwise plan of "
                "q/k/v shards a bias contiguously (it would split signal and noise maps apart). Allowed: "
                "attention_bias=False."
            )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "DintConfig":
        """Builds the config of a preset shipped with the `modeling_dint` package (the paper's sizes and `tiny`).

        `overrides` replace preset fields, e.g. `DintConfig.from_preset("tiny", integral="softmax")`.
        """
        available = preset_names()
        if name not in available:
            raise ValueError(f"Unknown preset {name!r}: available presets are {available}.")
        fields = json.loads((resources.files("modeling_dint.presets") / f"{name}.json").read_text(encoding="utf-8"))
        fields.pop("model_type", None)
        fields.update(overrides)
        return cls(**fields)


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


__all__ = ["DintConfig", "DINT_LAYER_TYPE", "INTEGRAL_MODES", "depth_lambda_init", "preset_names"]
