"""DINT attention against the paper's formulas: row sums, causality, backends, padding, DiffLlama, gradients."""

import math

import pytest
import torch
from dint_testing import left_padded_batch, tiny_config, tiny_model
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

from modeling_dint import DintForCausalLM, dint_attention_map
from modeling_dint.modeling_dint import DintAttention, DintRotaryEmbedding, dint_query_layout


INTEGRALS = ["mean", "softmax", "none"]


def naive_dint_attention(attention: DintAttention, hidden_states, position_embeddings, query_valid, document_id):
    """The paper's formulas, row by row, O(N^2), from the module's weights (independent of the package's math)."""
    batch_size, length, _ = hidden_states.shape
    num_heads, head_dim = attention.num_heads, attention.head_dim
    num_kv_heads = attention.config.num_key_value_heads
    queries = attention.q_proj(hidden_states).view(batch_size, length, num_heads, head_dim).transpose(1, 2)
    keys = attention.k_proj(hidden_states).view(batch_size, length, num_kv_heads, head_dim).transpose(1, 2)
    values = attention.v_proj(hidden_states).view(batch_size, length, num_kv_heads, head_dim).transpose(1, 2)
    cos, sin = position_embeddings

    def rotate(x):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    queries, keys = rotate(queries), rotate(keys)
    group = num_heads // num_kv_heads
    lambda_full = (
        math.exp(float(attention.lambda_q1 @ attention.lambda_k1))
        - math.exp(float(attention.lambda_q2 @ attention.lambda_k2))
        + attention.lambda_init
    )
    half = num_heads // 2
    outputs = torch.zeros(batch_size, length, half, 2 * head_dim, dtype=torch.float64)
    for b in range(batch_size):
        allowed = torch.zeros(length, length, dtype=torch.bool)
        for n in range(length):
            for m in range(n + 1):
                allowed[n, m] = bool(query_valid[b, m]) and document_id[b, m] == document_id[b, n]
        for j in range(half):
            maps = []
            for head in (j, j + half):
                scores = queries[b, head].double() @ keys[b, head // group].double().T / math.sqrt(head_dim)
                scores = scores.masked_fill(~allowed, float("-inf"))
                maps.append(torch.nan_to_num(torch.softmax(scores, dim=-1)))
            signal_map, noise_map = maps
            integral_map = torch.zeros_like(signal_map)
            for n in range(length):
                rows = [m for m in range(n + 1) if query_valid[b, m] and document_id[b, m] == document_id[b, n]]
                if rows:
                    integral_map[n] = signal_map[rows].mean(dim=0)
                if attention.integral == "softmax":
                    support = allowed[n]
                    if support.any():
                        integral_map[n] = torch.softmax(integral_map[n].masked_fill(~support, float("-inf")), dim=-1)
            if attention.integral == "none":
                final_map = signal_map - lambda_full * noise_map
            else:
                final_map = signal_map - lambda_full * noise_map + lambda_full * integral_map
            kv_head = j // group
            head_values = torch.cat([values[b, kv_head], values[b, num_kv_heads // 2 + kv_head]], dim=-1).double()
            outputs[b, :, j] = final_map @ head_values
    outputs = attention.head_norm(outputs.float())
    return attention.o_proj(outputs.reshape(batch_size, length, -1))


@pytest.mark.parametrize("integral", INTEGRALS)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_attention_matches_naive_paper_formulas(integral, attn_implementation):
    model = tiny_model(attn_implementation, integral=integral)
    config = model.config
    attention = model.model.layers[1].self_attn
    input_ids, attention_mask = left_padded_batch(lengths=(7, 4))
    # Row 0 is a packed row: two documents, positions restart at 0.
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 0, 0, 0, 1, 2, 3]])
    attention_mask[0] = 1
    hidden_states = torch.randn(2, 7, config.hidden_size)
    position_embeddings = DintRotaryEmbedding(config)(hidden_states, position_ids)
    document_id = (position_ids == 0).long().cumsum(-1)
    query_valid = attention_mask.bool()

    # Padding and packing together, as a 4D boolean mask written out explicitly.
    mask = (
        torch.ones(7, 7, dtype=torch.bool).tril()[None]
        & query_valid[:, None, :]
        & (document_id[:, :, None] == document_id[:, None, :])
    )[:, None]
    query_valid_from_mask, document_start = dint_query_layout(mask, position_ids, 2, 7)
    assert torch.equal(query_valid_from_mask, query_valid)
    with torch.no_grad():
        expected = naive_dint_attention(attention, hidden_states, position_embeddings, query_valid, document_id)
        actual, _ = attention(hidden_states, position_embeddings, mask, query_valid, document_start)
    valid = query_valid[..., None].expand_as(actual)
    torch.testing.assert_close(actual[valid], expected[valid].float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("integral", ["mean", "softmax"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_final_attention_rows_sum_to_one(integral, padding_side):
    model = tiny_model("eager", integral=integral)
    input_ids, attention_mask = left_padded_batch(lengths=(9, 5))
    if padding_side == "right":
        input_ids, attention_mask = input_ids.flip(-1), attention_mask.flip(-1)
    with torch.no_grad():
        outputs = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    for layer, attentions in zip(model.model.layers, outputs.attentions):
        assert attentions.shape == (2, model.config.num_attention_heads, 9, 9)
        final = dint_attention_map(attentions, layer.self_attn.lambda_full(), attention_mask, integral=integral)
        assert final.shape == (2, model.config.num_attention_heads // 2, 9, 9)
        row_sums = final.sum(-1)[attention_mask.bool()[:, None, :].expand(-1, final.shape[1], -1)]
        torch.testing.assert_close(row_sums, torch.ones_like(row_sums), atol=1e-5, rtol=0)
        # DIFF's rows do not sum to 1: the integral is what restores it.
        diff_rows = dint_attention_map(attentions, layer.self_attn.lambda_full(), attention_mask, integral="none")
        assert (diff_rows.sum(-1) - 1).abs().max() > 1e-2
        assert torch.isfinite(final).all()


@pytest.mark.parametrize("integral", INTEGRALS)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_causality(integral, attn_implementation):
    model = tiny_model(attn_implementation, integral=integral)
    input_ids = torch.randint(2, 128, (1, 12))
    changed = input_ids.clone()
    changed[0, 7] = (changed[0, 7] + 5) % 128
    with torch.no_grad():
        logits, changed_logits = model(input_ids).logits, model(changed).logits
    torch.testing.assert_close(logits[:, :7], changed_logits[:, :7], atol=0, rtol=0)
    assert (logits[:, 7:] - changed_logits[:, 7:]).abs().max() > 1e-4


@pytest.mark.parametrize("integral", INTEGRALS)
def test_backends_agree(integral):
    input_ids, attention_mask = left_padded_batch(lengths=(10, 6))
    results = {}
    for attn_implementation in ("eager", "sdpa", "flex_attention"):
        model = tiny_model(attn_implementation, integral=integral)
        with torch.no_grad():
            results[attn_implementation] = (
                model(input_ids).logits,
                model(input_ids, attention_mask=attention_mask).logits,
            )
    valid = attention_mask.bool()
    for attn_implementation in ("sdpa", "flex_attention"):
        unpadded, padded = results[attn_implementation]
        torch.testing.assert_close(unpadded, results["eager"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded[valid], results["eager"][1][valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("integral", INTEGRALS)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_left_padding_invariance(integral, attn_implementation):
    model = tiny_model(attn_implementation, integral=integral)
    input_ids, attention_mask = left_padded_batch(lengths=(10, 6))
    with torch.no_grad():
        padded = model(input_ids, attention_mask=attention_mask).logits
        alone = model(input_ids[1:, 4:]).logits
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[1, 4:], alone[0], atol=1e-5, rtol=1e-5)


def test_none_mode_reproduces_diffllama():
    config = tiny_config(integral="none")
    model = DintForCausalLM(config).eval()
    diff_config = DiffLlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        rms_norm_eps=config.rms_norm_eps,
        lambda_std_dev=0.3,
        max_position_embeddings=config.max_position_embeddings,
    )
    reference = DiffLlamaForCausalLM(diff_config).eval()
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert unexpected == []
    assert sorted(missing) == sorted(f"model.layers.{i}.self_attn.head_norm.weight" for i in range(2))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.head_norm.weight.fill_(1 - layer.self_attn.lambda_init)
    input_ids, attention_mask = left_padded_batch(lengths=(9, 6))
    for attn_implementation in ("sdpa", "eager"):
        model.set_attn_implementation(attn_implementation)
        reference.set_attn_implementation(attn_implementation)
        with torch.no_grad():
            expected = reference(input_ids, attention_mask=attention_mask).logits
            actual = model(input_ids, attention_mask=attention_mask).logits
        valid = attention_mask.bool()
        torch.testing.assert_close(actual[valid], expected[valid], atol=1e-5, rtol=1e-5)
    # DINT adds no parameters to DiffLlama but the head-norm weights.
    extra = sum(layer.self_attn.head_norm.weight.numel() for layer in model.model.layers)
    assert model.num_parameters() == reference.num_parameters() + extra


# integral="softmax" always takes the materializing path: it has no fast path to compare.
@pytest.mark.parametrize("integral", ["mean", "none"])
def test_fast_path_gradients_equal_eager(integral):
    input_ids, attention_mask = left_padded_batch(lengths=(10, 7))
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    gradients = {}
    for attn_implementation in ("sdpa", "eager"):
        model = tiny_model(attn_implementation, integral=integral)
        model.train()
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        gradients[attn_implementation] = {name: p.grad.clone() for name, p in model.named_parameters()}
        assert all(torch.isfinite(g).all() for g in gradients[attn_implementation].values())
    for name, gradient in gradients["sdpa"].items():
        torch.testing.assert_close(gradient, gradients["eager"][name], atol=1e-5, rtol=1e-4, msg=name)
    lambda_gradient = gradients["sdpa"]["model.layers.0.self_attn.lambda_q1"]
    assert lambda_gradient.abs().max() > 0


# integral="softmax" materializes the maps whatever the backend: one backend covers it.
@pytest.mark.parametrize(
    "attn_implementation, integral",
    [(impl, integral) for impl in ("sdpa", "eager", "flex_attention") for integral in ("mean", "none")]
    + [("sdpa", "softmax")],
)
def test_bf16_long_sequence_with_left_padding_is_finite(attn_implementation, integral):
    model = tiny_model(attn_implementation, dtype=torch.bfloat16, integral=integral, num_hidden_layers=1)
    length = 4096
    input_ids = torch.randint(2, 128, (2, length))
    attention_mask = torch.ones(2, length, dtype=torch.long)
    attention_mask[1, :1000] = 0
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()
