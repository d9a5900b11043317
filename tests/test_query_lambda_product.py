"""v2's query and lambda projections as one product (issue 55 item 5, docs/design.md section 11): without a gradient,
q_proj's and lambda_proj's weights are views of one storage and run as one matrix product. The saved keys do not
change, nothing the user does to a weight leaves the product stale, and where the modules must run (a gradient, hooks,
PEFT) they do."""

import copy

import pytest
import torch
from dint_testing import V2, tiny_model

from modeling_dint import DintForCausalLM


def fused_layers(model) -> list:
    """The layers whose q_proj and lambda_proj weights share the storage their fused product reads."""
    return [
        layer.self_attn
        for layer in model.model.layers
        if layer.self_attn.query_lambda_weight is not None
        and layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.query_lambda_weight.data_ptr()
        and layer.self_attn.lambda_proj.weight.untyped_storage().data_ptr()
        == layer.self_attn.query_lambda_weight.untyped_storage().data_ptr()
    ]


def logits_with_and_without_the_product(model, input_ids):
    """(one product: no gradient, two products: the modules, as in training), both fp32 logits."""
    with torch.no_grad():
        fused = model(input_ids).logits
    assert len(fused_layers(model)) == model.config.num_hidden_layers
    with torch.enable_grad():
        separate = model(input_ids).logits.detach()
    return fused, separate


@pytest.fixture
def model():
    return tiny_model(**V2).eval()


@pytest.fixture
def input_ids(model):
    return torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def test_one_product_gives_the_two_products_logits_and_the_saved_model_is_unchanged(model, input_ids, tmp_path):
    keys = list(model.state_dict())
    fused, separate = logits_with_and_without_the_product(model, input_ids)
    torch.testing.assert_close(fused, separate, rtol=0, atol=1e-6)
    assert list(model.state_dict()) == keys and not any("query_lambda" in key for key in keys)
    model.save_pretrained(tmp_path)
    reloaded = DintForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, fused)
    assert len(fused_layers(reloaded)) == model.config.num_hidden_layers


@pytest.mark.parametrize(
    "change",
    [
        "data_write_in_place",  # p.data.mul_(): no version counter sees it
        "data_assignment",  # p.data = new tensor
        "lambda_data_assignment",  # lambda's alone: q still views the fused storage
        "in_place_without_grad",  # EMA, optimizers: p.mul_(d).add_(...)
        "load_state_dict",
        "load_state_dict_assign",
        "new_parameter",
    ],
)
def test_no_change_of_a_weight_leaves_the_product_stale(model, input_ids, change):
    with torch.no_grad():
        model(input_ids)  # fused
    attention = model.model.layers[1].self_attn
    other = tiny_model(**V2, seed=7).state_dict()
    query_weight, lambda_weight = attention.q_proj.weight, attention.lambda_proj.weight
    with torch.no_grad():
        if change == "data_write_in_place":
            query_weight.data.mul_(1.5)
            lambda_weight.data.add_(0.25)
        elif change == "data_assignment":
            query_weight.data = query_weight.detach() * 1.5
            lambda_weight.data = lambda_weight.detach() + 0.25
        elif change == "lambda_data_assignment":
            lambda_weight.data = lambda_weight.detach() + 0.25
        elif change == "in_place_without_grad":
            query_weight.mul_(0.5).add_(other["model.layers.1.self_attn.q_proj.weight"], alpha=0.5)
            lambda_weight.mul_(0.5).add_(other["model.layers.1.self_attn.lambda_proj.weight"], alpha=0.5)
        elif change == "load_state_dict":
            model.load_state_dict(other)
        elif change == "load_state_dict_assign":
            model.load_state_dict({key: value.clone() for key, value in other.items()}, assign=True)
        else:
            attention.q_proj.weight = torch.nn.Parameter(query_weight.detach() * 1.5)
    # The reference: a copy that never fused, run through the modules.
    reference = copy.deepcopy(model)
    with torch.enable_grad():
        expected = reference(input_ids).logits.detach()
    with torch.no_grad():
        actual = model(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(expected, tiny_model(**V2).eval()(input_ids).logits.detach(), atol=1e-3)


def test_hooks_and_peft_wrappers_run_as_modules(model, input_ids):
    calls = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *args: calls.append("q_proj"))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    assert calls == ["q_proj"]
    assert model.model.layers[0].self_attn.query_lambda_weight is None  # the layer with the hook did not fuse
    assert len(fused_layers(model)) == model.config.num_hidden_layers - 1
    called = []  # a global hook (torch.nn.modules.module.register_module_forward_hook) sees every module run
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, *args: called.append(module))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    for layer in model.model.layers:
        assert any(module is layer.self_attn.q_proj for module in called)
        assert any(module is layer.self_attn.lambda_proj for module in called)

    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "lambda_proj"], init_lora_weights=False))
    with torch.no_grad():
        adapted = lora(input_ids).logits
    with torch.enable_grad():
        torch.testing.assert_close(adapted, lora(input_ids).logits.detach(), rtol=0, atol=1e-6)
    merged = lora.merge_and_unload()  # merges into the fused storage or replaces the weights: either way current
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids).logits, adapted, rtol=1e-5, atol=1e-5)


def test_moving_the_model_frees_the_fused_storage_and_training_after_inference_mode_works(model, input_ids):
    with torch.inference_mode():
        model(input_ids)  # fuses inside inference mode: the storage must still be a plain tensor
    assert len(fused_layers(model)) == model.config.num_hidden_layers
    assert copy.deepcopy(model).model.layers[0].self_attn.query_lambda_weight is None  # a copy holds its own
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()  # writes into the fused storage through the parameters
    model.eval()
    with torch.enable_grad():
        expected = model(input_ids).logits.detach()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, expected, rtol=0, atol=1e-6)

    model.to(torch.float64)
    assert all(layer.self_attn.query_lambda_weight is None for layer in model.model.layers)
    with torch.no_grad():
        model(input_ids)
    assert {layer.query_lambda_weight.dtype for layer in fused_layers(model)} == {torch.float64}


def test_a_weight_replaced_alone_frees_the_old_storage_and_weights_viewing_a_buffer_are_not_rebound(model, input_ids):
    with torch.no_grad():
        model(input_ids)
    attention = model.model.layers[0].self_attn
    old_storage = attention.query_lambda_weight.untyped_storage().data_ptr()
    attention.q_proj.weight = torch.nn.Parameter(attention.q_proj.weight.detach() * 1.5)  # q alone replaced
    with torch.no_grad():
        model(input_ids)
    lambda_weight = attention.lambda_proj.weight
    assert lambda_weight.untyped_storage().data_ptr() != old_storage  # lambda no longer keeps the old q rows alive
    assert len(fused_layers(model)) == model.config.num_hidden_layers

    # A framework's flat buffer (FSDP, DeepSpeed): the weights view it and it writes them there; never rebound.
    other = model.model.layers[1].self_attn
    flat = torch.cat([other.q_proj.weight.detach().flatten(), other.lambda_proj.weight.detach().flatten(), torch.zeros(3)])
    query_rows, hidden = other.q_proj.weight.shape
    other.query_lambda_weight = None
    other.q_proj.weight.data = flat[: query_rows * hidden].view(query_rows, hidden)
    other.lambda_proj.weight.data = flat[query_rows * hidden : -3].view(-1, hidden)
    with torch.no_grad():
        before = model(input_ids).logits
        flat[: query_rows * hidden].mul_(1.5)  # the owner writes its buffer
        after = model(input_ids).logits
    assert other.query_lambda_weight is None and other.q_proj.weight.data_ptr() == flat.data_ptr()
    assert not torch.allclose(before, after, atol=1e-3)


def test_offloading_hooks_added_after_fusing_free_the_storage_and_torch_func_calls_run_as_modules(model, input_ids):
    with torch.no_grad():
        model(input_ids)
    attention = model.model.layers[0].self_attn
    attention.q_proj.weight = torch.nn.Parameter(attention.q_proj.weight.detach().to("meta"))  # as offloading does
    attention.q_proj.register_forward_pre_hook(lambda module, args: None)
    attention.fused_query_lambda_weight()
    assert attention.query_lambda_weight is None

    fresh = tiny_model(**V2).eval()
    with torch.no_grad():
        expected = fresh(input_ids).logits
    parameters = {name: parameter.detach().clone() for name, parameter in fresh.named_parameters()}
    with torch.no_grad():  # plain tensors in place of the parameters (torch.func): the modules run
        actual = torch.func.functional_call(fresh, parameters, (input_ids,)).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


def test_a_copy_of_a_compiled_attention_and_an_overridden_lambda(model, input_ids):
    compiled = tiny_model(**V2).model.layers[0].self_attn
    compiled.compile()  # not run: the copy must not keep a compiled call bound to the original
    assert compiled.__dict__.get("_compiled_call_impl") is not None
    assert copy.deepcopy(compiled).__dict__.get("_compiled_call_impl") is None

    attention = model.model.layers[0].self_attn

    class ScaledLambda(type(attention)):
        def differential_lambda(self, hidden_states):
            return 0.5 * super().differential_lambda(hidden_states)

    for layer in model.model.layers:
        layer.self_attn.__class__ = ScaledLambda
    with torch.no_grad():
        without_gradient = model(input_ids).logits
    with torch.enable_grad():
        with_gradient = model(input_ids).logits.detach()
    torch.testing.assert_close(without_gradient, with_gradient, rtol=0, atol=1e-6)
