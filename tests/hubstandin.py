"""A STAND-IN for the Hugging Face Hub, on loopback, for tests: not the Hub, and not a mirror.

It implements the endpoints that huggingface_hub calls for llamarig.model.hub, as the real Hub
answers them (status codes, ``X-Error-Code`` headers, JSON fields; found by running the client
against it and by reading the client's code):

- ``GET /api/models/{repo}/revision/{rev}`` (``HfApi.model_info``): ``id``, ``sha`` (the commit),
  ``private``, ``gated``, ``siblings``;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=..`` (``HfApi.list_repo_tree``): file
  entries with the git ``oid``, ``size`` and, for LFS files, ``lfs: {oid: sha256, size,
  pointerSize}``; paginated with a ``Link: <...>; rel="next"`` header past ``page_size`` entries;
- ``POST /api/models/{repo}/paths-info/{rev}`` (``HfApi.get_paths_info``), form data ``paths``;
- ``HEAD|GET /{repo}/resolve/{rev}/{path}``: an LFS file answers 302 to a second loopback server,
  the "CDN", with ``X-Linked-Size``/``X-Linked-Etag``/``X-Repo-Commit`` (what
  ``get_hf_file_metadata`` reads); a plain git file is served directly; the CDN serves the bytes
  with ``Range`` support (206, 416).

Errors as the Hub words them: a missing repo, or a private one without a token that grants it,
is 401 ``RepoNotFound`` (404 when authenticated); a missing revision is 404 ``RevisionNotFound``;
a missing file 404 ``EntryNotFound``; a gated repo's metadata is public but its files answer 401
``GatedRepo`` without a token and 403 ``GatedRepo`` with one that has no access.

A repo is a directory per revision (``add_repo``); files are read from disk when asked, so a
test serves real GGUFs. Every request is recorded in ``requests`` (method, path, whether it
carried an Authorization header, which server) for tests that check what the client called.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_POINTER_SIZE = 134
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Request:
    server: str  # "hub" or "cdn"
    method: str
    path: str  # with the query string
    authorized: bool  # carried an Authorization header


@dataclass
class StandInRepo:
    repo_id: str
    revisions: dict[str, tuple[str, Path]]  # name -> (commit sha, directory)
    gated: bool = False
    private: bool = False
    tokens: frozenset[str] = frozenset()  # tokens that grant access
    not_lfs: frozenset[str] = frozenset()  # paths stored in git, not LFS (no sha256 listed)

    def commit_directory(self, revision: str) -> tuple[str, Path] | None:
        if revision in self.revisions:
            return self.revisions[revision]
        for commit, directory in self.revisions.values():
            if revision == commit:
                return commit, directory
        return None


def commit_sha(text: str) -> str:
    """A 40-hex commit id, derived from ``text`` so tests can predict it."""
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass
class HubStandIn:
    page_size: int = 1000  # the Hub's page size for a tree listing without expand
    repos: dict[str, StandInRepo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    _sha256_cache: dict[tuple[Path, int, float], str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_repo(
        self,
        repo_id: str,
        directory: Path,
        *,
        revisions: dict[str, Path] | None = None,
        gated: bool = False,
        private: bool = False,
        tokens: tuple[str, ...] = (),
        not_lfs: tuple[str, ...] = (),
    ) -> str:
        """Serve ``directory`` as the ``main`` revision of ``repo_id`` (plus ``revisions``: more
        names, each with a directory of its own); return the commit sha of ``main``."""
        named = {"main": directory, **(revisions or {})}
        self.repos[repo_id] = StandInRepo(
            repo_id,
            {name: (commit_sha(f"{repo_id}@{name}"), path) for name, path in named.items()},
            gated=gated,
            private=private,
            tokens=frozenset(tokens),
            not_lfs=frozenset(not_lfs),
        )
        return self.repos[repo_id].revisions["main"][0]

    # --- the data the endpoints return -------------------------------------------------------

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        key = (path, stat.st_size, stat.st_mtime)
        with self._lock:
            known = self._sha256_cache.get(key)
        if known:
            return known
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        with self._lock:
            self._sha256_cache[key] = digest.hexdigest()
        return digest.hexdigest()

    def entry(self, repo: StandInRepo, root: Path, path: Path) -> dict:
        relative = path.relative_to(root).as_posix()
        if path.is_dir():
            return {"type": "directory", "oid": commit_sha(relative), "size": 0, "path": relative}
        size = path.stat().st_size
        if relative in repo.not_lfs:
            blob = hashlib.sha1(b"blob %d\0" % size + path.read_bytes()).hexdigest()
            return {"type": "file", "oid": blob, "size": size, "path": relative}
        sha256 = self.sha256(path)
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
        return {
            "type": "file",
            "oid": hashlib.sha1(b"blob %d\0" % len(pointer) + pointer.encode()).hexdigest(),
            "size": size,
            "path": relative,
            "lfs": {"oid": sha256, "size": size, "pointerSize": LFS_POINTER_SIZE},
        }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    stand_in: HubStandIn
    server_name_label: str
    cdn_base: str  # only on the hub: where LFS downloads redirect

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass  # a test reads .requests instead of stderr

    # --- plumbing -----------------------------------------------------------------------------

    def _record(self) -> None:
        self.stand_in.requests.append(
            Request(
                self.server_name_label,
                self.command,
                self.path,
                self.headers.get("Authorization") is not None,
            )
        )

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data, headers: dict | None = None) -> None:
        self._send(
            200, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})}
        )

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(
            status,
            json.dumps({"error": message}).encode(),
            {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message},
        )

    def _token(self) -> str | None:
        value = self.headers.get("Authorization", "")
        return value[len("Bearer ") :] if value.startswith("Bearer ") else None

    def _read_body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    # --- routing ------------------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route(self._read_body())

    def _route(self, body: bytes = b"") -> None:
        self._record()
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        if self.server_name_label == "cdn":
            return self._cdn(path)
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", url.path):
            return self._model_info(unquote(match[1]), unquote(match[2] or "main"))
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", url.path):
            return self._tree(unquote(match[1]), unquote(match[2]), unquote(match[3] or ""), query)
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/([^/]+)", url.path):
            paths = parse_qs(body.decode()).get("paths", [])
            return self._paths_info(unquote(match[1]), unquote(match[2]), paths)
        if match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", url.path):
            return self._resolve(unquote(match[1]), unquote(match[2]), unquote(match[3]))
        self._error(404, "EntryNotFound", f"no such endpoint in the Hub stand-in: {path}")

    def _repo(self, repo_id: str) -> StandInRepo | None:
        """The repo if this request may see its metadata; else the error is sent."""
        repo = self.stand_in.repos.get(repo_id)
        token = self._token()
        if repo is None or (repo.private and token not in repo.tokens):
            status = 404 if token else 401
            self._error(status, "RepoNotFound", "Repository not found")
            return None
        return repo

    def _revision(self, repo: StandInRepo, revision: str) -> tuple[str, Path] | None:
        found = repo.commit_directory(revision)
        if found is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return found

    # --- endpoints ----------------------------------------------------------------------------

    def _model_info(self, repo_id: str, revision: str) -> None:
        if (repo := self._repo(repo_id)) is None:
            return
        if (found := self._revision(repo, revision)) is None:
            return
        commit, root = found
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        self._json(
            {
                "_id": commit_sha(repo_id)[:24],
                "id": repo_id,
                "sha": commit,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "siblings": [{"rfilename": name} for name in files],
            }
        )

    def _tree(self, repo_id: str, revision: str, under: str, query: dict) -> None:
        if (repo := self._repo(repo_id)) is None:
            return
        if (found := self._revision(repo, revision)) is None:
            return
        _, root = found
        base = root / under.strip("/") if under.strip("/") else root
        if not base.is_dir():
            return self._error(404, "EntryNotFound", f"{under.strip('/')} does not exist")
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        children = sorted(base.rglob("*") if recursive else base.iterdir())
        entries = [self.stand_in.entry(repo, root, child) for child in children]
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + self.stand_in.page_size]
        headers = {}
        if start + self.stand_in.page_size < len(entries):
            next_query = f"recursive={str(recursive).lower()}&cursor={start + len(page)}"
            next_url = f"http://{self.headers['Host']}{urlsplit(self.path).path}?{next_query}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._json(page, headers)

    def _paths_info(self, repo_id: str, revision: str, paths: list[str]) -> None:
        if (repo := self._repo(repo_id)) is None:
            return
        if (found := self._revision(repo, revision)) is None:
            return
        _, root = found
        # like the Hub: a path that does not exist is left out, not an error
        wanted = [root / p for p in paths if ".." not in p.split("/")]
        self._json([self.stand_in.entry(repo, root, p) for p in wanted if p.exists()])

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        if (repo := self._repo(repo_id)) is None:
            return
        if repo.gated and self._token() not in repo.tokens:
            status = 403 if self._token() else 401
            return self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted")
        if (found := self._revision(repo, revision)) is None:
            return
        commit, root = found
        path = root / name
        if ".." in name.split("/") or not path.is_file():
            return self._error(404, "EntryNotFound", f"{name} does not exist on {revision}")
        entry = self.stand_in.entry(repo, root, path)
        if "lfs" not in entry:
            return self._serve(path, {"ETag": f'"{entry["oid"]}"', "X-Repo-Commit": commit})
        sha256 = entry["lfs"]["oid"]
        location = f"{self.cdn_base}/{quote(repo_id)}/{sha256}?name={quote(name)}&commit={commit}"
        self._send(
            302,
            headers={
                "Location": location,
                "ETag": f'"{entry["oid"]}"',
                "X-Linked-Etag": f'"{sha256}"',
                "X-Linked-Size": str(entry["size"]),
                "X-Repo-Commit": commit,
            },
        )

    def _cdn(self, path: str) -> None:
        """``/{repo}/{sha256}``: the bytes of the LFS object, found by its sha256."""
        match = re.fullmatch(r"/([^/]+/[^/]+)/([0-9a-f]{64})", path)
        repo = self.stand_in.repos.get(match[1]) if match else None
        for _, root in repo.revisions.values() if repo else ():
            for candidate in root.rglob("*"):
                if candidate.is_file() and self.stand_in.sha256(candidate) == match[2]:
                    return self._serve(candidate, {"ETag": f'"{match[2]}"'})
        self._send(404, b"no such object")

    def _serve(self, path: Path, headers: dict) -> None:
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        if spec := self.headers.get("Range"):
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", spec.strip())
            if not match or not (match[1] or match[2]):
                return self._send(416, headers={"Content-Range": f"bytes */{size}"})
            if match[1]:
                start = int(match[1])
                end = min(int(match[2]), size - 1) if match[2] else size - 1
            else:
                start = max(size - int(match[2]), 0)
            if start >= size or start > end:
                return self._send(416, headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end}/{size}"}
        length = end - start + 1
        self.send_response(status)
        for name, value in {**headers, "Accept-Ranges": "bytes"}.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(path, "rb") as handle:
            handle.seek(start)
            try:
                shutil.copyfileobj(_Limited(handle, length), self.wfile, _CHUNK)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading, as a resumable download may


class _Limited:
    """A reader of at most ``remaining`` bytes of ``handle``."""

    def __init__(self, handle, remaining: int):
        self.handle, self.remaining = handle, remaining

    def read(self, size: int = -1) -> bytes:
        if self.remaining <= 0:
            return b""
        size = self.remaining if size < 0 else min(size, self.remaining)
        data = self.handle.read(size)
        self.remaining -= len(data)
        return data


class RunningStandIn:
    """The stand-in's two servers (hub and CDN) on 127.0.0.1, each on a port of its own."""

    def __init__(self, stand_in: HubStandIn):
        self.stand_in = stand_in
        self._servers = []
        cdn = self._start("cdn", None)
        self.cdn_url = f"http://127.0.0.1:{cdn.server_address[1]}"
        hub = self._start("hub", self.cdn_url)
        self.url = f"http://127.0.0.1:{hub.server_address[1]}"

    def _start(self, label: str, cdn_base: str | None) -> ThreadingHTTPServer:
        handler = type(
            f"{label}Handler",
            (_Handler,),
            {"stand_in": self.stand_in, "server_name_label": label, "cdn_base": cdn_base},
        )
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        # a short poll: shutdown() waits up to one poll interval
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        self._servers.append(server)
        return server

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
