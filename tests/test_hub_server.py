"""The Hub-compatible test server (tests/hub_server.py) against the installed huggingface_hub and transformers.

huggingface_hub reads HF_ENDPOINT when it is imported, so each client runs in a fresh subprocess whose environment
points it at the server; the subprocess prints what it observed as JSON and the assertions run here.
"""

import base64
import json
import os
import sys
import urllib.error
import urllib.request

import pytest


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
if TESTS_DIR not in sys.path:  # hub_server.py lives beside this file
    sys.path.insert(0, TESTS_DIR)

from hub_server import HubServer, git_blob_oid, run_client  # noqa: E402


@pytest.fixture
def hub_server():
    with HubServer() as server:
        yield server



def read_tree(folder):
    """{relative path: bytes} of every file under `folder`, skipping huggingface_hub's own .cache folder."""
    files = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != ".cache"]
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, folder).replace(os.sep, "/")] = handle.read()
    return files


def write_tree(folder, files):
    for relative_path, content in files.items():
        path = os.path.join(folder, relative_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(content)


def make_safetensors_bytes(fill_value):
    from safetensors.torch import save
    import torch

    return save({"weight": torch.full((4, 8), float(fill_value)), "bias": torch.arange(8, dtype=torch.float32)})


UPLOAD_DOWNLOAD_SCRIPT = """
import json, sys
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

first_folder, second_folder, out_dir = sys.argv[1:4]
api = HfApi()
repo_id = api.create_repo("test-org/round-trip").repo_id
exists_ok_url = api.create_repo("test-org/round-trip", exist_ok=True)
first = api.upload_folder(repo_id=repo_id, folder_path=first_folder, commit_message="first")
latest_first = snapshot_download(repo_id, local_dir=out_dir + "/latest_first")
second = api.upload_folder(repo_id=repo_id, folder_path=second_folder, commit_message="second")
latest_second = snapshot_download(repo_id, local_dir=out_dir + "/latest_second")
# An old sha, downloaded into a cache that has never seen it: the bytes must come from the server.
pinned = snapshot_download(repo_id, revision=first.oid, cache_dir=out_dir + "/fresh_cache")
pinned_file = hf_hub_download(repo_id, "weights/model.safetensors", revision=first.oid,
                              cache_dir=out_dir + "/fresh_cache_2")
info = api.model_info(repo_id, files_metadata=True)
first_info = api.model_info(repo_id, revision=first.oid)
tree = sorted((entry.path, type(entry).__name__) for entry in api.list_repo_tree(repo_id, recursive=True))

errors = {}
for name, call in [
    ("missing_repo_download", lambda: hf_hub_download("test-org/missing", "config.json")),
    ("missing_repo_snapshot", lambda: snapshot_download("test-org/missing")),
    ("missing_repo_info", lambda: api.model_info("test-org/missing")),
    ("missing_revision_download", lambda: hf_hub_download(repo_id, "config.json", revision="no-such-branch")),
    ("missing_revision_snapshot", lambda: snapshot_download(repo_id, revision="no-such-branch")),
    ("missing_file", lambda: hf_hub_download(repo_id, "no_such_file.json")),
]:
    try:
        call()
        errors[name] = None
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as error:
        errors[name] = [cls.__name__ for cls in (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)
                        if isinstance(error, cls)]

print(json.dumps({
    "repo_id": repo_id, "exists_ok_url": exists_ok_url, "first": first.oid, "second": second.oid,
    "latest_first": latest_first, "latest_second": latest_second, "pinned": pinned, "pinned_file": pinned_file,
    "info_sha": info.sha, "first_info_sha": first_info.sha,
    "siblings": {s.rfilename: [s.size, s.blob_id] for s in info.siblings},
    "card_tags": info.card_data.tags if info.card_data else None, "library_name": info.library_name,
    "tree": tree, "errors": errors,
}))
"""


def test_upload_folder_snapshot_download_and_revision_pinning(hub_server, tmp_path):
    readme = b"---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- dint\n---\n# Test model\n"
    first_files = {
        "README.md": readme,
        "config.json": json.dumps({"model_type": "llama", "hidden_size": 32}).encode(),
        "weights/model.safetensors": make_safetensors_bytes(1.0),
        "notes/empty.txt": b"",
        "notes/binary.bin": bytes(range(256)) * 3,
    }
    second_files = dict(first_files, **{"weights/model.safetensors": make_safetensors_bytes(2.0)})
    write_tree(tmp_path / "first", first_files)
    write_tree(tmp_path / "second", second_files)

    seen = run_client(hub_server, tmp_path, UPLOAD_DOWNLOAD_SCRIPT, tmp_path / "first", tmp_path / "second",
                      tmp_path / "out")

    assert seen["repo_id"] == "test-org/round-trip"
    assert seen["exists_ok_url"] == f"{hub_server.url}/test-org/round-trip"
    assert seen["first"] != seen["second"] and len(seen["first"]) == len(seen["second"]) == 40
    assert read_tree(seen["latest_first"]) == first_files
    assert read_tree(seen["latest_second"]) == second_files
    assert read_tree(seen["pinned"]) == first_files
    with open(seen["pinned_file"], "rb") as handle:
        assert handle.read() == first_files["weights/model.safetensors"]

    assert seen["info_sha"] == seen["second"] and seen["first_info_sha"] == seen["first"]
    assert seen["siblings"] == {path: [len(content), git_blob_oid(content)] for path, content in second_files.items()}
    assert seen["card_tags"] == ["dint"] and seen["library_name"] == "transformers"
    assert seen["tree"] == sorted(
        [[path, "RepoFile"] for path in second_files] + [["notes", "RepoFolder"], ["weights", "RepoFolder"]]
    )
    assert seen["errors"] == {
        "missing_repo_download": ["RepositoryNotFoundError"],
        "missing_repo_snapshot": ["RepositoryNotFoundError"],
        "missing_repo_info": ["RepositoryNotFoundError"],
        "missing_revision_download": ["RevisionNotFoundError"],
        "missing_revision_snapshot": ["RevisionNotFoundError"],
        "missing_file": ["EntryNotFoundError"],
    }
    # Files went as base64 inside the NDJSON commits: no LFS or Xet traffic, no request the server did not know.
    assert not [request for request in hub_server.requests if request[2] == 500]
    assert hub_server.unhandled == []
    assert not [request for request in hub_server.requests if "lfs" in request[1] or "xet" in request[1]]


def test_invalid_readme_metadata_is_rejected(hub_server, tmp_path):
    seen = run_client(hub_server, tmp_path, """
        import json
        from huggingface_hub import HfApi
        api = HfApi()
        api.create_repo("test-org/bad-card")
        try:
            api.upload_file(path_or_fileobj=b"---\\ntags: [unclosed\\n---\\n", path_in_repo="README.md",
                            repo_id="test-org/bad-card")
            outcome = "uploaded"
        except ValueError as error:
            outcome = str(error)
        print(json.dumps({"outcome": outcome, "files": HfApi().list_repo_files("test-org/bad-card")}))
    """)
    assert seen["outcome"].startswith("Invalid metadata in README.md")
    assert seen["files"] == []


TRANSFORMERS_SCRIPT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

tokenizer_dir = sys.argv[1]
torch.manual_seed(0)
config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config)
first = model.push_to_hub("test-org/tiny-llama")
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
tokenizer.push_to_hub("test-org/tiny-llama")
original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
with torch.no_grad():
    model.model.norm.weight.add_(1.0)
second = model.push_to_hub("test-org/tiny-llama")

latest = AutoModelForCausalLM.from_pretrained("test-org/tiny-llama")
pinned = AutoModelForCausalLM.from_pretrained("test-org/tiny-llama", revision=first.oid)
hub_tokenizer = AutoTokenizer.from_pretrained("test-org/tiny-llama")
text = "Who's there? Nay, answer me: stand, and unfold yourself."

def same_weights(loaded, reference):
    state = loaded.state_dict()
    return sorted(state) == sorted(reference) and all(torch.equal(state[k], reference[k]) for k in reference)

print(json.dumps({
    "first": first.oid, "second": second.oid,
    "pinned_equals_first": same_weights(pinned, original),
    "latest_equals_second": same_weights(latest, model.state_dict()),
    "latest_differs_from_first": not same_weights(latest, original),
    "latest_class": type(latest).__name__,
    "tokenizer_ids_equal": hub_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"],
    "tokenizer_pad_eos": [hub_tokenizer.pad_token_id, hub_tokenizer.eos_token_id],
}))
"""


def test_transformers_push_to_hub_and_from_pretrained_round_trip(hub_server, tmp_path):
    tokenizer_dir = os.path.join(REPO_ROOT, "examples", "data", "tokenizer")
    seen = run_client(hub_server, tmp_path, TRANSFORMERS_SCRIPT, tokenizer_dir)

    assert seen["first"] != seen["second"]
    assert seen["pinned_equals_first"], "revision=<first sha> did not give the first weights back"
    assert seen["latest_equals_second"], "the latest revision did not give the pushed weights back"
    assert seen["latest_differs_from_first"]
    assert seen["latest_class"] == "LlamaForCausalLM"
    assert seen["tokenizer_ids_equal"] and seen["tokenizer_pad_eos"] == [1, 0]

    repo = hub_server.repos[("model", "test-org/tiny-llama")]
    files = set(repo.resolve_revision("main").files)
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not [request for request in hub_server.requests if request[2] == 500]
    assert hub_server.unhandled == []


def test_resolve_headers_and_range_requests(hub_server):
    """The raw HTTP contract hf_hub_download relies on, checked with urllib (no huggingface_hub involved)."""
    def request(method, path, body=None, headers=None):
        req = urllib.request.Request(hub_server.url + path, data=body, method=method,
                                     headers={"Authorization": "Bearer dummy", **(headers or {})})
        try:
            with urllib.request.urlopen(req) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    content = bytes(range(200))
    status, _, body = request("POST", "/api/repos/create", json.dumps({"name": "raw", "organization": "ns"}).encode())
    assert status == 200 and json.loads(body)["url"] == f"{hub_server.url}/ns/raw"
    status, _, body = request("POST", "/api/repos/create", json.dumps({"name": "raw", "organization": "ns"}).encode())
    assert status == 409 and json.loads(body)["url"] == f"{hub_server.url}/ns/raw"
    ndjson = "\n".join(json.dumps(line) for line in [
        {"key": "header", "value": {"summary": "add data", "description": ""}},
        {"key": "file", "value": {"path": "dir/data.bin", "encoding": "base64",
                                  "content": base64.b64encode(content).decode()}},
    ]).encode()
    status, _, body = request("POST", "/api/models/ns/raw/commit/main", ndjson,
                              {"Content-Type": "application/x-ndjson"})
    commit_sha = json.loads(body)["commitOid"]
    assert status == 200 and len(commit_sha) == 40

    status, headers, _ = request("HEAD", "/ns/raw/resolve/main/dir/data.bin")
    assert status == 200
    assert headers["X-Repo-Commit"] == commit_sha
    assert headers["ETag"] == f'"{git_blob_oid(content)}"'
    assert headers["Content-Length"] == str(len(content))
    status, headers, body = request("GET", "/ns/raw/resolve/main/dir/data.bin", headers={"Range": "bytes=150-"})
    assert status == 206 and body == content[150:] and headers["Content-Range"] == "bytes 150-199/200"

    for path, error_code in [
        ("/ns/missing/resolve/main/dir/data.bin", "RepoNotFound"),
        ("/ns/raw/resolve/no-branch/dir/data.bin", "RevisionNotFound"),
        ("/ns/raw/resolve/main/dir/missing.bin", "EntryNotFound"),
    ]:
        status, headers, _ = request("HEAD", path)
        assert (status, headers.get("X-Error-Code")) == (404, error_code), path
    # Writes need a token, like the Hub.
    req = urllib.request.Request(hub_server.url + "/api/models/ns/raw/commit/main", data=ndjson, method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(req)
    assert raised.value.code == 401
