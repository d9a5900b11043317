"""transformers' model contract, written down where DINT relies on it: what transformers' own common model tests
(`ModelTesterMixin`, `GenerationTesterMixin`) check of every built-in model, and compiled decoding."""

import pytest
import torch
import torch._dynamo
from dint_testing import LAYOUTS, V2, cache_of, diffllama_config_like, left_padded_batch, tiny_config, tiny_model, with_cache
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    CompileConfig,
    DiffLlamaForCausalLM,
    StaticCache,
)

from modeling_dint import (
    DintConfig,
    DintForCausalLM,
    DintForQuestionAnswering,
    DintForSequenceClassification,
    DintForTokenClassification,
    DintModel,
)
from modeling_dint.integrations.release_bridges import compile_on_every_device


MODEL_CLASSES = [DintModel, DintForCausalLM, DintForSequenceClassification, DintForTokenClassification,
                 DintForQuestionAnswering]
LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


# --- compiled decoding ---


@pytest.mark.parametrize(
    "integral, layout, lengths",
    [("mean", {}, (8, 5)), ("softmax", {}, (8, 5)), ("mean", V2, (8, 5)), ("mean", {}, (8,)), ("mean", V2, (8,))],
    ids=["v1-mean", "v1-softmax", "v2-mean", "v1-mean-one-prompt", "v2-mean-one-prompt"],
)
def test_compiled_static_cache_generation_compiles_the_decode_step_once(integral, layout, lengths):
    """generate() with a static cache and a compile config compiles the decode step once for the whole generation
    (with a 2D mask, which grows every step): any recompilation raises. A padded batch (a pad inside a row too), and
    one prompt: at batch 1 a view of the mask's last column keeps its growing row stride, which transformers 5.5 to
    5.17 pass to the step's masks and a compiled step guards on (it recompiled every step there)."""
    torch._dynamo.reset()
    model = tiny_model(integral=integral, **layout)
    input_ids, attention_mask = left_padded_batch(lengths=lengths)
    if len(lengths) > 1:
        attention_mask[1, -3] = 0  # and a pad inside a row
    generate_kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    expected = model.generate(input_ids, cache_implementation="static", **generate_kwargs)
    compile_config = compile_on_every_device(CompileConfig(fullgraph=True, dynamic=False))  # the CPU included
    torch._dynamo.utils.counters.clear()
    # torch's own patch restores the setting on exit (pytest's monkeypatch deletes it since pytest 9.2: torch keeps its
    # config values outside the module's __dict__)
    with torch._dynamo.config.patch(error_on_recompile=True):
        output = model.generate(
            input_ids, cache_implementation="static", compile_config=compile_config, **generate_kwargs
        )
    assert hasattr(model, "_compiled_call"), "generate() did not compile the forward"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the decode step (prefill runs eagerly)
    assert torch.equal(output, expected)


# --- static cache: the keys and values have a fixed length ---


def test_static_cache_has_the_fixed_length_of_its_keys_and_values():
    model = tiny_model()
    cache = StaticCache(config=model.config, max_cache_len=12)
    with torch.no_grad():
        model(torch.randint(2, 128, (1, 5)), **with_cache(cache))
    assert [layer.get_max_length() for layer in cache.layers] == [12, 12]
    assert cache.get_max_length() == 12
    assert cache.get_mask_sizes(1, 0) == (12, 0)
    assert cache.get_seq_length() == 5


def diffllama_like(model):
    """transformers' DiffLlama with the tiny DINT's head layout, eager attention (it returns the maps)."""
    config = model.config
    reference = DiffLlamaForCausalLM(diffllama_config_like(config)).eval()
    reference.config._attn_implementation = "eager"
    return reference


def static_generation_map_shapes(model, input_ids, **generate_kwargs):
    """The shapes of the attention maps of every step of a static-cache generate(), and the cache's max length."""
    cache = StaticCache(config=model.config, max_cache_len=12)  # longer than the 8 tokens generated
    with torch.no_grad():
        output = model.generate(
            input_ids, **with_cache(cache), max_new_tokens=3, do_sample=False, output_attentions=True,
            return_dict_in_generate=True, **generate_kwargs,
        )
    shapes = [[tuple(maps.shape) for maps in step] for step in output.attentions]
    return shapes, cache.get_max_length()


def assert_maps_span_the_static_cache(model, input_ids, **generate_kwargs):
    """What transformers' generation tests (`_check_attentions_for_generate`) check of a static cache: each step's maps
    have one key per slot of the cache, `cache.get_max_length()` of them, as DiffLlama's do."""
    shapes, max_length = static_generation_map_shapes(model, input_ids, **generate_kwargs)
    reference_shapes, reference_max_length = static_generation_map_shapes(
        diffllama_like(model), input_ids, **generate_kwargs
    )
    assert max_length == reference_max_length == 12
    assert shapes == reference_shapes
    heads = model.config.num_attention_heads
    assert shapes[0] == [(1, heads, input_ids.shape[1], 12)] * 2  # the prompt
    assert all(step == [(1, heads, 1, 12)] * 2 for step in shapes[1:])  # one token each


def test_static_cache_generation_returns_maps_over_the_cache_length():
    assert_maps_span_the_static_cache(tiny_model("eager"), torch.randint(2, 128, (1, 5)))


@pytest.mark.slow
def test_compiled_static_cache_generation_returns_maps_over_the_cache_length():
    torch._dynamo.reset()
    compile_config = compile_on_every_device(CompileConfig(fullgraph=True, dynamic=False))  # the CPU included
    model = tiny_model("eager")
    assert_maps_span_the_static_cache(model, torch.randint(2, 128, (1, 5)), compile_config=compile_config)
    assert hasattr(model, "_compiled_call"), "generate() did not compile the forward"


# --- dtypes: the lambda vectors stay fp32 ---


def test_keep_in_fp32_modules_lists_are_disjoint():
    """transformers' `test_keep_in_fp32_modules` requires a module to be in one list only."""
    for model_class in MODEL_CLASSES:
        model = model_class(tiny_config())
        assert not (model._keep_in_fp32_modules & model._keep_in_fp32_modules_strict), model_class.__name__
        assert set(LAMBDA_VECTORS) <= model._keep_in_fp32_modules_strict


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lambda_vectors_stay_fp32_in_half_precision_loads(tmp_path, dtype):
    DintForCausalLM(tiny_config()).save_pretrained(tmp_path)
    model = DintForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    for name, parameter in model.named_parameters():
        expected = torch.float32 if name.split(".")[-1] in LAMBDA_VECTORS else dtype
        assert parameter.dtype == expected, name


def build_under_default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return DintForCausalLM(tiny_config())
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda dtype: DintForCausalLM._from_config(tiny_config(), dtype=dtype), id="_from_config"),
        pytest.param(lambda dtype: AutoModelForCausalLM.from_config(tiny_config(), dtype=dtype), id="from_config"),
        pytest.param(build_under_default_dtype, id="default_dtype"),
    ],
)
def test_lambda_vectors_are_built_fp32_under_a_half_precision_default_dtype(build, dtype):
    """A strict-fp32 parameter is fp32 however the model is built: `from_config(..., dtype=...)` builds the model under
    that default dtype (transformers' `test_keep_in_fp32_modules_strict`), and the other weights follow it."""
    model = build(dtype).eval()
    for name, parameter in model.named_parameters():
        expected = torch.float32 if name.split(".")[-1] in LAMBDA_VECTORS else dtype
        assert parameter.dtype == expected, name
    input_ids = torch.randint(2, 128, (2, 6))
    with torch.no_grad():
        logits = model(input_ids).logits
        generated = model.generate(input_ids, max_new_tokens=3, do_sample=False)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert generated.shape == (2, 9)


# --- configuration ---


def test_config_round_trips(tmp_path):
    config = tiny_config(integral="softmax", lambda_init=0.5, head_norm_affine=False)
    assert DintConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    for reloaded in (DintConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert type(reloaded) is DintConfig
        saved, loaded = config.to_dict(), reloaded.to_dict()
        saved.pop("_name_or_path"), loaded.pop("_name_or_path")  # where it was loaded from
        assert loaded == saved
        assert reloaded.layer_types == config.layer_types


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_lambda_std_dev_is_refused(value):
    with pytest.raises(Exception, match="lambda_std_dev"):
        tiny_config(lambda_std_dev=value)


@pytest.mark.parametrize("model_class", MODEL_CLASSES)
def test_a_config_changed_after_construction_is_validated_when_a_model_is_built(model_class):
    config = tiny_config()
    config.integral = "sofmax"
    with pytest.raises(Exception, match="`integral` must be one of"):
        model_class(config)


# --- outputs ---


@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_shapes(layout):
    config = tiny_config(**layout)
    batch_size, length = 2, 7
    input_ids = torch.randint(2, config.vocab_size, (batch_size, length))
    model = tiny_model("eager", **layout)
    with torch.no_grad():
        output = model(input_ids, output_hidden_states=True, output_attentions=True, use_cache=True)
        last_logits = model(input_ids, logits_to_keep=1).logits
    assert output.logits.shape == (batch_size, length, config.vocab_size)
    assert last_logits.shape == (batch_size, 1, config.vocab_size)
    torch.testing.assert_close(last_logits[:, 0], output.logits[:, -1], atol=1e-5, rtol=1e-5)
    assert len(output.hidden_states) == config.num_hidden_layers + 1
    assert all(state.shape == (batch_size, length, config.hidden_size) for state in output.hidden_states)
    assert len(output.attentions) == config.num_hidden_layers
    assert all(maps.shape == (batch_size, config.num_attention_heads, length, length) for maps in output.attentions)
    cache = cache_of(output)
    assert len(cache.layers) == config.num_hidden_layers and cache.get_seq_length() == length
    key_shape = (batch_size, config.num_key_value_heads, length, config.head_dim)
    assert all(layer.keys.shape == key_shape and layer.values.shape == key_shape for layer in cache.layers)
    with torch.no_grad():  # as `output` (with a gradient, v2's query and lambda projections run as two products)
        as_tuple = model(input_ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], output.logits)
