# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""`dint-serve`: transformers' own OpenAI-compatible server for DINT checkpoints.

    dint-serve ./dint-model --continuous-batching --host 127.0.0.1 --port 8000

It is `transformers serve` (the same app, handlers and flags: `dint-serve --help`), with one difference: transformers
5.23's and 5.24's model manager resolves the model class as `getattr(transformers, config.architectures[0])`, which
fails for any model that transformers does not ship (`AttributeError: module transformers has no attribute
DintForCausalLM`).
Here an architecture that transformers does not name loads through `AutoModelForCausalLM`, where importing
`modeling_dint` has registered DINT (and `--trust-remote-code` loads other custom code); and `/v1/models` lists the
model the server was started with.

The upstream change that makes this script unnecessary, in `transformers/cli/serving/model_manager.py`
(`ModelManager._load_model`):

    architecture = getattr(transformers, config.architectures[0], None) or AutoModelForCausalLM

and, in `ModelManager.get_gen_models` (5.23), the forced model listed first (and an empty list without a Hub cache);
transformers 5.24 does that itself (`ModelManager.list_models`).

Requires the serving extra: `pip install "modeling-dint[serve]"`.
"""

import transformers


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

    lists_forced_model_itself = hasattr(model_manager.ModelManager, "list_models")  # 5.24
    lists_cached_models_only = hasattr(model_manager.ModelManager, "get_gen_models")  # 5.23
    if not (hasattr(model_manager, "transformers") and (lists_forced_model_itself or lists_cached_models_only)):
        raise RuntimeError(
            "transformers.cli.serving.model_manager changed (transformers "
            f"{transformers.__version__}): check whether `transformers serve` loads custom models now, and update "
            "modeling_dint/serve_cli.py."
        )
    model_manager.transformers = _ArchitecturesOrAutoModel()
    if lists_forced_model_itself or getattr(model_manager.ModelManager, "lists_served_model", False):
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


def main(argv: list[str] | None = None) -> None:
    """The `dint-serve` console script: `transformers serve` with DINT registered and Auto-class loading."""
    try:
        import typer
        from transformers.cli.serve import Serve
        from transformers.utils.import_utils import is_serve_available
    except ImportError as error:
        raise SystemExit(f'dint-serve needs the serving extra: pip install "modeling-dint[serve]" ({error})') from error
    if not is_serve_available():
        raise SystemExit('dint-serve needs the serving extra: pip install "modeling-dint[serve]"')

    import modeling_dint  # noqa: F401  (registers DINT with the Auto classes and continuous batching)

    install_serving_model_manager()
    app = typer.Typer(add_completion=False, help="transformers serve, for DINT models (and other custom models).")
    app.command()(Serve)
    app(args=argv, prog_name="dint-serve")


if __name__ == "__main__":
    main()
