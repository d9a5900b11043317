"""The Triton integral kernel (`modeling_dint/integral_triton_kernel.py`) against the eager ops it replaces, forward
and backward: outputs, the state the cache keeps and every gradient, for every layout of rows (padding inside rows,
packed documents, a carried state, restarts at chunk boundaries), both head layouts, fp32 and bf16, odd lengths and
head sizes; through a whole model (forward, backward, cached generation); no new compilation per length or batch
size; and the plan's choice (`choose_implementation`, `DINT_INTEGRAL_KERNEL`).

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
from modeling_dint.cache_dint import DintDynamicLayer
from modeling_dint.integral_cpu_kernel import integral_kernel
from modeling_dint.integral_dint import (
    CPU_KERNEL,
    EAGER,
    TRITON_KERNEL,
    TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT,
    DintIntegral,
    DintIntegralLayout,
    choose_implementation,
    combine_with_integral,
    document_starts,
    kernel_takes,
    plan_integral,
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
        signal, noise, torch.tensor(0.5, device=DEVICE), layout.inverse_query_count[:, :, 0, 0], layout.row_flags(),
        None, None, False, 0.0,
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
        layout.row_flags(), carry, weight, normalize, eps, store_running=True,
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
        # compiler's fusion of the eager ops, not the kernel (`choose_implementation`; tests/test_gpu.py compiles it)
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
            cache_of(chunk).layers[layer_idx].signal_sum, cache_of(full).layers[layer_idx].signal_sum,
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
        integral(signal, noise, torch.tensor(0.5, device=DEVICE), layout, head_norm).sum().backward()
    # One variant each: the tails, the chunk scan forward and back, the forward, the backward's two passes
    assert len(set(launches)) == 6, sorted(set(launches))
    if DEVICE == "cuda":
        monkeypatch.undo()  # the kernels themselves again
        new = {name: count - before[name] for name, count in compiled().items()}
        at_most = {"_chunk_tails_kernel": 1, "_chunk_scan_kernel": 2, "_integral_forward_kernel": 1,
                   "_integral_backward_kernel": 2}  # (fewer where an earlier test compiled the same variant)
        assert all(new[name] <= at_most[name] for name in kernels), new


def planned_layout(model, input_ids: torch.Tensor) -> DintIntegralLayout:
    """The planned layout that one forward of `model` over `input_ids` gives its layers (`forward_integral_layout`)."""
    captured = {}
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True
    )
    try:
        model(input_ids.to(DEVICE))
    finally:
        handle.remove()
    return captured["integral_layout"]


def test_dint_integral_kernel_chooses_and_refuses(monkeypatch):
    """`DINT_INTEGRAL_KERNEL`, read by each forward's plan: "eager" runs the eager ops, "triton" the kernel (here, on
    CPU, under the interpreter) with the rows it reads, unset chooses by device (CUDA: the kernel in training mode or
    with a gradient, the eager ops for a short call in eval mode without one; CPU: its kernel without a gradient).
    Another value is refused, naming the variable and the choices; "triton" in a dtype the kernel does not take is
    refused, naming the dtypes it takes."""
    model = tiny_model().to(DEVICE)
    input_ids = torch.randint(3, 128, (1, 8))
    cpu_kernel = CPU_KERNEL if integral_kernel() is not None else EAGER  # (where a C++ compiler builds it)
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    with torch.no_grad():
        assert planned_layout(model, input_ids).implementation == EAGER
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
    with torch.no_grad():
        layout = planned_layout(model, input_ids)
    assert layout.implementation == TRITON_KERNEL
    assert torch.equal(layout.kernel_row_flags, layout.row_flags())
    assert torch.equal(layout.kernel_inverse_count, layout.inverse_query_count[:, :, 0, 0])
    monkeypatch.delenv("DINT_INTEGRAL_KERNEL")
    with torch.no_grad():  # CUDA: a short call in eval mode
        assert planned_layout(model, input_ids).implementation == (EAGER if DEVICE == "cuda" else cpu_kernel)
        in_training = planned_layout(model.train(), input_ids)
    assert in_training.implementation == (TRITON_KERNEL if DEVICE == "cuda" else cpu_kernel)
    with torch.enable_grad():
        assert planned_layout(model.eval(), input_ids).implementation == (
            TRITON_KERNEL if DEVICE == "cuda" else EAGER
        )
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "fast")
    with pytest.raises(ValueError, match="DINT_INTEGRAL_KERNEL='fast' is not one of auto, eager, triton"):
        model(input_ids.to(DEVICE))
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
    with pytest.raises(ValueError, match="DINT_INTEGRAL_KERNEL=triton, but the Triton kernel takes torch.float32, "
                       "torch.bfloat16, torch.float16 and this forward computes in torch.float64"):
        model.double()(input_ids.to(DEVICE))


def test_unforced_the_kernel_takes_calls_with_a_gradient_in_training_or_with_many_elements(monkeypatch):
    """With `DINT_INTEGRAL_KERNEL` unset, a CUDA forward takes the kernel where it cost less than the eager ops on an
    H200 (`choose_implementation`): every forward in grad mode, every one in training mode (a reentrant checkpoint's
    forward without gradient rounds as its recomputation), and from `TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT` elements of
    O1 per layer on (not a decoding step or a short prefill); never while compiling, for requests packed into one row,
    or in a dtype the kernel does not take (unforced: no error). Off CUDA, Triton is made to run on CUDA devices here:
    the rule is tested, not the device."""
    if DEVICE != "cuda":
        monkeypatch.setattr(triton_kernel, "runs_on", lambda device: device.type == "cuda")

    def chosen(batch_size, rows, gradient=False, training=False, compiling=False, per_row=False, dtype=torch.bfloat16):
        elements = batch_size * rows * 16 * 128  # O1 of 16 differential heads of 128 channels
        return choose_implementation(
            torch.device("cuda"), "auto", dtype, elements, gradient, training, compiling, per_row, None
        )

    assert chosen(1, 1) == EAGER  # decoding
    assert chosen(8, 1) == EAGER
    assert chosen(1, 2048) == EAGER  # 4.2M: eager measured faster
    assert chosen(1, 8192) == TRITON_KERNEL  # 16.8M: the kernel measured faster
    assert chosen(1, TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT // 2048) == TRITON_KERNEL
    assert chosen(1, TRITON_MIN_ELEMENTS_WITHOUT_GRADIENT // 2048 - 1) == EAGER
    assert chosen(1, 1, gradient=True) == TRITON_KERNEL
    assert chosen(1, 1, training=True) == TRITON_KERNEL
    assert chosen(1, 8192, gradient=True, training=True, compiling=True) == EAGER  # the compiler fuses the eager ops
    assert chosen(1, 8192, gradient=True, per_row=True) == EAGER  # continuous batching's packed requests
    assert chosen(1, 8192, gradient=True, dtype=torch.float64) == EAGER


def test_the_plan_reads_the_gradient_from_grad_mode():
    """The plan's gradient is grad mode when the forward plans (`torch.is_grad_enabled()`), whatever requires one: a
    frozen model (a LoRA adapter's base, an evaluation with grad mode on) plans as a trainable one, and a trainable one
    plans without a gradient under `torch.no_grad()`. A layout its caller builds (vLLM's) is planned by its first call
    alike, in eval mode, though no tensor of the call requires a gradient. A gradient takes the kernel on CUDA and the
    eager ops on CPU (its kernel has no backward); none, at this length, the eager ops on CUDA and the kernel on CPU."""
    with_gradient = TRITON_KERNEL if DEVICE == "cuda" else EAGER
    without_gradient = EAGER if DEVICE == "cuda" else (CPU_KERNEL if integral_kernel() is not None else EAGER)
    input_ids = torch.randint(3, 128, (1, 8))
    for model in (tiny_model().to(DEVICE), tiny_model().to(DEVICE).requires_grad_(False)):
        with torch.enable_grad():
            assert planned_layout(model, input_ids).implementation == with_gradient
        with torch.no_grad():
            assert planned_layout(model, input_ids).implementation == without_gradient
    integral = DintIntegral("mean", layer_idx=0)
    signal, noise = torch.randn(1, 8, 4, 16, device=DEVICE).chunk(2, dim=2)
    for grad_mode, expected in ((True, with_gradient), (False, without_gradient)):
        layout = DintIntegralLayout.build(None, None, None, 1, 8, torch.device(DEVICE))
        with torch.set_grad_enabled(grad_mode):
            integral(signal, noise, torch.tensor(0.5, device=DEVICE), layout, nn.Identity())
        assert layout.implementation == expected


def test_the_kernel_steps_aside_where_it_cannot_compute_the_call(kernel_calls, monkeypatch):
    """Forced, the kernel leaves to the eager ops, with their output, every call it cannot compute (`kernel_takes`, per
    call): a caller that normalizes itself (no head norm), a head norm with hooks or one that is not plain RMSNorm
    (LayerNorm, an RMSNorm subclass with a forward of its own), lambda on another device; and the plan gives requests
    packed into one row (continuous batching) the eager ops. DINT's own head norm is fused."""
    from modeling_dint.modeling_dint import DintHeadRMSNorm

    class ScaledRMSNorm(nn.RMSNorm):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    integral = DintIntegral("mean", layer_idx=0)
    signal, noise = torch.randn(1, 8, 4, 16, device=DEVICE).chunk(2, dim=2)
    lambda_ = torch.tensor(0.5, device=DEVICE)

    def call(head_norm, kernel):
        monkeypatch.setenv("DINT_INTEGRAL_KERNEL", kernel)
        layout = DintIntegralLayout.build(None, None, None, 1, 8, torch.device(DEVICE))
        with torch.no_grad():
            output = integral(signal, noise, lambda_, layout, head_norm)
        assert layout.implementation == (TRITON_KERNEL if kernel == "triton" else EAGER)
        return output

    for head_norm in (DintHeadRMSNorm(16), nn.RMSNorm(16)):
        head_norm = head_norm.to(DEVICE)
        assert kernel_takes(signal, noise, lambda_, head_norm, signal.dtype)
        launches = len(kernel_calls)
        assert_close(call(head_norm, "triton"), call(head_norm, "eager"), torch.float32)
        assert len(kernel_calls) == launches + 1
    forward_hooked, backward_hooked = nn.RMSNorm(16), nn.RMSNorm(16)
    forward_hooked.register_forward_hook(lambda module, args, output: 2 * output)
    backward_hooked.register_full_backward_hook(lambda *args: None)
    launches = len(kernel_calls)
    for head_norm in (None, nn.LayerNorm(16), ScaledRMSNorm(16), forward_hooked, backward_hooked):
        head_norm = None if head_norm is None else head_norm.to(DEVICE)
        assert not kernel_takes(signal, noise, lambda_, head_norm, signal.dtype)
        assert_close(call(head_norm, "triton"), call(head_norm, "eager"), torch.float32)
    assert len(kernel_calls) == launches
    assert not kernel_takes(signal, noise, torch.tensor(0.5, device="meta"), nn.Identity(), signal.dtype)
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
    packed = DintIntegralLayout.for_packed_requests(torch.arange(8)[None], torch.tensor([0, 3, 8])).to(DEVICE)
    plan_integral(packed, None, torch.device(DEVICE), torch.float32, signal.numel(), False, False)
    assert packed.implementation == EAGER


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
    assert cache.layers[0].signal_sum.shape == (1, 2, 32)
