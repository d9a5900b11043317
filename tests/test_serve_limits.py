"""One bad request never takes `dint-serve` down: each request that the model or the server cannot complete gets a 400
naming the limit, and the server keeps serving (the next request is answered, `/health` stays ok). Checked through
real `dint-serve` subprocesses and the official `openai` client, for a tiny DINT and a Llama of the same size, with
and without continuous batching; and `dint-serve --continuous-batching` refusing an `integral="softmax"` checkpoint
at start-up. Needs the serving extra (`.[serve]`)."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch
from dint_testing import tiny_model
from packaging.version import Version


import transformers  # noqa: E402


if Version(transformers.__version__) < Version("5.23"):  # dint-serve runs transformers 5.23's serving app
    pytest.skip(f"dint-serve needs transformers >= 5.23 (installed: {transformers.__version__})",
                allow_module_level=True)
openai = pytest.importorskip("openai", reason='the serving extra is not installed: pip install -e ".[serve]"')
pytest.importorskip("fastapi", reason='the serving extra is not installed: pip install -e ".[serve]"')

from serve_harness import launch_dint_serve  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(REPO_ROOT, "examples", "data", "tokenizer")
CONTEXT = 40
"""The models' max_position_embeddings."""
CACHE_BLOCKS, BLOCK_SIZE = 2, 16
PAGED_CACHE_TOKENS = CACHE_BLOCKS * BLOCK_SIZE
"""The continuous-batching servers' paged cache, smaller than the context so that both limits can be reached."""
CONTINUOUS_BATCHING = ["--continuous-batching", "--cb-num-blocks", str(CACHE_BLOCKS),
                       "--cb-block-size", str(BLOCK_SIZE)]
SERVERS = [("dint", "default"), ("dint", "continuous-batching"), ("llama", "default"), ("llama", "continuous-batching")]


def prompt_of(num_tokens: int) -> str:
    """A prompt of exactly `num_tokens` tokens with the repo's tokenizer (" the" is one token, no BOS is added)."""
    return " the" * num_tokens


def save_models(directory: str) -> dict[str, str]:
    """A tiny DINT (integral "mean"), the same with integral "softmax", and a Llama of the same size (the DINT's
    parameter count plus its head norms), each with the repo's tokenizer and no EOS, so that a completion runs to
    its limit."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    common = dict(vocab_size=len(tokenizer), max_position_embeddings=CONTEXT, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=None, initializer_range=0.3)
    models = {"dint": tiny_model(integral="mean", **common), "softmax": tiny_model(integral="softmax", **common)}
    dint_config = models["dint"].config
    torch.manual_seed(0)
    models["llama"] = LlamaForCausalLM(LlamaConfig(
        hidden_size=dint_config.hidden_size, intermediate_size=dint_config.intermediate_size,
        num_hidden_layers=dint_config.num_hidden_layers, num_attention_heads=dint_config.num_attention_heads,
        num_key_value_heads=dint_config.num_key_value_heads, head_dim=dint_config.head_dim, **common,
    ))
    paths = {}
    for name, model in models.items():
        paths[name] = os.path.join(directory, name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("dint-serve-limits"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=os.path.join(directory, "hub-cache"))
    return save_models(directory), env


@pytest.fixture(scope="module")
def served(model_paths):
    """{(model, mode): (openai client, model path, DintServer)} for the four servers (started together: each spends
    seconds importing torch and transformers)."""
    paths, env = model_paths
    servers = {}
    try:
        for model, mode in SERVERS:
            flags = CONTINUOUS_BATCHING if mode == "continuous-batching" else []
            servers[model, mode] = launch_dint_serve(paths[model], *flags, env=env)
        for server in servers.values():
            server.wait_until_healthy()
        yield {
            key: (openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60),
                  paths[key[0]], server)
            for key, server in servers.items()
        }
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(params=SERVERS, ids=[f"{model}-{mode}" for model, mode in SERVERS])
def server(request, served):
    """(openai client, model path, DintServer, mode) of one server."""
    client, path, dint_server = served[request.param]
    return client, path, dint_server, request.param[1]


def assert_refused(call, *phrases: str) -> None:
    """`call()` gets a 400 whose detail contains every phrase."""
    with pytest.raises(openai.BadRequestError) as refusal:
        call()
    detail = refusal.value.body["detail"]
    for phrase in phrases:
        assert phrase in detail, detail


def assert_still_serving(client, path, dint_server) -> None:
    """The server answers a normal request and reports itself healthy."""
    response = client.completions.create(model=path, prompt=prompt_of(5), max_tokens=3, temperature=0)
    assert response.usage.completion_tokens == 3
    with urllib.request.urlopen(f"{dint_server.base_url}/health", timeout=10) as health:
        assert json.load(health) == {"status": "ok"}


def test_empty_prompt_and_empty_chat_are_refused(server):
    client, path, dint_server, _ = server
    assert_refused(lambda: client.completions.create(model=path, prompt="", max_tokens=3), "prompt is empty")
    assert_refused(lambda: client.completions.create(model=path, prompt="", max_tokens=3, stream=True),
                   "prompt is empty")
    assert_refused(lambda: client.chat.completions.create(model=path, messages=[], max_tokens=3), "`messages`")
    assert_still_serving(client, path, dint_server)


@pytest.mark.parametrize("messages", [[{"content": "Hello"}], [{"role": None, "content": "Hello"}],
                                      [{"role": "user", "content": "Hi"}, {"role": 3, "content": "Hello"}]],
                         ids=["missing", "null", "number"])
def test_chat_message_without_a_string_role_is_refused(server, messages):
    client, path, dint_server, _ = server
    index = len(messages) - 1
    assert_refused(lambda: client.chat.completions.create(model=path, messages=messages, max_tokens=3),
                   f"`messages[{index}].role`")
    assert_refused(lambda: client.chat.completions.create(model=path, messages=messages, max_tokens=3, stream=True),
                   f"`messages[{index}].role`")
    assert_still_serving(client, path, dint_server)


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_below_one_is_refused(server, max_tokens):
    client, path, dint_server, _ = server
    assert_refused(lambda: client.completions.create(model=path, prompt=prompt_of(5), max_tokens=max_tokens),
                   "`max_tokens`", "at least 1", str(max_tokens))
    chat = [{"role": "user", "content": "To be"}]
    assert_refused(lambda: client.chat.completions.create(model=path, messages=chat, max_completion_tokens=max_tokens),
                   "`max_completion_tokens`", "at least 1")
    assert_still_serving(client, path, dint_server)


@pytest.mark.parametrize("length", [CONTEXT, CONTEXT + 30])
def test_prompt_that_fills_the_context_is_refused(server, length):
    client, path, dint_server, _ = server
    for stream in (False, True):
        assert_refused(lambda: client.completions.create(model=path, prompt=prompt_of(length), max_tokens=3,
                                                         stream=stream),
                       f"The prompt has {length} tokens", f"max_position_embeddings) is {CONTEXT} tokens")
    assert_still_serving(client, path, dint_server)


@pytest.mark.parametrize("model", ["dint", "llama"])
def test_prompt_larger_than_the_paged_cache_is_refused(served, model):
    client, path, dint_server = served[model, "continuous-batching"]
    length = PAGED_CACHE_TOKENS + 2  # within the model's context
    assert_refused(lambda: client.completions.create(model=path, prompt=prompt_of(length), max_tokens=3),
                   f"The prompt has {length} tokens", f"paged cache holds {PAGED_CACHE_TOKENS} tokens")
    assert_still_serving(client, path, dint_server)


def test_completion_stops_where_the_context_or_the_paged_cache_ends(server):
    """A huge `max_tokens` (or none: transformers' default of 1024) generates up to the model's context, or the
    paged cache, and stops there with finish_reason "length"."""
    client, path, dint_server, mode = server
    room = min(CONTEXT, PAGED_CACHE_TOKENS) if mode == "continuous-batching" else CONTEXT
    prompt_length = 8
    for options in ({"max_tokens": 10**9}, {}, {"max_tokens": 10**9, "stream": True}):
        response = client.completions.create(model=path, prompt=prompt_of(prompt_length), temperature=0, **options)
        last = list(response)[-1] if options.get("stream") else response
        assert last.choices[0].finish_reason == "length", options
        assert last.usage.completion_tokens == room - prompt_length, options
    assert_still_serving(client, path, dint_server)


def test_continuous_batching_refuses_a_softmax_dint_at_start_up(model_paths):
    paths, env = model_paths
    server = launch_dint_serve(paths["softmax"], *CONTINUOUS_BATCHING, env=env)
    try:
        returncode = server.process.wait(timeout=180)
    except subprocess.TimeoutExpired:
        server.stop()
        pytest.fail(f"dint-serve started instead of refusing:\n{server.output()}")
    output = server.output()
    assert returncode == 2, output
    error = output.strip().splitlines()[-1]
    assert error.startswith("dint-serve: error: "), output
    for phrase in ("integral='softmax'", "without --continuous-batching", "integral='mean'"):
        assert phrase in error, error
    assert "Uvicorn running" not in output  # refused before the server started


def test_help_describes_dint_serve_and_keeps_transformers_flags():
    result = subprocess.run([sys.executable, "-m", "modeling_dint.integrations.serve_cli", "--help"],
                            capture_output=True, text=True, check=True)
    help_text = result.stdout
    for phrase in ("DINT", "continuous-batching", "integral", "400", "max_position_embeddings", "paged cache",
                   "max_tokens"):
        assert phrase in help_text, phrase
    for flag in ("--continuous-batching", "--cb-num-blocks", "--cb-block-size", "--host", "--port", "--dtype",
                 "--trust-remote-code", "--attn-implementation"):
        assert flag in help_text, flag


def test_importing_serve_cli_changes_nothing_in_transformers():
    """dint-serve adapts transformers' serving app only when its `main()` runs (no test runs it in this process)."""
    import modeling_dint.integrations.serve_cli  # noqa: F401
    from transformers.cli.serving import model_manager, server, utils

    assert model_manager.transformers is transformers
    for adapted in (model_manager.ModelManager, server.build_server, utils.GenerateManager, utils.CBGenerateManager):
        assert adapted.__module__.startswith("transformers.cli.serving."), adapted


@pytest.mark.parametrize("continuous_batching", [False, True])
def test_the_cpu_kernel_is_built_before_the_server_starts(monkeypatch, continuous_batching):
    """Without continuous batching (whose packed requests run the eager integral) dint-serve builds or loads the fused
    CPU integral kernel before transformers' server starts, so that no request waits for the build."""
    import inspect

    import transformers.cli.serve

    import modeling_dint.integral_cpu_kernel as kernel_module
    from modeling_dint.integrations import serve_cli

    started = []

    class RecordingServe:  # transformers' Serve, as far as the command line sees it; records the kernel's state
        __signature__ = inspect.signature(transformers.cli.serve.Serve)

        def __init__(self, **options):
            started.append((options.get("continuous_batching"), bool(built)))

    monkeypatch.setattr(transformers.cli.serve, "Serve", RecordingServe)
    # transformers' serving app stays as it is in this process (test_importing_serve_cli_changes_nothing_in_transformers)
    monkeypatch.setattr(serve_cli, "install_serving_model_manager", lambda: None)
    monkeypatch.setattr(serve_cli, "install_request_limits", lambda: None)
    built = []  # the decision is what is tested, not the build: the kernel's getter records its calls
    monkeypatch.setattr(kernel_module, "integral_kernel", lambda: built.append(True))
    argv = ["--continuous-batching"] if continuous_batching else []
    with pytest.raises(SystemExit) as exit_info:
        serve_cli.main(argv)
    assert exit_info.value.code in (0, None)
    assert started == [(continuous_batching, not continuous_batching)]
