"""Sharing DINT models on the Hub: the generated model card, and the push / trust_remote_code load round trip against
the Hub-compatible test server (tests/hub_server.py).

huggingface_hub reads HF_ENDPOINT when it is imported, so the clients run in fresh subprocesses pointed at the server.
The loading process cannot import `modeling_dint` (a meta-path finder refuses it): the model must come from the remote
code that travelled with the weights.
"""

import ast
import json
import os
import re

import pytest
import yaml

from dint_testing import tiny_model
from hub_server import HubServer, run_client
import modeling_dint
from modeling_dint import DintConfig, dint_model_card, save_dint_for_hub
from modeling_dint.integrations import release_bridges, serve_cli


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(REPO_ROOT, "examples", "data", "tokenizer")
REMOTE_CODE_FILES = set(modeling_dint.REMOTE_CODE_FILES)
DEVELOPMENT_BRIDGES = (*release_bridges.__all__, "SERVE_LISTS_THE_SERVED_MODEL")
"""The bridges between transformers releases that only the package's tools, tests and recipes use (`dint-serve`'s
lives in serve_cli.py): none of them travels with a checkpoint."""


def front_matter(readme: str) -> dict:
    assert readme.startswith("---\n"), readme[:80]
    return yaml.safe_load(readme.split("---\n", 2)[1])


def test_model_card_metadata_and_body():
    model = tiny_model(integral="softmax", lambda_init=0.5)
    card = dint_model_card(model, repo_id="someone/dint-test", tags=["shakespeare", "dint"],
                           eval_results={"held-out perplexity": 123.4})
    metadata = front_matter(card)
    assert metadata["library_name"] == "transformers"
    assert metadata["pipeline_tag"] == "text-generation"
    assert metadata["tags"] == ["dint", "arxiv:2501.17486", "shakespeare"]
    assert metadata["dint"]["integral"] == "softmax"
    assert metadata["dint"]["lambda_init"] == 0.5
    assert metadata["dint"]["num_parameters"] == model.num_parameters()
    body = card.split("---\n", 2)[2]
    assert "# dint-test" in body
    assert "https://arxiv.org/abs/2501.17486" in body
    assert f"{model.num_parameters():,}" in body and "`softmax`" in body
    assert 'from_pretrained("someone/dint-test", trust_remote_code=True)' in body
    assert "| held-out perplexity | 123.4 |" in body

    # From a config alone: no parameter count, still the integral mode.
    config_card = front_matter(dint_model_card(DintConfig.from_preset("tiny", integral="none")))
    assert config_card["dint"]["integral"] == "none" and "num_parameters" not in config_card["dint"]
    assert config_card["dint"]["differential_attention"] == "v1"


def test_model_card_of_a_v2_model_names_its_layout_and_lambda():
    card = dint_model_card(DintConfig.from_preset("tiny-v2"))
    assert front_matter(card)["dint"]["differential_attention"] == "v2"
    body = card.split("---\n", 2)[2]
    assert "| head layout | `v2`: DIFF V2's" in body
    assert "sigmoid(lambda_proj(x))" in body and "depth schedule" not in body
    assert "| per-head RMSNorm | off |" in body


def test_model_card_refuses_other_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))
    with pytest.raises(TypeError, match="DINT model"):
        dint_model_card(llama)


def test_save_dint_for_hub_writes_a_loadable_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model = tiny_model(vocab_size=len(tokenizer))
    save_dint_for_hub(model, tmp_path, tokenizer=tokenizer)
    files = set(os.listdir(tmp_path))
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert {name for name in files if name.endswith(".py")} == REMOTE_CODE_FILES  # what travels, and nothing else
    assert front_matter((tmp_path / "README.md").read_text())["dint"]["num_parameters"] == model.num_parameters()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    reference = model.state_dict()
    assert all(reloaded.state_dict()[name].equal(tensor) for name, tensor in reference.items())


def test_remote_code_carries_no_development_bridges(tmp_path):
    """What `save_pretrained` writes beside the weights holds what a checkpoint needs to load and run: no bridge that
    only the package's tools, tests and recipes use is named in it, and it imports neither module that holds them (a
    fresh process without the package loads it: test_modeling.py's remote-code test)."""
    assert hasattr(serve_cli, "SERVE_LISTS_THE_SERVED_MODEL")
    tiny_model().save_pretrained(tmp_path)
    saved = {path.name: path.read_text(encoding="utf-8") for path in tmp_path.glob("*.py")}
    assert set(saved) == REMOTE_CODE_FILES
    carried = [
        (name, bridge)
        for name, text in saved.items()
        for bridge in DEVELOPMENT_BRIDGES
        if re.search(rf"\b{bridge}\b", text)
    ]
    assert not carried, f"development bridges in the remote code: {carried}"
    imports = [
        (name, line)
        for name, text in saved.items()
        for line in re.findall(r"^\s*(?:from|import) \S+.*$", text, re.M)
        if "release_bridges" in line or "serve_cli" in line
    ]
    assert not imports, imports


def sibling_imports(path) -> set[str]:
    """The sibling files a module imports (`from .x import y`, `from . import x`), read from its syntax tree: every
    import of the module, at its top or inside a function."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            assert node.level == 1, f"{path}: a remote-code module imports from above its folder (line {node.lineno})"
            modules = [node.module] if node.module else [alias.name for alias in node.names]
            names.update(f"{module.split('.')[0]}.py" for module in modules)
    return names


def test_remote_code_files_are_every_sibling_the_shipped_modules_import():
    """`REMOTE_CODE_FILES` is the configuration and modeling files and every sibling they reach through imports, and
    nothing else: a shipped module that imports a file missing from it fails here (the remote code would not load);
    transformers' own scan (`get_relative_import_files`, what its loader copies) finds the same files."""
    from transformers.dynamic_module_utils import get_relative_import_files

    package = os.path.dirname(modeling_dint.__file__)
    reached, to_read = set(), ["configuration_dint.py", "modeling_dint.py"]
    while to_read:
        name = to_read.pop()
        if name not in reached:
            reached.add(name)
            to_read.extend(sibling_imports(os.path.join(package, name)))
    assert reached == REMOTE_CODE_FILES, f"missing {reached - REMOTE_CODE_FILES}, unused {REMOTE_CODE_FILES - reached}"
    scanned = {os.path.basename(path) for entry in ("configuration_dint.py", "modeling_dint.py")
               for path in get_relative_import_files(os.path.join(package, entry))}
    assert scanned | {"configuration_dint.py", "modeling_dint.py"} == REMOTE_CODE_FILES


def test_remote_code_names_every_file_for_the_loaders_that_read_one_file():
    """transformers 5.5 to 5.10.0 load a local folder's remote code with the files that `modeling_dint.py` imports
    itself (`get_relative_imports`, no recursion): it names every other file of `REMOTE_CODE_FILES`."""
    from transformers.dynamic_module_utils import get_relative_imports

    modeling_file = os.path.join(os.path.dirname(modeling_dint.__file__), "modeling_dint.py")
    named = {f"{name}.py" for name in get_relative_imports(modeling_file)} | {"modeling_dint.py"}
    assert named == REMOTE_CODE_FILES, REMOTE_CODE_FILES - named


def test_save_pretrained_writes_the_declared_files_whatever_transformers_scan_finds(tmp_path, monkeypatch):
    """The files beside the weights come from `REMOTE_CODE_FILES`, not from transformers' import scan: with a scan
    that finds no sibling, the folder still holds them all, and a model loads from it."""
    from transformers import AutoModelForCausalLM
    from transformers import dynamic_module_utils

    monkeypatch.setattr(dynamic_module_utils, "get_relative_import_files", lambda module_file: [])
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert {path.name for path in tmp_path.glob("*.py")} == REMOTE_CODE_FILES
    package = os.path.dirname(modeling_dint.__file__)
    for name in REMOTE_CODE_FILES:
        with open(os.path.join(package, name), encoding="utf-8") as handle:
            assert (tmp_path / name).read_text(encoding="utf-8") == handle.read(), name
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(reloaded.state_dict()[name].equal(tensor) for name, tensor in model.state_dict().items())


def test_the_docs_name_the_code_files_that_travel_with_a_model(tmp_path):
    """docs/hub.md and the README's layout name exactly the files `save_pretrained` writes beside the weights (issue
    50: they said three and five while six travel; eight since the Triton kernel and the masks' own file, issue 49)."""
    tiny_model().save_pretrained(tmp_path)
    saved = {path.name for path in tmp_path.glob("*.py")}
    assert saved == REMOTE_CODE_FILES and len(saved) == 8
    with open(os.path.join(REPO_ROOT, "docs", "hub.md"), encoding="utf-8") as handle:
        hub_page = " ".join(handle.read().split())
    assert "the eight code files that `save_pretrained` writes" in hub_page
    assert all(f"`{name}`" in hub_page for name in saved)
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as handle:
        layout = handle.read().split("## Layout", 1)[1].split("integrations/:", 1)[0]
    assert set(re.findall(r"\w+\.py", layout)) == saved and "the eight files" in layout


PUSH_SCRIPT = """
import json, sys
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer
from modeling_dint import DintConfig, DintForCausalLM, push_dint_to_hub

tokenizer_dir, out_dir = sys.argv[1:3]
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
torch.manual_seed(0)
config = DintConfig.from_preset("tiny", vocab_size=len(tokenizer), lambda_std_dev=0.3)
model = DintForCausalLM(config).eval()
prompt = tokenizer("Who's there? Nay, answer me", return_tensors="pt")

def greedy():
    with torch.no_grad():
        tokens = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokens[0].tolist()

first = push_dint_to_hub(model, "test-org/dint-tiny", tokenizer=tokenizer, training_summary="Random weights (test).")
save_file(model.state_dict(), out_dir + "/first.safetensors")
first_tokens = greedy()
with torch.no_grad():
    for layer in model.model.layers:
        layer.self_attn.lambda_q1.add_(0.5)
        layer.mlp.up_proj.weight.mul_(3.0)
# The second push is transformers' own push_to_hub: it must keep the DINT card that is already in the repo.
second = model.push_to_hub("test-org/dint-tiny")
save_file(model.state_dict(), out_dir + "/second.safetensors")
second_tokens = greedy()
print(json.dumps({"first": first.oid, "second": second.oid, "first_tokens": first_tokens,
                  "second_tokens": second_tokens, "num_parameters": model.num_parameters()}))
"""

LOAD_SCRIPT = """
import importlib.abc, importlib.util, json, sys

class BlockModelingDint(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "modeling_dint" or name.startswith("modeling_dint."):
            raise ImportError(f"blocked: {name} (the model must load from the Hub's remote code)")
        return None

sys.meta_path.insert(0, BlockModelingDint())
try:
    import modeling_dint
    blocked = False
except ImportError:
    blocked = True

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

out_dir, first_sha = sys.argv[1:3]
tokenizer = AutoTokenizer.from_pretrained("test-org/dint-tiny", trust_remote_code=True)
prompt = tokenizer("Who's there? Nay, answer me", return_tensors="pt")
seen = {"blocked": blocked}
for name, revision in [("latest", None), ("first", first_sha)]:
    model = AutoModelForCausalLM.from_pretrained("test-org/dint-tiny", revision=revision, trust_remote_code=True).eval()
    with torch.no_grad():
        tokens = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    state = model.state_dict()
    seen[name] = {
        "module": type(model).__module__,
        "class": type(model).__name__,
        "tokens": tokens[0].tolist(),
        "weights_equal": {reference: sorted(state) == sorted(load_file(f"{out_dir}/{reference}.safetensors"))
                          and all(torch.equal(state[key], tensor)
                                  for key, tensor in load_file(f"{out_dir}/{reference}.safetensors").items())
                          for reference in ("first", "second")},
    }
seen["modeling_dint_imported"] = any(name.split(".")[0] == "modeling_dint" for name in sys.modules)
print(json.dumps(seen))
"""



def test_push_to_hub_and_trust_remote_code_load_with_revision_pinning(tmp_path):
    with HubServer() as server:
        pushed = run_client(server, tmp_path, PUSH_SCRIPT, TOKENIZER_DIR, tmp_path)
        # A fresh process, a fresh cache, and no way to import the package: only the Hub's files.
        (tmp_path / "loader").mkdir()
        loaded = run_client(server, tmp_path / "loader", LOAD_SCRIPT, tmp_path, pushed["first"])
        repo = server.repos[("model", "test-org/dint-tiny")]
        assert not [request for request in server.requests if request[2] == 500]
        assert server.unhandled == []

    # What the repo holds, at each commit.
    assert pushed["first"] != pushed["second"]
    for sha in (pushed["first"], pushed["second"]):
        files = repo.resolve_revision(sha).files
        assert {"model.safetensors", "config.json", "README.md", "generation_config.json"} <= set(files)
        assert {name for name in files if name.endswith(".py")} == REMOTE_CODE_FILES
        config = json.loads(repo.blobs[files["config.json"]])
        assert config["model_type"] == "dint"
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dint.DintForCausalLM"
        assert config["auto_map"]["AutoConfig"] == "configuration_dint.DintConfig"
        card = repo.blobs[files["README.md"]].decode()
        metadata = front_matter(card)
        assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
        assert "dint" in metadata["tags"] and "arxiv:2501.17486" in metadata["tags"]
        assert metadata["dint"]["integral"] == "mean"
        assert metadata["dint"]["num_parameters"] == pushed["num_parameters"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(repo.resolve_revision(pushed["first"]).files)

    # Loaded by repo id through remote code, with the package blocked.
    assert loaded["blocked"] and not loaded["modeling_dint_imported"]
    for name in ("latest", "first"):
        assert loaded[name]["module"].startswith("transformers_modules."), loaded[name]["module"]
        assert loaded[name]["class"] == "DintForCausalLM"
    assert loaded["latest"]["weights_equal"] == {"first": False, "second": True}
    assert loaded["first"]["weights_equal"] == {"first": True, "second": False}, "revision pinning failed"
    assert loaded["latest"]["tokens"] == pushed["second_tokens"]
    assert loaded["first"]["tokens"] == pushed["first_tokens"]
    assert pushed["first_tokens"] != pushed["second_tokens"]
