"""A small Hugging Face Hub-compatible HTTP server for tests (stdlib only).

It serves the part of the Hub API that `huggingface_hub` (2.x) and transformers' `push_to_hub` /
`from_pretrained(repo_id)` call, on 127.0.0.1, with repos kept in memory:

    POST   /api/repos/create                                      create a repo (409 + url if it exists)
    DELETE /api/repos/delete                                      delete a repo
    GET    /api/whoami-v2                                         the (single, fake) user
    POST   /api/validate-yaml                                     check a README's YAML front matter
    GET    /api/{type}s/{ns}/{name}[/revision/{rev}]              repo info: id, sha, siblings, cardData, ...
    GET    /api/{type}s/{ns}/{name}/tree/{rev}[/{path}]           list files and folders (recursive, expand)
    POST   /api/{type}s/{ns}/{name}/paths-info/{rev}              info on given paths
    POST   /api/{type}s/{ns}/{name}/preupload/{rev}               always answers uploadMode "regular" (no LFS)
    POST   /api/{type}s/{ns}/{name}/commit/{rev}                  NDJSON commit: header, file (base64), deletedFile,
                                                                  deletedFolder
    POST   /api/{type}s/{ns}/{name}/branch/{branch}               create a branch; DELETE deletes it
    GET    /api/{type}s/{ns}/{name}/refs                          branches
    GET    /api/{type}s/{ns}/{name}/commits/{rev}                 history, newest first
    HEAD   /[{type}s/]{ns}/{name}/resolve/{rev}/{path}            file metadata: X-Repo-Commit, ETag, Content-Length
    GET    /[{type}s/]{ns}/{name}/resolve/{rev}/{path}            file bytes (Range supported)

Every commit gets a new 40-hex sha; a revision is a branch name or a commit sha, so downloading at an old sha gives
the old files. Errors are 404s with `X-Error-Code` RepoNotFound / RevisionNotFound / EntryNotFound, which
huggingface_hub turns into RepositoryNotFoundError / RevisionNotFoundError / EntryNotFoundError. Writes need an
`Authorization` header (any token).

huggingface_hub reads its endpoint from the environment when it is imported, so run the client side in a fresh
process whose environment comes from `server.client_env(hf_home)`:

    with HubServer() as server:
        env = server.client_env(hf_home=str(tmp_path / "hf_home"))
        subprocess.run([sys.executable, "-c", script], env=env, check=True)
"""

import base64
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


DEFAULT_NAMESPACE = "user"
DEFAULT_BRANCH = "main"
REPO_TYPES = ("model", "dataset", "space")
_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


def git_blob_oid(content):
    """The git object id of a blob: sha1(b"blob <size>\\0" + content), what the Hub returns as a file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _now_iso():
    """Current UTC time in the Hub's format, e.g. '2024-05-01T12:00:00.000Z'."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _parse_front_matter(readme_text):
    """Return the YAML front matter of a README as a dict, None if it has none; raise ValueError if it is invalid."""
    import yaml

    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", readme_text, re.DOTALL)
    if match is None:
        return None
    try:
        metadata = yaml.safe_load(match.group(1))
    except yaml.YAMLError as error:
        raise ValueError(f"Invalid YAML in README front matter: {error}")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ValueError(f"README front matter must be a YAML mapping, got {type(metadata).__name__}")
    return metadata


class HubError(Exception):
    """An error answered as JSON `{"error": message}` with `X-Error-Code` / `X-Error-Message` headers."""

    def __init__(self, status, message, error_code=None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.headers = headers or {}


class Commit:
    """One commit: its sha, parent sha (None for the first), message, date and the full tree {path: blob oid}."""

    def __init__(self, sha, parent_sha, title, message, date, files):
        self.sha = sha
        self.parent_sha = parent_sha
        self.title = title
        self.message = message
        self.date = date
        self.files = files


class Repo:
    """A repo in memory: branches {name: head sha}, commits {sha: Commit}, blobs {oid: bytes}."""

    def __init__(self, repo_type, repo_id, private):
        self.repo_type = repo_type
        self.repo_id = repo_id
        self.private = private
        self.created_at = _now_iso()
        self.branches = {}
        self.commits = {}
        self.blobs = {}

    def resolve_revision(self, revision):
        """Return the Commit a branch name or a commit sha points to; raise RevisionNotFound otherwise."""
        if revision in self.branches:
            return self.commits[self.branches[revision]]
        if _COMMIT_SHA.match(revision) and revision in self.commits:
            return self.commits[revision]
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def last_commit_touching(self, commit, path):
        """The oldest ancestor of `commit` (itself included) since which `path` has had the same content."""
        blob_oid = commit.files.get(path)
        while commit.parent_sha is not None:
            parent = self.commits[commit.parent_sha]
            if parent.files.get(path) != blob_oid:
                break
            commit = parent
        return commit


class HubServer:
    """A threaded Hub-compatible server on 127.0.0.1; `url` is its endpoint once started.

    Use it as a context manager, or call `start()` and `stop()`. `requests` records (method, path, status) of every
    request served and `unhandled` the (method, path) of requests no route matched, for tests to inspect.
    """

    def __init__(self, host="127.0.0.1", port=0, namespace=DEFAULT_NAMESPACE):
        self.host = host
        self.port = port
        self.namespace = namespace
        self.repos = {}
        self.requests = []
        self.unhandled = []
        self._lock = threading.RLock()
        self._commit_counter = 0
        self._httpd = None
        self._thread = None

    # -- lifecycle --------------------------------------------------------------------------------------------------

    @property
    def url(self):
        if self._httpd is None:
            raise RuntimeError("HubServer is not started: call start() or use it as a context manager")
        return f"http://{self.host}:{self._httpd.server_address[1]}"

    def start(self):
        if self._httpd is not None:
            return self
        handler_class = type("BoundHubRequestHandler", (_HubRequestHandler,), {"hub": self})
        self._httpd = ThreadingHTTPServer((self.host, self.port), handler_class)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self):
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)
        self._httpd = None
        self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    def client_env(self, hf_home, base_env=None):
        """Environment for a subprocess whose huggingface_hub / transformers must talk to this server.

        Points HF_ENDPOINT here with a dummy token, Xet off, telemetry off, online, and every cache (hub files,
        remote-code modules) under `hf_home`. Set it before huggingface_hub is imported: hence a subprocess.
        """
        env = dict(os.environ if base_env is None else base_env)
        for key in (
            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
            "TRANSFORMERS_CACHE", "HF_MODULES_CACHE", "HF_TOKEN_PATH", "HF_STORED_TOKENS_PATH",
            "HUGGING_FACE_HUB_TOKEN", "HF_XET_CACHE", "HF_ASSETS_CACHE",
        ):
            env.pop(key, None)
        no_proxy = ",".join(filter(None, [env.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
        env.update(
            HF_ENDPOINT=self.url,
            HF_TOKEN="dummy-test-token",
            HF_HUB_DISABLE_XET="1",
            HF_HOME=str(hf_home),
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HUB_DISABLE_IMPLICIT_TOKEN="0",
            NO_PROXY=no_proxy,
            no_proxy=no_proxy,
        )
        return env

    # -- helpers used by the request handler --------------------------------------------------------------------------

    def repo_url(self, repo_type, repo_id):
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        return f"{self.url}/{prefix}{repo_id}"

    def get_repo(self, repo_type, repo_id, authorized=True):
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not authorized):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def new_commit(self, repo, branch, parent_sha, title, message, files):
        """Record a commit with tree `files` on top of `parent_sha`, move `branch` to it, return it."""
        self._commit_counter += 1
        tree_digest = json.dumps(sorted(files.items()))
        seed_parts = [repo.repo_type, repo.repo_id, str(parent_sha), title, message, tree_digest]
        seed = "\n".join(seed_parts + [str(self._commit_counter)])
        sha = hashlib.sha1(seed.encode()).hexdigest()
        commit = Commit(sha, parent_sha, title, message, _now_iso(), dict(files))
        repo.commits[sha] = commit
        repo.branches[branch] = sha
        return commit


class _HubRequestHandler(BaseHTTPRequestHandler):
    """Routes one request to the `hub` (a HubServer, set on the bound subclass)."""

    protocol_version = "HTTP/1.1"
    server_version = "TestHub/1.0"
    timeout = 120
    hub = None

    # -- plumbing ---------------------------------------------------------------------------------------------------

    def log_message(self, format, *args):  # requests are recorded in hub.requests instead of stderr
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status, body=b"", headers=None, content_type="application/json"):
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)
        self.hub.requests.append((self.command, self.path, status))

    def _send_json(self, status, payload, headers=None):
        self._send(status, json.dumps(payload).encode(), headers)

    def _dispatch(self, method):
        split_url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(split_url.query).items()}
        # Split the still-quoted path so that a revision quoted as "refs%2Fpr%2F1" stays one segment.
        segments = [unquote(segment) for segment in split_url.path.strip("/").split("/")]
        try:
            body = self._read_body()
            with self.hub._lock:
                self._route(method, segments, query, body)
        except HubError as error:
            headers = dict(error.headers)
            if error.error_code is not None:
                headers["X-Error-Code"] = error.error_code
            headers["X-Error-Message"] = error.message.encode("ascii", "replace").decode()
            self._send_json(error.status, {"error": error.message}, headers)
        except Exception as error:  # a server bug: answer 500 with the reason rather than hang the client
            self._send_json(500, {"error": f"{type(error).__name__}: {error}"})

    @property
    def _authorized(self):
        return bool(self.headers.get("Authorization"))

    def _require_auth(self):
        if not self._authorized:
            raise HubError(401, "Invalid credentials in Authorization header")

    # -- routing ----------------------------------------------------------------------------------------------------

    def _not_found(self, method):
        self.hub.unhandled.append((method, self.path))
        return HubError(404, f"This test server has no route for {method} {self.path}")

    def _route(self, method, segments, query, body):
        if segments[0] == "api":
            return self._route_api(method, segments[1:], query, body)
        # /[datasets/|spaces/]{ns}/{name}/resolve/{rev}/{path...}
        repo_type = "model"
        if segments[0] in ("datasets", "spaces"):
            repo_type, segments = segments[0][:-1], segments[1:]
        if method in ("GET", "HEAD") and len(segments) >= 5 and segments[2] == "resolve":
            repo_id = f"{segments[0]}/{segments[1]}"
            return self._resolve(method, repo_type, repo_id, segments[3], "/".join(segments[4:]))
        raise self._not_found(method)

    def _route_api(self, method, segments, query, body):
        route = (method, "/".join(segments))
        if route == ("GET", "whoami-v2"):
            return self._send_json(200, {"type": "user", "name": self.hub.namespace, "fullname": "Test User",
                                         "orgs": [], "auth": {"type": "access_token"}})
        if route == ("POST", "repos/create"):
            return self._create_repo(json.loads(body or b"{}"))
        if route == ("DELETE", "repos/delete"):
            return self._delete_repo(json.loads(body or b"{}"))
        if route == ("POST", "validate-yaml"):
            return self._validate_yaml(json.loads(body or b"{}"))

        if len(segments) < 3 or segments[0] not in ("models", "datasets", "spaces"):
            raise self._not_found(method)
        repo_type = segments[0][:-1]
        repo = self.hub.get_repo(repo_type, f"{segments[1]}/{segments[2]}", authorized=self._authorized)
        action, args = (segments[3], segments[4:]) if len(segments) > 3 else (None, [])

        if method == "GET" and action is None:
            return self._repo_info(repo, repo.resolve_revision(DEFAULT_BRANCH), query)
        if method == "GET" and action == "revision" and len(args) == 1:
            return self._repo_info(repo, repo.resolve_revision(args[0]), query)
        if method == "GET" and action == "tree" and args:
            return self._tree(repo, repo.resolve_revision(args[0]), "/".join(args[1:]), query)
        if method == "POST" and action == "paths-info" and len(args) == 1:
            return self._paths_info(repo, repo.resolve_revision(args[0]), body)
        if method == "POST" and action == "preupload" and len(args) == 1:
            self._require_auth()
            return self._preupload(repo, args[0], json.loads(body or b"{}"), query)
        if method == "POST" and action == "commit" and len(args) == 1:
            self._require_auth()
            return self._commit(repo, args[0], body, query)
        if action == "branch" and len(args) == 1 and method in ("POST", "DELETE"):
            self._require_auth()
            return self._branch(method, repo, args[0], json.loads(body or b"{}"))
        if method == "GET" and action == "refs" and not args:
            return self._refs(repo)
        if method == "GET" and action == "commits" and len(args) == 1:
            return self._commits(repo, repo.resolve_revision(args[0]))
        raise self._not_found(method)

    # -- repos ------------------------------------------------------------------------------------------------------

    def _create_repo(self, payload):
        self._require_auth()
        repo_type = payload.get("type") or "model"
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type {repo_type!r}: expected one of {REPO_TYPES}")
        name = payload.get("name")
        if not name or "/" in name:
            raise HubError(400, f"Invalid repo name {name!r}")
        repo_id = f"{payload.get('organization') or self.hub.namespace}/{name}"
        url = self.hub.repo_url(repo_type, repo_id)
        if (repo_type, repo_id) in self.hub.repos:
            return self._send_json(409, {"error": f"You already created this {repo_type} repo", "url": url})
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = Repo(repo_type, repo_id, private)
        self.hub.repos[(repo_type, repo_id)] = repo
        self.hub.new_commit(repo, DEFAULT_BRANCH, None, "initial commit", "", {})
        self._send_json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self, payload):
        self._require_auth()
        repo_type = payload.get("type") or "model"
        repo_id = f"{payload.get('organization') or self.hub.namespace}/{payload.get('name')}"
        self.hub.get_repo(repo_type, repo_id)
        del self.hub.repos[(repo_type, repo_id)]
        self._send(200, b"", content_type=None)

    def _validate_yaml(self, payload):
        try:
            _parse_front_matter(payload.get("content", ""))
        except ValueError as error:
            return self._send_json(400, {"errors": [{"message": str(error)}], "warnings": []})
        self._send_json(200, {"errors": [], "warnings": []})

    def _repo_info(self, repo, commit, query):
        with_blobs = query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for path in sorted(commit.files):
            sibling = {"rfilename": path}
            if with_blobs:
                blob_oid = commit.files[path]
                sibling.update(size=len(repo.blobs[blob_oid]), blobId=blob_oid)
            siblings.append(sibling)
        info = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit.sha,
            "lastModified": commit.date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(len(repo.blobs[oid]) for oid in set(commit.files.values())),
        }
        if repo.repo_type == "model":
            info["modelId"] = repo.repo_id
        card_data = None
        if "README.md" in commit.files:
            try:
                card_data = _parse_front_matter(repo.blobs[commit.files["README.md"]].decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                card_data = None
        if card_data:
            info["cardData"] = card_data
            tags = card_data.get("tags") or []
            info["tags"] = list(tags) if isinstance(tags, list) else [str(tags)]
            for key in ("library_name", "pipeline_tag"):
                if isinstance(card_data.get(key), str):
                    info[key] = card_data[key]
                    info["tags"].append(card_data[key])
        if repo.repo_type == "model" and "config.json" in commit.files:
            try:
                config = json.loads(repo.blobs[commit.files["config.json"]])
                info["config"] = {key: config[key] for key in ("architectures", "model_type", "auto_map")
                                  if key in config}
            except (ValueError, TypeError):
                pass
        self._send_json(200, info)

    # -- files ------------------------------------------------------------------------------------------------------

    def _entry(self, repo, commit, path, expand):
        """The tree/paths-info entry for a file or folder `path` of `commit`, None if it does not exist."""
        if path in commit.files:
            blob_oid = commit.files[path]
            entry = {"type": "file", "oid": blob_oid, "size": len(repo.blobs[blob_oid]), "path": path}
            if expand:
                last = repo.last_commit_touching(commit, path)
                entry["lastCommit"] = {"id": last.sha, "title": last.title, "date": last.date}
            return entry
        prefix = path + "/"
        children = sorted((p, oid) for p, oid in commit.files.items() if p.startswith(prefix))
        if not children:
            return None
        tree_oid = hashlib.sha1(json.dumps(children).encode()).hexdigest()
        return {"type": "directory", "oid": tree_oid, "size": 0, "path": path}

    def _tree(self, repo, commit, path, query):
        path = path.strip("/")
        recursive = query.get("recursive", "").lower() in ("1", "true")
        expand = query.get("expand", "").lower() in ("1", "true")
        prefix = path + "/" if path else ""
        if path and (path in commit.files or self._entry(repo, commit, path, False) is None):
            raise HubError(404, f"Not a folder: {path}", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        listed = set()
        for file_path in commit.files:
            if not file_path.startswith(prefix):
                continue
            parts = file_path[len(prefix):].split("/")
            if recursive:
                for depth in range(1, len(parts) + 1):
                    listed.add(prefix + "/".join(parts[:depth]))
            else:
                listed.add(prefix + parts[0])
        entries = [self._entry(repo, commit, entry_path, expand) for entry_path in sorted(listed)]
        self._send_json(200, entries)

    def _paths_info(self, repo, commit, body):
        form = parse_qs(body.decode("utf-8"))
        expand = form.get("expand", ["False"])[-1].lower() in ("1", "true")
        entries = []
        for path in form.get("paths", []):
            entry = self._entry(repo, commit, path.strip("/"), expand)
            if entry is not None:
                entries.append(entry)
        self._send_json(200, entries)

    def _resolve(self, method, repo_type, repo_id, revision, path):
        repo = self.hub.get_repo(repo_type, repo_id, authorized=self._authorized)
        commit = repo.resolve_revision(revision)
        if path not in commit.files:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        blob_oid = commit.files[path]
        content = repo.blobs[blob_oid]
        headers = {
            "X-Repo-Commit": commit.sha,
            "ETag": f'"{blob_oid}"',
            "Accept-Ranges": "bytes",
            "Content-Disposition": f'inline; filename="{path.split("/")[-1]}"',
        }
        status = 200
        range_match = re.match(r"^bytes=(\d*)-(\d*)$", self.headers.get("Range", "").strip())
        if range_match and (range_match.group(1) or range_match.group(2)):
            if range_match.group(1):
                start = int(range_match.group(1))
                end = int(range_match.group(2)) if range_match.group(2) else len(content) - 1
            else:  # suffix range: the last N bytes
                start, end = max(0, len(content) - int(range_match.group(2))), len(content) - 1
            end = min(end, len(content) - 1)
            if start >= len(content) or start > end:
                raise HubError(
                    416, "Requested range not satisfiable", headers={"Content-Range": f"bytes */{len(content)}"}
                )
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            content = content[start : end + 1]
            status = 206
        headers["Content-Length"] = str(len(content))
        self._send(status, content, headers, content_type="application/octet-stream")

    # -- writes -----------------------------------------------------------------------------------------------------

    def _writable_branch(self, repo, revision, query):
        if query.get("create_pr", "") in ("1", "true", "True"):
            raise HubError(400, "This test server does not support create_pr")
        if revision not in repo.branches:
            raise HubError(404, f"Invalid rev id: {revision} (commits go to an existing branch)", "RevisionNotFound")
        return revision

    def _preupload(self, repo, revision, payload, query):
        branch = self._writable_branch(repo, revision, query)
        head = repo.commits[repo.branches[branch]]
        files = []
        for file_info in payload.get("files", []):
            path = file_info["path"]
            files.append({"path": path, "uploadMode": "regular", "shouldIgnore": False, "oid": head.files.get(path)})
        self._send_json(200, {"files": files, "commitOid": head.sha})

    def _commit(self, repo, revision, body, query):
        branch = self._writable_branch(repo, revision, query)
        head = repo.commits[repo.branches[branch]]
        lines = [json.loads(line) for line in body.decode("utf-8").splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "A commit payload starts with a 'header' line")
        header = lines[0]["value"]
        parent_commit = header.get("parentCommit")
        if parent_commit is not None and parent_commit != head.sha:
            raise HubError(412, f"Parent commit {parent_commit} is not the head of {branch} ({head.sha})")
        files = dict(head.files)
        new_blobs = {}
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            path = value.get("path", "").strip("/")
            if key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise HubError(400, f"Unsupported encoding {value.get('encoding')!r} for {path}")
                content = base64.b64decode(value["content"])
                blob_oid = git_blob_oid(content)
                new_blobs[blob_oid] = content
                files[path] = blob_oid
            elif key == "deletedFile":
                if path not in files:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del files[path]
            elif key == "deletedFolder":
                removed = [p for p in files if p.startswith(path + "/")]
                if not removed:
                    raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in removed:
                    del files[p]
            elif key == "lfsFile":
                raise HubError(400, "This test server has no LFS storage: preupload answers uploadMode 'regular'")
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        repo.blobs.update(new_blobs)
        commit = self.hub.new_commit(repo, branch, head.sha, header.get("summary", ""),
                                     header.get("description", ""), files)
        self._send_json(200, {
            "success": True,
            "commitOid": commit.sha,
            "commitUrl": f"{self.hub.repo_url(repo.repo_type, repo.repo_id)}/commit/{commit.sha}",
            "commitMessage": commit.title,
            "hookOutput": "",
        })

    def _branch(self, method, repo, branch, payload):
        if method == "DELETE":
            if branch not in repo.branches:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            if branch == DEFAULT_BRANCH:
                raise HubError(403, "Cannot delete the default branch")
            del repo.branches[branch]
            return self._send(200, b"", content_type=None)
        if branch in repo.branches:
            return self._send_json(409, {"error": f"Reference already exists: refs/heads/{branch}"})
        start = repo.resolve_revision(payload.get("startingPoint") or DEFAULT_BRANCH)
        repo.branches[branch] = start.sha
        self._send(200, b"", content_type=None)

    def _refs(self, repo):
        branches = [{"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha}
                    for name, sha in sorted(repo.branches.items())]
        self._send_json(200, {"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    def _commits(self, repo, commit):
        history = []
        while commit is not None:
            history.append({"id": commit.sha, "title": commit.title, "message": commit.message, "date": commit.date,
                            "authors": [{"user": self.hub.namespace}]})
            commit = repo.commits[commit.parent_sha] if commit.parent_sha is not None else None
        self._send_json(200, history)


if __name__ == "__main__":  # a manual run: python tests/hub_server.py, then point HF_ENDPOINT at the printed url
    import time

    with HubServer() as running_server:
        print(f"HF_ENDPOINT={running_server.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def run_client(server, workdir, script, *args):
    """Runs `script` in a fresh Python process pointed at `server` (its own HF_HOME under `workdir`); returns the
    JSON the script printed on its last line."""
    env = server.client_env(hf_home=workdir / "hf_home")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        env=env, cwd=workdir, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"client failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])
