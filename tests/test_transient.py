"""Transient store failures: which errors are retried in place, and the exit code the steps give them."""

from __future__ import annotations

import errno
import time

import pytest
import requests
from google.api_core import exceptions as gexc

from jaxrec.adapters.store import StoreUnavailable, is_transient, transient_as_unavailable
from recovery_steps import restore_latest
from workflows.local.outage import OutageProxy, parse_outages


@pytest.mark.parametrize(
    "exc, transient",
    [
        (gexc.ServiceUnavailable("backendError"), True),
        (gexc.TooManyRequests("rateLimitExceeded"), True),
        (gexc.InternalServerError("internal"), True),
        (gexc.RetryError("deadline", cause=None), True),
        (requests.exceptions.ConnectionError("refused"), True),
        (OSError(errno.ESTALE, "stale file handle"), True),
        (gexc.Forbidden("no storage.objects.get"), False),
        (gexc.NotFound("no such bucket"), False),
        (OSError(errno.ENOSPC, "no space"), False),
        (PermissionError(errno.EACCES, "denied"), False),
    ],
)
def test_is_transient_table(exc, transient):
    assert is_transient(exc) is transient


def test_transient_becomes_one_line_and_others_pass_through():
    with pytest.raises(StoreUnavailable) as e, transient_as_unavailable("gs://b/p"):
        raise gexc.ServiceUnavailable("We encountered an internal error.\nPlease try again.")
    assert "\n" not in str(e.value) and str(e.value).startswith("run store gs://b/p unreachable: ServiceUnavailable")
    with pytest.raises(gexc.Forbidden), transient_as_unavailable("gs://b/p"):
        raise gexc.Forbidden("denied")


def test_restore_latest_exits_transient_while_the_store_answers_503(gcs_emulator, tmp_path, monkeypatch, capsys):
    proxy = OutageProxy(gcs_emulator.url)
    try:
        _through(proxy, gcs_emulator, monkeypatch)
        monkeypatch.setenv("JAXREC_STORE_RETRY_DEADLINE_S", "0.5")
        proxy.down_for(60)
        code = restore_latest.main(
            [
                "--store-root",
                "gs://test-bucket/outage",
                "--run-id",
                "r1",
                "--attempt",
                "0",
                "--output-dir",
                str(tmp_path / "o"),
            ]
        )
    finally:
        proxy.close()
    err = capsys.readouterr().err
    assert code == 69 and "transient" in err and "Traceback" not in err
    assert proxy.refused >= 1


def test_parse_outages():
    assert parse_outages(["restore-latest=4", "classify-failure=2.5"]) == (
        {"restore-latest": 4.0, "classify-failure": 2.5},
        [],
    )
    plan, problems = parse_outages(["restore-latest", "x=0"])
    assert plan == {} and len(problems) == 2 and "TEMPLATE=SECONDS" in problems[0]


def test_an_outage_armed_for_the_next_request_starts_with_it():
    """``down_from_next_request``: however long the step takes to call, its first request meets the outage, which
    lasts its length from that request on."""
    now = {"t": 100.0}
    proxy = OutageProxy("http://127.0.0.1:9", clock=lambda: now["t"])
    try:
        proxy.down_from_next_request(2)
        now["t"] += 50  # a slow start: a window opened when armed would have passed
        assert not proxy.is_down and proxy.refusal() == 503
        now["t"] += 1.9
        assert proxy.refusal() == 503
        now["t"] += 0.2
        assert proxy.refusal() is None and proxy.refused == 2
    finally:
        proxy.close()


def test_the_proxy_throttles_a_share_of_requests_with_the_body_gcs_sends(gcs_emulator):
    """``fail_for(status=429, share)``: about that share of requests answered 429 ``rateLimitExceeded`` (what the
    storage client raises as TooManyRequests), the rest forwarded to the emulator; 0 s ends it."""
    import json
    import urllib.error
    import urllib.request

    proxy = OutageProxy(gcs_emulator.url, seed=7)
    url = f"{proxy.url}/storage/v1/b/test-bucket/o"
    answers = []
    try:
        proxy.fail_for(60, status=429, share=0.5)
        for _ in range(40):
            try:
                with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
                    answers.append(r.status)
            except urllib.error.HTTPError as e:
                answers.append(e.code)
                assert json.loads(e.read())["error"]["errors"][0]["reason"] == "rateLimitExceeded"
        proxy.fail_for(0)
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
            after = r.status
        with pytest.raises(ValueError, match="503"):
            proxy.fail_for(1, status=500)
    finally:
        proxy.close()
    assert set(answers) == {200, 429} and 8 <= answers.count(429) <= 32, answers
    assert proxy.refused == answers.count(429) and after == 200


def test_a_hold_leaves_the_writes_it_names_unanswered_until_released_or_its_limit(gcs_emulator):
    """``hold_matching(fragment, s)``: a request naming ``fragment`` waits (a slow answer) while others are
    answered; ``release()`` lets it go on to the emulator; a hold nobody releases ends by itself after ``s``."""
    import concurrent.futures
    import urllib.request

    gcs_emulator.create_bucket("held")
    proxy = OutageProxy(gcs_emulator.url)
    base = f"{proxy.url}/upload/storage/v1/b/held/o?uploadType=media&name="

    def put(name: str) -> int:
        req = urllib.request.Request(base + name, data=b"x", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback
            return r.status

    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        proxy.hold_matching("checkpoints/30/", 60)
        held = pool.submit(put, "run/checkpoints/30/a")
        assert put("run/checkpoints/25/a") == 200
        with pytest.raises(concurrent.futures.TimeoutError):
            held.result(timeout=1.0)
        assert proxy.held == 1
        proxy.release()
        assert held.result(timeout=10) == 200
        proxy.hold_matching("checkpoints/30/", 0.5)
        began = time.monotonic()
        assert put("run/checkpoints/30/b") == 200
        waited = time.monotonic() - began
    finally:
        proxy.close()
        pool.shutdown(wait=False, cancel_futures=True)
    assert 0.4 <= waited < 10 and proxy.held == 2, (waited, proxy.held)


def test_a_resent_final_chunk_of_a_completed_upload_is_answered_as_gcs_does(gcs_emulator):
    """The answer to an upload's final chunk is lost (the connection reset after the emulator completed it):
    gcsfs sends the chunk again to the same session. GCS answers 200 with the object; the emulator forgets the
    session (404, which gcsfs raises as FileNotFoundError). Through the proxy the write succeeds, as on GCS."""
    import gcsfs

    proxy = OutageProxy(gcs_emulator.url)
    real, lost = proxy.upstream, []

    def reset_after_the_first_final_chunk(method, path, body, headers):
        got = real(method, path, body, headers)
        if "upload_id=" in path and got[0] in (200, 201) and not lost:
            lost.append(path)
            raise ConnectionResetError("connection reset by peer (after the upload completed)")
        return got

    proxy.upstream = reset_after_the_first_final_chunk
    try:
        fs = gcsfs.GCSFileSystem(endpoint_url=proxy.url, token="anon", skip_instance_cache=True)
        with fs.open("test-bucket/resent/_CHECKPOINT_METADATA", "w") as f:
            f.write('{"step": 10}')
        assert fs.cat("test-bucket/resent/_CHECKPOINT_METADATA") == b'{"step": 10}'
    finally:
        proxy.close()
    assert lost and proxy.completed_resends == 1, (lost, proxy.completed_resends)


def test_a_failure_aimed_at_checkpoint_manifests_refuses_those_writes_alone_and_a_create_only_write_retries_through(
    gcs_emulator, monkeypatch
):
    """``fail_matching("manifest.json", s)``: every manifest write answered 503 for ``s`` seconds while other writes
    go through; the store's create-only write of a manifest is retried by the storage client and lands once the
    window is over (one 503 on one write costs nothing)."""
    from pydantic import BaseModel

    from jaxrec.adapters.store import RunStore

    class Doc(BaseModel):
        run_id: str
        step: int

    proxy = OutageProxy(gcs_emulator.url)
    try:
        _through(proxy, gcs_emulator, monkeypatch)
        store = RunStore("gs://test-bucket/aimed", "r")
        proxy.fail_matching("manifest.json", 1.5)
        store.write_json("attempts/0/heartbeats/0.json", {"step": 5})
        assert proxy.refused == 0  # another write: through at once
        store.create_record("checkpoints/5/manifest.json", Doc(run_id="r", step=5))
        assert proxy.refused >= 1
        assert store.read_json("checkpoints/5/manifest.json") == {"run_id": "r", "step": 5}
    finally:
        proxy.close()


def _through(proxy: OutageProxy, gcs_emulator, monkeypatch) -> None:
    """Point this process's GCS clients at the emulator through ``proxy``."""
    for k, v in proxy.env(gcs_emulator.env).items():
        monkeypatch.setenv(k, v)


def _reset_after_upload(proxy: OutageProxy, name: bytes, times: int) -> list[str]:
    """Make the proxy reset the connection after an upload of ``name`` landed (the answer lost), ``times`` times;
    the paths it did so for."""
    real, lost = proxy.upstream, []

    def reset_after_a_completed_upload(method, path, body, headers):
        got = real(method, path, body, headers)
        if method == "POST" and name in (body or b"") and got[0] in (200, 201) and len(lost) < times:
            lost.append(path)
            raise ConnectionResetError("connection reset by peer (after the upload completed)")
        return got

    proxy.upstream = reset_after_a_completed_upload
    return lost


def test_a_last_writer_wins_record_is_retried_through_503s_and_through_its_own_unseen_success(
    gcs_emulator, monkeypatch
):
    """A heartbeat or a supervisor's verdict (one writer, rewritten in place): every try is conditional on the
    generation this store last wrote, so the storage client retries it. A 503 window on heartbeats costs nothing;
    an answer lost after the write landed (reset after upload) is found done, not written twice."""
    from jaxrec.adapters.store import RunStore

    proxy = OutageProxy(gcs_emulator.url)
    lost = _reset_after_upload(proxy, b"supervision.json", times=1)
    try:
        _through(proxy, gcs_emulator, monkeypatch)
        store = RunStore("gs://test-bucket/last-writer", "r")
        store.write_json("attempts/0/heartbeats/0.json", {"step": 1})
        proxy.fail_matching("heartbeats", 1.5)
        store.write_json("attempts/0/heartbeats/0.json", {"step": 2})
        assert proxy.refused >= 1
        assert store.read_json("attempts/0/heartbeats/0.json") == {"step": 2}

        store.write_json("attempts/0/supervision.json", {"verdict": "succeeded"})
        assert lost, "the reset after a completed upload was not made"
        assert store.read_json("attempts/0/supervision.json") == {"verdict": "succeeded"}
        store.write_json("attempts/0/supervision.json", {"verdict": "failed"})  # its generation is known: one try
        assert store.read_json("attempts/0/supervision.json") == {"verdict": "failed"}
    finally:
        proxy.close()


def test_a_conditional_write_whose_answer_was_lost_is_done_not_refused(gcs_emulator, monkeypatch):
    """validate-config pins the config with an explicit precondition (only if absent, or unchanged): a reset after
    the upload landed makes the client's retry meet its own object. For a document that is a state (idempotent) the
    same bytes are done; other bytes there are still another writer's, refused. (A read-modify-write counter is not
    idempotent: tests/test_store.py holds that no update is lost there.)"""
    from jaxrec.adapters.store import PreconditionFailed, RunStore

    proxy = OutageProxy(gcs_emulator.url)
    lost = _reset_after_upload(proxy, b"config.json", times=2)
    try:
        _through(proxy, gcs_emulator, monkeypatch)
        store = RunStore("gs://test-bucket/conditional", "r")
        first = store.write_json("config.json", {"hash": "a"}, if_generation_match=0, idempotent=True)
        assert len(lost) == 1, "the reset after a completed upload was not made"
        second = store.write_json("config.json", {"hash": "b"}, if_generation_match=first, idempotent=True)
        assert len(lost) == 2 and second != first
        assert store.read_json("config.json") == {"hash": "b"}
        with pytest.raises(PreconditionFailed):  # another writer's now
            store.write_json("config.json", {"hash": "c"}, if_generation_match=first, idempotent=True)
    finally:
        proxy.close()
