"""A JSON HTTP server on localhost for faking the Kubernetes API at its HTTP boundary."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Route = Callable[[str, str, dict[str, Any]], tuple[int, Any]]
"""``route(method, raw_path, request_body) -> (status, response body)``."""


class Stream:
    """A response body sent as newline-delimited JSON, then the connection closes (a watch that ended)."""

    def __init__(self, events: list[dict[str, Any]]):
        self.events = events


class JsonServer:
    """Serves GET, POST, PATCH and DELETE on 127.0.0.1 (any free port), answering each request with ``route``."""

    def __init__(self, route: Route):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                status, payload = route(method, self.path, body)
                if isinstance(payload, Stream):
                    # No Content-Length: the client reads lines until the server closes (HTTP/1.0 here).
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    for ev in payload.events:
                        self.wfile.write(json.dumps(ev).encode() + b"\n")
                    return
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_DELETE(self):
                self._answer("DELETE")

            def do_POST(self):
                self._answer("POST")

            def do_PATCH(self):
                self._answer("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self.server.shutdown()
        self.server.server_close()
