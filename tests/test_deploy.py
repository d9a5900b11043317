"""Deployment paths a transformers user expects (issue 10): pipeline with a chat template and a streamer, big-model
loading with disk offload, the offloaded KV cache, CPU quantization, torch.compile, torch.export of the decode step.

Every test compares with the plain fp32 model on the same tokens. Tensor parallelism is in test_tensor_parallel.py.
"""

import os
import threading
import time

import pytest
import torch
from dint_testing import V2, cache_of, tiny_model
from transformers import AutoTokenizer, CompileConfig, GenerationConfig

from modeling_dint import DintConfig, DintForCausalLM, integral_state_buffers
from modeling_dint.integrations.release_bridges import compile_on_every_device


DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data")
TOKENIZER_DIR = os.path.join(DATA_DIR, "tokenizer")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def greedy_reference(model, input_ids, new_tokens=NEW_TOKENS, attention_mask=None):
    """Greedy tokens and per-step logits of the plain eager model recomputing the whole sequence at every step."""
    output = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        use_cache=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return output.sequences, torch.stack(output.logits, dim=1)


# --- pipeline, chat template, streaming ---


def test_pipeline_from_checkpoint_with_chat_template_and_iterator_streamer(tmp_path, tokenizer):
    from transformers import TextIteratorStreamer, pipeline

    model = tiny_model(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Speak the speech, I pray you."}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_ids = prompt_ids["input_ids"]
    expected, _ = greedy_reference(model, prompt_ids)
    expected_reply = tokenizer.decode(expected[0, prompt_ids.shape[1] :], skip_special_tokens=True)

    generator = pipeline("text-generation", model=str(tmp_path), trust_remote_code=True, dtype=torch.float32)
    assert type(generator.model).__name__ == "DintForCausalLM"
    chat = generator(messages, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    assert chat[:-1] == messages and chat[-1]["role"] == "assistant"
    assert chat[-1]["content"] == expected_reply

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    thread = threading.Thread(
        target=generator.model.generate,
        kwargs=dict(input_ids=prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=streamer),
    )
    thread.start()
    chunks = list(streamer)
    thread.join()
    assert len(chunks) > 1  # it streamed, not one final string
    assert "".join(chunks) == expected_reply


# --- big-model loading (Accelerate) ---


def test_device_map_auto_with_disk_offload_generates_the_plain_tokens(tmp_path):
    model = tiny_model(hidden_size=128, intermediate_size=256, num_hidden_layers=4, vocab_size=256)
    model.save_pretrained(tmp_path / "checkpoint")
    checkpoint_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    input_ids = torch.randint(2, 256, (2, 10))
    expected, expected_logits = greedy_reference(model, input_ids)

    offloaded = DintForCausalLM.from_pretrained(
        tmp_path / "checkpoint",
        device_map="auto",
        max_memory={"cpu": checkpoint_bytes // 2},  # half the checkpoint: the rest must go to disk
        offload_folder=tmp_path / "offload",
        dtype=torch.float32,
    )
    device_map = offloaded.hf_device_map
    assert "disk" in device_map.values() and "cpu" in device_map.values(), device_map
    # `_no_split_modules`: every decoder layer is placed whole (no entry below "model.layers.{i}").
    layer_entries = [name for name in device_map if name.startswith("model.layers")]
    assert all(name.count(".") == 2 for name in layer_entries), layer_entries

    output = offloaded.generate(
        input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    assert torch.equal(output.sequences, expected)
    torch.testing.assert_close(torch.stack(output.logits, dim=1), expected_logits, atol=1e-5, rtol=1e-5)


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_13b_preset_builds_on_meta_in_seconds_and_without_memory():
    from accelerate import infer_auto_device_map

    rss_before = current_rss_bytes()
    start = time.perf_counter()
    config = DintConfig.from_preset("13.1b")
    with torch.device("meta"):
        model = DintForCausalLM(config)
    seconds = time.perf_counter() - start
    rss_growth = current_rss_bytes() - rss_before

    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert 12.5e9 < num_parameters < 13.5e9, num_parameters
    # (The lambda vectors are excluded here: see test_lambda_vectors_follow_the_device_context.)
    assert {p.device.type for name, p in model.named_parameters() if ".lambda_" not in name} == {"meta"}
    assert seconds < 10, f"building the 13.1B model on meta took {seconds:.1f} s"
    assert rss_growth < 256 * 2**20, f"building on meta grew the process by {rss_growth / 2**20:.0f} MiB"
    # The device map Accelerate infers for it keeps each decoder layer whole.
    device_map = infer_auto_device_map(
        model, max_memory={"cpu": "8GiB"}, no_split_module_classes=model._no_split_modules
    )
    assert all(name.count(".") <= 2 for name in device_map if name.startswith("model.layers")), device_map


def test_lambda_vectors_follow_the_device_context():
    with torch.device("meta"):
        model = DintForCausalLM(tiny_model().config)
    assert {parameter.device.type for parameter in model.parameters()} == {"meta"}


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="cache_implementation='offloaded' is CUDA-only in transformers 5.23: Cache.update calls "
    "torch.cuda.default_stream (transformers/cache_utils.py:1564, in Cache.update)",
)
@pytest.mark.parametrize("attn_implementation, integral", [("sdpa", "mean"), ("eager", "mean"), ("sdpa", "softmax")])
def test_offloaded_cache_keeps_the_integral_exact(attn_implementation, integral):
    model = tiny_model(attn_implementation, integral=integral).cuda()
    input_ids = torch.randint(2, 128, (2, 12), device="cuda")
    expected, expected_logits = greedy_reference(model, input_ids)
    output = model.generate(
        input_ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_implementation="offloaded",
        output_logits=True,
        return_dict_in_generate=True,
    )
    cache = cache_of(output)
    # The KV went to the host: after the last step, the last layer is offloaded (layer 0 was prefetched back).
    assert cache.offloading and cache.layers[-1].keys.device.type == "cpu"
    assert cache.layers[0].query_count.device.type == "cuda"  # the integral state stays on the compute device
    assert torch.equal(output.sequences, expected)
    torch.testing.assert_close(torch.stack(output.logits, dim=1), expected_logits, atol=1e-4, rtol=1e-4)


# --- quantization on CPU (torchao int8 weight-only through TorchAoConfig) ---


def load_int8_weight_only(checkpoint):
    pytest.importorskip("torchao", reason="torchao is the `quantization` extra: pip install -e '.[quantization]'")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return DintForCausalLM.from_pretrained(
        checkpoint,
        quantization_config=TorchAoConfig(Int8WeightOnlyConfig()),
        device_map="cpu",
        dtype=torch.float32,
    ).eval()


def test_torchao_int8_weight_only_quantizes_linears_and_keeps_lambdas_and_norms_fp32(tmp_path):
    model = tiny_model(hidden_size=128, intermediate_size=256, vocab_size=256)
    model.save_pretrained(tmp_path)
    quantized = load_int8_weight_only(tmp_path)

    for layer in quantized.model.layers:
        attention = layer.self_attn
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, layer.mlp.down_proj):
            assert type(linear.weight).__name__ == "Int8Tensor"
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            parameter = getattr(attention, name)
            assert type(parameter) is torch.nn.Parameter and parameter.dtype == torch.float32
            torch.testing.assert_close(parameter, getattr(model.get_submodule(f"model.layers.{attention.layer_idx}.self_attn"), name))
        assert type(attention.head_norm.weight) is torch.nn.Parameter and attention.head_norm.weight.dtype == torch.float32

    input_ids = torch.randint(2, 256, (2, 16))
    with torch.no_grad():
        expected_logits = model(input_ids).logits
        logits = quantized(input_ids).logits
    relative_error = (logits - expected_logits).norm() / expected_logits.norm()
    assert relative_error < 0.02, relative_error
    assert (logits.argmax(-1) == expected_logits.argmax(-1)).float().mean() > 0.9
    # Generation with the (dynamic) DINT cache works on the quantized model and matches its own recomputation.
    cached = quantized.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    uncached, _ = greedy_reference(quantized, input_ids)
    assert torch.equal(cached, uncached)


def test_torchao_int8_weight_only_on_a_v2_model(tmp_path):
    """DIFF V2's layout quantizes as Llama does: every linear, lambda_proj included, int8; the logits stay close and
    cached generation matches its own recomputation."""
    model = tiny_model(hidden_size=128, intermediate_size=256, vocab_size=256, **V2)
    model.save_pretrained(tmp_path)
    quantized = load_int8_weight_only(tmp_path)
    for layer in quantized.model.layers:
        attention = layer.self_attn
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, attention.lambda_proj):
            assert type(linear.weight).__name__ == "Int8Tensor"
    input_ids = torch.randint(2, 256, (2, 16))
    with torch.no_grad():
        expected_logits = model(input_ids).logits
        logits = quantized(input_ids).logits
    assert (logits - expected_logits).norm() / expected_logits.norm() < 0.02
    cached = quantized.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    uncached, _ = greedy_reference(quantized, input_ids)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_load_keeps_lambda_vectors_in_fp32(tmp_path, dtype):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = DintForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    attention = loaded.model.layers[0].self_attn
    assert attention.q_proj.weight.dtype == dtype
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        assert getattr(attention, name).dtype == torch.float32, name
        torch.testing.assert_close(getattr(attention, name), getattr(model.model.layers[0].self_attn, name))


def heldout_perplexity(model, token_ids, block=128):
    """exp(mean next-token loss) over consecutive blocks of the held-out token stream."""
    blocks = token_ids[: len(token_ids) // block * block].view(-1, block)
    with torch.no_grad():
        losses = [model(chunk, labels=chunk).loss for chunk in blocks.split(8)]
    return torch.stack(losses).mean().exp().item()


@pytest.mark.slow
def test_int8_weight_only_heldout_perplexity_within_a_few_percent(tmp_path, tokenizer):
    """Trains a small DINT on the Shakespeare corpus (so the weights carry signal), then compares held-out
    perplexity of the fp32 model and of its torchao int8 weight-only load."""
    with open(os.path.join(DATA_DIR, "shakespeare_train.txt"), encoding="utf-8") as file:
        train_ids = torch.tensor(tokenizer(file.read()[:400_000]).input_ids)
    with open(os.path.join(DATA_DIR, "shakespeare_heldout.txt"), encoding="utf-8") as file:
        heldout_ids = torch.tensor(tokenizer(file.read()[:20_000]).input_ids)
    model = tiny_model(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2, pad_token_id=0
    ).train()
    start = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        starts = torch.randint(0, len(train_ids) - 129, (8,), generator=generator)
        batch = torch.stack([train_ids[start : start + 128] for start in starts])
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(tmp_path)
    print(f"training took {time.perf_counter() - start:.1f} s")

    fp32_perplexity = heldout_perplexity(model, heldout_ids)
    start = time.perf_counter()
    int8_perplexity = heldout_perplexity(load_int8_weight_only(tmp_path), heldout_ids)
    print(f"int8 evaluation took {time.perf_counter() - start:.1f} s")
    print(f"held-out perplexity: fp32 {fp32_perplexity:.3f}, int8 weight-only {int8_perplexity:.3f}")
    assert fp32_perplexity < 0.25 * len(tokenizer)  # it learned something (uniform would be the vocabulary size)
    assert abs(int8_perplexity / fp32_perplexity - 1) < 0.03


# --- torch.compile and torch.export ---


@pytest.mark.slow
def test_torch_compile_forward_fullgraph_equals_eager():
    model = tiny_model()
    input_ids = torch.randint(2, 128, (2, 10))
    with torch.no_grad():
        expected = model(input_ids).logits
        compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break would raise
        torch.testing.assert_close(compiled(input_ids).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_static_cache_decode_equals_eager():
    model = tiny_model()
    input_ids = torch.randint(2, 128, (1, 10))
    expected, expected_logits = greedy_reference(model, input_ids)
    compile_config = compile_on_every_device(CompileConfig(fullgraph=True, mode="default"))  # the CPU included
    output = model.generate(
        input_ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_implementation="static",
        compile_config=compile_config,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert hasattr(model, "_compiled_call")  # generate() did compile the forward
    assert torch.equal(output.sequences, expected)
    torch.testing.assert_close(torch.stack(output.logits, dim=1), expected_logits, atol=1e-5, rtol=1e-5)


def exportable_decoder(model, max_cache_len):
    """transformers' ExecuTorch recipe (`TorchExportableModuleForDecoderOnlyLM`, static cache), with the DINT
    integral state allocated before tracing and registered as buffers beside the keys and values, so that the
    exported program updates it in place from step to step as it does the KV cache."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static", cache_config={"batch_size": 1, "max_cache_len": max_cache_len}
    )
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)
    static_cache_module = exportable.model
    for name, buffer in integral_state_buffers(static_cache_module.static_cache, model.config).items():
        static_cache_module.register_buffer(name, buffer, persistent=False)
    return exportable


# The recipe registers the cache layers' integral state as buffers that the exported program updates in place: the
# "side effects" torch.compile reports are that update, on purpose.
@pytest.mark.filterwarnings("ignore:While compiling, we found certain side effects:UserWarning")
def test_torch_export_of_the_decode_step_equals_eager():
    model = tiny_model()
    input_ids = torch.randint(2, 128, (1, 10))
    with torch.no_grad():
        expected = model(input_ids).logits
    exported = exportable_decoder(model, max_cache_len=32).export(
        input_ids=input_ids[:, :1], cache_position=torch.tensor([0])
    )
    assert isinstance(exported, torch.export.ExportedProgram)
    decode_step = exported.module()
    for _ in range(2):  # a second pass from position 0 restarts the integral, as the recipe restarts the KV cache
        logits = torch.cat(
            [
                decode_step(input_ids=input_ids[:, step : step + 1], cache_position=torch.tensor([step]))
                for step in range(input_ids.shape[1])
            ],
            dim=1,
        )
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
