"""GPU paths (bf16, long context, cached generation on CUDA, the Triton integral kernel in training, compiled decoding
with CUDA graphs), on both head layouts (DIFF V1's and V2's). Skipped where no CUDA device exists: CI has none; run
`python -m pytest tests/test_gpu.py` on a GPU machine (`bench/gpu_bf16.py` runs it first)."""

import copy

import pytest
import torch
from dint_testing import left_padded_batch, tiny_model


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


layouts = pytest.mark.parametrize("differential_attention", ["v1", "v2"])


@cuda
@layouts
@pytest.mark.parametrize("integral", ["mean", "none"])
def test_bf16_fast_path_matches_eager_on_cuda(integral, differential_attention):
    input_ids, attention_mask = left_padded_batch(lengths=(512, 300))
    logits = {}
    for attn_implementation in ("sdpa", "eager"):
        model = tiny_model(
            attn_implementation, dtype=torch.bfloat16, integral=integral, differential_attention=differential_attention
        ).cuda()
        with torch.no_grad():
            logits[attn_implementation] = model(input_ids.cuda(), attention_mask=attention_mask.cuda()).logits.float()
    valid = attention_mask.bool().cuda()
    difference = (logits["sdpa"] - logits["eager"])[valid].abs().max().item()
    assert difference < 0.1, difference


@cuda
@layouts
@pytest.mark.parametrize("integral", ["mean", "none"])
def test_bf16_long_context_on_cuda_is_finite(integral, differential_attention):
    length = 32768
    model = tiny_model(
        "sdpa", dtype=torch.bfloat16, integral=integral, max_position_embeddings=length,
        differential_attention=differential_attention,
    ).cuda()
    input_ids = torch.randint(2, 128, (2, length), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5000] = 0
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, logits_to_keep=64).logits
    assert torch.isfinite(logits).all()


@cuda
@layouts
@pytest.mark.parametrize("integral", ["mean", "softmax"])
def test_cached_generation_on_cuda_matches_recomputation(integral, differential_attention):
    model = tiny_model("sdpa", integral=integral, differential_attention=differential_attention).cuda()
    input_ids, attention_mask = left_padded_batch(lengths=(12, 7))
    kwargs = dict(attention_mask=attention_mask.cuda(), max_new_tokens=12, do_sample=False)
    cached = model.generate(input_ids.cuda(), use_cache=True, **kwargs)
    uncached = model.generate(input_ids.cuda(), use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    static = model.generate(input_ids.cuda(), cache_implementation="static", **kwargs)
    assert torch.equal(static, uncached)


@cuda
@layouts
def test_the_triton_kernel_trains_a_bf16_model_as_the_eager_ops(differential_attention, monkeypatch):
    """On CUDA the integral runs as the Triton kernel (counted): a left-padded bf16 batch of 2048 tokens with a packed
    second document gives the eager integral's logits, loss and gradients within bf16's rounding."""
    import modeling_dint.integral_triton_kernel as triton_kernel

    calls = []
    forward = triton_kernel.integral_forward
    monkeypatch.setattr(triton_kernel, "integral_forward", lambda *a, **k: (calls.append(1), forward(*a, **k))[1])
    input_ids, attention_mask = left_padded_batch(lengths=(2048, 1500))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    position_ids[1, 1200:] -= position_ids[1, 1200].clone()
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    def step():
        model = tiny_model(dtype=torch.bfloat16, differential_attention=differential_attention).cuda().train()
        output = model(input_ids.cuda(), attention_mask=attention_mask.cuda(), position_ids=position_ids.cuda(),
                       labels=labels.cuda())
        output.loss.backward()
        return output.logits.float(), output.loss.float(), {n: p.grad.float() for n, p in model.named_parameters()}

    actual = step()
    assert len(calls) == 2
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    expected = step()
    valid = attention_mask.bool().cuda()
    assert (actual[0] - expected[0])[valid].abs().max().item() < 0.1
    assert abs(actual[1].item() - expected[1].item()) < 1e-2
    for name, gradient in expected[2].items():
        scale = gradient.abs().max().item() + 1e-3
        assert (actual[2][name] - gradient).abs().max().item() < 0.05 * scale, name


@cuda
@layouts
def test_compiled_static_decode_uses_cuda_graphs_and_gives_the_eager_tokens(differential_attention):
    """`cache_implementation="static"` with the decode step compiled in CUDA-graph mode ("reduce-overhead"): the tokens
    of eager generation with a dynamic cache, one graph, and no step that skipped CUDA graphs."""
    import torch._dynamo
    from transformers import CompileConfig

    model = tiny_model("sdpa", differential_attention=differential_attention).cuda()  # fp32: the same tokens
    input_ids, attention_mask = left_padded_batch(lengths=(40, 23))
    kwargs = dict(attention_mask=attention_mask.cuda(), max_new_tokens=16, do_sample=False, pad_token_id=0)
    eager = model.generate(input_ids.cuda(), **kwargs)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(
        input_ids.cuda(), cache_implementation="static",
        compile_config=CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead"), **kwargs,
    )
    assert torch.equal(compiled, eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


@cuda
@pytest.mark.parametrize("rows", [1, 37])
def test_the_eager_ops_on_cuda_read_bf16_outputs_as_their_fp32_casts(rows, monkeypatch):
    """Without a gradient the eager ops on CUDA read O1 and O2 in bf16 (CUDA's ops cast each element as they read it):
    the output is that of the same call on their fp32 casts, bit for bit, padding rows and a packed document included.
    Each call plans its own copy of the layout, as a forward in its dtype would."""
    from torch import nn

    from modeling_dint.integral_dint import EAGER, DintIntegral, DintIntegralLayout

    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    integral = DintIntegral("mean", layer_idx=0)
    attention_output = torch.randn(2, rows, 8, 32, device="cuda", dtype=torch.bfloat16)
    lambda_ = torch.rand(2, rows, 4, 1, device="cuda")
    query_valid = torch.ones(2, rows, dtype=torch.bool, device="cuda")
    query_valid[1, : rows // 3] = False  # left padding
    document_start = torch.zeros(2, rows, dtype=torch.bool, device="cuda")
    document_start[0, rows // 2] = True
    layout = DintIntegralLayout.build(query_valid, document_start, None, 2, rows, torch.device("cuda"))
    results = []
    with torch.no_grad():
        for outputs in (attention_output, attention_output.float()):
            planned = copy.copy(layout)
            results.append(integral(outputs[:, :, 0::2], outputs[:, :, 1::2], lambda_, planned, nn.Identity()))
            assert planned.implementation == EAGER
    assert results[0].dtype == torch.bfloat16
    assert torch.equal(results[0][query_valid], results[1].to(torch.bfloat16)[query_valid])


@cuda
def test_v2_query_and_lambda_run_as_one_product_on_cuda():
    """On CUDA too (not refused as memory shared with other processes): both weights views of one storage, the logits
    those of the two products, and `model.cpu()` keeps nothing on the GPU."""
    model = tiny_model(differential_attention="v2", num_key_value_heads=1).cuda()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    with torch.no_grad():
        fused = model(input_ids).logits
    attentions = [layer.self_attn for layer in model.model.layers]
    assert all(attention.query_lambda_weight is not None for attention in attentions)
    assert all(attention.q_proj.weight.data_ptr() == attention.query_lambda_weight.data_ptr() for attention in attentions)
    with torch.enable_grad():
        separate = model(input_ids).logits.detach()
    torch.testing.assert_close(fused, separate, rtol=0, atol=1e-5)
    model.cpu()
    assert all(attention.query_lambda_weight is None for attention in attentions)
