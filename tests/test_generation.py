"""KV-cache-aware integral statistics: every generate() mode gives the tokens and logits of full recomputation."""

import io
import contextlib

import pytest
import torch
from dint_testing import LAYOUTS, cache_of, left_padded_batch, tiny_model, with_cache
from transformers import DynamicCache, StaticCache

from modeling_dint import DintDynamicLayer, dint_attention_map
from modeling_dint.integrations.release_bridges import GENERATE_RECORDS_PAST_FOR_CROP


INTEGRALS = ["mean", "softmax"]
BACKENDS = ["sdpa", "eager"]
NEW_TOKENS = 8


def repetitive_prompt(batch_size: int = 1):
    """A prompt whose n-grams repeat, so that prompt-lookup decoding proposes candidates (and crops rejected ones)."""
    return torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]] * batch_size)


def assert_step_logits_match_full_forward(model, output, prompt_length, attention_mask=None):
    """The logits of each cached decoding step equal those of one forward over the final sequence."""
    sequences = output.sequences
    if attention_mask is not None:
        attention_mask = torch.cat(
            [attention_mask, attention_mask.new_ones(sequences.shape[0], sequences.shape[1] - prompt_length)], dim=-1
        )
    with torch.no_grad():
        full_logits = model(sequences, attention_mask=attention_mask).logits
    assert len(output.logits) == sequences.shape[1] - prompt_length
    for step, step_logits in enumerate(output.logits):
        torch.testing.assert_close(step_logits, full_logits[:, prompt_length - 1 + step], atol=1e-5, rtol=1e-5)


def generate_pair(model, input_ids, seed=0, **kwargs):
    """generate() with the cache and without it, from the same random state."""
    torch.manual_seed(seed)
    cached = model.generate(input_ids, max_new_tokens=NEW_TOKENS, use_cache=True, **kwargs)
    torch.manual_seed(seed)
    kwargs.pop("prompt_lookup_num_tokens", None)
    kwargs.pop("prefill_chunk_size", None)
    kwargs.pop("cache_implementation", None)
    uncached = model.generate(input_ids, max_new_tokens=NEW_TOKENS, use_cache=False, **kwargs)
    return cached, uncached


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn_implementation", BACKENDS)
@pytest.mark.parametrize("integral", INTEGRALS)
@pytest.mark.parametrize(
    "mode, generate_kwargs",
    [
        ("greedy", dict(do_sample=False)),
        ("sampling", dict(do_sample=True, top_k=0, temperature=1.0)),
        pytest.param(
            "prompt_lookup",
            dict(do_sample=False, prompt_lookup_num_tokens=3),
            marks=pytest.mark.skipif(
                not GENERATE_RECORDS_PAST_FOR_CROP, reason="transformers < 5.14 crops without recording past states"
            ),
        ),
        ("prefill_chunks", dict(do_sample=False, prefill_chunk_size=3)),
        ("static_cache", dict(do_sample=False, cache_implementation="static")),
    ],
)
def test_decoding_mode_matches_recomputation(attn_implementation, integral, mode, generate_kwargs, monkeypatch, layout):
    model = tiny_model(attn_implementation, integral=integral, **layout)
    input_ids = repetitive_prompt()
    crops = []
    original_crop = DintDynamicLayer.crop
    monkeypatch.setattr(DintDynamicLayer, "crop", lambda self, n: (crops.append(n), original_crop(self, n))[1])
    cached, uncached = generate_pair(
        model, input_ids, return_dict_in_generate=True, output_logits=True, **generate_kwargs
    )
    assert torch.equal(cached.sequences, uncached.sequences)
    assert cached.sequences.shape[1] == input_ids.shape[1] + NEW_TOKENS
    assert_step_logits_match_full_forward(model, cached, input_ids.shape[1])
    if mode == "prompt_lookup":
        assert any(n < 0 for n in crops), "prompt lookup never rolled the cache back: the test would not cover crop"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn_implementation", BACKENDS)
@pytest.mark.parametrize("integral", INTEGRALS)
def test_left_padded_batch_of_different_lengths(attn_implementation, integral, layout):
    model = tiny_model(attn_implementation, integral=integral, **layout)
    input_ids, attention_mask = left_padded_batch(lengths=(9, 4, 6))
    cached, uncached = generate_pair(
        model, input_ids, attention_mask=attention_mask, do_sample=False, return_dict_in_generate=True,
        output_logits=True,
    )
    assert torch.equal(cached.sequences, uncached.sequences)
    assert_step_logits_match_full_forward(model, cached, input_ids.shape[1], attention_mask)
    # Each padded prompt generates what it generates alone.
    for row, length in enumerate((9, 4, 6)):
        alone = model.generate(input_ids[row : row + 1, 9 - length :], max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(alone[0, length:], cached.sequences[row, 9:])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn_implementation", BACKENDS)
@pytest.mark.parametrize("integral", INTEGRALS)
def test_beam_search(attn_implementation, integral, layout):
    model = tiny_model(attn_implementation, integral=integral, **layout)
    input_ids, attention_mask = left_padded_batch(lengths=(7, 5))
    kwargs = dict(
        attention_mask=attention_mask, num_beams=3, num_return_sequences=2, do_sample=False,
        return_dict_in_generate=True, output_scores=True,
    )
    cached, uncached = generate_pair(model, input_ids, **kwargs)
    assert cached.sequences.shape == (4, 7 + NEW_TOKENS)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn_implementation", BACKENDS)
@pytest.mark.parametrize("integral", INTEGRALS)
def test_user_cache_continued_across_two_generate_calls(attn_implementation, integral, layout):
    model = tiny_model(attn_implementation, integral=integral, **layout)
    input_ids = torch.randint(2, 128, (1, 6))
    cache = DynamicCache(config=model.config)
    first = model.generate(input_ids, **with_cache(cache), max_new_tokens=NEW_TOKENS, do_sample=False)
    follow_up = torch.cat([first, torch.randint(2, 128, (1, 3))], dim=-1)
    second = model.generate(
        follow_up, **with_cache(cache), max_new_tokens=NEW_TOKENS, do_sample=False,
        return_dict_in_generate=True, output_logits=True,
    )
    reference = model.generate(follow_up, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=False)
    assert torch.equal(second.sequences, reference)
    assert_step_logits_match_full_forward(model, second, follow_up.shape[1])


@pytest.mark.parametrize("integral", INTEGRALS)
def test_generated_attention_rows_sum_to_one_at_every_step(integral):
    model = tiny_model("eager", integral=integral)
    input_ids, attention_mask = left_padded_batch(lengths=(6, 4))
    output = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False,
        output_attentions=True, return_dict_in_generate=True,
    )
    prompt_length, total = input_ids.shape[1], output.sequences.shape[1] - 1
    full_mask = torch.cat([attention_mask, attention_mask.new_ones(2, total - prompt_length)], dim=-1)
    for layer_index, layer in enumerate(model.model.layers):
        # Rows of all steps, gathered into one [B, H, N, N] map: the prefill rows, then one row per new token.
        maps = torch.zeros(2, model.config.num_attention_heads, total, total)
        maps[:, :, :prompt_length, :prompt_length] = output.attentions[0][layer_index]
        for step, step_attentions in enumerate(output.attentions[1:]):
            row = prompt_length + step
            maps[:, :, row : row + 1, : row + 1] = step_attentions[layer_index]
        final = dint_attention_map(maps, layer.self_attn.lambda_full(), full_mask, integral=integral)
        row_sums = final.sum(-1)[full_mask.bool()[:, None, :].expand(-1, final.shape[1], -1)]
        torch.testing.assert_close(row_sums, torch.ones_like(row_sums), atol=1e-5, rtol=0)
        with torch.no_grad():
            recomputed = model(output.sequences[:, :total], attention_mask=full_mask, output_attentions=True)
        valid = full_mask.bool()[:, None, :, None]
        torch.testing.assert_close(
            maps.masked_fill(~valid, 0), recomputed.attentions[layer_index].masked_fill(~valid, 0), atol=1e-6, rtol=0
        )


def integral_state_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for state in layer.integral_state():
            if state is not None:
                total += state.numel() * state.element_size()
    return total


@pytest.mark.parametrize("attn_implementation", BACKENDS)
@pytest.mark.parametrize("integral", INTEGRALS)
def test_prefill_leaves_only_the_last_row_in_the_cache(attn_implementation, integral):
    """After a prompt, each cache layer holds a copy of the running sums' last row: a view would keep the whole
    running tensor of the prompt alive (O(T) per layer, O(T^2) for the column sums)."""
    model = tiny_model(attn_implementation, integral=integral)
    with torch.no_grad():
        cache = cache_of(model(torch.randint(2, 128, (2, 64)), use_cache=True))
    for layer in cache.layers:
        states = [state for state in layer.integral_state() if state is not None]
        assert states
        for state in states:
            assert state.untyped_storage().nbytes() == state.numel() * state.element_size()


def test_mean_state_does_not_grow_with_the_sequence():
    model = tiny_model("sdpa", integral="mean")
    sizes = []
    for new_tokens in (4, 40):
        cache = DynamicCache(config=model.config)
        model.generate(torch.randint(2, 128, (2, 16)), **with_cache(cache), max_new_tokens=new_tokens, do_sample=False)
        sizes.append(integral_state_bytes(cache))
        layer = cache.layers[0]
        assert layer.signal_sum.shape == (2, 2, 2 * model.config.head_dim) and layer.signal_sum.dtype == torch.float32
        assert layer.query_count.shape == (2,) and layer.column_sums is None
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn_implementation", BACKENDS)
def test_batch_operations_carry_the_integral_state(attn_implementation, layout):
    model = tiny_model(attn_implementation, **layout)
    input_ids, attention_mask = left_padded_batch(lengths=(7, 5))
    next_tokens = torch.randint(2, 128, (2, 1))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids, attention_mask=attention_mask, **with_cache(cache))
        cache.batch_repeat_interleave(2)
        cache.reorder_cache(torch.tensor([3, 2, 1, 0]))
        cache.batch_select_indices(torch.tensor([0, 3]))  # rows 1 and 0 of the original batch
        order = torch.tensor([1, 0])
        full_mask = torch.cat([attention_mask[order], attention_mask.new_ones(2, 1)], dim=-1)
        step = model(next_tokens, attention_mask=full_mask, **with_cache(cache)).logits
        full = model(torch.cat([input_ids[order], next_tokens], dim=-1), attention_mask=full_mask).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn_implementation", BACKENDS)
def test_crop_rolls_back_recorded_tokens_and_refuses_more(attn_implementation, layout):
    model = tiny_model(attn_implementation, **layout)
    input_ids = torch.randint(2, 128, (1, 10))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids[:, :6], **with_cache(cache))
        for layer in cache.layers:  # per layer: `Cache.activate_past_recording` exists from transformers 5.14
            layer.activate_past_recording()
        model(input_ids[:, 6:9], **with_cache(cache))
        cache.crop(-2)  # back to 7 tokens
        assert cache.get_seq_length() == 7
        step = model(input_ids[:, 7:8], **with_cache(cache)).logits
        full = model(input_ids[:, :8]).logits
        torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
        # The recording restarted at the crop: one recorded token now, so two cannot be rolled back.
        with pytest.raises(ValueError, match="rolled back only over the 1 tokens recorded"):
            cache.crop(-2)
        with pytest.raises(ValueError, match="takes 0 or a negative number"):
            cache.crop(3)


def test_bare_dynamic_cache_is_refused_with_the_fix():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"built without a config.*DynamicCache\(config=model.config\)"):
        model(torch.randint(2, 128, (1, 5)), **with_cache(DynamicCache()))


def test_static_cache_built_by_the_user():
    model = tiny_model()
    input_ids = torch.randint(2, 128, (1, 9))
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(input_ids[:, :6], **with_cache(cache))
        steps = [model(input_ids[:, t : t + 1], **with_cache(cache)).logits for t in range(6, 9)]
        full = model(input_ids).logits
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.layers[0].query_count is None  # no state until the next update
        state_addresses = [state.data_ptr() for state in cache.layers[0].recurrent_states.values() if state is not None]
        assert all(state.abs().sum() == 0 for state in cache.layers[0].recurrent_states.values() if state is not None)
        # After reset the cache serves a new prompt as a new cache would, in the same (static) state tensors
        restarted = [model(input_ids[:, :6], **with_cache(cache)).logits]
        restarted += [model(input_ids[:, t : t + 1], **with_cache(cache)).logits for t in range(6, 9)]
        assert [state.data_ptr() for state in cache.layers[0].recurrent_states.values() if state is not None] == (
            state_addresses
        )
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(restarted, dim=1), full, atol=1e-5, rtol=1e-5)


def test_pipeline_and_text_streamer():
    from transformers import AutoTokenizer, TextStreamer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(
        __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "examples", "data", "tokenizer")
    )
    model = tiny_model(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    prompt = "To be, or not to be"
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected_text = tokenizer.decode(expected[0], skip_special_tokens=True)

    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    result = generator(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert result[0]["generated_text"] == expected_text

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        streamed = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=TextStreamer(tokenizer))
    assert torch.equal(streamed, expected)
    assert printed.getvalue().strip() == expected_text.strip()


@pytest.mark.slow
def test_compiled_decode_step_with_static_cache_matches_eager():
    """torch.compile(fullgraph=True) of the decode step with the static cache: no graph break, the same logits."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model("sdpa")
    input_ids = torch.randint(2, 128, (2, 10))
    with torch.no_grad():
        full = model(input_ids).logits
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(input_ids[:, :6], **with_cache(cache))
        decode_step = torch.compile(model.forward, fullgraph=True, dynamic=False)
        steps = [
            decode_step(input_ids[:, t : t + 1], **with_cache(cache), position_ids=torch.full((2, 1), t)).logits
            for t in range(6, 10)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 6:], atol=1e-5, rtol=1e-5)
