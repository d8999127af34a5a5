"""toxiproxy's TCP faults as the chaos tests use them, for real: the ``toxiproxy-server`` build.sh builds, in front
of a small HTTP server on loopback, each toxic seen from the client's side (a delay, a reset, a connection that
never answers, a slow or cut stream), cleared toxics and a disabled proxy. Needs only the bin directory, not the
control plane."""

from __future__ import annotations

import errno
import http.client
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import realcluster
import toxiproxy
from realcluster import TierUnavailable

pytestmark = [pytest.mark.k8s]

BODY = b"x" * 20_000
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The upstream: an HTTP server on 127.0.0.1 in a thread; its ``host:port``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, name="upstream", daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def tp(tmp_path_factory) -> Iterator[toxiproxy.Toxiproxy]:
    """toxiproxy-server from the tier's bin directory, stopped after the module."""
    try:
        t = toxiproxy.start(realcluster.find_binaries(), tmp_path_factory.mktemp("toxiproxy") / "toxiproxy.log")
    except TierUnavailable as e:
        if os.environ.get("JAXREC_K8S_REQUIRED") or os.environ.get("CI"):
            pytest.fail(f"real-controller tier required but unavailable: {e}", pytrace=False)
        pytest.skip(f"real-controller tier not run: {e}")
    try:
        yield t
    finally:
        t.stop()


@pytest.fixture
def proxy(tp, server, request) -> Iterator[toxiproxy.Proxy]:
    """A proxy of this test's own in front of the upstream; deleted after it."""
    p = tp.proxy(request.node.name.replace("[", "-").replace("]", ""), server)
    try:
        yield p
    finally:
        p.delete()


def get(p: toxiproxy.Proxy, timeout: float = 10.0) -> tuple[bytes, float]:
    """GET / through the proxy: the body and the seconds it took."""
    t0 = time.monotonic()
    with _OPENER.open(f"http://{p.listen}/", timeout=timeout) as r:
        body = r.read()
    return body, time.monotonic() - t0


def test_started_on_loopback(tp, proxy, server):
    assert tp.version() == "2.5.0"
    assert tp.component.alive()
    assert tp.api_url.startswith("http://127.0.0.1:")
    assert proxy.listen.startswith("127.0.0.1:") and proxy.port > 0
    assert proxy.upstream == server
    listeners = realcluster.netns_listeners(tp.component.proc.pid)
    assert ("127.0.0.1", proxy.port) in listeners
    assert not any(port == proxy.port and ip != "127.0.0.1" for ip, port in listeners)


def test_pass_through(proxy):
    body, took = get(proxy)
    assert body == BODY
    assert took < 1.0


def test_latency(proxy):
    name = proxy.add("latency", {"latency": 1000, "jitter": 0})
    assert name == "latency_downstream"
    assert [(t["name"], t["type"], t["attributes"]["latency"]) for t in proxy.toxics()] == [
        ("latency_downstream", "latency", 1000)
    ]
    body, took = get(proxy)
    assert body == BODY and took >= 1.0
    proxy.remove(name)
    body, took = get(proxy)
    assert body == BODY and took < 1.0


def test_reset_peer(proxy):
    proxy.add("reset_peer", {"timeout": 0})
    with pytest.raises((ConnectionResetError, urllib.error.URLError)) as err:
        get(proxy)
    # Reset by the peer (a TCP RST: ECONNRESET), not a close, a refusal or a timeout; raw from the response read,
    # or wrapped by urllib.
    e = err.value
    e = getattr(e, "reason", e)
    assert isinstance(e, ConnectionResetError) and e.errno == errno.ECONNRESET, repr(e)


def test_timeout_never_answers_then_clear(proxy):
    # Upstream: the request never reaches the server, which so never answers nor closes (downstream, the toxic
    # would pass on this one-request server's close after its answer).
    proxy.add("timeout", {"timeout": 0}, stream="upstream")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        get(proxy, timeout=2.0)
    assert time.monotonic() - t0 >= 1.9
    proxy.clear()
    assert proxy.toxics() == []
    body, took = get(proxy)
    assert body == BODY and took < 1.0


def test_bandwidth_slicer_limit_data(proxy):
    proxy.add("bandwidth", {"rate": 10})  # 10 KB/s: 20 kB take about 2 s
    body, took = get(proxy)
    assert body == BODY and took >= 1.5
    proxy.clear()
    proxy.add("slicer", {"average_size": 64, "size_variation": 32, "delay": 100})
    assert get(proxy)[0] == BODY  # sliced into small writes, every byte arrives
    proxy.clear()
    proxy.add("limit_data", {"bytes": 1000})  # the response cut after 1000 bytes (headers included)
    with pytest.raises(http.client.IncompleteRead):
        get(proxy)


def test_disable_refuses_then_enable(proxy):
    proxy.disable()
    with pytest.raises(urllib.error.URLError) as err:
        get(proxy, timeout=2.0)
    assert isinstance(err.value.reason, ConnectionRefusedError), err.value
    proxy.enable()
    body, _ = get(proxy)
    assert body == BODY


def test_client_checks(proxy):
    with pytest.raises(ValueError, match="no attribute"):
        proxy.add("latency", {"latency_ms": 5})
    with pytest.raises(ValueError, match="unknown toxic type"):
        proxy.add("packet_loss", {})
    proxy.add("latency", {"latency": 1}, name="l1")
    with pytest.raises(toxiproxy.ToxiproxyError, match="409"):
        proxy.add("latency", {"latency": 1}, name="l1")
