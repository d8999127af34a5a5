"""A run-store outage for local rehearsals: an HTTP proxy in front of the GCS emulator that can go down.

While down it answers with the bodies GCS sends (JSON API errors ``backendError``, ``rateLimitExceeded``), so a step
that runs during an outage meets what it would meet on GCS, and the emulator keeps its objects across the outage.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlparse

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
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that drops its keep-alive connection is not an error of the proxy.
        pass


class OutageProxy:
    """Forwards to ``upstream``; ``down_for`` answers 503, ``fail_for`` a share of requests 503 or 429.

    With ``authorize`` (a bearer token -> whether it was issued), a request without an issued token is answered
    401 as GCS answers an anonymous caller (the emulator accepts anything): a client that lost its credentials
    is seen, not carried by the emulator. ``unauthorized`` counts those answers.

    A resumable upload session stays valid on GCS once its upload completed: a client whose final chunk's answer
    was lost (a connection reset) sends it again, or asks for the session's status, and GCS answers 200 with the
    object's metadata (cloud.google.com/storage/docs/performing-resumable-uploads, "Check the status of a resumable
    upload"; a session lives a week). fake-gcs-server forgets a completed session and answers 404, which clients
    read as "not found" and give up on the write. The proxy answers as GCS does: a 404 for a session it saw begin
    whose object was written since is the completed upload's 200 (``completed_resends`` counts them).
    """

    def __init__(
        self,
        upstream: str,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        authorize: Callable[[str], bool] | None = None,
    ):
        self._upstream = upstream
        self._clock = clock
        self.unauthorized = 0
        self._down_until = 0.0
        self._pending: float | None = None  # an outage that begins with the next request, and its length
        self._status, self._share = 503, 1.0
        self._aimed: tuple[str, int, float] | None = None  # (what the request names, status, until)
        self._held: tuple[str, float] | None = None  # (what the request names, until)
        self._released = threading.Event()
        self.held = 0
        self._rng = random.Random(seed)
        self.refused = 0
        self.completed_resends = 0
        self._sessions: dict[str, tuple[str, str, float]] = {}  # upload_id -> bucket, object name, begun (epoch s)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                proxy.hold(self.path, body)
                status = proxy.refusal(self.path, body)
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                if status is None and authorize is not None and not authorize(token):
                    proxy.unauthorized += 1
                    data, headers = json.dumps(UNAUTHORIZED).encode(), {"Content-Type": "application/json"}
                    status = 401
                elif status is not None:
                    data, headers = json.dumps(BODIES[status]).encode(), {"Content-Type": "application/json"}
                else:
                    fwd = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    begun = time.time()
                    status, headers, data = proxy.upstream(self.command, self.path, body, fwd)
                    headers = proxy.located_here(headers)
                    if "upload_id=" not in self.path:
                        proxy.session_begun(self.path, body, headers, begun)
                    elif status == 404:  # a chunk (gcsfs POSTs them, others PUT) to a session the emulator forgot
                        status, headers, data = proxy.completed_session(self.path, fwd) or (status, headers, data)
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

    def upstream(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        """One request to the emulator: its status, headers (less the hop-by-hop ones) and body."""
        up = urlparse(self._upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=dict(headers))
            r = conn.getresponse()
            data = r.read()
        finally:
            conn.close()
        skip = ("transfer-encoding", "connection", "content-length")
        return r.status, {k: v for k, v in r.getheaders() if k.lower() not in skip}, data

    def located_here(self, headers: Mapping[str, str]) -> dict[str, str]:
        """``Location`` (a resumable upload's session URI) pointed at this proxy.

        On GCS it names the endpoint the client called; the emulator names whichever address reached it (that of a
        proxy behind this one), and the upload's chunks would go around this one.
        """
        out = dict(headers)
        for k, v in headers.items():
            if k.lower() == "location" and v.startswith("http"):
                out[k] = urlparse(v)._replace(scheme="http", netloc=urlparse(self.url).netloc).geturl()
        return out

    def session_begun(self, path: str, body: bytes | None, headers: Mapping[str, str], begun: float) -> None:
        """Remember a resumable upload session the emulator opened (its object, and when); other requests pass."""
        url = urlparse(path)
        if parse_qs(url.query).get("uploadType") != ["resumable"] or not url.path.startswith("/upload/storage/v1/b/"):
            return
        location = next((v for k, v in headers.items() if k.lower() == "location"), "")
        upload_id = parse_qs(urlparse(location).query).get("upload_id", [""])[0]
        name = parse_qs(url.query).get("name", [""])[0]
        if not name and body:
            try:
                name = str(json.loads(body).get("name") or "")
            except (ValueError, AttributeError):
                name = ""
        if upload_id and name:
            self._sessions[upload_id] = (url.path.split("/")[5], name, begun)

    def completed_session(self, path: str, headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes] | None:
        """GCS's answer to a chunk sent to a session whose upload completed: 200 and the object; None if it did not."""
        upload_id = parse_qs(urlparse(path).query).get("upload_id", [""])[0]
        known = self._sessions.get(upload_id)
        if known is None:
            return None
        bucket, name, begun = known
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        status, got, data = self.upstream("GET", f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}", None, auth)
        if status != 200:
            return None
        try:
            written = datetime.fromisoformat(json.loads(data)["updated"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            return None
        if written < begun - 1.0:  # an older object of that name: this session's upload never completed
            return None
        total = _upload_total(headers)
        if total is not None and str(total) != str(json.loads(data).get("size")):
            return None  # another write of that name, not this session's bytes
        self._sessions.pop(upload_id, None)  # a session is answered once; the emulator keeps the object
        self.completed_resends += 1
        return 200, got, data

    @property
    def is_down(self) -> bool:
        """True during an outage."""
        return self._clock() < self._down_until

    def down_for(self, seconds: float) -> None:
        """Answer 503 from now for ``seconds``."""
        self.fail_for(seconds)

    def down_from_next_request(self, seconds: float) -> None:
        """Answer 503 for ``seconds`` from the next request on: an outage the next client to call is sure to meet."""
        self._status, self._share = 503, 1.0
        self._pending = seconds

    def fail_for(self, seconds: float, status: int = 503, share: float = 1.0) -> None:
        """From now for ``seconds``, answer ``status`` (503 or 429) to each request with probability ``share``."""
        if status not in BODIES:
            raise ValueError(f"status {status}: the proxy answers {sorted(BODIES)}")
        self._status, self._share = status, share
        self._down_until = self._clock() + seconds

    def fail_matching(self, fragment: str, seconds: float, status: int = 503) -> None:
        """From now for ``seconds``, answer ``status`` to every request that names ``fragment``.

        Named in its path, its query or the first KB of its body (where a multipart upload names its object): one
        kind of write failing while every other request goes through.
        """
        if status not in BODIES:
            raise ValueError(f"status {status}: the proxy answers {sorted(BODIES)}")
        self._aimed = (fragment, status, self._clock() + seconds)

    def hold_matching(self, fragment: str, seconds: float) -> None:
        """From now, hold every request that names ``fragment`` (as ``fail_matching`` finds it).

        A held request waits, unanswered, until ``release()`` or for ``seconds`` at most, then goes on: a slow
        answer to one kind of write.
        """
        self._released.clear()
        self._held = (fragment, self._clock() + seconds)

    def release(self) -> None:
        """End ``hold_matching``: the requests it holds go on now."""
        self._held = None
        self._released.set()

    def hold(self, path: str, body: bytes | None) -> None:
        """Wait while a hold names this request (counts the requests held)."""
        held = self._held
        if held is None or held[0] not in _named(path, body):
            return
        left = held[1] - self._clock()
        if left > 0:
            self.held += 1
            self._released.wait(left)

    def refusal(self, path: str = "", body: bytes | None = None) -> int | None:
        """The status to answer the request now with, or None to forward it (counts refusals)."""
        aimed = self._aimed
        if aimed is not None and self._clock() < aimed[2]:
            if aimed[0] in _named(path, body):
                self.refused += 1
                return aimed[1]
        pending, self._pending = self._pending, None
        if pending is not None:
            self._down_until = self._clock() + pending
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
        """Stop serving (what a hold holds goes on first)."""
        self.release()
        self._server.shutdown()
        self._server.server_close()


def _named(path: str, body: bytes | None) -> str:
    """What a request names: its path and query, and the first KB of its body (a multipart upload's object)."""
    return unquote(path) + (body or b"")[:1024].decode("latin-1")


def _upload_total(headers: Mapping[str, str]) -> int | None:
    """The object's size a chunk's ``Content-Range`` (``bytes 0-99/100``, ``bytes */100``) declares, if it does."""
    value = next((v for k, v in headers.items() if k.lower() == "content-range"), "")
    total = value.rpartition("/")[2]
    return int(total) if total.isdigit() else None


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
    """A progress hook: when a node of a planned template starts for the first time, the store goes down.

    The outage begins with the first store request after the node started (its first read, however long the step
    took to start), so the step meets it whatever the machine's load.
    """

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
                self.proxy.down_from_next_request(seconds)
                self.fired.append((node.template, time.time()))
                self._say(f"         store outage: {seconds:g}s from the first store request of {node.display}")
            progress(kind, node, res)

        return hook
