"""`dint-serve` (transformers' own OpenAI-compatible server for DINT), started on 127.0.0.1 and driven with the
official `openai` client, with and without continuous batching. Needs the serving extra (`.[serve]`)."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from dint_testing import tiny_model


import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402


if Version(transformers.__version__) < Version("5.23"):  # dint-serve runs transformers 5.23's serving app
    pytest.skip(f"dint-serve needs transformers >= 5.23 (installed: {transformers.__version__})", allow_module_level=True)
openai = pytest.importorskip("openai", reason='the serving extra is not installed: pip install -e ".[serve]"')
pytest.importorskip("fastapi", reason='the serving extra is not installed: pip install -e ".[serve]"')
pytest.importorskip("uvicorn", reason='the serving extra is not installed: pip install -e ".[serve]"')

from transformers import AutoTokenizer  # noqa: E402

from serve_harness import start_dint_serve  # noqa: E402


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(REPO_ROOT, "examples", "data", "tokenizer")
MAX_TOKENS = 12
CHATS = [
    [{"role": "user", "content": "To be, or not to be"}],
    [{"role": "user", "content": "Now is the winter of our discontent"}],
    [{"role": "system", "content": "You speak in verse."}, {"role": "user", "content": "Friends, Romans"}],
    [{"role": "user", "content": "O Romeo"}, {"role": "assistant", "content": "wherefore"}, {"role": "user", "content": "art thou"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny DINT (integral "mean") saved with the repo's tokenizer and its chat template."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model = tiny_model(
        integral="mean",
        initializer_range=0.3,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    directory = tmp_path_factory.mktemp("dint-serve-model")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=["default", "continuous-batching"])
def server(request, model_dir):
    # A small paged cache: continuous batching would otherwise size it from the free memory (slow to allocate)
    flags = ["--continuous-batching", "--cb-num-blocks", "64"] if request.param == "continuous-batching" else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=os.path.join(model_dir, "hub-cache"))
    dint_server = start_dint_serve(model_dir, *flags, env=env)
    yield openai.OpenAI(base_url=f"{dint_server.base_url}/v1", api_key="unused"), model_dir, dint_server
    dint_server.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    """What generate() gives (greedy), from the same saved model and tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def complete(input_ids: list[int]) -> str:
        output = model.generate(torch.tensor([input_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        return tokenizer.decode(output[0, len(input_ids) :], skip_special_tokens=True)

    def chat(messages) -> str:
        return complete(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])

    def text(prompt: str) -> str:
        return complete(tokenizer(prompt)["input_ids"])

    return chat, text


def chat_completion(client, model, messages, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kwargs)


def test_models_lists_the_served_model(server):
    client, model, _ = server
    assert model in [entry.id for entry in client.models.list().data]


def test_chat_completion_equals_generate(server, reference):
    client, model, _ = server
    reference_chat, _ = reference
    for messages in CHATS[:2]:
        response = chat_completion(client, model, messages)
        assert response.choices[0].message.content == reference_chat(messages)
        assert response.usage.completion_tokens <= MAX_TOKENS


def test_streaming_gives_the_non_streaming_text(server):
    client, model, _ = server
    messages = CHATS[2]
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in chat_completion(client, model, messages, stream=True)
        if chunk.choices
    )
    assert streamed == chat_completion(client, model, messages).choices[0].message.content


def test_completion_equals_generate(server, reference):
    client, model, _ = server
    _, reference_text = reference
    prompt = "Once more unto the breach"
    response = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == reference_text(prompt)


def test_concurrent_clients_each_get_their_own_answer(server, reference):
    client, model, _ = server
    reference_chat, _ = reference
    with ThreadPoolExecutor(max_workers=len(CHATS)) as pool:
        answers = list(pool.map(lambda messages: chat_completion(client, model, messages).choices[0].message.content, CHATS))
    assert answers == [reference_chat(messages) for messages in CHATS]
    assert len(set(answers)) > 1


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) that process `pid` has used so far (Linux: /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads the server's CPU time from /proc")
def test_streaming_generation_stops_when_the_client_disconnects(server):
    """A streaming completion with a huge `max_tokens` (capped at the model's 8192 positions: minutes of generation
    on CPU) whose client leaves after three chunks: the server stops generating (it uses no CPU after a moment) and
    answers the next request."""
    client, model, dint_server = server
    stream = client.completions.create(model=model, prompt="Once more unto the breach", max_tokens=10**9, temperature=0,
                                       stream=True)
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    time.sleep(2)  # the server sees the disconnect and cancels the generation
    before = cpu_seconds(dint_server.process.pid)
    time.sleep(3)
    assert cpu_seconds(dint_server.process.pid) - before < 0.15  # generating would use a good part of a core
    response = client.completions.create(model=model, prompt="Once more", max_tokens=3, temperature=0)
    assert response.usage.completion_tokens == 3
