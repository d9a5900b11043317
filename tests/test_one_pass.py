"""The one-pass fast path (issue 20): one attention call over each KV head's 2*head_dim-wide V gives the logits of the
two calls over the halves of V (DiffLlama's way) and of the eager reference, with padding, packed sequences and a
cache; `one_pass_attention` decides it once per model."""

import pytest
import torch
from dint_testing import cache_of, left_padded_batch, tiny_config, tiny_model, with_cache

from modeling_dint import DintConfig
from modeling_dint.configuration_dint import uses_one_pass_attention


def path_config(attn_implementation, **overrides):
    config = tiny_config(**overrides)
    config._attn_implementation = attn_implementation
    return config


@pytest.mark.parametrize(
    "attn_implementation, one_pass_attention, integral, expected",
    [
        ("flex_attention", None, "mean", True),  # the default: one pass where the backend is flex_attention
        ("flex_attention", None, "none", True),
        ("flex_attention", False, "mean", False),
        ("sdpa", None, "mean", False),  # sdpa's CPU kernel takes a wider V only in its slow math kernel
        ("sdpa", True, "mean", True),
        ("eager", True, "mean", False),  # the materializing path builds the maps
        ("flex_attention", True, "softmax", False),  # "softmax" always materializes
    ],
)
def test_the_config_decides_one_pass(attn_implementation, one_pass_attention, integral, expected):
    config = path_config(attn_implementation, one_pass_attention=one_pass_attention, integral=integral)
    assert uses_one_pass_attention(config) is expected


def test_one_pass_with_a_backend_without_a_wider_value_is_refused():
    config = path_config("flash_attention_2", one_pass_attention=True)
    with pytest.raises(ValueError, match=r"one_pass_attention=True.*'flash_attention_2'.*Allowed"):
        uses_one_pass_attention(config)


def test_one_pass_attention_must_be_none_or_a_bool():
    with pytest.raises(Exception, match="one_pass_attention"):
        DintConfig(one_pass_attention="yes")


def logits_of(model, **inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("integral", ["mean", "none", "softmax"])
def test_one_pass_equals_two_calls_and_eager_with_padding(integral):
    input_ids, attention_mask = left_padded_batch(lengths=(11, 6))
    valid = attention_mask.bool()
    one_pass = tiny_model("flex_attention", integral=integral)
    assert uses_one_pass_attention(one_pass.config) is (integral != "softmax")
    two_calls = tiny_model("flex_attention", integral=integral, one_pass_attention=False)
    eager = tiny_model("eager", integral=integral)
    for inputs in ({"input_ids": input_ids}, {"input_ids": input_ids, "attention_mask": attention_mask}):
        expected = logits_of(eager, **inputs)
        actual = logits_of(one_pass, **inputs)
        rows = valid if "attention_mask" in inputs else torch.ones_like(valid)
        torch.testing.assert_close(actual[rows], logits_of(two_calls, **inputs)[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(actual[rows], expected[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("integral", ["mean", "none"])
def test_one_pass_sdpa_equals_two_calls(integral):
    input_ids, attention_mask = left_padded_batch(lengths=(9, 5))
    valid = attention_mask.bool()
    one_pass = tiny_model("sdpa", integral=integral, one_pass_attention=True)
    two_calls = tiny_model("sdpa", integral=integral)
    expected = logits_of(two_calls, input_ids=input_ids, attention_mask=attention_mask)
    actual = logits_of(one_pass, input_ids=input_ids, attention_mask=attention_mask)
    torch.testing.assert_close(actual[valid], expected[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("integral", ["mean", "none"])
def test_one_pass_packed_sequences_equal_each_document_alone(integral):
    """Two documents packed in one row (position ids restart at 0): each document's logits are those of the document
    alone, and equal the eager reference on the packed row."""
    one_pass = tiny_model("flex_attention", integral=integral)
    eager = tiny_model("eager", integral=integral)
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(2, 128, (1, 7), generator=generator)
    second = torch.randint(2, 128, (1, 5), generator=generator)
    packed = torch.cat([first, second], dim=-1)
    position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None]
    actual = logits_of(one_pass, input_ids=packed, position_ids=position_ids)
    expected = logits_of(eager, input_ids=packed, position_ids=position_ids)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual[:, :7], logits_of(one_pass, input_ids=first), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual[:, 7:], logits_of(one_pass, input_ids=second), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("integral", ["mean", "none"])
def test_one_pass_cached_decoding_equals_the_full_forward(integral):
    """A prompt fills the cache in one pass, then tokens one at a time: each step's logits equal the full forward's
    (no padding mask: torch 2.13's CPU inductor fails to compile the flex decode kernel with one, for every model and
    for both the one-pass and the two-call path, see docs/performance.md). The prompt is not 8 tokens long: torch
    2.13's compiled CPU flex_attention with grouped KV heads returns NaN now and then for exactly 8 queries and keys
    (for Llama too)."""
    model = tiny_model("flex_attention", integral=integral)
    input_ids = torch.randint(2, 128, (2, 13), generator=torch.Generator().manual_seed(4))
    prompt_length = 9
    full = logits_of(model, input_ids=input_ids)
    with torch.no_grad():
        output = model(input_ids[:, :prompt_length], use_cache=True)
        torch.testing.assert_close(output.logits, full[:, :prompt_length], atol=1e-5, rtol=1e-5)
        cache = cache_of(output)
        for position in range(prompt_length, input_ids.shape[1]):
            step = model(input_ids[:, position : position + 1], **with_cache(cache), use_cache=True)
            torch.testing.assert_close(step.logits[:, 0], full[:, position], atol=1e-5, rtol=1e-5, msg=f"{position}")
