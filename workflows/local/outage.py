"""A run-store outage for local rehearsals: an HTTP proxy in front of the GCS emulator that can go down.

While down it answers every request (or a share of them) with HTTP 503 and the body GCS sends when it is
unavailable (JSON API error format, reason ``backendError``), or with 429 and the body of GCS's rate limit
(``rateLimitExceeded``); otherwise it forwards requests unchanged. The steps reach the emulator
through it, so a step that runs during an outage meets what it would meet on GCS, and the emulator keeps its
objects across the outage.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

UNAVAILABLE = {
    "error": {
        "code": 503,
        "message": "We encountered an internal error. Please try again.",
        "errors": [
            {
                "message": "We encountered an internal error. Please try again.",
                "domain": "global",
                "reason": "backendError",
            }
        ],
    }
}
THROTTLED = {
    "error": {
        "code": 429,
        "message": "The rate of change requests to the object exceeds the rate limit. Please reduce the rate.",
        "errors": [{"message": "The rate of change requests exceeds the rate limit.", "domain": "usageLimits",
                    "reason": "rateLimitExceeded"}],
    }
}  # fmt: skip
UNAUTHORIZED = {
    "error": {
        "code": 401,
        "message": "Anonymous caller does not have storage.objects.get access to the Google Cloud Storage object.",
        "errors": [{"message": "Anonymous caller does not have storage.objects.get access.", "domain": "global",
                    "reason": "required", "locationType": "header", "location": "Authorization"}],
    }
}  # fmt: skip
BODIES = {503: UNAVAILABLE, 429: THROTTLED}


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that drops its keep-alive connection is not an error of the proxy.
        pass


class OutageProxy:
    """Forwards to ``upstream``; ``down_for`` answers 503, ``fail_for`` a share of requests 503 or 429.

    With ``authorize`` (a bearer token -> whether it was issued), a request without an issued token is answered
    401 as GCS answers an anonymous caller (the emulator accepts anything): a client that lost its credentials
    is seen, not carried by the emulator. ``unauthorized`` counts those answers.
    """

    def __init__(
        self,
        upstream: str,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        authorize: Callable[[str], bool] | None = None,
    ):
        up = urlparse(upstream)
        self._clock = clock
        self.unauthorized = 0
        self._down_until = 0.0
        self._status, self._share = 503, 1.0
        self._rng = random.Random(seed)
        self.refused = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                status = proxy.refusal()
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                if status is None and authorize is not None and not authorize(token):
                    proxy.unauthorized += 1
                    data, headers = json.dumps(UNAUTHORIZED).encode(), {"Content-Type": "application/json"}
                    status = 401
                elif status is not None:
                    data, headers = json.dumps(BODIES[status]).encode(), {"Content-Type": "application/json"}
                else:
                    conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
                    fwd = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    conn.request(self.command, self.path, body=body, headers=fwd)
                    r = conn.getresponse()
                    data, status = r.read(), r.status
                    skip = ("transfer-encoding", "connection", "content-length")
                    headers = {k: v for k, v in r.getheaders() if k.lower() not in skip}
                    conn.close()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def is_down(self) -> bool:
        """True during an outage."""
        return self._clock() < self._down_until

    def down_for(self, seconds: float) -> None:
        """Answer 503 from now for ``seconds``."""
        self.fail_for(seconds)

    def fail_for(self, seconds: float, status: int = 503, share: float = 1.0) -> None:
        """From now for ``seconds``, answer ``status`` (503 or 429) to each request with probability ``share``."""
        if status not in BODIES:
            raise ValueError(f"status {status}: the proxy answers {sorted(BODIES)}")
        self._status, self._share = status, share
        self._down_until = self._clock() + seconds

    def refusal(self) -> int | None:
        """The status to answer the request now with, or None to forward it (counts refusals)."""
        if not self.is_down or self._rng.random() >= self._share:
            return None
        self.refused += 1
        return self._status

    def env(self, emulator_env: Mapping[str, str]) -> dict[str, str]:
        """The emulator's client environment with the HTTP endpoints pointed at this proxy."""
        out = dict(emulator_env)
        out["STORAGE_EMULATOR_HOST"] = self.url
        out["TENSORSTORE_GCS_HTTP_URL"] = self.url
        return out

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


def parse_outages(specs: list[str]) -> tuple[dict[str, float], list[str]]:
    """``TEMPLATE=SECONDS`` options -> template name -> outage seconds, and one problem line per bad option."""
    plan, problems = {}, []
    for spec in specs:
        name, sep, secs = spec.partition("=")
        try:
            seconds = float(secs)
        except ValueError:
            seconds = -1.0
        if not sep or not name or seconds <= 0:
            problems.append(f"--store-outage {spec!r}: expected TEMPLATE=SECONDS, e.g. restore-latest=4")
            continue
        plan[name] = seconds
    return plan, problems


class OutagePlan:
    """A progress hook: when a node of a planned template starts for the first time, the store goes down."""

    def __init__(self, proxy: OutageProxy, plan: Mapping[str, float], say: Callable[[str], None] = print):
        self.proxy = proxy
        self.plan = dict(plan)
        self.fired: list[tuple[str, float]] = []
        self._say = say

    def wrap(self, progress: Callable[..., None]) -> Callable[..., None]:
        """A progress hook that fires the outages, then calls ``progress``."""

        def hook(kind: str, node: Any, res: Any) -> None:
            seconds = self.plan.get(node.template)
            if kind == "start" and seconds is not None and node.template not in {t for t, _ in self.fired}:
                self.proxy.down_for(seconds)
                self.fired.append((node.template, time.time()))
                self._say(f"         store outage: {seconds:g}s from the start of {node.display}")
            progress(kind, node, res)

        return hook
