# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The tools around the model, which never travel with a checkpoint (as transformers keeps its own integrations):

- `serving.py`: transformers' continuous batching of a DINT model (`DintForCausalLM.init_continuous_batching`);
- `serve_cli.py`: `dint-serve`, transformers' OpenAI-compatible server with DINT's start-up checks;
- `hub.py`: the model card, the one-folder save and the one-commit push;
- `release_bridges.py`: what moved between transformers releases for the tests, benches and recipes;
- `vllm/`: DINT as a vLLM model (the `vllm.general_plugins` entry point).

Each module is imported when it is used; `import modeling_dint` imports `hub.py` only (its three functions are part of
the package's public names). These modules used to sit at `modeling_dint/`'s top level: an import by the old path fails
with a message naming the new one (`MovedToolsFinder`).
"""

import importlib.abc


MOVED_TOOLS = {
    f"modeling_dint.{name}": f"modeling_dint.integrations.{name}"
    for name in ("serving", "serve_cli", "hub", "release_bridges", "vllm")
}
"""Old import path -> new one, for the modules that moved from `modeling_dint/` into this subpackage."""


def moved_tool_error(old_path: str) -> ModuleNotFoundError:
    """The error of an import by an old path of `MOVED_TOOLS`: it names the new one."""
    new_path = MOVED_TOOLS[old_path]
    return ModuleNotFoundError(
        f"{old_path} moved to {new_path} (the tools around the model live in modeling_dint.integrations; "
        f"modeling_dint's top level holds the files that travel with a checkpoint): import {new_path}. A console "
        "script or vLLM entry point that names the old path comes from an install of an older version: reinstall "
        "the package (`pip install -e .`).",
        name=old_path,
    )


class MovedToolsFinder(importlib.abc.MetaPathFinder):
    """Answers an import of an old path of `MOVED_TOOLS` (`import modeling_dint.hub`) with `moved_tool_error`. It
    answers for exactly these names (None for any other, so that every other import goes on as before) and is the
    first finder of `sys.meta_path`, so that a stale file of an older install at an old path (or an editable install's
    mapping to another checkout) is never imported beside the new modules. `from modeling_dint import hub` reads an
    attribute first: `modeling_dint.__getattr__` raises the same error."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_TOOLS:
            raise moved_tool_error(fullname)
        return None
