"""A fake Hugging Face hub on loopback HTTP, for tests that download with huggingface_hub and datasets and then run
offline: ``HF_ENDPOINT=hub.url`` makes both libraries talk to it.

It answers what ``snapshot_download``, ``hf_hub_download``, ``HfFileSystem`` (ranged reads) and
``datasets.load_dataset_builder`` ask of a hub: repo info at a revision, the file tree, paths-info, and file downloads
(HEAD, GET, ``Range``). Each repo has one commit, served for the revision ``main`` and for its sha. ``hub.requests``
lists every request path, so a test can tell what was downloaded; :meth:`FakeHub.close` shuts the server down.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

_API = re.compile(r"^/api/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)(?:/(?P<op>revision|tree|paths-info)"
                  r"/(?P<rev>[^/]+)(?:/(?P<path>.*))?)?$")
_RESOLVE = re.compile(r"^/(?:(?P<kind>datasets)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class FakeHub:
    """Repos served from memory: ``add(kind, repo_id, files)`` with ``kind`` "models" or "datasets"."""

    def __init__(self):
        self.repos: dict[tuple[str, str], tuple[str, dict[str, bytes]]] = {}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

            def do_POST(self):
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, kind: str, repo_id: str, files: dict[str, bytes]) -> str:
        """Serve ``files`` (path in repo -> bytes) as repo ``repo_id``; returns its commit sha."""
        sha = hashlib.sha1(json.dumps(sorted((p, hashlib.sha1(b).hexdigest()) for p, b in files.items()))
                           .encode()).hexdigest()
        self.repos[(kind, repo_id)] = (sha, dict(files))
        return sha

    def add_folder(self, kind: str, repo_id: str, folder: Path) -> str:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add(kind, repo_id, files)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- request handling ----
    def _repo(self, kind: str, repo_id: str, rev: str):
        entry = self.repos.get((kind, repo_id))
        if entry is None or unquote(rev) not in ("main", entry[0]):
            return None
        return entry

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        self.requests.append(f"{h.command} {path}")
        if m := _RESOLVE.match(path):
            return self._file(h, "datasets" if m["kind"] else "models", m["repo"], m["rev"], m["path"], body)
        m = _API.match(path)
        if m is None:
            return self._send(h, 404, {"error": "not found"}, body)
        entry = self._repo(m["kind"], m["repo"], m["rev"] or "main")
        if entry is None:
            return self._send(h, 404, {"error": "Repository not found"}, body, {"X-Error-Code": "RepoNotFound"})
        sha, files = entry
        if m["op"] in (None, "revision"):
            info = {"id": m["repo"], "_id": m["repo"], "sha": sha, "private": False, "disabled": False,
                    "gated": False, "downloads": 0, "likes": 0, "tags": [], "cardData": {},
                    "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                    "siblings": [{"rfilename": p, "size": len(b)} for p, b in sorted(files.items())]}
            return self._send(h, 200, info, body)
        if m["op"] == "tree":
            prefix = (m["path"] or "").strip("/")
            recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
            return self._send(h, 200, self._tree(files, prefix, recursive), body)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length).decode() if length else ""
        asked = (json.loads(raw).get("paths", []) if raw.startswith("{")
                 else parse_qs(raw).get("paths", []))
        entries = [e for e in self._tree(files, "", True) if e["path"] in asked]
        return self._send(h, 200, entries, body)

    @staticmethod
    def _tree(files: dict[str, bytes], prefix: str, recursive: bool) -> list[dict]:
        out, dirs = [], set()
        for p, b in sorted(files.items()):
            if prefix and not p.startswith(prefix + "/"):
                continue
            rest = p[len(prefix) + 1:] if prefix else p
            parts = rest.split("/")
            for i in range(1, len(parts)):
                d = "/".join(filter(None, [prefix, *parts[:i]]))
                if d not in dirs and (recursive or i == 1):
                    dirs.add(d)
                    out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                                "path": d})
            if recursive or len(parts) == 1:
                out.append({"type": "file", "oid": hashlib.sha1(b).hexdigest(), "size": len(b), "path": p})
        return out

    def _file(self, h, kind: str, repo_id: str, rev: str, path: str, body: bool) -> None:
        entry = self._repo(kind, repo_id, rev)
        if entry is None or path not in entry[1]:
            return self._send(h, 404, {"error": "Entry not found"}, body, {"X-Error-Code": "EntryNotFound"})
        sha, files = entry
        data = files[path]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        status, rng = 200, h.headers.get("Range")
        if rng and (m := re.match(r"bytes=(\d*)-(\d*)$", rng)):
            if m[1]:
                a = int(m[1])
                b = min(int(m[2]), len(data) - 1) if m[2] else len(data) - 1
            else:  # a suffix: the last n bytes
                a, b = max(len(data) - int(m[2]), 0), len(data) - 1
            headers["Content-Range"] = f"bytes {a}-{b}/{len(data)}"
            data, status = data[a:b + 1], 206
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    @staticmethod
    def _send(h, status: int, obj, body: bool, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)
