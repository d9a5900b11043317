"""DINT on DIFF V2's layout (`differential_attention="v2"`, docs/design.md section 10): its config, DIFF V2 itself
(integral "none") against the formula written out here, Llama's KV cache, the attention maps, the parameter count.
The paths both layouts share (generation modes, padding, packing, training, remote code, serving) are parametrized
over both layouts in their own test files (`dint_testing.LAYOUTS`)."""

import pytest
import torch
from dint_testing import V2, cache_of, left_padded_batch, tiny_config, tiny_model, with_cache
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_dint import DintConfig, DintForCausalLM, dint_attention_map
from modeling_dint.configuration_dint import DINT_LAYER_TYPE, uses_one_pass_attention
from modeling_dint.modeling_dint import create_dint_masks


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(head_norm=True), "has no per-head RMSNorm: `head_norm` must be False"),
        (dict(lambda_init=0.5), "`lambda_init` must be None, got 0.5"),
        (dict(one_pass_attention=False), "`one_pass_attention` must be None"),
        (dict(head_norm_affine=False), r"no norm weight to leave out: `head_norm_affine` must be True .*got False"),
        (dict(differential_attention="v1", lambda_gate=True), "`lambda_gate=True` needs differential_attention='v2'"),
        (dict(num_key_value_heads=2, num_attention_heads=6, hidden_size=48), r"must divide num_attention_heads / 2 = 3"),
        (dict(differential_attention="v3"), r"`differential_attention` must be one of \('v1', 'v2'\), got 'v3'"),
    ],
)
def test_a_v2_config_that_asks_for_what_v2_has_not_is_refused_at_build(overrides, message):
    with pytest.raises(Exception, match=message):
        DintConfig(**{"differential_attention": "v2", **overrides})


def test_v2_defaults_one_kv_head_per_differential_head_and_no_head_norm(tmp_path):
    config = DintConfig(hidden_size=64, num_attention_heads=8, differential_attention="v2")
    # DIFF V2's head_dim: d = hidden / h, h = 4 output heads (2h = 8 query heads)
    assert (config.num_key_value_heads, config.head_norm, config.head_dim, config.differential_head_dim) == (
        4, False, 16, 16
    )
    assert config.lambda_gate is False
    config.save_pretrained(tmp_path)
    reloaded = DintConfig.from_pretrained(tmp_path)
    assert reloaded.differential_attention == "v2" and reloaded.head_norm is False and reloaded.head_dim == 16
    v1 = DintConfig(hidden_size=64, num_attention_heads=8)
    assert (v1.differential_attention, v1.head_norm, v1.num_key_value_heads, v1.differential_head_dim) == ("v1", True, 8, 16)
    assert uses_one_pass_attention(tiny_config(**V2))  # one attention call on every fast backend


def test_v2_parameters_are_diff_v2s():
    """q: hidden -> 2h*d, k/v: hidden -> KV*d, o: h*d -> hidden, lambda_proj: hidden -> h; no lambda vectors, no norm."""
    model = tiny_model(**V2)
    attention = model.model.layers[0].self_attn
    config = model.config
    hidden, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {name: tuple(parameter.shape) for name, parameter in attention.named_parameters()}
    assert shapes == {
        "q_proj.weight": (heads * d, hidden),
        "k_proj.weight": (kv * d, hidden),
        "v_proj.weight": (kv * d, hidden),
        "o_proj.weight": (hidden, heads // 2 * d),
        "lambda_proj.weight": (heads // 2, hidden),
    }


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", "flex_attention"])
def test_integral_none_is_diff_v2_written_out(attn_implementation):
    """DIFF V2 (unilm's multihead_flashdiffv2): one attention call over the 2h query heads and the KV heads (GQA),
    O1 = the even heads, O2 = the odd heads, out = o_proj(O1 - sigmoid(W_lambda x) * O2), no norm."""
    model = tiny_model(attn_implementation, integral="none", **{**V2, "num_attention_heads": 8, "num_key_value_heads": 2})
    layer = model.model.layers[1]
    attention = layer.self_attn
    batch_size, length = 2, 9
    hidden_states = torch.randn(batch_size, length, model.config.hidden_size)
    position_ids = torch.arange(length)[None].expand(batch_size, -1)
    cos, sin = model.model.rotary_emb(hidden_states, position_ids)

    def heads(projection, count):
        return projection(hidden_states).view(batch_size, length, count, -1).transpose(1, 2)

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]

    query, key, value = heads(attention.q_proj, 8), heads(attention.k_proj, 2), heads(attention.v_proj, 2)
    query, key = rotate(query), rotate(key)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    output = output.transpose(1, 2)  # [B, T, 2h, d]
    lambda_ = torch.sigmoid(hidden_states @ attention.lambda_proj.weight.T)[..., None]  # [B, T, h, 1]
    expected = attention.o_proj((output[:, :, 0::2] - lambda_ * output[:, :, 1::2]).reshape(batch_size, length, -1))

    attention_mask = create_dint_masks(model.config, hidden_states, None, None, position_ids)[DINT_LAYER_TYPE]
    with torch.no_grad():
        actual, _ = attention(hidden_states, (cos, sin), attention_mask, None)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_kv_cache_is_llamas_and_the_integral_state_is_h_by_d():
    """A v2 DINT and a Llama with the same hidden size, query heads (2h) and KV heads cache the same K/V tensors per
    token; the integral adds one `(h, d)` fp32 sum per layer and batch row, whatever the length."""
    model = tiny_model(**{**V2, "num_attention_heads": 8, "num_key_value_heads": 2})
    config = model.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=config.head_dim,
    )).eval()
    input_ids = torch.randint(2, 128, (3, 11))
    dint_cache = cache_of(model(input_ids, use_cache=True))
    llama_cache = cache_of(llama(input_ids, use_cache=True))
    for dint_layer, llama_layer in zip(dint_cache.layers, llama_cache.layers, strict=True):
        assert dint_layer.keys.shape == llama_layer.keys.shape == (3, 2, 11, config.head_dim)
        assert dint_layer.values.shape == llama_layer.values.shape
        assert dint_layer.signal_sum.shape == (3, 4, config.head_dim) and dint_layer.signal_sum.dtype == torch.float32


@pytest.mark.parametrize("integral", ["mean", "softmax", "none"])
def test_attention_maps_one_per_query_head_and_the_final_map(integral):
    """`output_attentions` gives the 2h maps, one per query head (signal and noise alternating); `dint_attention_map`
    composes A_final from them with the per-token lambda: causal, and every valid row sums to 1 (to 1 - lambda for
    DIFF V2, integral "none")."""
    model = tiny_model("eager", integral=integral, **V2)
    input_ids, attention_mask = left_padded_batch(lengths=(9, 5))
    with torch.no_grad():
        outputs = model(input_ids, attention_mask=attention_mask, output_attentions=True, output_hidden_states=True)
    layer = model.model.layers[1]
    maps = outputs.attentions[1]
    assert maps.shape == (2, model.config.num_attention_heads, 9, 9)
    with torch.no_grad():
        lambda_ = layer.self_attn.differential_lambda(layer.input_layernorm(outputs.hidden_states[1]))[..., 0]
    final = dint_attention_map(maps, lambda_, attention_mask, integral=integral, differential_attention="v2")
    assert final.shape == (2, model.config.num_attention_heads // 2, 9, 9)
    valid = attention_mask.bool()
    row_sums = final.sum(-1)  # [B, h, T]
    expected = torch.ones_like(row_sums) if integral != "none" else 1 - lambda_.transpose(1, 2)
    torch.testing.assert_close(row_sums.transpose(1, 2)[valid], expected.transpose(1, 2)[valid], atol=1e-5, rtol=1e-5)
    assert torch.all(final.triu(diagonal=1) == 0)


def test_one_forward_equals_the_decoding_steps_on_flex_attention():
    """flex_attention (the backend whose block mask DINT's v1 one-pass uses) serves v2's one call too: a prompt, then
    tokens one at a time, equal one forward. The prompt is 9 tokens long so that no decoding step attends to exactly
    8 keys: torch 2.13's compiled CPU flex_attention with grouped KV heads is wrong there (transformers' Llama too:
    on a 2-core AMD EPYC the step at 8 keys differs by 0.26 in the logits, every time; elsewhere now and then)."""
    sdpa, flex = tiny_model("sdpa", **V2), tiny_model("flex_attention", **V2)
    input_ids = torch.randint(2, 128, (2, 14))
    prompt_length = 9
    with torch.no_grad():
        full = sdpa(input_ids).logits
        torch.testing.assert_close(flex(input_ids).logits, full, atol=1e-5, rtol=1e-5)
        prompt = flex(input_ids[:, :prompt_length], use_cache=True)
        cache = cache_of(prompt)
        steps = [prompt.logits] + [
            flex(input_ids[:, t : t + 1], **with_cache(cache), use_cache=True).logits
            for t in range(prompt_length, input_ids.shape[1])
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_v2_tiny_preset_builds():
    config = DintConfig.from_preset("tiny-v2")
    assert config.differential_attention == "v2" and config.head_norm is False
    model = DintForCausalLM(config)
    assert model(torch.randint(0, config.vocab_size, (1, 5))).logits.shape == (1, 5, config.vocab_size)


def test_a_saved_v2_config_keeps_its_head_dim(tmp_path):
    """Configs saved before the v2 default became DIFF V2's (hidden / (2h) then) carry their head_dim: they load as
    they were saved."""
    DintConfig(hidden_size=64, num_attention_heads=8, head_dim=8, differential_attention="v2").save_pretrained(tmp_path)
    assert '"head_dim": 8' in (tmp_path / "config.json").read_text()
    reloaded = DintConfig.from_pretrained(tmp_path)
    assert reloaded.head_dim == 8
    assert DintForCausalLM(reloaded).model.layers[0].self_attn.q_proj.weight.shape == (8 * 8, 64)


def test_lambda_gate_multiplies_lambda_per_head_and_is_saved_in_fp32(tmp_path):
    """`lambda_gate=True`: lambda = gate * sigmoid(lambda_proj(x)), one gate per differential head, 1 when built from
    scratch, saved and reloaded, fp32 in a bf16 load (as v1's lambda vectors)."""
    model = DintForCausalLM(tiny_config(**V2, lambda_gate=True)).eval()
    attention = model.model.layers[0].self_attn
    assert torch.equal(attention.lambda_gate.weight, torch.ones(model.config.num_attention_heads // 2))
    with torch.no_grad():
        attention.lambda_gate.weight.copy_(torch.tensor([0.0, -0.5]))
    hidden_states = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        expected = torch.sigmoid(hidden_states @ attention.lambda_proj.weight.T) * torch.tensor([0.0, -0.5])
        torch.testing.assert_close(attention.differential_lambda(hidden_states)[..., 0], expected)
    model.save_pretrained(tmp_path)
    reloaded = DintForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    gate = reloaded.model.layers[0].self_attn.lambda_gate.weight
    assert reloaded.config.lambda_gate is True and gate.dtype == torch.float32
    assert torch.equal(gate, torch.tensor([0.0, -0.5]))
    without_gate = DintForCausalLM(tiny_config(**V2))
    assert without_gate.model.layers[0].self_attn.lambda_gate is None
    assert not any("lambda_gate" in name for name in without_gate.state_dict())
