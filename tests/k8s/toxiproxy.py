"""Shopify's toxiproxy as a component of the real-controller tier: a TCP proxy on loopback whose faults (latency,
connection reset, a connection that never answers, bandwidth, slicing, a byte limit) a chaos test sets and clears
while both ends of the connection run unchanged.

``toxiproxy-server`` is built by ``tools/k8s/build.sh`` (toxiproxy v2.5.0, the newest version the Go module proxy
serves) and runs as a :class:`realcluster.Component`: its own process group, SIGKILL when the test process dies,
its HTTP API on 127.0.0.1 only. A test puts a proxy in front of a server (``Toxiproxy.proxy``), points the client
at ``Proxy.listen`` instead of the server, and adds toxics to the proxy.

The HTTP API as toxiproxy v2.5.0 serves it (read in its module source, not guessed): routes and answers in
``api.go`` (``POST /proxies`` creates a proxy and answers it, 201; ``POST /proxies/{proxy}`` updates ``enabled``:
false closes the listener and every open connection, so new ones are refused; ``POST /proxies/{proxy}/toxics``
adds a toxic and answers it; ``DELETE`` answers 204; errors are JSON ``{"error", "status"}``); a listen port of 0
is an ephemeral port whose address the answer carries (``proxy.go``, ``listen``); a toxic's defaults (``stream``
downstream, ``toxicity`` 1.0, ``name`` ``<type>_<stream>``) in ``toxic_collection.go`` (``AddToxicJson``); each
toxic's attributes in ``toxics/*.go``, whose JSON decoding ignores unknown names (hence :data:`TOXICS`, checked
here before a toxic is sent).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from realcluster import Component, TierUnavailable, free_port, wait_for

BINARY = "toxiproxy-server"
# Each toxic type of toxiproxy v2.5.0 and its attributes (``toxics/<type>.go``; times in ms unless said).
TOXICS: dict[str, frozenset[str]] = {
    "latency": frozenset({"latency", "jitter"}),  # each chunk delayed latency +/- jitter
    "reset_peer": frozenset({"timeout"}),  # on the first data, after timeout: close with SO_LINGER 0 (a TCP RST)
    # Data dropped; closed after timeout, never when 0 (until removed). The sender's close still goes through: a
    # request black-holed is an upstream timeout.
    "timeout": frozenset({"timeout"}),
    "bandwidth": frozenset({"rate"}),  # KB/s
    "slicer": frozenset({"average_size", "size_variation", "delay"}),  # bytes, bytes, microseconds
    "limit_data": frozenset({"bytes"}),  # closed once this many bytes went through
    "slow_close": frozenset({"delay"}),  # the close delayed
}
STREAMS = ("downstream", "upstream")  # downstream: server -> client; upstream: client -> server
_EXITED = object()
# The API is on loopback: never through an HTTP proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ToxiproxyError(RuntimeError):
    """toxiproxy's API refused a call (its status and ``error`` message)."""


def _call(api_url: str, method: str, path: str, body: Any = None) -> Any:
    """One API call; the JSON answer (text for ``/version``, None for 204)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(api_url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with _OPENER.open(req, timeout=10) as r:
            raw, ctype = r.read(), r.headers.get_content_type()
    except urllib.error.HTTPError as e:
        raise ToxiproxyError(f"{method} {path}: {e.code} {e.read().decode(errors='replace').strip()}") from None
    if not raw:
        return None
    return json.loads(raw) if ctype == "application/json" else raw.decode()


@dataclass
class Proxy:
    """One proxy of the server: listens on ``listen`` (``127.0.0.1:PORT``) and relays each connection to
    ``upstream`` through its toxics."""

    api_url: str
    name: str
    upstream: str
    listen: str

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    def add(
        self,
        kind: str,
        attributes: dict[str, Any],
        toxicity: float = 1.0,
        stream: str = "downstream",
        name: str | None = None,
    ) -> str:
        """Add a toxic of type ``kind`` (a key of :data:`TOXICS`) to every new and open connection's ``stream``
        direction, applied to a connection with probability ``toxicity``; returns its name (default
        ``<kind>_<stream>``, toxiproxy's own).

        Raises:
            ValueError: An unknown type, stream or attribute (toxiproxy would ignore an unknown attribute).
            ToxiproxyError: toxiproxy refused it (e.g. 409: a toxic of that name exists).
        """
        if kind not in TOXICS:
            raise ValueError(f"unknown toxic type {kind!r} (toxiproxy v2.5.0 has {', '.join(sorted(TOXICS))})")
        unknown = set(attributes) - TOXICS[kind]
        if unknown:
            raise ValueError(f"{kind} has no attribute {', '.join(sorted(unknown))} (it has {sorted(TOXICS[kind])})")
        if stream not in STREAMS:
            raise ValueError(f"stream is one of {STREAMS}, not {stream!r}")
        body = {"type": kind, "stream": stream, "toxicity": toxicity, "attributes": dict(attributes)}
        if name is not None:
            body["name"] = name
        return _call(self.api_url, "POST", f"/proxies/{self.name}/toxics", body)["name"]

    def toxics(self) -> list[dict[str, Any]]:
        """The proxy's toxics as toxiproxy answers them (name, type, stream, toxicity, attributes)."""
        return _call(self.api_url, "GET", f"/proxies/{self.name}/toxics")

    def remove(self, toxic_name: str) -> None:
        """Remove one toxic (open connections go on without it)."""
        _call(self.api_url, "DELETE", f"/proxies/{self.name}/toxics/{toxic_name}")

    def clear(self) -> None:
        """Remove every toxic of the proxy."""
        for t in self.toxics():
            self.remove(t["name"])

    def disable(self) -> None:
        """Take the proxy down: its listener and every open connection are closed; new connections are refused."""
        _call(self.api_url, "POST", f"/proxies/{self.name}", {"enabled": False})

    def enable(self) -> None:
        """Listen again, on the same address."""
        _call(self.api_url, "POST", f"/proxies/{self.name}", {"enabled": True})

    def delete(self) -> None:
        """Remove the proxy from the server (its listener and connections closed)."""
        _call(self.api_url, "DELETE", f"/proxies/{self.name}")


@dataclass
class Toxiproxy:
    """The running ``toxiproxy-server`` and its HTTP API (``api_url``, loopback)."""

    component: Component
    api_url: str
    proxies: dict[str, Proxy] = field(default_factory=dict)

    def version(self) -> str:
        return _call(self.api_url, "GET", "/version")

    def proxy(self, name: str, upstream_host_port: str) -> Proxy:
        """A new proxy ``name`` to ``upstream_host_port`` (``host:port``), enabled, listening on 127.0.0.1 on a
        port the kernel picks (listen port 0; the answer carries the address, so no other process can take the
        port between its choice and the bind)."""
        got = _call(
            self.api_url,
            "POST",
            "/proxies",
            {"name": name, "listen": "127.0.0.1:0", "upstream": upstream_host_port, "enabled": True},
        )
        p = Proxy(self.api_url, got["name"], got["upstream"], got["listen"])
        self.proxies[name] = p
        return p

    def stop(self) -> None:
        self.component.stop()


def start(bin_dir: Path, log: Path, timeout: float = 15.0) -> Toxiproxy:
    """Start ``toxiproxy-server`` from ``bin_dir`` with its API on 127.0.0.1:<free port>, logging to ``log``;
    returns once ``GET /version`` answers. A port taken between :func:`free_port` and the server's bind makes it
    exit at once: then another port, up to three times.

    Raises:
        TierUnavailable: ``bin_dir`` has no toxiproxy-server (run tools/k8s/build.sh).
    """
    exe = bin_dir / BINARY
    if not os.access(exe, os.X_OK):
        raise TierUnavailable(f"{bin_dir} lacks {BINARY}: run tools/k8s/build.sh")
    log.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        port = free_port()
        comp = Component(BINARY, [str(exe), "-host", "127.0.0.1", "-port", str(port)], log)
        comp.start()
        tp = Toxiproxy(comp, f"http://127.0.0.1:{port}")

        def answers(comp: Component = comp, tp: Toxiproxy = tp) -> object:
            return tp.version() if comp.alive() else _EXITED

        try:
            got = wait_for(f"{BINARY} answering GET /version", answers, timeout, 0.05)
        except BaseException:
            comp.stop()
            raise
        if got is not _EXITED:
            return tp
    raise AssertionError(f"{BINARY} exited at start three times; its log:\n{comp.tail()}")
