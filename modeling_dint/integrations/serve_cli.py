# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""`dint-serve`: transformers' own OpenAI-compatible server (`transformers serve`) for DINT checkpoints, with every
request checked against what the model and the server can hold.

    dint-serve ./dint-model --continuous-batching --host 127.0.0.1 --port 8000

The app, its handlers and its flags are transformers' (`dint-serve --help`). Importing this module changes nothing;
`main()` (the console script) adapts transformers' serving app in three ways before it starts it:

1. Loading: transformers 5.23's and 5.24's model manager resolves the model class as `getattr(transformers,
   config.architectures[0])`, which fails for any model that transformers does not ship (`AttributeError: module
   transformers has no attribute DintForCausalLM`). Here such an architecture loads through `AutoModelForCausalLM`,
   where importing `modeling_dint` has registered DINT (and `--trust-remote-code` loads other custom code); and
   `/v1/models` lists the model the server was started with.
2. Start-up: `--continuous-batching` on a DINT checkpoint with `integral="softmax"` is refused before the server
   starts (`continuous_batching_refusal`); without continuous batching, on CPU, the fused CPU integral kernel is
   built (or loaded from its cache) before the server starts, not during the first request.
3. Request limits (listed in `DINT_SERVE_HELP`, `dint-serve --help`): a request that the model or the server cannot
   complete gets a 400 that names the limit, before it reaches generation, and the server keeps serving; a
   completion stops where the model's context (or the paged cache) ends. Without them, an empty prompt, a prompt
   larger than the whole paged cache or an unbounded `max_tokens` kills transformers' continuous-batching worker for
   good (every later request 503), `max_tokens` 0 gives a 500, a prompt longer than the model's context is accepted
   with a warning, and a huge `max_tokens` keeps a non-streaming generation going after its client has left. They
   apply to every model the server loads, DINT or not.

The transformers internals touched (each install function names its own and fails loudly when they change) were read
in transformers 5.23 and 5.24; `tests/test_serve_cli.py` and `tests/test_serve_limits.py` run the real server.

The upstream changes that make this module unnecessary, in `transformers/cli/serving/`:
- `model_manager.py`, `ModelManager._load_model`:
  `architecture = getattr(transformers, config.architectures[0], None) or AutoModelForCausalLM`; and in 5.23's
  `ModelManager.get_gen_models`, the forced model listed first (and an empty list without a Hub cache); 5.24 does
  that itself (`ModelManager.list_models`).
- `utils.py`: `BaseHandler._validate_request` refuses an empty `messages` list or a message without a string `role`
  (and an empty Responses `input`) and a
  `max_tokens` / `max_completion_tokens` / `max_output_tokens` that is not a whole number >= 1, with a 400; and one
  check in `BaseGenerateManager`, before `generate()` or `add_request`, of the tokenized prompt against
  `max_position_embeddings` and (continuous batching) the paged cache's `num_blocks * page_size`, which also caps
  `max_new_tokens` at what remains. A non-streaming generation should stop when its client disconnects, as a
  streaming one does (`DirectStreamer.cancel` / `cancel_request`), polling `Request.is_disconnected()`.

Requires the serving extra: `pip install -e ".[serve]"` in the repository's root.
"""

import inspect
import sys
import time

import transformers

from ..transformers_compat import installed_release


# --- `transformers serve` lists the model it was started with in `/v1/models` from 5.24 (`ModelManager.list_models`);
# 5.23's `ModelManager.get_gen_models` lists the Hub cache's models only, which dint-serve extends
# (`install_serving_model_manager`): this bridge serves 5.23. ---
SERVE_LISTS_THE_SERVED_MODEL = installed_release() >= (5, 24)


DINT_SERVE_HELP = """\
Serve a DINT model (or any causal LM that transformers loads) with transformers' OpenAI-compatible server: the
endpoints and flags of `transformers serve`, plus Auto-class loading of DINT checkpoints and request limits.

\b
Endpoints: POST /v1/chat/completions, /v1/completions, /v1/responses;
           GET /v1/models, /health.

\b
--continuous-batching runs requests together in transformers' paged cache
(DINT keeps its integral state there, beside K and V); size the cache with
--cb-num-blocks and --cb-block-size (tokens per block). A DINT model with
integral "softmax" cannot run this way: dint-serve refuses it at start-up
(serve it without the flag).

\b
Every request is checked; one that fails gets a 400 naming the limit, and
the server keeps serving:
- a chat (messages) holds at least one message, each an object with a
  string role;
- max_tokens, max_completion_tokens, max_output_tokens are whole numbers >= 1;
- the tokenized prompt has at least 1 token and fewer than the model's
  max_position_embeddings;
- with --continuous-batching, fewer tokens than the paged cache holds in all
  (--cb-num-blocks x --cb-block-size).
A completion stops when prompt + completion reach max_position_embeddings (or
the paged cache), whatever max_tokens asks (finish_reason "length"). A
streaming request stops generating when its client disconnects.

\b
Example: dint-serve ./dint-model --continuous-batching --cb-num-blocks 64
"""
"""The help of `dint-serve --help`, above transformers' flags (click's `\\b` keeps a paragraph's line breaks)."""

TOKEN_COUNT_FIELDS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}
"""The request fields, per endpoint, that set how many tokens to generate."""


class _ArchitecturesOrAutoModel:
    """Stands in for the `transformers` module in the serving model manager: an architecture that transformers
    names resolves as before; any other resolves to `AutoModelForCausalLM`, which loads registered and remote-code
    models (`AutoModelForCausalLM.from_pretrained` takes the same arguments as a model class)."""

    def __getattr__(self, name: str):
        try:
            return getattr(transformers, name)
        except AttributeError:
            return transformers.AutoModelForCausalLM


def install_serving_model_manager() -> None:
    """Lets `transformers serve`'s model manager load models that transformers does not ship, and list the model it
    serves (idempotent). The two transformers internals touched: the `transformers` name and the `ModelManager`
    class of `transformers.cli.serving.model_manager` (which `Serve` imports when it starts)."""
    from huggingface_hub.errors import CacheNotFound
    from transformers.cli.serving import model_manager

    listing_method = "list_models" if SERVE_LISTS_THE_SERVED_MODEL else "get_gen_models"
    if not (hasattr(model_manager, "transformers") and hasattr(model_manager.ModelManager, listing_method)):
        raise RuntimeError(
            "transformers.cli.serving.model_manager changed (transformers "
            f"{transformers.__version__}): check whether `transformers serve` loads custom models now, and update "
            "modeling_dint/integrations/serve_cli.py."
        )
    model_manager.transformers = _ArchitecturesOrAutoModel()
    if SERVE_LISTS_THE_SERVED_MODEL or getattr(model_manager.ModelManager, "lists_served_model", False):
        return  # 5.24, or this 5.23 subclass is already installed

    class ServedModelManager(model_manager.ModelManager):
        """`/v1/models` lists the model given on the command line (transformers 5.23 lists only the generative
        models of the Hub cache, whose architectures transformers ships, and fails where there is no cache)."""

        lists_served_model = True

        def get_gen_models(self, cache_dir: str | None = None) -> list[dict]:
            try:
                cached = super().get_gen_models(cache_dir)
            except CacheNotFound:
                cached = []
            if self.force_model is None:
                return cached
            served = {"id": self.force_model, "object": "model", "owned_by": "", "created": 0}
            return [served] + [entry for entry in cached if entry["id"] != self.force_model]

    model_manager.ModelManager = ServedModelManager


# --------------------------------------------------------------------------------------------------------------------
# Start-up


def continuous_batching_refusal(model_name: str, config) -> str | None:
    """Why `model_name` (its config `config`) cannot be served with continuous batching, or None if it can: the
    checks DINT's continuous batching itself makes when it starts (`serving.check_transformers_release`,
    `DintConfig.check_paged_serving`), made before the server reports healthy."""
    if getattr(config, "model_type", None) != "dint":
        return None
    from . import serving
    from ..configuration_dint import DintConfig

    try:
        serving.check_transformers_release()
        DintConfig.check_paged_serving(config)  # the package's check, whatever config class a checkpoint loaded
    except (RuntimeError, ValueError) as error:
        return f"{model_name}: {error}"
    return None


def check_serving_options(options: dict) -> None:
    """Refuses, before anything is loaded, options under which the forced model cannot be served: prints
    `dint-serve: error: ...` and exits with status 2. A config that cannot be read here is left to the server's own
    loading, which reports it."""
    model_name = options.get("force_model")
    if not (options.get("continuous_batching") and model_name):
        return
    from transformers.cli.serving.utils import split_model_id

    repository, gguf_file = split_model_id(model_name)
    if gguf_file is not None:
        return  # a GGUF file names its architecture inside the file; not DINT
    try:
        config = transformers.AutoConfig.from_pretrained(
            repository, trust_remote_code=bool(options.get("trust_remote_code"))
        )
    except (OSError, ValueError):
        return
    refusal = continuous_batching_refusal(model_name, config)
    if refusal is not None:
        print(f"dint-serve: error: {refusal}", file=sys.stderr)
        raise SystemExit(2)


# --------------------------------------------------------------------------------------------------------------------
# Request limits


def request_body_error(path: str, body) -> str | None:
    """What is wrong with the JSON body of a request to `path` before anything is tokenized (an empty chat, a token
    count below 1), or None. Bodies that are not JSON objects are left to transformers."""
    if not isinstance(body, dict):
        return None
    for field in TOKEN_COUNT_FIELDS.get(path, ()):
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"`{field}` must be a whole number of at least 1, got {value!r}."
    if path == "/v1/chat/completions":
        return messages_error(body.get("messages"))
    if path == "/v1/responses" and body.get("input") == [] and not body.get("instructions"):
        return "`input` must hold at least one message (or come with `instructions`), got []."
    return None


def messages_error(messages) -> str | None:
    """What is wrong with a chat request's `messages` (not a list, empty, a message that is not an object or whose
    `role` is missing or not a string: the chat template would fail on it with a 500), or None."""
    if not (isinstance(messages, list) and messages):
        return f"`messages` must be a list of at least one message, got {messages!r}."
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"`messages[{index}]` must be an object with a `role` and a `content`, got {message!r}."
        if "role" not in message:
            return f"`messages[{index}].role` is missing: each message needs a string `role` (\"user\", ...)."
        if not isinstance(message["role"], str):
            return (f"`messages[{index}].role` must be a string (\"system\", \"user\", \"assistant\", ...), got "
                    f"{message['role']!r}.")
    return None


def limit_generation(prompt_length: int, generation_config, model, paged_cache_tokens: int | None = None) -> None:
    """Checks a tokenized prompt of `prompt_length` tokens against the model's context (`max_position_embeddings`)
    and, under continuous batching, the paged cache (`paged_cache_tokens`), and caps `generation_config.max_new_tokens`
    (the request's own copy) at the room that remains.

    Raises:
        fastapi.HTTPException: 400, naming the limit and the prompt's length.
    """
    from fastapi import HTTPException

    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if prompt_length == 0:
        raise HTTPException(status_code=400, detail="The prompt is empty (0 tokens): send at least one token.")
    if context is not None and prompt_length >= context:
        raise HTTPException(
            status_code=400,
            detail=f"The prompt has {prompt_length} tokens: this model's context (max_position_embeddings) is "
            f"{context} tokens, prompt and completion together. Send a prompt of at most {context - 1} tokens.",
        )
    if paged_cache_tokens is not None and prompt_length >= paged_cache_tokens:
        raise HTTPException(
            status_code=400,
            detail=f"The prompt has {prompt_length} tokens: this server's paged cache holds {paged_cache_tokens} "
            f"tokens in all requests together (--cb-num-blocks x --cb-block-size), prompt and completion together. "
            f"Send a prompt of at most {paged_cache_tokens - 1} tokens, or start the server with a larger cache.",
        )
    limits = [limit for limit in (context, paged_cache_tokens) if limit is not None]
    if not limits:
        return  # a model without max_position_embeddings, served without continuous batching
    room = min(limits) - prompt_length
    if generation_config.max_new_tokens is None or generation_config.max_new_tokens > room:
        generation_config.max_new_tokens = room


def prompt_length(inputs) -> int:
    """Tokens in the prompt of the handlers' `inputs` (a list of ids under continuous batching, `[1, T]` else)."""
    input_ids = inputs["input_ids"]
    return len(input_ids) if isinstance(input_ids, list) else input_ids.shape[-1]


def install_request_limits() -> None:
    """Makes the serving app check every request against the limits of `DINT_SERVE_HELP` (idempotent). The
    transformers internals touched, in `transformers.cli.serving` (which `Serve` reads when it starts):
    `server.build_server` (wrapped: a middleware checks request bodies), `utils.GenerateManager` and
    `utils.CBGenerateManager` (subclassed: `generate_streaming` and `generate_non_streaming` check the tokenized
    prompt first; `init_cb` refuses what continuous batching cannot run and reads the paged cache's size)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from transformers.cli.serving import server, utils

    if getattr(server.build_server, "checks_request_limits", False):
        return
    expected = ("generate_streaming", "generate_non_streaming", "init_cb")
    changed = [
        f"{manager.__name__}.{method}"
        for manager in (utils.GenerateManager, utils.CBGenerateManager)
        for method in expected
        if "gen_config" not in inspect.signature(getattr(manager, method)).parameters
    ]
    if changed or "generation_state" not in inspect.signature(server.build_server).parameters:
        raise RuntimeError(
            f"transformers.cli.serving changed (transformers {transformers.__version__}): {changed or 'build_server'}"
            " no longer take what dint-serve's request limits wrap; update modeling_dint/integrations/serve_cli.py."
        )

    class LimitedGenerateManager(utils.GenerateManager):
        """`model.generate()` on the server's inference thread, for prompts within the model's context."""

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            limit_generation(prompt_length(inputs), gen_config, model)
            return super().generate_streaming(model, processor, inputs, gen_config, request_id, response_parser)

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            limit_generation(prompt_length(inputs), gen_config, model)
            return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)

    class LimitedCBGenerateManager(utils.CBGenerateManager):
        """Continuous batching, for prompts within the model's context and the paged cache; refuses a model that
        continuous batching cannot run (`continuous_batching_refusal`) instead of starting its worker."""

        paged_cache_tokens: int | None = None

        def init_cb(self, model, gen_config) -> None:
            from fastapi import HTTPException

            refusal = continuous_batching_refusal(str(model.name_or_path), model.config)
            if refusal is not None:
                raise HTTPException(status_code=400, detail=refusal)
            starting = self._cb is None
            super().init_cb(model, gen_config)
            if starting:
                self.paged_cache_tokens = self._wait_for_paged_cache_tokens()

        def _wait_for_paged_cache_tokens(self, timeout: float = 600.0) -> int:
            """Tokens the paged cache holds in all (`num_blocks * page_size`), once the worker that `init_cb`
            started has built it (the worker thread builds the cache; the first request waits for it)."""
            deadline = time.monotonic() + timeout
            while self._cb.batch_processor is None and time.monotonic() < deadline:
                self._check_alive("(starting)")
                time.sleep(0.01)
            cache = self.scheduler.cache
            return cache.num_blocks * self._cb.continuous_batching_config.page_size

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            limit_generation(prompt_length(inputs), gen_config, model, self.paged_cache_tokens)
            return super().generate_streaming(model, processor, inputs, gen_config, request_id, response_parser)

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            limit_generation(prompt_length(inputs), gen_config, model, self.paged_cache_tokens)
            return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)

    build_transformers_server = server.build_server

    def build_server(*args, **kwargs):
        """transformers' app, with a middleware that refuses malformed generation requests (`request_body_error`)
        before a handler loads, tokenizes or generates anything."""
        app = build_transformers_server(*args, **kwargs)

        @app.middleware("http")
        async def check_request_body(request: Request, call_next):
            if request.method == "POST" and request.url.path in TOKEN_COUNT_FIELDS:
                try:
                    body = await request.json()
                except ValueError:
                    body = None  # not JSON: transformers answers it
                error = request_body_error(request.url.path, body)
                if error is not None:
                    return JSONResponse({"detail": error}, status_code=400)
            return await call_next(request)

        return app

    build_server.checks_request_limits = True
    utils.GenerateManager = LimitedGenerateManager
    utils.CBGenerateManager = LimitedCBGenerateManager
    server.build_server = build_server


# --------------------------------------------------------------------------------------------------------------------
# The console script


def main(argv: list[str] | None = None) -> None:
    """The `dint-serve` console script: `transformers serve` with DINT registered, Auto-class loading, a start-up
    check of the options and the request limits. Nothing is changed in transformers before this runs."""
    try:
        import typer
        from transformers.cli.serve import Serve
        from transformers.utils.import_utils import is_serve_available
    except ImportError as error:
        raise SystemExit(
            f'dint-serve needs the serving extra: pip install -e ".[serve]" in the repository root ({error})'
        ) from error
    if not is_serve_available():
        raise SystemExit('dint-serve needs the serving extra: pip install -e ".[serve]" in the repository root')

    import modeling_dint  # noqa: F401  (registers DINT with the Auto classes)
    from modeling_dint.integral_cpu_kernel import integral_kernel

    install_serving_model_manager()
    install_request_limits()

    def serve(**options) -> None:
        check_serving_options(options)
        if not options.get("continuous_batching") and options.get("device") in (None, "auto", "cpu"):
            # Build (or load the cached build of) the fused CPU integral before the server reports healthy, not
            # during the first request (about 35 s once per machine; a no-op where it cannot build).
            integral_kernel()
        Serve(**options)

    serve.__signature__ = inspect.signature(Serve)  # transformers' flags, as `transformers serve` has them
    app = typer.Typer(add_completion=False, rich_markup_mode=None)
    app.command(help=DINT_SERVE_HELP)(serve)
    app(args=argv, prog_name="dint-serve")


if __name__ == "__main__":
    main()
