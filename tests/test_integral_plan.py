"""The integral's plan (issue 55): decided once per forward, a decoding step at its arithmetic's cost and equal to the
reference bit for bit, a cache that keeps only its state, the environment variable validated, Triton not imported."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from dint_testing import LAYOUTS, left_padded_batch, tiny_model, with_cache
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from modeling_dint.integral_dint import EAGER, DintIntegral, DintIntegralLayout, DintIntegralState, plan_integral


class RecordedOps(TorchDispatchMode):
    """The aten ops dispatched inside the block (views included), by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def decode_logits(model, input_ids, cache):
    """One forward per token of `input_ids` `[B, T]` after what `cache` holds: the logits of every step, `[B, T, V]`."""
    logits = []
    for step in range(input_ids.shape[1]):
        logits.append(model(input_ids[:, step : step + 1], **with_cache(cache), use_cache=True).logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["eager", "auto"])
def test_decoding_steps_equal_the_reference_bit_for_bit(layout, kernel, monkeypatch):
    """The decoding step (`S += O1` in the cache's own state, in place, then the combination, no casts) gives the
    reference's logits bit for bit in fp32: the same fp32 arithmetic in fewer ops. The reference runs where the plan
    takes no decoding step: with grad mode on. (v1 on CPU by default: the CPU op, within fp32 rounding.)"""
    if kernel == "eager":
        monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    model = tiny_model(**layout)
    input_ids = torch.randint(2, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    fast_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prompt_logits = model(input_ids[:, :6], **with_cache(fast_cache), use_cache=True).logits
    reference_cache = copy.deepcopy(fast_cache)
    with torch.no_grad():
        fast = decode_logits(model, input_ids[:, 6:], fast_cache)
    with torch.enable_grad():
        reference = decode_logits(model, input_ids[:, 6:], reference_cache)
    if kernel == "auto" and model.config.head_norm:  # v1 on CPU: the CPU op (test_a_decoding_step_takes_...)
        torch.testing.assert_close(fast, reference.detach(), atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(fast, reference.detach())
        for fast_layer, reference_layer in zip(fast_cache.layers, reference_cache.layers):
            assert torch.equal(fast_layer.signal_sum, reference_layer.signal_sum.detach())
    with torch.no_grad():
        full = model(input_ids).logits
    torch.testing.assert_close(torch.cat([prompt_logits, fast], dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decoding_steps_with_padding_and_restarts_equal_the_reference(layout, monkeypatch):
    """generate() passes a padding mask and position ids (a row whose position is 0 restarts its document): the
    decoding step zeroes the state where its row restarts and adds nothing where its row is padding, as the
    reference does; greedy tokens and scores equal the reference's."""
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")  # the prefills alike; the steps: in place against the reference
    model = tiny_model(**layout)
    input_ids, attention_mask = left_padded_batch(lengths=(9, 5))
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        fast = model.generate(input_ids, **kwargs)
    with torch.enable_grad():
        reference = model.generate(input_ids, **kwargs)
    assert torch.equal(fast.sequences, reference.sequences)
    for fast_scores, reference_scores in zip(fast.scores, reference.scores):
        assert torch.equal(fast_scores, reference_scores)

    # A row that restarts its document at a decoding step (position id 0 there, row 0 only): the step's state is
    # the new row's O1 alone in that row, the carried sum plus it in the other, as in the reference.
    prompt_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids[:, :4], **with_cache(prompt_cache), use_cache=True)

    def restarting_step():
        cache = copy.deepcopy(prompt_cache)
        logits = model(input_ids[:, 4:5], position_ids=torch.tensor([[0], [4]]), **with_cache(cache), use_cache=True)
        return logits.logits, [layer.signal_sum for layer in cache.layers]

    with torch.no_grad():
        fast_logits, fast_states = restarting_step()
    with torch.enable_grad():
        reference_logits, reference_states = restarting_step()
    assert torch.equal(fast_logits, reference_logits.detach())
    assert all(torch.equal(a, b.detach()) for a, b in zip(fast_states, reference_states))


STEP_INPUTS = {  # what a decoding step is given, and the ops its integral then dispatches (before v1's head norm)
    "no position ids": ["unsqueeze", "add_", "addcmul", "addcmul"],
    # generate() passes position ids: a row at position 0 restarts its document, so the state is `O1 + S * factor`
    "generate's position ids": ["unsqueeze", "addcmul", "addcmul", "addcmul"],
    # and a padding mask where a row is padded: O1 zeroed where the new row is padding (a `where`, never a product:
    # NaN; its 0.0 is a wrapped CPU scalar, no kernel on a GPU, where an out-of-place `masked_fill` would copy first)
    "generate's padding mask": ["unsqueeze", "scalar_tensor", "where", "addcmul", "addcmul", "addcmul"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("step_inputs", list(STEP_INPUTS))
def test_a_decoding_step_dispatches_its_arithmetic(layout, step_inputs, monkeypatch):
    """A layer's integral in a decoding step (fp32) dispatches the sum into the state in place (one op; with padding,
    a `where` before it), the two fused multiply-adds (and a view, and v1's head norm), nothing else: no cast, no
    copy, no scan, whether or not the step has generate()'s position ids and padding mask. The state is the carried
    sum plus the new row, the new row alone where the row restarts (position id 0), unchanged where it is padding.
    (By default on CPU a v1 layer takes the CPU op instead, which fuses its head norm:
    `test_a_v1_decoding_step_takes_the_cpu_op`.)"""
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    model = tiny_model(**layout)
    attention = model.model.layers[1].self_attn
    cache = DynamicCache(config=model.config)
    captured = {}

    def capture(module, args, kwargs):
        captured.update(kwargs)

    prompt, attention_mask = left_padded_batch(lengths=(8, 5))
    step_kwargs, restarts, padded = {}, torch.tensor([False, False]), torch.tensor([False, False])
    if step_inputs != "no position ids":  # row 0 restarts its document; row 1 goes on (generate()'s next position)
        step_kwargs["position_ids"] = torch.tensor([[0], [5]])
        restarts = torch.tensor([True, False])
    if step_inputs == "generate's padding mask":  # and row 1's new token is padding
        step_kwargs["attention_mask"] = torch.cat([attention_mask, torch.tensor([[1], [0]])], dim=-1)
        padded = torch.tensor([False, True])
    handle = attention.register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad():
        model(prompt, attention_mask=attention_mask, **with_cache(cache), use_cache=True)
        model(torch.randint(2, 128, (2, 1)), **step_kwargs, **with_cache(cache), use_cache=True)
    handle.remove()
    layout_of_step = captured["integral_layout"]
    assert layout_of_step.decoding_step
    assert (layout_of_step.step_carry_factor is None) == (step_inputs == "no position ids")
    assert (layout_of_step.step_valid is None) == (step_inputs != "generate's padding mask")
    heads, channels = model.config.num_differential_heads, model.config.differential_head_dim
    signal, noise = torch.randn(2, 2, 1, heads, channels)
    lambda_ = attention.differential_lambda(torch.randn(2, 1, model.config.hidden_size))
    state_before = cache.layers[1].signal_sum.clone()
    with torch.no_grad(), RecordedOps() as recorded:
        attention.integral(signal, noise, lambda_, layout_of_step, attention.head_norm)
    expected = STEP_INPUTS[step_inputs]
    norm_ops = recorded.names[len(expected):]
    assert recorded.names[: len(expected)] == expected, recorded.names
    assert all(name in ("rms_norm", "_fused_rms_norm", "pow", "mean", "add", "add_", "rsqrt", "mul") for name in norm_ops)
    assert (len(norm_ops) == 0) == (type(attention.head_norm) is torch.nn.Identity), recorded.names
    carried = torch.where(restarts[:, None, None], 0.0, state_before)
    state_after = torch.where(padded[:, None, None], carried, carried + signal[:, 0])
    torch.testing.assert_close(cache.layers[1].signal_sum, state_after, rtol=0, atol=0)


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind `tensors`."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["eager", "auto"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_cache_keeps_only_its_state(layout, kernel, batch_size, monkeypatch):
    """After a prefill the cache's integral states own their storage: `[B, heads, C]` fp32 per layer and layer 0's
    count `[B]`, not views of the call's `[T, ...]` running sums (which a prompt cached for reuse would keep alive)."""
    if kernel == "eager":
        monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    model = tiny_model(**layout)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(2, 128, (batch_size, 300)), **with_cache(cache), use_cache=True)
    heads, channels = model.config.num_differential_heads, model.config.differential_head_dim
    states = [layer.signal_sum for layer in cache.layers] + [cache.layers[0].query_count]
    expected = 4 * batch_size * (heads * channels * len(cache.layers) + 1)
    assert storage_bytes(states) == expected


def test_the_integral_kernel_variable_is_validated_in_every_forward(monkeypatch):
    """`DINT_INTEGRAL_KERNEL` is read once per forward and refused when it is not a known value, whatever the model's
    integral and attention; a change between forwards takes effect at the next one."""
    input_ids = torch.randint(2, 128, (1, 5))
    models = [tiny_model(), tiny_model("eager"), tiny_model(integral="softmax"), tiny_model(integral="none")]
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "bogus")
    for model in models:
        with pytest.raises(ValueError, match="DINT_INTEGRAL_KERNEL='bogus' is not one of auto, eager, triton"):
            model(input_ids)
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "eager")
    captured = {}
    handle = models[0].model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True
    )
    with torch.no_grad():
        models[0](input_ids)
    assert captured["integral_layout"].implementation == EAGER
    monkeypatch.setenv("DINT_INTEGRAL_KERNEL", "triton")
    triton_importable = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0
    if not triton_importable:
        with pytest.raises(RuntimeError, match="DINT_INTEGRAL_KERNEL=triton, but Triton cannot run on cpu tensors"):
            models[0](input_ids)
    handle.remove()


def test_import_does_not_import_triton(tmp_path):
    """`import modeling_dint` and a CPU forward never import Triton (it reads `TRITON_INTERPRET` when imported): a
    `triton` that fails on import is never touched."""
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('triton was imported')\n")
    script = textwrap.dedent(
        """
        import sys
        import torch
        import modeling_dint
        from modeling_dint import DintConfig, DintForCausalLM
        config = DintConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)
        model = DintForCausalLM(config).eval()
        with torch.no_grad():
            model.generate(torch.randint(2, 64, (1, 5)), max_new_tokens=3, do_sample=False)
        assert "triton" not in sys.modules, "triton was imported"
        """
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_layout_moved_to_another_device_is_planned_for_it():
    """`DintIntegralLayout.to` (what Accelerate's hooks call per layer) returns the layout itself on its own device,
    and a moved copy otherwise, planned again for that kind of device from the same inputs (a layer offloaded with
    `device_map`), the rest of the plan kept."""
    device = torch.device("cpu")
    layout = DintIntegralLayout.build(None, None, None, 1, 4, device)
    with torch.enable_grad():  # a training forward on CPU: the eager ops with the blocked scan
        plan_integral(layout, None, device, torch.float32, 4 * 64, True, False)
    assert layout.to("cpu") is layout and layout.implementation == EAGER and layout.running_sum is not None
    moved = layout.to("meta")
    assert moved is not layout and moved.running_query_count.device.type == "meta"
    assert moved.implementation == EAGER and moved.running_sum is None  # no tuned scan on another kind of device
    assert moved.plan_inputs == layout.plan_inputs and layout.running_query_count.device == device


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_decoding_step_takes_the_cheaper_implementation(layout):
    """By default on CPU a decoding step of a layer that normalizes each head (v1) takes the CPU op, one call in place
    of the combination's and the head norm's ten ops; without a head norm (v2) the in-place ops, which cost the host
    less than the op's call."""
    from modeling_dint.integral_cpu_kernel import integral_kernel

    model = tiny_model(**layout)
    cache, captured = DynamicCache(config=model.config), {}
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True
    )
    with torch.no_grad():
        model(torch.randint(2, 128, (1, 8)), **with_cache(cache), use_cache=True)
        model(torch.randint(2, 128, (1, 1)), **with_cache(cache), use_cache=True)
    handle.remove()
    planned = captured["integral_layout"]
    if integral_kernel() is not None and model.config.head_norm:
        assert planned.implementation == "cpu" and not planned.decoding_step
    else:
        assert planned.decoding_step


class TableState(DintIntegralState):
    """A packed-request holder as vLLM's step is: a state table; each row carries its request's slot (`row_slot`, -1
    for a request with no past), the kernel reads it at the request's first row (`carry_slot`) and each storing row
    stores its running sum (`store_slot`)."""

    records_rows, keeps_state_table = True, True

    def __init__(self, table, row_slot, carry_slot, store_slot):
        self.table, self.row_slot, self.carry_slot, self.store_slot = table, row_slot, carry_slot, store_slot

    def carried(self, layer_idx, state_idx):
        return torch.where((self.row_slot >= 0)[:, None, None], self.table[self.row_slot.clamp(min=0)], 0.0)[None]

    def store(self, state, layer_idx, state_idx, running_rows=None):
        stores = self.store_slot >= 0
        self.table[self.store_slot[stores]] = running_rows[0, stores]

    def state_table(self, layer_idx):
        return self.table, self.carry_slot[None], self.store_slot[None]


def test_a_callers_layout_with_its_own_kernel_rows_is_planned_by_its_first_call():
    """vLLM builds its step's layout itself, with the kernel's row flags but not the inverse counts: the first call
    plans it (the CPU op for packed requests with a state table, where it builds) and fills in what is missing; the
    output and the stored states equal the eager ops'."""
    from modeling_dint.integral_cpu_kernel import integral_kernel

    positions, cu_seq_lens_q = torch.tensor([[3, 4, 0, 1, 2]]), torch.tensor([0, 2, 5])
    heads, channels = 2, 8
    generator = torch.Generator().manual_seed(0)
    signal, noise = torch.randn(2, 1, 5, heads, channels, generator=generator)
    lambda_ = torch.tensor(0.3)
    head_norm = torch.nn.RMSNorm(channels, eps=1e-6)
    results = []
    for kernel in ("auto", "eager"):
        os.environ["DINT_INTEGRAL_KERNEL"] = kernel
        try:
            layout = DintIntegralLayout.for_packed_requests(positions, cu_seq_lens_q)
            layout.kernel_row_flags = layout.row_flags()
            table = torch.randn(4, heads, channels, generator=torch.Generator().manual_seed(1))
            state = TableState(
                table, torch.tensor([2, 2, -1, -1, -1]), torch.tensor([2, -1, -1, -1, -1]), torch.tensor([-1, 1, -1, -1, 3])
            )
            with torch.no_grad():
                output = DintIntegral("mean", 0)(signal, noise, lambda_, layout, head_norm, state)
        finally:
            del os.environ["DINT_INTEGRAL_KERNEL"]
        expected_implementation = "cpu" if kernel == "auto" and integral_kernel() is not None else EAGER
        assert layout.implementation == expected_implementation
        assert layout.kernel_inverse_count is not None or expected_implementation == EAGER
        results.append((output, table))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-5)
