"""DINT attention against the paper's formulas: row sums, causality, backends, padding, DiffLlama, gradients."""

import math
import warnings

import pytest
import torch
from dint_testing import LAYOUTS, V2, diffllama_config_like, left_padded_batch, tiny_config, tiny_model
from transformers import DiffLlamaForCausalLM

from modeling_dint import DintForCausalLM, dint_attention_map
from modeling_dint.integral_cpu_kernel import SCAN_BLOCK_ROWS, _lower_triangle, blocked_running_sum, blocked_scan_is_exact
from modeling_dint.integral_dint import (
    DintIntegralLayout,
    document_starts,
    plan_integral,
    segmented_running_sum,
    valid_query_rows,
)
from modeling_dint.integral_triton_kernel import rows_last_running_sum
from modeling_dint.modeling_dint import DintAttention, DintHeadRMSNorm, DintRotaryEmbedding


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
    v1 = attention.config.differential_attention == "v1"
    if v1:  # one lambda per layer
        lambda_full = torch.full((batch_size, length), (
            math.exp(float(attention.lambda_q1 @ attention.lambda_k1))
            - math.exp(float(attention.lambda_q2 @ attention.lambda_k2))
            + attention.lambda_init
        ), dtype=torch.float64)[..., None].expand(-1, -1, num_heads // 2)
    else:  # v2: one per row and differential head, sigmoid(W_lambda x), times the head's gate (`lambda_gate`)
        lambda_full = torch.sigmoid(hidden_states.double() @ attention.lambda_proj.weight.double().T)
        if attention.config.lambda_gate:
            lambda_full = lambda_full * attention.lambda_gate.weight.double()
    half = num_heads // 2
    outputs = torch.zeros(batch_size, length, half, (2 if v1 else 1) * head_dim, dtype=torch.float64)
    for b in range(batch_size):
        allowed = torch.zeros(length, length, dtype=torch.bool)
        for n in range(length):
            for m in range(n + 1):
                allowed[n, m] = bool(query_valid[b, m]) and document_id[b, m] == document_id[b, n]
        for j in range(half):
            maps = []
            for head in ((j, j + half) if v1 else (2 * j, 2 * j + 1)):
                scores = queries[b, head].double() @ keys[b, head // group].double().T / math.sqrt(head_dim)
                scores = scores.masked_fill(~allowed, float("-inf"))
                maps.append(torch.nan_to_num(torch.softmax(scores, dim=-1)))
            signal_map, noise_map = maps
            integral_map = torch.zeros_like(signal_map)
            for n in range(length):
                rows = [m for m in range(n + 1) if query_valid[b, m] and document_id[b, m] == document_id[b, n]]
                if rows:
                    integral_map[n] = signal_map[rows].mean(dim=0)
                if attention.config.integral == "softmax":
                    support = allowed[n]
                    if support.any():
                        integral_map[n] = torch.softmax(integral_map[n].masked_fill(~support, float("-inf")), dim=-1)
            row_lambda = lambda_full[b, :, j, None]  # [T, 1]
            if attention.config.integral == "none":
                final_map = signal_map - row_lambda * noise_map
            else:
                final_map = signal_map - row_lambda * noise_map + row_lambda * integral_map
            if v1:
                kv_head = j // group
                head_values = torch.cat([values[b, kv_head], values[b, num_kv_heads // 2 + kv_head]], dim=-1).double()
            else:  # both maps read the KV head of query head 2j
                head_values = values[b, 2 * j // group].double()
            outputs[b, :, j] = final_map @ head_values
    outputs = attention.head_norm(outputs.float())
    return attention.o_proj(outputs.reshape(batch_size, length, -1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("integral", INTEGRALS)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_attention_matches_naive_paper_formulas(integral, attn_implementation, layout):
    model = tiny_model(attn_implementation, integral=integral, **layout)
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
    query_valid_from_mask = valid_query_rows(mask, 2, 7)
    document_start = document_starts(query_valid_from_mask, position_ids, 2, 7)
    assert torch.equal(query_valid_from_mask, query_valid)
    layout = DintIntegralLayout.build(query_valid_from_mask, document_start, None, 2, 7, hidden_states.device)
    with torch.no_grad():
        expected = naive_dint_attention(attention, hidden_states, position_embeddings, query_valid, document_id)
        actual, _ = attention(hidden_states, position_embeddings, mask, layout)
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
    # Bit for bit, on any CPU: the same kernels on the same shapes, weights and (freshly allocated) alignment; a masked
    # key adds an exact zero.
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
    diff_config = diffllama_config_like(config, lambda_std_dev=0.3)
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


def running_sum_by_loop(rows, query_valid, document_start, carry, query_dim):
    """The running sum over query rows as a loop in float64, independent of the package's scan and gather."""
    moved = rows.movedim(query_dim, 1).double()
    result = torch.zeros_like(moved)
    for b in range(moved.shape[0]):
        total = torch.zeros_like(moved[b, 0]) if carry is None else carry[b].double()
        for n in range(moved.shape[1]):
            if document_start is not None and document_start[b, n]:
                total = torch.zeros_like(total)
            if query_valid is None or query_valid[b, n]:
                total = total + moved[b, n]
            result[b, n] = total
    return result.movedim(1, query_dim)


@pytest.mark.parametrize("query_dim", [1, 2])
@pytest.mark.parametrize("length", [1, 9, 300])  # 300: blocks of SCAN_BLOCK_ROWS on two levels, the last one padded
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("documents", ["none", "first row", "random"])
@pytest.mark.parametrize("carry", [False, True])
def test_segmented_running_sum_matches_a_loop(query_dim, length, padding, documents, carry):
    """Every shortcut of the layout (no padding; no document start, or one at row 0 only, known without a tensor;
    a one-row call) against the plain definition; padding rows hold NaN, which must not leak."""
    generator = torch.Generator().manual_seed(length + 10 * query_dim)
    batch_size = 4
    shape = (batch_size, length, 2, 5) if query_dim == 1 else (batch_size, 2, length, 5)
    query_valid = torch.rand(batch_size, length, generator=generator) > 0.3 if padding else None
    document_start = torch.rand(batch_size, length, generator=generator) > 0.6 if documents == "random" else None
    rows = torch.randn(shape, generator=generator)
    if query_valid is not None:
        row_mask = query_valid.view(batch_size, length, 1, 1) if query_dim == 1 else query_valid.view(batch_size, 1, length, 1)
        rows = torch.where(row_mask, rows, float("nan"))
    carried_sums = torch.randn(batch_size, 2, 5, generator=generator) if carry else None
    carried_count = torch.randint(0, 5, (batch_size,), generator=generator).float() if carry else None

    continues_cache = documents != "first row"
    layout = DintIntegralLayout.build(
        query_valid, document_start, carried_count, batch_size, length, rows.device, continues_cache
    )
    if not continues_cache:  # what the layout was told without a tensor, written out for the loop
        document_start = torch.zeros(batch_size, length, dtype=torch.bool)
        document_start[:, 0] = True
    actual = segmented_running_sum(rows, layout, carried_sums, query_dim=query_dim)
    expected = running_sum_by_loop(rows, query_valid, document_start, carried_sums, query_dim)
    assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected.float(), atol=1e-5, rtol=1e-5)

    ones = torch.ones(batch_size, length)
    expected_count = running_sum_by_loop(ones, query_valid, document_start, carried_count, 1).float()
    torch.testing.assert_close(layout.running_query_count, expected_count)
    torch.testing.assert_close(layout.inverse_query_count[:, :, 0, 0], 1 / expected_count.clamp(min=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("documents", [False, True])
def test_blocked_running_sum_matches_the_cumulative_sum_and_its_gradient(dtype, documents):
    """The CPU eager ops' running sum in blocks of matrix multiplies (`blocked_running_sum`, which the plan takes on
    CPUs) gives the scan's fp32 sums and gradients, documents restarting included: training runs it too. With fp32
    matrix multiplies allowed to run in bf16 it is not taken."""
    generator = torch.Generator().manual_seed(7)
    batch_size, length = 3, 20 * SCAN_BLOCK_ROWS + 5
    rows = torch.randn(batch_size, length, 2, 5, generator=generator).to(dtype).requires_grad_()
    weights = torch.randn(batch_size, length, 2, 5, generator=generator)
    restart_row = None
    expected = rows.float().cumsum(1)
    if documents:
        document_start = torch.rand(batch_size, length, generator=generator) > 0.97
        layout = DintIntegralLayout.build(None, document_start, None, batch_size, length, rows.device)
        restart_row = layout.restart_row
        expected = expected - (expected - rows).gather(1, restart_row[:, :, None, None].expand(rows.shape))
    actual = blocked_running_sum(rows, restart_row)
    assert actual.dtype == torch.float32 and actual.shape == rows.shape
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)
    (actual_gradient,) = torch.autograd.grad((actual * weights).sum(), rows)
    (expected_gradient,) = torch.autograd.grad((expected * weights).sum(), rows)
    tolerances = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {}  # bf16 gradients: bf16's defaults
    torch.testing.assert_close(actual_gradient, expected_gradient, **tolerances)

    def planned_scan():  # a training forward's plan on CPU: the eager ops, with the blocked scan where it is exact
        layout = DintIntegralLayout.build(None, None, None, 1, 20, rows.device)
        return plan_integral(layout, None, rows.device, torch.float32, 20 * 16, True, False).running_sum

    assert blocked_scan_is_exact() and planned_scan() is blocked_running_sum
    precision = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        assert not blocked_scan_is_exact() and planned_scan() is None
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = precision


def test_running_sums_stay_fp32_under_cpu_autocast():
    """A Trainer's bf16 autocast on CPU lowers matrix multiplies to bf16: the blocked running sum (a matrix multiply)
    and the counts it gives the layout must stay fp32 and equal to the sums outside autocast."""
    rows = torch.randn(2, 300, 2, 5, generator=torch.Generator().manual_seed(0))
    document_start = torch.zeros(2, 300, dtype=torch.bool)
    document_start[1, 100] = True

    def sums():
        layout = DintIntegralLayout.build(None, document_start, None, 2, 300, rows.device)
        return layout.running_query_count, segmented_running_sum(rows, layout, running_sum=blocked_running_sum)

    expected = sums()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        actual = sums()
    for got, want in zip(actual, expected):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_model_trains_after_running_under_inference_mode():
    """The blocked running sum's cached lower-triangular matrix, first built under `torch.inference_mode()` (a
    pipeline, a server), must not be an inference tensor, which a training step could not save for backward."""
    _lower_triangle.cache_clear()
    model = tiny_model("sdpa")
    input_ids = torch.randint(2, 128, (2, 40))
    with torch.inference_mode():
        model(input_ids)
    model.train()
    model(input_ids, labels=input_ids).loss.backward()
    assert model.model.layers[0].self_attn.lambda_q1.grad is not None


def test_bf16_stays_within_its_bound_of_fp32():
    """A bf16 model's logits stay as close to the fp32 model's as before issue 31 (max 0.0058 here): the integral's
    sums and the combination of the fast path stay fp32; a combination in bf16 (as integral "none" has it) reads
    0.010."""
    input_ids, attention_mask = left_padded_batch(lengths=(512, 300))
    valid = attention_mask.bool()
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            logits[dtype] = tiny_model("sdpa", dtype=dtype).forward(input_ids, attention_mask=attention_mask).logits
    difference = (logits[torch.bfloat16].float() - logits[torch.float32])[valid].abs().max().item()
    assert difference < 0.0075, difference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("documents", [False, True])
def test_tuned_scans_agree_with_the_reference(dtype, documents):
    """The scans tuned per device (the rows last, what CUDA's eager ops run; blocks of matrix multiplies, CPU's) give
    the reference's sums and gradients, padding, documents and a carry included, so the CPU suite covers both."""
    generator = torch.Generator().manual_seed(3)
    batch_size, length = 2, 3 * SCAN_BLOCK_ROWS + 1
    query_valid = torch.rand(batch_size, length, generator=generator) > 0.2
    document_start = torch.rand(batch_size, length, generator=generator) > 0.8 if documents else None
    layout = DintIntegralLayout.build(query_valid, document_start, torch.tensor([2.0, 0.0]), batch_size, length, "cpu")
    carry = torch.randn(batch_size, 3, 8, generator=generator)
    rows = torch.randn(batch_size, length, 3, 8, generator=generator).to(dtype).requires_grad_()
    weights = torch.randn(rows.shape, generator=generator)
    results = []
    for running_sum in (None, rows_last_running_sum, blocked_running_sum):
        totals = segmented_running_sum(rows, layout, carry, running_sum)
        (gradient,) = torch.autograd.grad((totals * weights).sum(), rows)
        assert totals.dtype == torch.float32 and totals.shape == rows.shape
        results.append((totals, gradient))
    for totals, gradient in results[1:]:
        torch.testing.assert_close(totals, results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gradient, results[0][1], **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}))


def test_head_norm_runs_in_its_input_dtype():
    """The head norm normalizes the fp32 combination in fp32 whatever the weight's dtype (a bf16 model keeps bf16
    weights), without torch's mixed-dtype fallback (unfused, with a warning); and a bf16 input stays bf16."""
    norm = DintHeadRMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm = norm.to(torch.bfloat16)
    hidden_states = torch.randn(2, 5, 3, 8)
    expected = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Mm]ismatch dtype.*")
        actual = norm(hidden_states)
        assert norm(hidden_states.bfloat16()).dtype == torch.bfloat16
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected)


def test_layout_moves_with_accelerate_to_a_layer_device():
    """A model split over devices (`device_map`) gets each layer's arguments moved by accelerate's `send_to_device`,
    which moves an object through its `to`: every tensor of the layout must follow, and its flags stay as they are.
    A padding mask on another device than the model's is moved when the layout is built (as transformers' mask is)."""
    from accelerate.utils import send_to_device

    query_valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    document_start = torch.tensor([[False, True, False, True], [True, False, False, False]])
    layout = DintIntegralLayout.build(query_valid, document_start, torch.ones(2), 2, 4, torch.device("cpu"))
    moved = send_to_device(layout, torch.device("meta"))
    assert isinstance(moved, DintIntegralLayout) and moved.carry_kept is True
    for name in ("query_valid", "restart_row", "in_carried_document", "running_query_count", "inverse_query_count"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(layout, name).device.type == "cpu", name

    built_elsewhere = DintIntegralLayout.build(query_valid, document_start, None, 2, 4, torch.device("meta"))
    assert built_elsewhere.query_valid.device.type == "meta"
    assert built_elsewhere.restart_row.device.type == "meta"


def test_backend_without_mask_function_still_skips_padding_rows():
    """A registered attention backend with no mask function (as TGI / vLLM register) gets no mask from transformers and
    handles padding itself; the integral must still leave the padding rows out of its running mean."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    input_ids, attention_mask = left_padded_batch(lengths=(10, 6))
    length = input_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    own_mask = causal[None, None] & attention_mask.bool()[:, None, None, :]  # [B, 1, T, K], what the backend knows

    def self_masking_attention(module, query, key, value, attention_mask, **kwargs):
        assert attention_mask is None  # transformers built no mask for this backend
        return sdpa_attention_forward(module, query, key, value, own_mask, **kwargs)

    AttentionInterface.register("dint_test_self_masking", self_masking_attention)
    try:
        model = tiny_model("sdpa", integral="mean")
        with torch.no_grad():
            alone = model(input_ids[1:, 4:]).logits
            model.set_attn_implementation("dint_test_self_masking")
            padded = model(input_ids, attention_mask=attention_mask).logits
    finally:
        AttentionInterface._global_mapping.pop("dint_test_self_masking", None)
    torch.testing.assert_close(padded[1, 4:], alone[0], atol=1e-5, rtol=1e-5)
