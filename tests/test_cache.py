"""The cache's integral state stays consistent: a refused operation changes nothing, a cache that cannot carry this
model's statistics is refused with the reason, and beam search reorders the static cache's state."""

import pytest
import torch
from dint_testing import cache_of, tiny_config, tiny_model, with_cache
from transformers import DynamicCache, StaticCache

from modeling_dint import DintConfig
from modeling_dint.transformers_compat import HAS_CACHE_LAYER_REGISTRY


def cache_lengths(cache):
    return [layer.keys.shape[-2] for layer in cache.layers]


def integral_states(cache):
    return [[None if state is None else state.clone() for state in layer.integral_state()] for layer in cache.layers]


def test_a_refused_crop_changes_nothing():
    model = tiny_model()
    input_ids = torch.randint(2, 128, (1, 7))
    with torch.no_grad():
        cache = cache_of(model(input_ids[:, :5], use_cache=True))
        for layer in cache.layers:  # (`Cache.activate_past_recording` exists from transformers 5.14)
            layer.activate_past_recording()
        model(input_ids[:, 5:], **with_cache(cache))  # 2 recorded rows
    lengths, states = cache_lengths(cache), integral_states(cache)
    with pytest.raises(ValueError, match="Cannot crop 3 tokens"):
        cache.crop(-3)
    assert cache_lengths(cache) == lengths == [7, 7]
    for before, after in zip(states, integral_states(cache)):
        for state_before, state_after in zip(before, after):
            assert (state_before is None and state_after is None) or torch.equal(state_before, state_after)
    cache.crop(-2)  # what was recorded can still be rolled back
    assert cache_lengths(cache) == [5, 5]


@pytest.mark.parametrize(
    "filled_by, continued_by, message",
    [
        (dict(integral="none"), dict(integral="mean"), "filled by a model with integral='none'"),
        (dict(integral="mean"), dict(integral="none"), "filled by a model with integral='mean'"),
        (dict(integral="mean"), dict(integral="mean", attn_implementation="eager"), "the fast path"),
        (dict(integral="softmax"), dict(integral="mean"), "filled by a model with integral='softmax'"),
    ],
)
def test_a_cache_of_another_integral_mode_or_path_is_refused(filled_by, continued_by, message):
    input_ids = torch.randint(2, 128, (1, 6))
    with torch.no_grad():
        cache = cache_of(tiny_model(**filled_by)(input_ids[:, :4], use_cache=True))
        lengths = cache_lengths(cache)
        with pytest.raises(ValueError, match=message):
            tiny_model(**continued_by)(input_ids[:, 4:], **with_cache(cache))
    assert cache_lengths(cache) == lengths


def test_a_cache_with_fewer_dint_layers_than_the_model_is_refused():
    model = tiny_model()
    smaller = DintConfig(**{**model.config.to_dict(), "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="1 DINT layers and the model 2"):
        model(torch.randint(2, 128, (1, 4)), **with_cache(DynamicCache(config=smaller)))


def test_a_cache_holding_tokens_without_integral_statistics_is_refused():
    model = tiny_model()
    cache = DynamicCache(config=model.config)
    for layer_idx in range(model.config.num_hidden_layers):  # what a model that is not DINT would write
        keys = values = torch.zeros(1, 2, 3, model.config.head_dim)
        cache.update(keys, values, layer_idx)
    # Before transformers 5.14 `DynamicCache(config=...)` builds plain layers (the compat module swaps them for DINT
    # layers only while they are empty): a filled one is refused as a cache without DINT statistics.
    message = "holds 3 tokens but no integral statistics" if HAS_CACHE_LAYER_REGISTRY else "has none"
    with pytest.raises(ValueError, match=message):
        model(torch.randint(2, 128, (1, 4)), **with_cache(cache))


@pytest.mark.parametrize("integral", ["mean", "softmax"])
def test_beam_search_with_a_static_cache_equals_beam_search_without_a_cache(integral):
    """Beams that change places move their integral state along (`DintStaticLayer.reorder_cache`)."""
    model = tiny_model(integral=integral)
    input_ids = torch.randint(2, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(
        max_new_tokens=8, num_beams=4, num_return_sequences=2, do_sample=False, early_stopping=False,
        return_dict_in_generate=True, output_scores=True,
    )
    with torch.no_grad():
        reference = model.generate(input_ids, use_cache=False, **kwargs)
        static = model.generate(input_ids, cache_implementation="static", **kwargs)
    steps = torch.arange(reference.beam_indices.shape[-1])
    beam_changed_place = (reference.beam_indices[:, 1:] % 4 != reference.beam_indices[:, :-1] % 4).any()
    assert beam_changed_place and steps.numel() > 1, "no beam changed place: the test would not cover reorder_cache"
    assert torch.equal(static.sequences, reference.sequences)
    # Equal to the last bit here; 1e-6 catches a state left in place (softmax: 2.5e-5, mean: 2e-3 off).
    torch.testing.assert_close(static.sequences_scores, reference.sequences_scores, atol=1e-6, rtol=0)


def test_a_static_cache_is_never_cropped_silently():
    """transformers 5.24 gives `StaticLayer` a crop that rewinds K/V only, and lets assisted and prompt-lookup decoding
    crop a static cache: a DINT static cache says it cannot be cropped and refuses, so generate() never continues from
    K/V rolled back without the integral statistics (before 5.24 generate() refuses static caches there itself)."""
    model = tiny_model()
    input_ids = torch.randint(2, 128, (1, 9))
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=32)
        model(input_ids[:, :6], **with_cache(cache))
    assert not any(getattr(layer, "is_croppable", False) for layer in cache.layers)
    lengths, states = cache.get_seq_length(), integral_states(cache)
    with pytest.raises(ValueError, match="DINT static cache cannot be cropped"):
        cache.layers[0].crop(-2)
    assert cache.get_seq_length() == lengths
    for before, after in zip(states, integral_states(cache)):
        assert all(torch.equal(a, b) for a, b in zip(before, after) if a is not None)
    with torch.no_grad(), pytest.raises((ValueError, TypeError, RuntimeError)):
        model.generate(
            input_ids, **with_cache(StaticCache(config=model.config, max_cache_len=64)), prompt_lookup_num_tokens=3,
            max_new_tokens=6, do_sample=False,
        )


def test_trainer_evaluation_drops_the_cache_from_the_outputs(tmp_path):
    """With `use_cache=True` the model output carries the cache (`cache` from transformers 5.24, `past_key_values`
    before); `keys_to_ignore_at_inference` names both, so Trainer's prediction loop never tries to gather it."""
    from transformers import Trainer, TrainingArguments

    from modeling_dint import DintForSequenceClassification

    model = DintForSequenceClassification(tiny_config(num_labels=3, use_cache=True))
    data = [{"input_ids": torch.randint(2, 128, (8,)), "labels": torch.tensor(i % 3)} for i in range(4)]
    # (from 5.24 Trainer sets the model's `use_cache` from its arguments)
    cache_argument = {"use_cache": True} if "use_cache" in TrainingArguments.__dataclass_fields__ else {}
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[], use_cpu=True, **cache_argument
    )
    predictions = Trainer(model=model, args=args).predict(data)
    assert predictions.predictions.shape == (4, 3)
