"""The transformers internals `modeling_dint/transformers_compat.py` (the model's bridges, remote code) and
`modeling_dint/integrations/release_bridges.py` (the tools', tests' and recipes' bridges) rely on, checked on the
installed release.

Each failure names the symbol and the releases the bridge was written for: a new transformers release that moves one
of them fails here first, with the name to look at, instead of somewhere inside a DINT forward or a remote-code load.
The bridges for older releases are also run here against the newest release's own implementation.
"""

import inspect
import json
import os
import re
import warnings

import pytest
import torch
import transformers
from dint_testing import cache_of, left_padded_batch, tiny_config, tiny_model, with_cache
from transformers import StaticCache, cache_utils

from modeling_dint import DintDynamicLayer, DintForCausalLM, DintStaticLayer
from modeling_dint.integrations import release_bridges
from modeling_dint.configuration_dint import V1_TP_PLAN, V2_TP_PLAN
from modeling_dint import transformers_compat as compat
from modeling_dint.integral_dint import CacheIntegralState


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALLED = compat.installed_release()


def changed(symbol: str, written_for: str, detail: str, module: str = "transformers_compat.py") -> str:
    return (
        f"transformers {transformers.__version__} changed `{symbol}`, which modeling_dint/{module} "
        f"relies on (written for transformers {written_for}): {detail}"
    )


def test_below_the_floor_fails_with_one_clear_error():
    for installed in ("4.57.6", "5.0.0", "5.4.0"):
        with pytest.raises(compat.UnsupportedTransformersError) as error:
            compat.check_transformers_version(installed)
        message = str(error.value)
        assert f"transformers {installed} is installed" in message and ">= 5.5.0" in message
        assert 'pip install -U "transformers>=5.5.0,<6"' in message
    for installed in ("5.5.0", "5.5.4", "5.23.0", transformers.__version__):
        compat.check_transformers_version(installed)


def test_install_requires_states_the_floor():
    with open(os.path.join(REPO_ROOT, "setup.py"), encoding="utf-8") as file:
        requirement = re.search(r'"transformers>=([\d.]+),<6"', file.read())
    assert requirement is not None and requirement.group(1) == compat.MINIMUM_TRANSFORMERS_VERSION


@pytest.mark.parametrize("differential_attention", ["v1", "v2"])
def test_tied_embeddings_build_save_and_reload_with_the_layouts_tp_plan(tmp_path, differential_attention):
    # transformers 5.15 to 5.20 assign `base_model_tp_plan` in `PreTrainedConfig.__post_init__` when the embeddings
    # are tied (SmolLM2's and most small models' setting); a plan without a setter failed every such config there
    config = tiny_config(tie_word_embeddings=True, differential_attention=differential_attention)
    layout_plan = V1_TP_PLAN if differential_attention == "v1" else V2_TP_PLAN
    assert config.base_model_tp_plan.items() >= layout_plan.items()
    model = DintForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json", encoding="utf-8") as file:
        assert "base_model_tp_plan" not in json.load(file)
    reloaded = DintForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.base_model_tp_plan == config.base_model_tp_plan
    input_ids = torch.randint(2, 128, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, model(input_ids).logits)


@pytest.mark.parametrize("differential_attention", ["v1", "v2"])
def test_an_assigned_tp_plan_adds_or_changes_entries_over_the_layouts(differential_attention):
    config = tiny_config(differential_attention=differential_attention)
    layout_plan = V1_TP_PLAN if differential_attention == "v1" else V2_TP_PLAN
    changed = {"embed_tokens": "embedding_rowwise", "layers.*.mlp.down_proj": "rowwise_split_input"}
    config.base_model_tp_plan = {**config.base_model_tp_plan, **changed}
    assert config.base_model_tp_plan == {**layout_plan, **changed}
    assert config.__dict__["base_model_tp_plan"] == changed  # only what differs from the layout's plan is kept
    assert "base_model_tp_plan" not in config.to_dict()
    assert "base_model_tp_plan" not in json.loads(config.to_json_string())


@pytest.mark.parametrize("padded", [False, True])
def test_create_causal_mask_bridge_matches_transformers(padded):
    model = tiny_model("eager")
    input_ids, attention_mask = left_padded_batch(lengths=(6, 6 if not padded else 4))
    inputs_embeds = model.model.embed_tokens(input_ids)
    kwargs = dict(
        config=_sdpa_mask_config(),
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=torch.arange(6)[None],
    )
    kwargs[compat.CACHE_ARGUMENT] = None
    bridged = compat.create_causal_mask_before_5_15(allow_is_causal_skip=False, **kwargs)
    assert bridged is not None and bridged.shape == (2, 1, 6, 6) and bridged.dtype == torch.bool
    expected = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
    assert torch.equal(bridged, expected.expand_as(bridged))
    if INSTALLED >= (5, 15):
        assert compat.HAS_CAUSAL_SKIP_ARGUMENT
        native = compat.create_causal_mask(
            allow_is_causal_skip=False, cache=None, **{k: v for k, v in kwargs.items() if k != compat.CACHE_ARGUMENT}
        )
        assert native is not None and torch.equal(native, bridged), changed(
            "transformers.masking_utils.create_causal_mask(allow_is_causal_skip=False)",
            "5.15 - 5.23",
            "it no longer returns sdpa's boolean [B, 1, T, K] causal mask",
        )


def _sdpa_mask_config():
    """What create_causal_mask reads of a config, asking for sdpa's boolean mask (as DINT's materializing path)."""
    from modeling_dint.masking_dint import _DenseMaskConfig

    return _DenseMaskConfig()


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_cache_layers_for_dint_layer_types(cache_kind):
    model = tiny_model()
    config = model.config
    if INSTALLED >= (5, 14):
        mappings = (cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, cache_utils.STATIC_LAYER_TYPE_MAPPING)
        registered = (mappings[0].get("dint_attention"), mappings[1].get("dint_attention"))
        assert registered == (DintDynamicLayer, DintStaticLayer), changed(
            "transformers.cache_utils.DYNAMIC_LAYER_TYPE_MAPPING / STATIC_LAYER_TYPE_MAPPING (`_layer_type`)",
            "5.14 - 5.23",
            f"the DINT layers are not registered by their `_layer_type`: {registered}",
        )
    # The bridge of 5.5 - 5.13, run here too: the plain layers those releases build become DINT layers.
    if cache_kind == "dynamic":
        cache = transformers.DynamicCache(config=config)
        cache.layers[:] = [cache_utils.DynamicLayer() for _ in range(config.num_hidden_layers)]
    else:
        cache = StaticCache(config=config, max_cache_len=16)
        cache.layers[:] = [cache_utils.StaticLayer(max_cache_len=16) for _ in range(config.num_hidden_layers)]
    compat.replace_plain_cache_layers(cache, DintDynamicLayer, DintStaticLayer)
    expected_class = DintDynamicLayer if cache_kind == "dynamic" else DintStaticLayer
    assert all(type(layer) is expected_class for layer in cache.layers)
    input_ids = torch.randint(2, 128, (1, 6))
    with torch.no_grad():
        prefill = model(input_ids[:, :5], **with_cache(cache))
        step = model(input_ids[:, 5:], **with_cache(cache_of(prefill))).logits
        full = model(input_ids).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)


def test_generate_rolls_back_by_recording_where_the_flag_says():
    recording = hasattr(cache_utils.Cache, "activate_past_recording")
    assert recording == release_bridges.GENERATE_RECORDS_PAST_FOR_CROP, changed(
        "transformers.cache_utils.Cache.activate_past_recording",
        "5.14 - 5.23",
        "GENERATE_RECORDS_PAST_FOR_CROP no longer tells whether generate() records past states before a crop",
        module="release_bridges.py",
    )


def test_the_cache_keyword_is_the_installed_releases():
    """`CACHE_ARGUMENT` is the name transformers' own Llama passes the cache by (`cache` from 5.24, `past_key_values`
    before); a DINT forward accepts both names on every release and returns the cache under the installed one."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel

    for forward in (LlamaModel.forward, LlamaForCausalLM.forward):
        parameters = inspect.signature(inspect.unwrap(forward)).parameters
        assert compat.CACHE_ARGUMENT in parameters, changed(
            f"{forward.__qualname__}'s cache parameter",
            "5.5 - 5.24",
            f"`{compat.CACHE_ARGUMENT}` is not among {list(parameters)}",
        )
    assert compat.HAS_CACHE_ARGUMENT == (INSTALLED >= (5, 24))
    model = tiny_model()
    input_ids = torch.randint(2, 128, (1, 6))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.24 deprecates `past_key_values=` (as on Llama)
        full = model(input_ids).logits
        for old_name in (False, True):
            cache = transformers.DynamicCache(config=model.config)
            name = "past_key_values" if old_name else compat.CACHE_ARGUMENT
            prefill = model.model(input_ids[:, :5], **{name: cache})
            assert prefill[compat.CACHE_ARGUMENT] is cache and cache.get_seq_length() == 5
            step = model(input_ids[:, 5:], **{name: cache}).logits
            torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
        if not compat.HAS_CACHE_ARGUMENT:  # (from 5.24 transformers' deprecate_kwarg keeps `cache` and warns)
            with pytest.raises(ValueError, match="not both"):
                model.model(input_ids, past_key_values=cache, cache=transformers.DynamicCache(config=model.config))


def test_below_the_torch_floor_fails_with_one_clear_error():
    for installed in ("2.4.1", "2.5.1+cpu"):
        with pytest.raises(compat.UnsupportedTransformersError) as error:
            compat.check_torch_version(installed)
        message = str(error.value)
        assert f"torch {installed} is installed" in message and f">= {compat.MINIMUM_TORCH_VERSION}" in message
    compat.check_torch_version(compat.MINIMUM_TORCH_VERSION)
    compat.check_torch_version(torch.__version__)
    with open(os.path.join(REPO_ROOT, "setup.py"), encoding="utf-8") as file:
        requirement = re.search(r'"torch>=([\d.]+)"', file.read())
    assert requirement is not None and requirement.group(1) == compat.MINIMUM_TORCH_VERSION


def test_recurrent_state_layers_are_the_installed_releases():
    """The DINT cache layers are transformers' recurrent-state layers: from 5.14 its own classes, with several states
    per layer (`number_of_states`, `state_idx`); the bridge gives 5.5 - 5.13 the same layout."""
    if INSTALLED >= (5, 14):
        assert compat.HAS_INDEXED_RECURRENT_STATES, changed(
            "transformers.cache_utils.LinearAttentionCacheLayerMixin.__init__(number_of_states)",
            "5.14 - 5.24",
            "a linear-attention layer no longer keeps several recurrent states",
        )
        assert compat.RecurrentStateAndFullAttentionLayer is cache_utils.LinearAttentionAndFullAttentionLayer
        assert compat.RecurrentStateAndStaticFullAttentionLayer is cache_utils.LinearAttentionAndStaticFullAttentionLayer
        parameters = list(inspect.signature(cache_utils.Cache.update_recurrent_state).parameters)
        assert parameters[:4] == ["self", "recurrent_states", "layer_idx", "state_idx"], changed(
            "transformers.cache_utils.Cache.update_recurrent_state", "5.14 - 5.24", f"its parameters are {parameters}"
        )
    assert issubclass(DintDynamicLayer, cache_utils.LinearAttentionCacheLayerMixin)
    assert issubclass(DintStaticLayer, cache_utils.LinearAttentionCacheLayerMixin)
    # The integral reads the DINT layers' states itself (`CacheIntegralState`), on every release; where transformers has
    # a Cache-level getter (5.23 on) it returns the same tensors.
    model = tiny_model()
    with torch.no_grad():
        cache = cache_of(model(torch.randint(2, 128, (2, 5)), use_cache=True))
    state_holder = CacheIntegralState(cache)
    for layer_idx, layer in enumerate(cache.layers):
        for state_idx, state in enumerate(layer.integral_state()):
            carried = state_holder.carried(layer_idx, state_idx)
            assert carried is state or (carried is None and state is None)
            if hasattr(cache_utils.Cache, "get_recurrent_state"):
                native = cache.get_recurrent_state(layer_idx, state_idx)
                assert native is state or (native is None and state is None), changed(
                    "transformers.cache_utils.Cache.get_recurrent_state", "5.23 - 5.24",
                    "it no longer returns a layer's state (None before its first update)",
                )


def test_compile_on_every_device_is_what_generate_reads():
    """`compile_on_every_device` sets `CompileConfig._compile_all_devices`, a private attribute that generate()'s
    compile criteria read: both must still be there."""
    from transformers import CompileConfig
    from transformers.generation.utils import GenerationMixin

    compile_config = release_bridges.compile_on_every_device(CompileConfig(fullgraph=True))
    assert compile_config._compile_all_devices is True
    assert "_compile_all_devices" in inspect.getsource(GenerationMixin._valid_auto_compile_criteria), changed(
        "transformers.generation.utils.GenerationMixin._valid_auto_compile_criteria", "5.5 - 5.24",
        "it no longer reads CompileConfig._compile_all_devices", module="release_bridges.py",
    )


def test_the_decoder_layer_runs_one_checkpointing_wrapper():
    """transformers wraps each decoder-layer subclass's `forward` for gradient checkpointing (5.24:
    `GradientCheckpointingLayer.__init_subclass__`, `functools.wraps`): DINT's layer runs Llama's forward under one
    wrapper, as Llama's own layer does, not two. Fails loudly when transformers changes how it wraps."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from modeling_dint.modeling_dint import DintDecoderLayer

    llama_forward = compat.unwrapped_forward(LlamaDecoderLayer)
    if LlamaDecoderLayer.forward is llama_forward:  # a release that does not wrap: nothing to unwrap
        assert DintDecoderLayer.forward is llama_forward
        return
    assert LlamaDecoderLayer.forward.__code__.co_name == "forward_with_checkpointing"
    assert DintDecoderLayer.forward.__code__.co_name == "forward_with_checkpointing"
    assert DintDecoderLayer.forward.__wrapped__ is llama_forward
    assert llama_forward.__code__.co_name != "forward_with_checkpointing"
    # checkpointing still works through the one wrapper: a training step with gradient checkpointing
    model = tiny_model()
    model.gradient_checkpointing_enable()
    model.train()
    input_ids = torch.randint(2, 128, (2, 12))
    model(input_ids, labels=input_ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
