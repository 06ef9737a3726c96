"""A local stand-in for the Hugging Face hub's HTTP API, with fault injection.

Serves, on 127.0.0.1, the endpoints huggingface_hub and `dsctl download` use:
  GET /api/models/<repo>[/revision/<rev>]   -> {"id", "sha", "siblings"}
  GET /api/models/<repo>/tree/<rev>?recursive=...  -> [{"type", "path", "size", "oid", "lfs"}]
  GET /<repo>/resolve/<rev>/<path>  -> plain files directly; LFS files redirect (302) to
  GET /cdn/<sha256>                 -> the bytes, honouring `Range: bytes=N-` (206)
Faults (consumed in order, per file): error statuses, connections cut or
stalled after k body bytes, one corrupted transfer. Every body byte sent is counted.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Faults:
    api_503: int = 0  # first N API requests answer 503
    status: dict = field(default_factory=dict)  # path -> list of statuses for its next GETs (e.g. [503, 500])
    cuts: dict = field(default_factory=dict)  # path -> list of byte counts: cut the next GETs after that many
    corrupt_once: set = field(default_factory=set)  # paths whose next full body has one byte flipped
    stalls: dict = field(default_factory=dict)  # path -> list of byte counts: go silent after that many
    stall_s: float = 1.5


@dataclass
class Stats:
    served: dict = field(default_factory=dict)  # path -> body bytes sent
    gets: list = field(default_factory=list)  # (path, range start, status)
    api_calls: int = 0

    @property
    def total_served(self) -> int:
        return sum(self.served.values())


class FakeHub:
    def __init__(self, repo_id: str, files: dict[str, bytes], lfs: set[str]):
        self.repo_id, self.files, self.lfs = repo_id, files, lfs
        self.by_sha = {hashlib.sha256(files[p]).hexdigest(): p for p in lfs}
        self.faults, self.stats = Faults(), Stats()
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def tree(self) -> list[dict]:
        out = []
        for path, data in sorted(self.files.items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
            if path in self.lfs:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out

    def next_fault(self, table: dict, path: str):
        with self.lock:
            queue = table.get(path)
            return queue.pop(0) if queue else None


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _json(self, status: int, payload, headers: dict = ()) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in dict(headers).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = unquote(urlparse(self.path).path)
            api = f"/api/models/{hub.repo_id}"
            if path.startswith("/api/"):
                with hub.lock:
                    hub.stats.api_calls += 1
                    fail = hub.faults.api_503 > 0
                    hub.faults.api_503 -= int(fail)
                if fail:
                    return self._json(503, {"error": "overloaded"}, {"Retry-After": "0"})
                if path == api or path.startswith(api + "/revision/"):
                    siblings = [{"rfilename": p} for p in sorted(hub.files)]
                    return self._json(200, {"id": hub.repo_id, "sha": COMMIT, "siblings": siblings})
                if path.startswith(api + "/tree/"):
                    return self._json(200, hub.tree())
                return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            prefix = f"/{hub.repo_id}/resolve/"
            if path.startswith(prefix):
                rev, _, file = path[len(prefix):].partition("/")
                if file not in hub.files:
                    return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                if file in hub.lfs:  # like the hub: LFS content comes from a CDN URL
                    self.send_response(302)
                    self.send_header("Location", f"/cdn/{hashlib.sha256(hub.files[file]).hexdigest()}?sig=x")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                return self._serve(file)
            if path.startswith("/cdn/") and path[5:] in hub.by_sha:
                return self._serve(hub.by_sha[path[5:]])
            return self._json(404, {"error": "not found"})

        def _serve(self, file: str) -> None:
            data = hub.files[file]
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[6:-1])
            status = hub.next_fault(hub.faults.status, file)
            if status is not None:
                hub.stats.gets.append((file, start, status))
                return self._json(status, {"error": "injected"}, {"Retry-After": "0"})
            if start >= len(data) and start:
                hub.stats.gets.append((file, start, 416))
                return self._json(416, {"error": "range"})
            body = data[start:]
            with hub.lock:
                if file in hub.faults.corrupt_once and start == 0:
                    hub.faults.corrupt_once.discard(file)
                    body = body[:10] + bytes([body[10] ^ 0xFF]) + body[11:]
            cut = hub.next_fault(hub.faults.cuts, file)
            stall = hub.next_fault(hub.faults.stalls, file)
            if stall is not None:
                cut = stall
            code = 206 if start else 200
            hub.stats.gets.append((file, start, code))
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            sent = body if cut is None else body[:cut]
            self.wfile.write(sent)
            with hub.lock:
                hub.stats.served[file] = hub.stats.served.get(file, 0) + len(sent)
            if cut is not None:
                self.wfile.flush()
                if stall is not None:  # the client's read timeout fires first
                    time.sleep(hub.faults.stall_s)
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self.close_connection = True

    return Handler
