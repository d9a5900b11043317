"""A config edit after the model is built: the fields the modules are built from (`ARCHITECTURE_FIELDS`) are refused at
the assignment on a config a built model holds, with a message that names the field and says how to get that model;
the model in memory, its save and its reload stay equal. An edited copy builds the model asked for. transformers'
runtime fields stay settable, and copies of a config are free again."""

import copy
import gc
import pickle
from dataclasses import FrozenInstanceError

import pytest
import torch

from dint_testing import V2_GATED, assert_equal_to_rounding, tiny_model
from modeling_dint import DintConfig, DintForCausalLM
from modeling_dint.configuration_dint import ARCHITECTURE_FIELDS
from modeling_dint.transformers_compat import CACHE_ARGUMENT


MAIN_JOB_PRESET = "tiny"
"""The main job's model (`configuration/tiny.json`), on which the edits were first tried."""

REFUSED_EDITS = [
    ("integral", "none"),
    ("integral", "softmax"),
    ("integral", "bogus"),
    ("lambda_init", 0.5),
    ("head_norm", False),
    ("head_norm_affine", False),
    ("differential_attention", "v2"),
    ("num_attention_heads", 8),
    ("num_key_value_heads", 4),
    ("head_dim", 32),
    ("hidden_size", 512),
    ("rms_norm_eps", 1e-3),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}),
]


def main_job_model() -> DintForCausalLM:
    torch.manual_seed(0)
    return DintForCausalLM(DintConfig.from_preset(MAIN_JOB_PRESET)).eval()


def reloaded(model, path) -> DintForCausalLM:
    model.save_pretrained(path)
    return DintForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(3, 1000, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("field, value", REFUSED_EDITS, ids=[f"{field}={value}" for field, value in REFUSED_EDITS])
def test_an_architecture_edit_on_a_built_model_is_refused_at_the_assignment(field, value, input_ids, tmp_path):
    """Refused at once, naming the field, the value and how to get that model; the model, its config, its save and
    its reload are what they were."""
    model = main_job_model()
    with torch.no_grad():
        before = model(input_ids).logits
    value_before = copy.deepcopy(getattr(model.config, field))
    with pytest.raises(FrozenInstanceError) as error:
        setattr(model.config, field, value)
    message = str(error.value)
    assert f"`{field}={value!r}`" in message and "built DINT model" in message
    assert "copy.deepcopy(model.config)" in message and f"from_pretrained(path, {field}=" in message
    assert getattr(model.config, field) == value_before
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, before)
        assert_equal_to_rounding(reloaded(model, tmp_path)(input_ids).logits, before)


def test_the_lambda_gate_of_a_v2_model_is_refused_too():
    model = tiny_model(**V2_GATED)
    with pytest.raises(FrozenInstanceError, match="`lambda_gate=False`"):
        model.config.lambda_gate = False
    assert model.config.lambda_gate is True


@pytest.mark.parametrize(
    "field, value", [("integral", "none"), ("integral", "softmax"), ("lambda_init", 0.5), ("head_norm", False)]
)
def test_a_model_built_from_an_edited_copy_is_that_model_and_reloads_equal(field, value, input_ids, tmp_path):
    """The ways the message gives: an edited copy of the config builds the model asked for (here with the first
    model's weights, less the head norms where `head_norm=False`); it computes another function, and saves and
    reloads to equal logits. The first model's saved weights loaded under the edited field give that model too."""
    model = main_job_model()
    config = copy.deepcopy(model.config)
    setattr(config, field, value)
    edited = DintForCausalLM(config).eval()
    missing, unexpected = edited.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(name.endswith("head_norm.weight") for name in unexpected)
    assert bool(unexpected) == (field == "head_norm")
    assert getattr(edited.config, field) == value and getattr(model.config, field) != value
    with torch.no_grad():
        logits = edited(input_ids).logits
        assert torch.isfinite(logits).all()
        assert (logits - model(input_ids).logits).abs().max() > 1e-3  # the edit took effect
        assert_equal_to_rounding(reloaded(edited, tmp_path / "edited")(input_ids).logits, logits)
        # The message's other way: the saved weights loaded under the edited field give the same model.
        model.save_pretrained(tmp_path / "original")
        loaded = DintForCausalLM.from_pretrained(tmp_path / "original", **{field: value}).eval()
        assert_equal_to_rounding(loaded(input_ids).logits, logits)
    assert getattr(DintConfig.from_pretrained(tmp_path / "edited"), field) == value


def test_an_invalid_value_in_an_edited_copy_is_refused_when_the_model_is_built():
    config = copy.deepcopy(main_job_model().config)
    config.integral = "bogus"
    with pytest.raises(Exception, match="`integral` must be one of"):
        DintForCausalLM(config)


def test_runtime_fields_stay_settable_and_take_effect(input_ids, tmp_path):
    """transformers' runtime fields, the token ids, `vocab_size` through `resize_token_embeddings` and
    `num_hidden_layers` (the forward runs the first layers: transformers' early-exit assistant) change on a built
    model; so does `one_pass_attention`, read at every forward and validated at the assignment."""
    model = main_job_model()
    with torch.no_grad():
        reference = model(input_ids).logits
        model.config.use_cache = False
        assert getattr(model(input_ids), CACHE_ARGUMENT) is None
        model.config.use_cache = True
        model.config.output_hidden_states = True
        assert len(model(input_ids).hidden_states) == model.config.num_hidden_layers + 1
        model.config.output_hidden_states = False
        model.set_attn_implementation("eager")
        model.config.output_attentions = True
        assert len(model(input_ids).attentions) == model.config.num_hidden_layers
        model.config.output_attentions = False
        model.set_attn_implementation("sdpa")
        model.config.pad_token_id = 0
        model.config.one_pass_attention = True
        torch.testing.assert_close(model(input_ids).logits, reference, rtol=1e-5, atol=1e-5)
        model.config.one_pass_attention = None
        layers = model.config.num_hidden_layers
        model.config.num_hidden_layers = 1
        early_exit = model(input_ids).logits
        model.config.num_hidden_layers = layers
        assert (early_exit - reference).abs().max() > 1e-3
        assert torch.equal(model(input_ids).logits, reference)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    assert model.config.vocab_size == model.get_input_embeddings().weight.shape[0]
    # The same value may be assigned (a no-op), as `config.update(config.to_dict())` does.
    model.config.integral = model.config.integral
    model.config.update({"head_norm": True, "hidden_size": model.config.hidden_size})


def test_a_bound_config_validates_one_pass_attention_at_the_assignment():
    """v2 always makes one call: `one_pass_attention=True` is refused there at once (save_pretrained would write a
    config that does not load), and the config keeps its value."""
    model = tiny_model(**V2_GATED)
    with pytest.raises(ValueError, match="`one_pass_attention` must be None"):
        model.config.one_pass_attention = True
    assert model.config.one_pass_attention is None
    with pytest.raises(ValueError, match="lambda_std_dev"):
        model.config.lambda_std_dev = float("nan")
    assert model.config.lambda_std_dev == 0.3


def test_copies_of_a_bound_config_are_free_and_copies_of_the_model_bound():
    model = main_job_model()
    for copied in (copy.deepcopy(model.config), copy.copy(model.config), pickle.loads(pickle.dumps(model.config)),
                   DintConfig.from_dict(model.config.to_dict())):
        assert not copied.held_by_model()
        copied.integral = "none"
    assert model.config.integral == "mean"
    for copied_model in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied_model.config is not model.config and copied_model.config.held_by_model()
        with pytest.raises(FrozenInstanceError, match="`integral='none'`"):
            copied_model.config.integral = "none"
    config = model.config
    del model, copied_model
    gc.collect()
    assert not config.held_by_model()  # no model holds it any more
    config.integral = "none"


def test_architecture_fields_are_config_fields():
    config = DintConfig.from_preset(MAIN_JOB_PRESET)
    assert all(field in config.to_dict() for field in ARCHITECTURE_FIELDS)
