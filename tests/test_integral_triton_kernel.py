"""The Triton integral kernel (`modeling_dint/integral_triton_kernel.py`) against the eager ops it replaces, forward
and backward: outputs, the state the cache keeps and every gradient, for every layout of rows (padding inside rows,
packed documents, a carried state, restarts at chunk boundaries), both head layouts, fp32 and bf16, odd lengths and
head sizes; through a whole model (forward, backward, cached generation); no new compilation per length or batch
size; and the dispatch (`DINT_INTEGRAL_KERNEL`).

On a CUDA machine the kernels run compiled on the GPU. Elsewhere they run under Triton's interpreter, which must be
turned on before Triton is imported: `TRITON_INTERPRET=1 python -m pytest tests/test_integral_triton_kernel.py`
(CI's Triton stage). Without Triton, or without a GPU and the interpreter, these tests are skipped."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import modeling_dint.integral_triton_kernel as triton_kernel
from dint_testing import LAYOUTS, V2, cache_of, left_padded_batch, tiny_model, with_cache
from modeling_dint.cache_dint import SIGNAL_SUM, DintDynamicLayer
from modeling_dint.integral_cpu_kernel import integral_kernel
from modeling_dint.integral_dint import (
    DintIntegral,
    DintIntegralLayout,
    carried_state,
    combine_with_integral,
    document_starts,
    segmented_running_sum,
)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not triton_kernel.runs_on(torch.device(DEVICE)),
    reason="needs Triton with a CUDA device, or TRITON_INTERPRET=1 (set before Triton is imported) on CPU",
)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the forward kernels' launches (`integral_forward`) and makes the model take the Triton kernel."""
    calls = []
    forward = triton_kernel.integral_forward

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return forward(*args, **kwargs)

    monkeypatch.setattr(triton_kernel, "integral_forward", counted)
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
    return calls


def rows_case(case: str, batch_size: int, length: int, generator: torch.Generator):
    """`(query_valid, position_ids, carry_kept)` of one layout of rows."""
    query_valid, position_ids, carry_kept = None, None, True
    if case == "padding inside rows and packed documents":
        query_valid = torch.rand(batch_size, length, generator=generator) > 0.25
        query_valid[0, :7] = False  # left padding
        position_ids = torch.arange(length).repeat(batch_size, 1) + 5
        for row, start in ((1, length // 3), (1, 2 * length // 3), (2, 16), (2, 17), (2, 32)):
            if row < batch_size and start < length:  # documents starting inside a chunk and at chunk boundaries
                position_ids[row, start:] -= position_ids[row, start].clone()
                query_valid[row, start] = True
    elif case == "row 0 restarts in some rows":
        carry_kept = torch.tensor([True, False, True][:batch_size])
    return query_valid, position_ids, carry_kept


def eager_reference(signal, noise, lambda_, layout, carry, head_norm):
    """The eager path of `DintIntegral.__call__`: the running sum, the combination, the head norm and the cast."""
    running = segmented_running_sum(signal.float(), layout, carry)
    combined = combine_with_integral(signal.float(), noise.float(), lambda_, running, layout.inverse_query_count)
    return head_norm(combined).to(signal.dtype), running[:, -1], running


def assert_close(actual, expected, dtype, scale=1.0):
    """fp32 tightly; bf16 and fp16 within their rounding of the same fp32 value (plus the sums' order)."""
    tolerance = dict(atol=1e-5 * scale, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2 * scale, rtol=2e-2)
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_layout", ["v1", "v2"])
@pytest.mark.parametrize("case", ["plain", "padding inside rows and packed documents", "row 0 restarts in some rows"])
@pytest.mark.parametrize("length, channels, chunk_rows", [(1, 16, None), (5, 24, None), (77, 24, None), (90, 80, 16)])
def test_kernel_matches_the_eager_integral_forward_and_backward(
    dtype, head_layout, case, length, channels, chunk_rows, monkeypatch
):
    """O1 and O2 as the attention gives them (v1: the two halves of one output, one lambda and the head norm; v2: its
    even and odd heads, a lambda per row and head, no norm), a carried state and count: the output, the last and
    every row's state, and the gradients of O1 and O2 (into their one output), lambda, the norm's weight and the
    carry, with a gradient on the state too. `chunk_rows=16` cuts 90 rows into 6 chunks, scanned 2 at a time."""
    check_against_eager(dtype, head_layout, case, length, channels, chunk_rows, monkeypatch)


@pytest.mark.parametrize("head_layout", ["v1", "v2"])
def test_fp16_matches_the_eager_integral(head_layout, monkeypatch):
    """fp16 as bf16: padding, documents and a carried state over 6 chunks."""
    check_against_eager(torch.float16, head_layout, "padding inside rows and packed documents", 90, 80, 16, monkeypatch)


def test_a_second_derivative_is_refused_not_wrong():
    """The kernels' backward is not differentiable: asking for a second derivative raises instead of giving zeros."""
    attention_output = torch.randn(1, 20, 4, 16, device=DEVICE, requires_grad=True)
    signal, noise = attention_output.chunk(2, dim=2)
    layout = DintIntegralLayout.build(None, None, None, 1, 20, torch.device(DEVICE))
    output = triton_kernel.triton_integral(
        signal, noise, torch.tensor(0.5, device=DEVICE), layout.inverse_count_rows(),
        layout.row_flags(1, 20, torch.device(DEVICE)), None, None, False, 0.0,
    )[0]
    (gradient,) = torch.autograd.grad(output.square().sum(), attention_output, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        gradient.sum().backward()


def check_against_eager(dtype, head_layout, case, length, channels, chunk_rows, monkeypatch):
    if chunk_rows is not None:
        monkeypatch.setattr(triton_kernel, "chunk_rows_for", lambda query_length, channels: chunk_rows)
        monkeypatch.setattr(triton_kernel, "SCAN_BLOCK_CHUNKS", 2)
    generator = torch.Generator().manual_seed(length + channels)
    batch_size, heads = 3, 2
    attention_output = torch.randn(batch_size, length, 2 * heads, channels, generator=generator)
    attention_output = attention_output.to(DEVICE, dtype).requires_grad_()
    if head_layout == "v1":
        signal, noise = attention_output.chunk(2, dim=2)
        lambda_ = torch.tensor(0.37, device=DEVICE, requires_grad=True)
        head_norm = nn.RMSNorm(channels, eps=1e-5).to(DEVICE)
        nn.init.uniform_(head_norm.weight, 0.5, 1.5)
    else:
        signal, noise = attention_output[:, :, 0::2], attention_output[:, :, 1::2]
        lambda_ = torch.rand(batch_size, length, heads, 1, generator=generator).to(DEVICE).requires_grad_()
        head_norm = nn.Identity()
    query_valid, position_ids, carry_kept = rows_case(case, batch_size, length, generator)
    document_start = document_starts(query_valid, position_ids, batch_size, length)
    past_count = torch.tensor([3.0, 1.0, 4.0])
    layout = DintIntegralLayout.build(query_valid, document_start, past_count, batch_size, length, "cpu", carry_kept)
    layout = layout.to(DEVICE)
    carry = torch.randn(batch_size, heads, channels, generator=generator).to(DEVICE).requires_grad_()
    weight, normalize, eps = (head_norm.weight, True, 1e-5) if head_layout == "v1" else (None, False, 0.0)

    expected = eager_reference(signal, noise, lambda_, layout, carry, head_norm)
    actual = triton_kernel.triton_integral(
        signal, noise, lambda_, layout.inverse_query_count[:, :, 0, 0],
        layout.row_flags(batch_size, length, torch.device(DEVICE)), carry, weight, normalize, eps, store_running=True,
    )

    valid = slice(None) if query_valid is None else query_valid.to(DEVICE)
    assert actual[0].dtype == dtype and actual[0].shape == signal.shape and actual[0].is_contiguous()
    assert_close(actual[0][valid], expected[0][valid], dtype)
    torch.testing.assert_close(actual[1], expected[1], atol=1e-5, rtol=1e-5)  # the sums are fp32 in both
    torch.testing.assert_close(actual[2], expected[2], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(actual[0]).all() and torch.isfinite(actual[1]).all()

    grad_output = torch.randn(signal.shape, generator=generator).to(DEVICE, dtype)
    grad_last = torch.randn(batch_size, heads, channels, generator=generator).to(DEVICE)
    inputs = [attention_output, lambda_, carry] + ([weight] if weight is not None else [])

    def gradients(output, last_sum):
        loss = (output.float() * grad_output.float()).sum() + (last_sum * grad_last).sum()
        return torch.autograd.grad(loss, inputs)

    for name, got, want in zip(["O", "lambda", "carry", "weight"], gradients(*actual[:2]), gradients(*expected[:2])):
        scale = want.abs().max().item() + 1.0
        assert_close(got, want, dtype, scale=scale), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_trains_through_the_kernel(layout, dtype, kernel_calls, monkeypatch):
    """A left-padded batch and a packed row: the logits, the loss and every parameter's gradient equal the eager
    integral's."""
    input_ids, attention_mask = left_padded_batch(lengths=(70, 41))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    position_ids[1, 50:] -= position_ids[1, 50].clone()  # a second document packed into row 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    def step():
        model = tiny_model(dtype=dtype, **layout).to(DEVICE).train()
        output = model(
            input_ids.to(DEVICE), attention_mask=attention_mask.to(DEVICE), position_ids=position_ids.to(DEVICE),
            labels=labels.to(DEVICE),
        )
        output.loss.backward()
        gradients = {name: parameter.grad.float() for name, parameter in model.named_parameters()}
        return output.logits.float(), output.loss.float(), gradients

    actual = step()
    assert len(kernel_calls) == 2  # one per layer
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    expected = step()
    valid = attention_mask.bool().to(DEVICE)
    assert_close(actual[0][valid], expected[0][valid], dtype)
    assert_close(actual[1], expected[1], dtype)
    for name, gradient in expected[2].items():
        assert_close(actual[2][name], gradient, dtype, scale=gradient.abs().max().item() + 1.0), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "generate_kwargs",
    [
        dict(do_sample=False),
        dict(do_sample=False, num_beams=3, num_return_sequences=2),
        dict(do_sample=False, prefill_chunk_size=5),
        # eager: on CUDA, generate() compiles a static cache's decoding step by itself, and a compiled step runs the
        # compiler's fusion of the eager ops, not the kernel (`DintIntegral.kernel_for`; tests/test_gpu.py compiles it)
        dict(do_sample=False, cache_implementation="static", disable_compile=True),
        dict(do_sample=False, prompt_lookup_num_tokens=3),
    ],
    ids=["greedy", "beams", "prefill chunks", "static cache", "prompt lookup"],
)
def test_cached_generation_through_the_kernel_equals_recomputation(layout, generate_kwargs, kernel_calls, monkeypatch):
    """Every decoding mode with the kernel (the state carried, reordered, expanded, rolled back by `crop` over the
    rows the kernel recorded) gives the tokens of generation without a cache."""
    model = tiny_model(**layout).to(DEVICE)
    input_ids, attention_mask = left_padded_batch(lengths=(13, 8))
    input_ids[:, -8:] = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8])  # n-grams that prompt lookup proposes again
    crops = []
    if "prompt_lookup_num_tokens" in generate_kwargs:  # one row (assisted decoding's limit)
        input_ids, attention_mask = input_ids[:1], attention_mask[:1]
        crop = DintDynamicLayer.crop
        monkeypatch.setattr(DintDynamicLayer, "crop", lambda self, n: (crops.append(n), crop(self, n))[1])
    kwargs = dict(attention_mask=attention_mask.to(DEVICE), max_new_tokens=8, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(input_ids.to(DEVICE), **kwargs, **generate_kwargs)
        calls = len(kernel_calls)
        generate_kwargs = {key: value for key, value in generate_kwargs.items()
                           if key not in ("prefill_chunk_size", "cache_implementation", "disable_compile",
                                          "prompt_lookup_num_tokens")}
        uncached = model.generate(input_ids.to(DEVICE), use_cache=False, **kwargs, **generate_kwargs)
    assert calls >= 2 * 4, "the cached generation did not run through the kernel"
    assert torch.equal(cached, uncached)
    if crops:
        assert any(n < 0 for n in crops)


def test_a_continued_cache_carries_the_kernels_state(monkeypatch):
    """Prefill with the kernel, continue the cache with a chunk: the state and logits of one forward over all."""
    model = tiny_model(**V2).to(DEVICE)
    input_ids = torch.randint(3, 128, (2, 40), device=DEVICE)
    with torch.no_grad():
        monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
        prefill = model(input_ids[:, :25], use_cache=True)
        chunk = model(input_ids[:, 25:], **with_cache(cache_of(prefill)))
        monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
        full = model(input_ids, use_cache=True)
    torch.testing.assert_close(chunk.logits, full.logits[:, 25:], atol=1e-5, rtol=1e-5)
    for layer_idx in range(model.config.num_hidden_layers):
        torch.testing.assert_close(
            carried_state(cache_of(chunk), layer_idx, SIGNAL_SUM), carried_state(cache_of(full), layer_idx, SIGNAL_SUM),
            atol=1e-5, rtol=1e-5,
        )


def test_no_new_compilation_per_length_or_batch_size(monkeypatch):
    """The kernels compile once per head size, dtype and options: what a launch specializes on does not depend on the
    length (past one chunk) or the batch size. On a GPU the JIT caches count the compiled variants; under the
    interpreter, the launches' compile-time arguments are compared."""
    kernels = ("_chunk_tails_kernel", "_chunk_scan_kernel", "_integral_forward_kernel", "_integral_backward_kernel")

    def compiled():  # Triton's JIT cache per device (triton 3.x): the kernels compiled so far in this process
        return {name: sum(len(caches[0]) for caches in getattr(triton_kernel, name).device_caches.values())
                for name in kernels}

    before = compiled() if DEVICE == "cuda" else None
    launches = []
    for name in kernels:
        kernel = getattr(triton_kernel, name)

        class Recorded:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.append((self.name, tuple(sorted(kwargs.items()))))
                    return self.kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(triton_kernel, name, Recorded(kernel, name))
    integral = DintIntegral("mean", layer_idx=0)
    head_norm = nn.RMSNorm(24).to(DEVICE)
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
    for batch_size, length in ((1, 100), (2, 131), (3, 257), (1, 1000)):
        attention_output = torch.randn(batch_size, length, 4, 24, device=DEVICE, requires_grad=True)
        signal, noise = attention_output.chunk(2, dim=2)
        layout = DintIntegralLayout.build(None, None, None, batch_size, length, torch.device(DEVICE))
        integral(signal, noise, torch.tensor(0.5, device=DEVICE), layout, None, head_norm).sum().backward()
    # One variant each: the tails, the chunk scan forward and back, the forward, the backward's two passes
    assert len(set(launches)) == 6, sorted(set(launches))
    if DEVICE == "cuda":
        monkeypatch.undo()  # the kernels themselves again
        new = {name: count - before[name] for name, count in compiled().items()}
        at_most = {"_chunk_tails_kernel": 1, "_chunk_scan_kernel": 2, "_integral_forward_kernel": 1,
                   "_integral_backward_kernel": 2}  # (fewer where an earlier test compiled the same variant)
        assert all(new[name] <= at_most[name] for name in kernels), new


def test_dint_integral_kernel_chooses_and_refuses(monkeypatch):
    """`DINT_INTEGRAL_KERNEL`: "eager" runs the eager ops, "triton" the kernel (here, on CPU, under the interpreter),
    unset chooses by device (CUDA: the kernel where it pays off, here in training mode, with a gradient or from the
    threshold's elements on); another value is refused, naming the variable and the choices."""
    from modeling_dint.integral_dint import TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT

    integral = DintIntegral("mean", layer_idx=0)
    attention_output = torch.randn(1, 8, 4, 16, device=DEVICE)
    signal, noise = attention_output.chunk(2, dim=2)
    layout = DintIntegralLayout.build(None, None, None, 1, 8, torch.device(DEVICE))
    arguments = (signal, noise, torch.tensor(0.5, device=DEVICE), layout, None, nn.Identity().eval())
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    assert integral.kernel_for(*arguments) == "eager"
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
    assert integral.kernel_for(*arguments) == "triton"
    assert integral.kernel_for(*arguments[:-1], None) == "eager"  # a caller that normalizes itself
    monkeypatch.delenv("DINT_INTEGRAL_KERNEL")
    cpu_kernel = "cpu" if integral_kernel() is not None else "eager"  # (where a C++ compiler builds it)
    assert integral.kernel_for(*arguments) == ("eager" if DEVICE == "cuda" else cpu_kernel)  # CUDA: a short call
    in_training = (*arguments[:-1], nn.Identity().train())
    assert integral.kernel_for(*in_training) == ("triton" if DEVICE == "cuda" else cpu_kernel)
    if DEVICE == "cuda":  # a call from the threshold on, in eval mode without a gradient
        rows = TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT // (2 * 8)
        long_output = torch.randn(1, rows, 4, 8, device=DEVICE)
        long_layout = DintIntegralLayout.build(None, None, None, 1, rows, torch.device(DEVICE))
        assert integral.kernel_for(*long_output.chunk(2, dim=2), *arguments[2:3], long_layout, None,
                                   nn.Identity().eval()) == "triton"
    wanting_gradient = (signal.requires_grad_(), noise, *arguments[2:])
    assert integral.kernel_for(*wanting_gradient) == ("triton" if DEVICE == "cuda" else "eager")
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "fast")
    with pytest.raises(ValueError, match="DINT_INTEGRAL_KERNEL='fast' is not one of auto, eager, triton"):
        integral.kernel_for(*arguments)


def test_unforced_the_kernel_takes_calls_with_a_gradient_in_training_or_with_many_elements():
    """With `DINT_INTEGRAL_KERNEL` unset, CUDA calls take the kernel where it cost less than the eager ops on an H200:
    every call with a gradient (any of O1, O2, lambda and the head norm's weight requiring one, in grad mode), every
    call in training mode (a reentrant checkpoint's forward without gradient rounds as its recomputation), and calls
    from `TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT` elements of O1 on (not a decoding step or a short prefill)."""
    from modeling_dint.integral_dint import TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT, triton_kernel_pays_off, wants_gradient

    def signal(batch_size, rows, heads=16, channels=128):
        return torch.empty(batch_size, rows, heads, channels, device="meta")

    assert not triton_kernel_pays_off(signal(1, 1), gradient=False, training=False)  # decoding
    assert not triton_kernel_pays_off(signal(8, 1), gradient=False, training=False)
    assert not triton_kernel_pays_off(signal(1, 2048), gradient=False, training=False)  # 4.2M: eager measured faster
    assert triton_kernel_pays_off(signal(1, 8192), gradient=False, training=False)  # 16.8M: the kernel measured faster
    assert triton_kernel_pays_off(signal(1, TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT // 2048), False, False)
    assert triton_kernel_pays_off(signal(1, 1), gradient=True, training=False)
    assert triton_kernel_pays_off(signal(1, 1), gradient=False, training=True)

    outputs = torch.randn(1, 4, 4, 8).chunk(2, dim=2)
    lambda_ = torch.tensor(0.5)
    assert not wants_gradient(*outputs, lambda_, nn.Identity())
    assert not wants_gradient(*outputs, lambda_, nn.RMSNorm(8, elementwise_affine=False))  # no weight
    assert wants_gradient(*outputs, lambda_, nn.RMSNorm(8))  # its weight
    assert wants_gradient(*outputs, lambda_.clone().requires_grad_(), nn.Identity())
    tracked = torch.randn(1, 4, 4, 8, requires_grad=True).chunk(2, dim=2)  # a LoRA-adapted projection's outputs
    assert wants_gradient(*tracked, lambda_, nn.Identity())
    with torch.no_grad():
        assert not wants_gradient(*tracked, lambda_.clone().requires_grad_(), nn.RMSNorm(8))
    frozen = nn.RMSNorm(8).requires_grad_(False)
    assert not wants_gradient(*outputs, lambda_, frozen)


def test_the_kernel_steps_aside_where_it_cannot_compute_the_call(monkeypatch):
    """Forced or not, the eager ops run for: requests packed into one row (continuous batching), fp64, a head norm
    with hooks or one that is not plain RMSNorm (LayerNorm, an RMSNorm subclass with a forward of its own), lambda on
    another device; DINT's own head norm is fused."""
    from modeling_dint.modeling_dint import DintHeadRMSNorm

    class ScaledRMSNorm(nn.RMSNorm):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
    integral = DintIntegral("mean", layer_idx=0)
    attention_output = torch.randn(1, 8, 4, 16, device=DEVICE)
    signal, noise = attention_output.chunk(2, dim=2)
    layout = DintIntegralLayout.build(None, None, None, 1, 8, torch.device(DEVICE))
    lambda_ = torch.tensor(0.5, device=DEVICE)

    def kernel(norm, signal=signal, noise=noise, lambda_=lambda_, layout=layout):
        return integral.kernel_for(signal, noise, lambda_, layout, None, norm.to(DEVICE))

    assert kernel(DintHeadRMSNorm(16)) == "triton" and kernel(nn.RMSNorm(16)) == "triton"
    assert kernel(nn.LayerNorm(16)) == "eager" and kernel(ScaledRMSNorm(16)) == "eager"
    hooked = nn.RMSNorm(16)
    hooked.register_full_backward_hook(lambda *args: None)
    assert kernel(hooked) == "eager"
    assert kernel(nn.Identity(), signal=signal.double(), noise=noise.double()) == "eager"
    assert kernel(nn.Identity(), lambda_=torch.tensor(0.5, device="meta")) == "eager"
    packed = DintIntegralLayout.for_packed_requests(torch.arange(8)[None], torch.tensor([0, 3, 8]))
    assert kernel(nn.Identity(), layout=packed.to(DEVICE)) == "eager"


def test_forcing_triton_on_cpu_without_the_interpreter_fails_clearly(tmp_path):
    """Without `TRITON_INTERPRET=1`, Triton cannot run on CPU tensors: forcing it says so instead of running eager."""
    script = (
        "import torch, sys; sys.path.insert(0, 'tests')\n"
        "from dint_testing import tiny_model\n"
        "model = tiny_model()\n"
        "try:\n"
        "    model(torch.randint(3, 128, (1, 6)))\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    environment = {**os.environ, "DINT_INTEGRAL_KERNEL": "triton", "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert "DINT_INTEGRAL_KERNEL=triton, but Triton cannot run on cpu tensors here" in result.stdout, result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout


def test_a_bare_dynamic_cache_still_gets_the_state_checked(kernel_calls):
    """The kernel path keeps the cache's contract: a cache built from the config carries the state it stores."""
    model = tiny_model().to(DEVICE)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 9), device=DEVICE), **with_cache(cache))
    assert len(kernel_calls) == model.config.num_hidden_layers
    assert carried_state(cache, 0, SIGNAL_SUM).shape == (1, 2, 32)
