"""The store's credentials in a pod come from the metadata server, through google-auth's own refresh path (against
``metadata_server.MetadataServer``), and a metadata server that does not answer is transient, never "no
credentials"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from support.metadata_server import MetadataServer

from jaxrec.adapters.store import credentials_source

# A child process, because google-auth reads GCE_METADATA_HOST when it is imported.
CHILD = textwrap.dedent(
    """
    import json, sys, time
    from jaxrec.adapters.cli import store_error_line
    from jaxrec.adapters.store import RunStore, await_credentials, credentials_source, is_transient
    out = {"source": credentials_source()}
    try:
        if sys.argv[1] == "await":
            t = time.monotonic()
            await_credentials(float(sys.argv[2]))
            out["waited"] = time.monotonic() - t
        store = RunStore(sys.argv[3], "creds")
        store.write_bytes("probe.json", json.dumps({"ok": True}).encode())
        out["read"] = store.read_json("probe.json")
    except Exception as e:
        out.update(error=type(e).__name__, transient=is_transient(e), line=store_error_line("step", "gs://x", e))
    print(json.dumps(out))
    """
)


@pytest.fixture
def metadata():
    md = MetadataServer(expires_in=240)
    yield md
    md.close()


def _as_pod(md: MetadataServer, code: str, *args: str, **env: str) -> dict:
    """Run ``code`` as a pod's process would (in a pod, no key file, the metadata server ``md``); its last line,
    parsed."""
    full = {**os.environ, **md.env(), "KUBERNETES_SERVICE_HOST": "127.0.0.1", **env}
    full.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    p = subprocess.run([sys.executable, "-c", code, *args], env=full, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _child(md: MetadataServer, root: str, mode: str = "store", deadline: float = 0.0, **env: str) -> dict:
    return _as_pod(md, CHILD, mode, str(deadline), root, **env)


def test_a_pods_store_gets_its_token_from_the_metadata_server(metadata, gcs_bucket, request):
    out = _child(metadata, f"gs://{gcs_bucket}/{request.node.name}")
    assert out == {"source": "pod", "read": {"ok": True}}
    assert metadata.counts["tokens"] >= 1


def test_a_metadata_server_that_answers_503_is_transient_not_missing_credentials(metadata, gcs_bucket, request):
    metadata.fail_for(600, status=503)
    out = _child(metadata, f"gs://{gcs_bucket}/{request.node.name}")
    assert (out["error"], out["transient"]) == ("RefreshError", True), out
    assert "transient" in out["line"] and "give the step Google credentials" not in out["line"], out["line"]
    assert metadata.counts["refused"] >= 5  # google-auth's own retries ran


def test_a_metadata_server_that_refuses_is_not_transient(metadata, gcs_bucket, request):
    metadata.fail_for(600, status=403)
    out = _child(metadata, f"gs://{gcs_bucket}/{request.node.name}")
    assert (out["error"], out["transient"]) == ("RefreshError", False), out
    assert "give the step Google credentials" in out["line"], out["line"]


def test_await_credentials_waits_out_a_metadata_server_that_does_not_answer_yet(metadata, gcs_bucket, request):
    metadata.hang_for(8)
    t = time.monotonic()
    out = _child(metadata, f"gs://{gcs_bucket}/{request.node.name}", "await", 60)
    assert out["read"] == {"ok": True}, out
    # It asked during the window (a request held unanswered), and went on once the server answered.
    assert metadata.counts["hung"] >= 1 and out["waited"] > 0 and time.monotonic() - t < 60, out


def test_await_credentials_gives_up_at_its_deadline_and_at_once_on_a_refusal(metadata, gcs_bucket, request):
    metadata.fail_for(600, status=503)
    t = time.monotonic()
    out = _child(metadata, f"gs://{gcs_bucket}/{request.node.name}", "await", 3)
    assert (out["error"], out["transient"]) == ("RefreshError", True), out
    slow = time.monotonic() - t
    metadata.fail_for(600, status=404)
    t = time.monotonic()
    out = _child(metadata, f"gs://{gcs_bucket}/{request.node.name}", "await", 600)
    assert (out["error"], out["transient"]) == ("RefreshError", False), out
    assert time.monotonic() - t < slow + 30  # a refusal is not waited on for the 600 s deadline


EMULATOR = {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:1"}
METADATA = {"GCE_METADATA_HOST": "127.0.0.1:2"}
POD = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}


@pytest.mark.parametrize(
    ("env", "source"),
    [
        (EMULATOR, "anonymous"),
        (EMULATOR | METADATA, "adc"),
        (EMULATOR | METADATA | POD, "pod"),
        (POD, "pod"),
        (POD | {"GOOGLE_APPLICATION_CREDENTIALS": "/k.json"}, "adc"),
        ({}, "adc"),
    ],
)
def test_credentials_source(env, source, monkeypatch):
    for k in ("STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert credentials_source() == source


def test_gcs_behind_the_proxy_refuses_a_request_without_an_issued_token(metadata, gcs_emulator, gcs_bucket, request):
    """The tier's proxy answers 401 (GCS's anonymous caller) to a request with no token the metadata server issued;
    a pod's store, whose tokens it issued, goes through."""
    from workflows.local.outage import OutageProxy

    proxy = OutageProxy(gcs_emulator.url, authorize=metadata.issued)
    try:
        root = f"gs://{gcs_bucket}/{request.node.name}"
        via = {"STORAGE_EMULATOR_HOST": proxy.url}
        assert _child(metadata, root, **via)["read"] == {"ok": True}
        assert proxy.unauthorized == 0
        anonymous = _child(metadata, root, **via, GCE_METADATA_HOST="")
        assert (anonymous["source"], anonymous["transient"]) == ("anonymous", False), anonymous
        # On the 401 google-auth asks the credentials to refresh, which anonymous ones cannot.
        assert "give the step Google credentials" in anonymous["line"], anonymous["line"]
        assert proxy.unauthorized >= 1
    finally:
        proxy.close()


GCSFS_CHILD = textwrap.dedent(
    """
    import json, sys
    from jaxrec.adapters.store import share_credentials_with_gcsfs
    if sys.argv[1] == "shared":
        share_credentials_with_gcsfs()
    import fsspec
    fs, out = fsspec.filesystem("gs"), {}
    try:
        fs.pipe(sys.argv[2], b"through gcsfs")
        out["read"] = fs.cat(sys.argv[2]).decode()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
    """
)


def test_gcsfs_in_a_pod_takes_the_pods_credentials_instead_of_going_on_anonymous(metadata, gcs_emulator, gcs_bucket):
    """gcsfs (orbax's and the compilation cache's gs:// paths) left to itself goes on anonymous (here: the
    emulator's FSSPEC_GCS_TOKEN=anon; on GKE: after a failed metadata ping); shared, it sends the pod's tokens."""
    answers = _children_behind_the_token_check(
        metadata, gcs_emulator, GCSFS_CHILD, ("alone", "shared"), lambda mode: f"gs://{gcs_bucket}/gcsfs-{mode}"
    )
    assert "401" in answers["alone"].get("error", ""), answers
    assert answers["shared"] == {"read": "through gcsfs"}, answers


ORBAX_CHILD = textwrap.dedent(
    """
    import json, sys
    from orbax.checkpoint._src.path import gcs_utils
    from trainer.checkpointing import give_orbax_the_pods_credentials
    if sys.argv[1] == "given":
        give_orbax_the_pods_credentials()
    try:
        out = {"bucket": gcs_utils.get_bucket(sys.argv[2]).name}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))
    """
)


def test_orbaxs_own_bucket_reads_take_the_pods_credentials(metadata, gcs_emulator, gcs_bucket):
    """orbax's ``gcs_utils.get_bucket`` (read while a save finalizes) makes a ``storage.Client()`` of its own,
    anonymous against an emulator; given the pod's credentials, its reads carry the metadata server's tokens."""
    answers = _children_behind_the_token_check(
        metadata, gcs_emulator, ORBAX_CHILD, ("alone", "given"), lambda mode: gcs_bucket
    )
    assert "Anonymous credentials cannot be refreshed" in answers["alone"].get("error", ""), answers
    assert answers["given"] == {"bucket": gcs_bucket}, answers


def _children_behind_the_token_check(metadata, gcs_emulator, child, modes, arg) -> dict[str, dict]:
    """Run ``child`` once per mode as a pod's process would (the metadata server, GCS behind the proxy that refuses
    a request without an issued token); each one's last line, parsed."""
    from workflows.local.outage import OutageProxy

    proxy = OutageProxy(gcs_emulator.url, authorize=metadata.issued)
    try:
        return {mode: _as_pod(metadata, child, mode, arg(mode), STORAGE_EMULATOR_HOST=proxy.url) for mode in modes}
    finally:
        proxy.close()


# A worker reading its config as its first act in a pod (trainer.app.Worker.load_config).
WORKER = textwrap.dedent(
    """
    import json, sys
    from trainer.app import RunArgs, Worker
    from trainer.decisions import TrainerExit
    try:
        out = {"run_id": Worker(RunArgs(sys.argv[1], sys.argv[2], 0, -1), env={}).load_config().run_id}
    except TrainerExit as e:
        out = {"code": int(e.code), "line": str(e)}
    print(json.dumps(out))
    """
)


def test_a_worker_waits_out_a_metadata_server_not_ready_in_its_first_seconds_and_reads_its_config(
    metadata, gcs_bucket, request
):
    from support.trainer_harness import tiny_config, write_config

    cfg = tiny_config(f"gs://{gcs_bucket}/{request.node.name}", hosts=1)
    write_config(cfg)
    metadata.fail_for(6, status=503)
    assert _as_pod(metadata, WORKER, cfg.storage.root, cfg.run_id) == {"run_id": cfg.run_id}
    assert metadata.counts["refused"] >= 1  # it asked while the server was not ready

    metadata.fail_for(600, status=503)  # still not ready past the store's retry deadline: transient, one line
    out = _as_pod(metadata, WORKER, cfg.storage.root, cfg.run_id, JAXREC_STORE_RETRY_DEADLINE_S="2")
    assert out["code"] == 69 and "transient" in out["line"] and "\n" not in out["line"], out


# tensorstore's first GCS request in a pod, then (after the parent made the metadata server fail) an array write.
TENSORSTORE_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import tensorstore as ts
    from trainer.checkpointing import settle_tensorstores_credentials
    mode, bucket, flag = sys.argv[1:4]
    if mode == "settled":
        settle_tensorstores_credentials(bucket, "probe/.tensorstore-credentials")
    print("ready", flush=True)
    while not os.path.exists(flag):
        time.sleep(0.05)
    out = {}
    try:
        kv = ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result()
        kv.write("probe/array-chunk", b"x" * 64).result(timeout=8)
        out["wrote"] = True
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(out), flush=True)
    """
)


@pytest.mark.parametrize("mode, authorized", [("settled", True), ("left-to-the-save", False)])
def test_tensorstore_decides_on_its_credentials_while_the_metadata_server_answers(
    metadata, gcs_emulator, gcs_bucket, tmp_path, mode, authorized
):
    """A worker has tensorstore make its once-per-process credentials decision right after its own token came
    (``settle_tensorstores_credentials``): a save that meets the metadata server silent later still sends a token.
    Left to the first save, tensorstore asks the silent server then, and the save waits or goes on with no token
    (chaos seed 1: a save hung 120 s and two requests carried no token)."""
    from workflows.local.outage import OutageProxy

    proxy = OutageProxy(gcs_emulator.url, authorize=metadata.issued)
    flag = tmp_path / "metadata-down"
    env = {**os.environ, **proxy.env(gcs_emulator.env), **metadata.env(), "KUBERNETES_SERVICE_HOST": "127.0.0.1"}
    for k in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        env.pop(k, None)
    child = subprocess.Popen(
        [sys.executable, "-c", TENSORSTORE_CHILD, mode, gcs_bucket, str(flag)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()[-2000:]
        metadata.hang_for(60)
        flag.touch()
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
        proxy.close()
    got = json.loads(out.strip().splitlines()[-1])
    if authorized:
        assert got == {"wrote": True} and proxy.unauthorized == 0, (got, err[-2000:])
    else:  # it asks the silent server first: the write waits out its time (or goes on with no token: 401)
        assert "wrote" not in got, (got, proxy.unauthorized, err[-2000:])
