"""GPU paths (bf16, long context, cached generation on CUDA), on both head layouts (DIFF V1's and V2's). Skipped where
no CUDA device exists: CI has none; run `python -m pytest tests/test_gpu.py` on a GPU machine."""

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
