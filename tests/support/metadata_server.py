"""A stand-in for the GCE metadata server that Workload Identity serves to every GKE pod (the GKE metadata server),
at the address google-auth and tensorstore read, so that their own credential paths run: google-auth's
``compute_engine`` credentials (``GCE_METADATA_HOST`` for requests, ``GCE_METADATA_IP`` for its ping; google-auth
2.63.0 ``compute_engine/_metadata.py``) and tensorstore's GCE auth provider (``GCE_METADATA_ROOT``; tensorstore
``internal/oauth2/gce_auth_provider.cc``).

It answers what those two read: the ping (``/``), the default service account's info
(``instance/service-accounts/default/?recursive=true``), its token (``.../token``), the project id and the universe
domain, each only to a request with ``Metadata-Flavor: Google`` and with that header on the answer, as the real
server does. Tokens are short-lived (``expires_in``), so that a run refreshes them many times.

Faults, each for a window from now: ``fail_for`` (an HTTP status, to a share of requests), ``hang_for`` (a request
that never answers: held until the window ends, then the connection is closed with no answer) and ``slow_for``
(each answer delayed). The real server is known to be unreachable in a pod's first seconds and to time out under
load (google-auth-library-python issue 1261, r-lib/gargle issue 186).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

EMAIL = "jaxrec-steps@local.iam.gserviceaccount.com"
PROJECT = "local"
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
SA = "/computeMetadata/v1/instance/service-accounts/"


class MetadataServer:
    """The stand-in on 127.0.0.1 (a free port), serving from a thread until ``close``."""

    def __init__(self, *, expires_in: int = 240, seed: int = 0):
        self.expires_in = expires_in
        self.counts: Counter[str] = Counter()
        self._issued: set[str] = set()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._fault: tuple[str, float, dict[str, Any]] = ("", 0.0, {})
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server interface
                server._serve(self)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="metadata-server").start()

    def issued(self, token: str) -> bool:
        """Whether this server issued ``token`` (what GCS checks; expiry aside)."""
        return token in self._issued

    def env(self) -> dict[str, str]:
        """The environment that points google-auth and tensorstore at this server."""
        return {"GCE_METADATA_HOST": self.address, "GCE_METADATA_IP": self.address, "GCE_METADATA_ROOT": self.address}

    # --- faults -------------------------------------------------------------------------------------------------

    def fail_for(self, seconds: float, status: int = 503, share: float = 1.0) -> None:
        """From now for ``seconds``, answer ``status`` to each request with probability ``share``."""
        self._set("fail", seconds, status=status, share=share)

    def hang_for(self, seconds: float, share: float = 1.0) -> None:
        """From now for ``seconds``, hold a share of requests unanswered until the window ends, then drop them."""
        self._set("hang", seconds, share=share)

    def slow_for(self, seconds: float, delay: float) -> None:
        """From now for ``seconds``, answer every request ``delay`` seconds late."""
        self._set("slow", seconds, delay=delay)

    def clear(self) -> None:
        """End any fault now."""
        self._set("", 0.0)

    def _set(self, kind: str, seconds: float, **params: Any) -> None:
        with self._lock:
            self._fault = (kind, time.monotonic() + seconds, params)

    def _now_fault(self) -> tuple[str, float, dict[str, Any]]:
        with self._lock:
            kind, until, params = self._fault
            if not kind or time.monotonic() >= until:
                return "", 0.0, {}
            if self._rng.random() >= params.get("share", 1.0):
                return "", 0.0, {}
            return kind, until, params

    # --- serving ------------------------------------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        kind, until, params = self._now_fault()
        if kind == "hang":
            self.counts["hung"] += 1
            time.sleep(max(0.0, until - time.monotonic()))
            h.close_connection = True
            return
        if kind == "slow":
            self.counts["slowed"] += 1
            time.sleep(params["delay"])
        if kind == "fail":
            self.counts["refused"] += 1
            return self._answer(h, params["status"], "text/plain", b"metadata server unavailable\n")
        if h.headers.get("Metadata-Flavor") != "Google":
            return self._answer(h, 403, "text/plain", b"Missing required header: Metadata-Flavor\n")
        status, ctype, body = self._route(urlsplit(h.path).path)
        self._answer(h, status, ctype, body)

    def _route(self, path: str) -> tuple[int, str, bytes]:
        if path in ("/", "/computeMetadata/", "/computeMetadata/v1/"):
            return 200, "application/text", b"computeMetadata/\n"
        if path in (SA + "default/", SA + EMAIL + "/"):
            info = {"aliases": ["default"], "email": EMAIL, "scopes": list(SCOPES)}
            return 200, "application/json", json.dumps(info).encode()
        if path in (SA + "default/token", SA + EMAIL + "/token"):
            self.counts["tokens"] += 1
            n = self.counts["tokens"]
            token = {"access_token": f"ya29.local-{n}", "expires_in": self.expires_in, "token_type": "Bearer"}
            self._issued.add(token["access_token"])
            return 200, "application/json", json.dumps(token).encode()
        if path == SA + "default/email":
            return 200, "application/text", EMAIL.encode()
        if path == "/computeMetadata/v1/project/project-id":
            return 200, "application/text", PROJECT.encode()
        if path == "/computeMetadata/v1/universe/universe-domain":
            return 200, "application/text", b"googleapis.com"
        return 404, "text/plain", b"Not Found\n"

    @staticmethod
    def _answer(h: BaseHTTPRequestHandler, status: int, ctype: str, body: bytes) -> None:
        try:
            h.send_response(status)
            h.send_header("Metadata-Flavor", "Google")
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its own timeout): what a real client sees too

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
