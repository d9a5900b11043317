"""The DINT model as a transformers model: config validation, Auto classes, heads, save/load, remote code."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from dint_testing import (
    LAYOUTS,
    WITHOUT_THE_PACKAGE,
    assert_equal_to_rounding,
    left_padded_batch,
    realigned,
    tiny_config,
    tiny_model,
)
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from modeling_dint import (
    DintConfig,
    DintForCausalLM,
    DintForQuestionAnswering,
    DintForSequenceClassification,
    DintForTokenClassification,
    DintModel,
)
from modeling_dint.configuration_dint import depth_lambda_init
from modeling_dint.integrations.release_bridges import enable_activation_checkpointing


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_attention_heads=5, num_key_value_heads=5), "`num_attention_heads` must be even"),
        (dict(num_attention_heads=6, num_key_value_heads=3), "`num_key_value_heads` must be even"),
        (dict(num_attention_heads=6, num_key_value_heads=4), r"`num_key_value_heads` \(4\) must divide"),
        (dict(integral="cumsum"), r"`integral` must be one of \('mean', 'softmax', 'none'\), got 'cumsum'"),
        (dict(lambda_init=1.2), r"`lambda_init` must be None .* or a float in \(0, 1\), got 1.2"),
        (dict(lambda_init=0.0), r"`lambda_init` must be None"),
        (dict(head_dim=15), r"`head_dim` must be a positive even integer .* got 15"),
        (dict(hidden_size=60, num_attention_heads=8, num_key_value_heads=8), r"`head_dim` must be .* got 7"),
        (dict(attention_dropout=0.1), r"`attention_dropout` must be 0"),
    ],
)
def test_invalid_config_raises_named_error(overrides, message):
    # transformers' strict configs wrap the validator's ValueError (as for LlamaConfig); the message is ours.
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        tiny_config(**overrides)


def test_a_bad_rope_parameter_is_warned_about_once_as_for_diffllama():
    """transformers' `test_model_loading_old_rope_configs`: building the config warns about a bad rope factor once;
    building the model from it warns no more (the model validates DINT's own fields only, not transformers' again)."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as transformers_logging

    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_parameters={"rope_type": "linear", "factor": -1.0, "rope_theta": 1e4})
    logger = transformers_logging.get_logger("transformers.modeling_rope_utils")
    for config_class, model_class in ((DiffLlamaConfig, DiffLlamaForCausalLM), (DintConfig, DintForCausalLM)):
        with CaptureLogger(logger) as captured:
            model_class(config_class(**fields))
        assert captured.out.count("factor field must be") == 1, (model_class.__name__, captured.out)


def test_config_defaults_and_schedule(tmp_path):
    config = tiny_config(num_hidden_layers=3)
    assert config.model_type == "dint"
    assert config.layer_types == ["dint_attention"] * 3
    assert config.integral == "mean"
    assert [config.lambda_init_for_layer(i) for i in range(3)] == [depth_lambda_init(i) for i in range(3)]
    assert depth_lambda_init(0) == pytest.approx(0.2)
    assert tiny_config(lambda_init=0.5).lambda_init_for_layer(2) == 0.5
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" not in saved
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(reloaded, DintConfig)
    assert reloaded.to_diff_dict() == config.to_diff_dict()
    # A change of depth changes the layer types with it.
    config.num_hidden_layers = 5
    assert len(config.layer_types) == 5
    # A bad value in a saved config is caught on load.
    saved["integral"] = "bogus"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(StrictDataclassClassValidationError, match="`integral` must be one of"):
        AutoConfig.from_pretrained(tmp_path)


def test_auto_classes_build_dint_models():
    config = tiny_config()
    assert type(AutoModel.from_config(config)) is DintModel
    assert type(AutoModelForCausalLM.from_config(config)) is DintForCausalLM
    assert type(AutoModelForSequenceClassification.from_config(config)) is DintForSequenceClassification
    assert type(AutoModelForTokenClassification.from_config(config)) is DintForTokenClassification
    assert type(AutoModelForQuestionAnswering.from_config(config)) is DintForQuestionAnswering


def test_task_heads_output_shapes_and_losses():
    config = tiny_config(num_labels=3)
    input_ids, attention_mask = left_padded_batch(lengths=(8, 5))
    torch.manual_seed(0)
    classifier = DintForSequenceClassification(config).eval()
    out = classifier(input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and torch.isfinite(out.loss)
    tagger = DintForTokenClassification(config).eval()
    out = tagger(input_ids, attention_mask=attention_mask, labels=torch.zeros_like(input_ids))
    assert out.logits.shape == (2, 8, 3) and torch.isfinite(out.loss)
    reader = DintForQuestionAnswering(config).eval()
    out = reader(input_ids, attention_mask=attention_mask, start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
    assert out.start_logits.shape == (2, 8) and out.end_logits.shape == (2, 8) and torch.isfinite(out.loss)
    base = DintModel(config).eval()
    out = base(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    assert out.last_hidden_state.shape == (2, 8, config.hidden_size)
    assert len(out.hidden_states) == config.num_hidden_layers + 1


def test_tied_embeddings():
    model = DintForCausalLM(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_head_norm_switches():
    assert tiny_model(head_norm=False).model.layers[0].self_attn.head_norm.__class__.__name__ == "Identity"
    norm = tiny_model(head_norm_affine=False).model.layers[0].self_attn.head_norm
    assert norm.weight is None
    logits = tiny_model(head_norm_affine=False)(torch.randint(2, 128, (1, 6))).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model_class", [DintForCausalLM, DintForSequenceClassification])
def test_save_load_round_trip_keeps_every_weight_bit_for_bit(tmp_path, model_class):
    """The state dict reloads bit for bit. The logits equal the saved model's to the float's rounding: the reloaded
    weights sit where safetensors put them (8-byte aligned; 8 bytes off the 64-byte boundary the built model's sit on,
    here), and MKL's matrix products (without `MKL_CBWR`) may sum in another order there (on an AMD EPYC they did: 2
    units in the last place). Copied to the built model's alignment, the same weights give the same logits bit for bit
    (the same kernels on the same alignment with the same threads: what MKL promises)."""
    config = tiny_config()
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("*.bin"))
    reloaded = model_class.from_pretrained(tmp_path).eval()
    for (name, tensor), (other_name, other) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert name == other_name and tensor.dtype == other.dtype and torch.equal(tensor, other), name
    input_ids = torch.randint(2, 128, (2, 7))
    with torch.no_grad():
        expected = model(input_ids).logits
        assert_equal_to_rounding(reloaded(input_ids).logits, expected)
        assert torch.equal(realigned(reloaded)(input_ids).logits, expected)


def test_save_pretrained_writes_remote_code(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoConfig"] == "configuration_dint.DintConfig"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dint.DintForCausalLM"
    assert config["auto_map"]["AutoModelForSequenceClassification"] == "modeling_dint.DintForSequenceClassification"
    for name in ("configuration_dint.py", "modeling_dint.py", "integral_dint.py", "cache_dint.py"):
        assert (tmp_path / name).exists(), name


REMOTE_CODE_SCRIPT = WITHOUT_THE_PACKAGE + textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        logits = model(input_ids).logits
        generated = model.generate(input_ids, max_new_tokens=5, do_sample=False)
    classifier = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True, num_labels=2)
    print(json.dumps({"logits": logits.flatten().tolist(), "generated": generated.tolist(),
                      "classifier": type(classifier).__name__}))
    """
)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_remote_code_loads_in_a_fresh_process_without_the_package(tmp_path, layout):
    model = tiny_model(**layout)
    model.save_pretrained(tmp_path / "model")
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    environment.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_SCRIPT, str(tmp_path / "model")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        expected_logits = model(input_ids).logits.flatten()
        expected_tokens = model.generate(input_ids, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(torch.tensor(loaded["logits"]), expected_logits, atol=1e-6, rtol=1e-6)
    assert loaded["generated"] == expected_tokens.tolist()
    assert loaded["classifier"] == "DintForSequenceClassification"


def test_gradient_checkpointing_gives_the_same_gradients():
    input_ids, attention_mask = left_padded_batch(lengths=(9, 6))
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    gradients = []
    for checkpointing in (False, True):
        model = tiny_model()
        model.train()
        if checkpointing:
            enable_activation_checkpointing(model)
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, atol=1e-6, rtol=1e-5, msg=name)
