"""A Hugging Face Hub on loopback, so tests run real `huggingface_hub` downloads without network.

Data flow: a test writes repos as plain folders with `publish(root, ...)`, starts `serve_hub(root)` (a stdlib
ThreadingHTTPServer on 127.0.0.1, one thread per connection) and points a client at it with `HF_ENDPOINT=server.url`
(read once, when `huggingface_hub.constants` is imported, so set it before that: `client_env` builds the environment
for a subprocess). The client asks the endpoints below; each answer is computed from the folders at request time,
so a test may publish more revisions while the server runs. `server.requests` counts the requests per path.

The endpoints, and where huggingface_hub 2.4.0 calls them (paths relative to its package):
  GET  /api/{models,datasets,spaces}/<org>/<name>[/revision/<rev>]      repo info: {"id", "sha", "siblings", ...}
       `HfApi.model_info` / `dataset_info` (hf_api.py:3145 / 3220, the GET at 3214 / 3284), reached through
       `HfApi.repo_info` (hf_api.py:3470) from `snapshot_download` (_snapshot_download.py:279; skipped when the
       revision already is a 40-hex commit) and from `HfApi.resolve_revision` (hf_api.py:3546). As on the Hub,
       `siblings` carry only `rfilename` unless `?blobs=true` (`files_metadata=True`) adds size, blobId and lfs.
  GET  /api/<type>s/<org>/<name>/tree/<rev>[/<path>]?recursive=...          the file list: [{"type", "path", "oid",
       "size", "lfs"?}, ...], all in one page (the Hub pages by 1000 with `Link: rel=next`; one page is as valid)
       `HfApi._iter_repo_tree_pages` (hf_api.py:4000, URL at 4023) via `list_repo_tree`, from `snapshot_download`
       (_snapshot_download.py:292) with the commit sha as revision and recursive=True; the listing is what
       allow_patterns / ignore_patterns filter (_snapshot_download.py:411), and it is cached as trees/<sha>.json.
  HEAD /[datasets/|spaces/]<org>/<name>/resolve/<rev>/<file>                   the file's metadata
       `get_hf_file_metadata` (file_download.py:1618, the HEAD at 1670, headers read at 1677-1689) from
       `_get_metadata_or_catch_error` (file_download.py:1693) in `hf_hub_download`, which `snapshot_download` runs
       once per kept file in threads (_snapshot_download.py:519-547). It needs `X-Repo-Commit` (else
       FileMetadataError, file_download.py:1791), an etag (`X-Linked-Etag` or `ETag`, 1802) which names the blob in
       the cache, and a size (`X-Linked-Size`, or `Content-Length` when not a redirect). A plain (git) file answers
       200 with ETag = its git blob sha1; an LFS file (suffix in LFS_SUFFIXES) answers 302 with ETag of the pointer,
       X-Linked-Etag = sha256, X-Linked-Size and `Location` on a *different origin* (http://localhost:PORT/cdn/...),
       so the client stops there as it does at the Hub's CDN (`_httpx2_follow_hub_redirects_with_backoff`,
       utils/_http.py:735) and downloads from `Location` (file_download.py:1819) without the auth header.
  GET  the same resolve URL, or the /cdn/<type>s/<org>/<name>/<sha>/<file> it redirects to       the bytes
       `http_get` (file_download.py:334) from `_download_to_tmp_and_move` (file_download.py:1969); no Range support
       (the client asks for a range only to resume a broken download).
Xet is never advertised (no `X-Xet-Hash` header, no `Link: rel=xet-auth`, no `xetHash` in the tree), so
`parse_xet_file_data_from_response` (utils/_xet.py:48) returns None and the plain HTTP path is taken even with
hf_xet installed. Not served (404 without X-Error-Code): POST paths-info, uploads and commits, listings of repos,
Range requests, `expand` data such as lastCommit.

Errors, as `hf_raise_for_status` (utils/_http.py:826) maps them by `X-Error-Code` (lines 880-953):
  missing repo      401 (no Authorization header, as the Hub answers anonymous callers) or 404, RepoNotFound
                    -> RepositoryNotFoundError
  gated repo        info and tree answer 200 with "gated": "manual"; resolve answers 401 (403 with a token),
                    GatedRepo -> GatedRepoError (a RepositoryNotFoundError subclass, errors.py:343)
  missing revision  404 RevisionNotFound -> RevisionNotFoundError
  missing file      404 EntryNotFound with X-Repo-Commit -> RemoteEntryNotFoundError (the client caches the absence)

On disk, under `root`: <type>s/<org>/<name>/repo.json holds {"refs": {branch or tag: sha}, "gated": false|"manual"},
and <type>s/<org>/<name>/commits/<sha>/ holds that commit's files. Repo ids must be `<org>/<name>`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Self
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".gguf",
    ".parquet",
    ".arrow",
    ".npy",
    ".npz",
    ".zip",
    ".gz",
)
COMMIT = re.compile(r"[0-9a-f]{40}")
DATE = "2024-01-01T00:00:00.000Z"
REPO_TYPES = ("model", "dataset", "space")
API_ROUTE = re.compile(
    r"/api/(?P<kind>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)"
    r"(?:/(?P<op>revision|tree)/(?P<rev>[^/]+)(?P<path>/.*)?)?"
)
RESOLVE_ROUTE = re.compile(r"/(?:(?P<kind>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")
CDN_ROUTE = re.compile(
    r"/cdn/(?P<kind>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)/(?P<sha>[0-9a-f]{40})/(?P<file>.+)"
)


# ---------------------------------------------------------------------------------------------------- repos on disk


def repo_dir(root: Path, repo_id: str, repo_type: str = "model") -> Path:
    """The folder of one repo: root/<type>s/<org>/<name>."""
    if repo_type not in REPO_TYPES or len(repo_id.split("/")) != 2 or ".." in repo_id.split("/"):
        raise ValueError(f"bad repo {repo_type} {repo_id!r}: want a type in {REPO_TYPES} and an id <org>/<name>")
    return Path(root) / f"{repo_type}s" / repo_id


def commit_sha(repo_id: str, files: dict[str, bytes], repo_type: str = "model") -> str:
    """A deterministic 40-hex commit id: sha1 of the repo and of its files' names and contents."""
    digest = hashlib.sha1(f"{repo_type}s/{repo_id}\n".encode())
    for name in sorted(files):
        digest.update(f"{name}\0{hashlib.sha1(files[name]).hexdigest()}\n".encode())
    return digest.hexdigest()


def publish(
    root: Path,
    repo_id: str,
    files: dict[str, bytes],
    *,
    repo_type: str = "model",
    revision: str | None = "main",
    commit: str | None = None,
) -> str:
    """Write a commit holding `files` (repo path -> bytes) and point `revision` (a branch or tag) at it; the commit's
    sha, `commit` or else `commit_sha` of the files. `revision=None` (or a 40-hex sha) writes no ref: the commit is
    reachable by its sha only. Publishing the same files again gives the same sha, so `publish(..., revision="v1")`
    with main's files makes a tag on main's commit."""
    if revision is not None and COMMIT.fullmatch(revision):
        commit, revision = commit or revision, None
    sha = commit or commit_sha(repo_id, files, repo_type)
    if not COMMIT.fullmatch(sha):
        raise ValueError(f"commit must be 40 lowercase hex digits, got {sha!r}")
    repo = repo_dir(root, repo_id, repo_type)
    shutil.rmtree(repo / "commits" / sha, ignore_errors=True)  # the commit holds exactly `files`
    for name, data in files.items():
        target = repo / "commits" / sha / _safe_relative(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (repo / "commits" / sha).mkdir(parents=True, exist_ok=True)
    meta = read_meta(repo)
    if revision is not None:
        meta["refs"][revision] = sha
    _write_meta(repo, meta)
    return sha


def gate(root: Path, repo_id: str, *, repo_type: str = "model") -> None:
    """Make a repo gated: its files answer 401/403 GatedRepo, its info and tree still answer (as on the Hub)."""
    repo = repo_dir(root, repo_id, repo_type)
    meta = read_meta(repo)
    meta["gated"] = "manual"
    _write_meta(repo, meta)


def read_meta(repo: Path) -> dict:
    """repo.json: {"refs": {name: sha}, "gated": false | "manual"}; defaults when absent."""
    path = repo / "repo.json"
    meta = json.loads(path.read_text()) if path.is_file() else {}
    return {"refs": meta.get("refs", {}), "gated": meta.get("gated", False)}


def _write_meta(repo: Path, meta: dict) -> None:
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "repo.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def _safe_relative(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"bad repo file path {name!r}")
    return path


# ---------------------------------------------------------------------------------------------------- blobs


@dataclass(frozen=True)
class Blob:
    """One file of a commit, with the ids the Hub gives it."""

    path: str
    size: int
    git_oid: str  # sha1 of the git blob: the file's own, or its LFS pointer's
    sha256: str | None  # set for LFS files only
    pointer_size: int | None


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_blob(path: str, data: bytes) -> Blob:
    if not path.endswith(LFS_SUFFIXES):
        return Blob(path, len(data), git_blob_oid(data), None, None)
    sha256 = hashlib.sha256(data).hexdigest()
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
    return Blob(path, len(data), git_blob_oid(pointer), sha256, len(pointer))


def commit_files(repo: Path, sha: str) -> list[str]:
    """The commit's file paths, '/'-separated, sorted."""
    base = repo / "commits" / sha
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())


def commit_blobs(repo: Path, sha: str) -> list[Blob]:
    return [make_blob(name, (repo / "commits" / sha / name).read_bytes()) for name in commit_files(repo, sha)]


# ---------------------------------------------------------------------------------------------------- answers


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class HubError(Exception):
    """An error answer in the Hub's form: status, X-Error-Code, X-Error-Message, a JSON {"error": message} body."""

    def __init__(self, status: int, code: str, message: str, **headers: str):
        super().__init__(message)
        self.answer = Answer(
            status,
            {"X-Error-Code": code, "X-Error-Message": message, **headers},
            json.dumps({"error": message}).encode(),
        )
        self.answer.headers["Content-Type"] = "application/json"


def json_answer(payload: object) -> Answer:
    return Answer(200, {"Content-Type": "application/json"}, json.dumps(payload).encode())


def open_repo(root: Path, repo_type: str, repo_id: str, authed: bool) -> Path:
    """The repo's folder; 401 (anonymous) or 404 RepoNotFound when there is none."""
    try:
        repo = repo_dir(root, repo_id, repo_type)
    except ValueError:
        repo = Path(root) / "missing"
    if not (repo / "repo.json").is_file() and not (repo / "commits").is_dir():
        raise HubError(404 if authed else 401, "RepoNotFound", "Repository not found")
    return repo


def resolve_revision(repo: Path, revision: str) -> str:
    """A branch or tag through repo.json's refs, or a 40-hex commit that exists; else 404 RevisionNotFound."""
    sha = read_meta(repo)["refs"].get(revision)
    if sha is None and COMMIT.fullmatch(revision) and (repo / "commits" / revision).is_dir():
        sha = revision
    if sha is None:
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    return sha


def repo_info(root: Path, repo_type: str, repo_id: str, revision: str, blobs: bool, authed: bool) -> Answer:
    repo = open_repo(root, repo_type, repo_id, authed)
    sha = resolve_revision(repo, revision)
    siblings = [sibling(b, blobs) for b in commit_blobs(repo, sha)]
    org = repo_id.split("/")[0]
    info = {
        "_id": commit_sha(repo_id, {}, repo_type)[:24],
        "id": repo_id,
        "author": org,
        "sha": sha,
        "lastModified": DATE,
        "createdAt": DATE,
        "private": False,
        "gated": read_meta(repo)["gated"],
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": siblings,
    }
    if repo_type == "model":
        info["modelId"] = repo_id
    return json_answer(info)


def sibling(blob: Blob, blobs: bool) -> dict:
    """One `siblings` entry; size, blobId and lfs only when asked with ?blobs=true, as on the Hub."""
    if not blobs:
        return {"rfilename": blob.path}
    entry = {"rfilename": blob.path, "size": blob.size, "blobId": blob.git_oid}
    if blob.sha256:
        entry["lfs"] = {"sha256": blob.sha256, "size": blob.size, "pointerSize": blob.pointer_size}
    return entry


def repo_tree(
    root: Path, repo_type: str, repo_id: str, revision: str, folder: str, recursive: bool, authed: bool
) -> Answer:
    repo = open_repo(root, repo_type, repo_id, authed)
    sha = resolve_revision(repo, revision)
    prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
    entries: dict[str, dict] = {}
    for blob in commit_blobs(repo, sha):
        if not blob.path.startswith(prefix):
            continue
        parts = blob.path[len(prefix) :].split("/")
        depth = len(parts) if recursive else 1
        for i in range(1, min(depth, len(parts) - 1) + 1):  # the folders on the way
            path = prefix + "/".join(parts[:i])
            entries.setdefault(path, {"type": "directory", "oid": git_blob_oid(path.encode()), "size": 0, "path": path})
        if recursive or len(parts) == 1:
            entries[blob.path] = tree_file(blob)
    if prefix and not entries:
        raise HubError(404, "EntryNotFound", f'{folder} does not exist on "{revision}"', **{"X-Repo-Commit": sha})
    return json_answer(sorted(entries.values(), key=lambda e: (e["type"] != "directory", e["path"])))


def tree_file(blob: Blob) -> dict:
    entry = {"type": "file", "oid": blob.git_oid, "size": blob.size, "path": blob.path}
    if blob.sha256:
        entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": blob.pointer_size}
    return entry


def resolve_file(root: Path, cdn: str, repo_type: str, repo_id: str, revision: str, name: str, authed: bool) -> Answer:
    """HEAD/GET /resolve: 200 with the bytes (git files) or 302 to the CDN origin (LFS files). A HEAD answer keeps
    the body's Content-Length (the client takes it for the file's size) and drops the body."""
    repo = open_repo(root, repo_type, repo_id, authed)
    if read_meta(repo)["gated"]:
        raise HubError(
            403 if authed else 401,
            "GatedRepo",
            f"Access to {repo_type} {repo_id} is restricted. You must have access to it and be "
            "authenticated to access it. Please log in.",
        )
    sha = resolve_revision(repo, revision)
    data = read_commit_file(repo, sha, name)
    blob = make_blob(name, data)
    headers = {"X-Repo-Commit": sha, "ETag": f'"{blob.git_oid}"', "Accept-Ranges": "bytes"}
    if blob.sha256 is None:
        return Answer(200, {**headers, "Content-Type": "application/octet-stream"}, data)
    location = f"{cdn}/cdn/{repo_type}s/{repo_id}/{sha}/{quote(name)}"
    return Answer(
        302, {**headers, "Location": location, "X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(blob.size)}
    )


def read_commit_file(repo: Path, sha: str, name: str) -> bytes:
    try:
        path = repo / "commits" / sha / _safe_relative(name)
    except ValueError:
        path = repo / "missing"
    if not path.is_file():
        raise HubError(404, "EntryNotFound", "Entry not found", **{"X-Repo-Commit": sha})
    return path.read_bytes()


def cdn_file(root: Path, repo_type: str, repo_id: str, sha: str, name: str) -> Answer:
    """What the Hub's CDN serves at a signed URL: the bytes, by content address."""
    data = read_commit_file(open_repo(root, repo_type, repo_id, authed=True), sha, name)
    return Answer(
        200, {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Content-Type": "application/octet-stream"}, data
    )


def route(server: _Server, raw_path: str, query: dict[str, list[str]], authed: bool) -> Answer:
    """Dispatch one request; `raw_path` is still %-encoded (revisions come with '/' as %2F)."""
    if m := CDN_ROUTE.fullmatch(raw_path):
        return cdn_file(server.root, m["kind"][:-1], unquote(m["repo"]), m["sha"], unquote(m["file"]))
    if m := API_ROUTE.fullmatch(raw_path):
        kind, repo_id, rev = m["kind"][:-1], unquote(m["repo"]), unquote(m["rev"] or "main")
        if m["op"] == "tree":
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            return repo_tree(server.root, kind, repo_id, rev, unquote(m["path"] or ""), recursive, authed)
        if m["op"] in (None, "revision") and not m["path"]:
            blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            return repo_info(server.root, kind, repo_id, rev, blobs, authed)
    if m := RESOLVE_ROUTE.fullmatch(raw_path):
        kind = (m["kind"] or "models")[:-1]
        return resolve_file(
            server.root, server.cdn_url, kind, unquote(m["repo"]), unquote(m["rev"]), unquote(m["file"]), authed
        )
    return Answer(404, {"Content-Type": "text/plain"}, b"Not Found")


# ---------------------------------------------------------------------------------------------------- the server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client pools connections
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, add=True)

    def finish(self) -> None:
        super().finish()
        self.server.track(self.connection, add=False)

    def do_GET(self) -> None:
        self.answer("GET")

    def do_HEAD(self) -> None:
        self.answer("HEAD")

    def answer(self, method: str) -> None:
        url = urlsplit(self.path)
        try:
            answer = route(self.server, url.path, parse_qs(url.query), "Authorization" in self.headers)
        except HubError as error:
            answer = error.answer
        self.server.hub.record(method, unquote(url.path), answer.status)
        self.send_response(answer.status)
        for key, value in {**answer.headers, "Content-Length": str(len(answer.body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if method != "HEAD":  # a HEAD answer has the headers of the GET one, Content-Length included
            self.wfile.write(answer.body)

    def log_message(self, format: str, *args: object) -> None:  # quiet: `HubServer.log` keeps the record
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, hub: HubServer):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.hub = Path(root), hub
        self.cdn_url = f"http://localhost:{self.server_address[1]}"  # another origin: the client stops at the 302
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    def track(self, connection: socket.socket, add: bool) -> None:
        with self._lock:
            (self._connections.add if add else self._connections.discard)(connection)

    def close_connections(self) -> None:
        """End kept-alive connections too, so a stopped server answers nothing at all."""
        with self._lock:
            for connection in list(self._connections):
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class HubServer:
    """A running loopback Hub. `url` is the HF_ENDPOINT; `requests` counts requests per path (%-decoded, no
    query), `log` lists (method, path, status) in arrival order. A context manager; `stop()` may be called twice."""

    def __init__(self, root: Path):
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.log: list[tuple[str, str, int]] = []
        self._server = _Server(root, self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True)
        self._thread.start()

    def record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests[path] += 1
            self.log.append((method, path, status))

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.close_connections()
            self._server.server_close()
            self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_hub(root: Path) -> HubServer:
    """Serve the repos under `root` (see `publish`) on 127.0.0.1 at a free port, from a background thread."""
    return HubServer(root)


def client_env(url: str | None, hf_home: Path, *, offline: bool = False) -> dict[str, str]:
    """This process's environment for a `huggingface_hub` subprocess that talks to `url` (None: no endpoint), with
    its cache in `hf_home`/hub, no token, no xet, no telemetry, no progress bars and no proxy; HF_HUB_OFFLINE as
    asked (this suite's conftest sets it to 1 for everything else)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_")) and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_OFFLINE=str(int(offline)),
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        TRANSFORMERS_OFFLINE=str(int(offline)),
    )
    if url is not None:
        env["HF_ENDPOINT"] = url
    return env


def main(argv: list[str]) -> None:
    """`python -m mrl.testing.hub_server ROOT`: serve ROOT until interrupted."""
    with serve_hub(Path(argv[0])) as hub:
        print(f"HF_ENDPOINT={hub.url}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main(sys.argv[1:])
