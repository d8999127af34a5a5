"""The process kubelet's readings of Argo's pod layout and executor rules (argo-workflows v4.0.5): the emissary
command prefix (``workflow/controller/workflowpod.go``), output parameters as ``SaveParameters`` saves them
(``workflow/executor/executor.go``: one trailing newline trimmed, a default for a missing file, the first missing
file without one is an error and ends the saving), the downward-API fields Argo and JobSet pods use. And its exec
endpoint, reached as ``kubectl exec`` reaches a kubelet: through the real API server's exec subresource, with the
Python client's WebSocket (``v4.channel.k8s.io``), into pods that have a PID namespace of their own."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime

import pytest
from podexec import (
    ExecRefused,
    container_argv,
    exec_request,
    exec_status,
    field_value,
    host_path_mounts,
    main_command,
    main_container,
    mount_points,
    mounts_token,
    save_parameters,
    termination_message,
)
from realcluster import wait_for
from tier import kube_exec, worker_like_pod

pytestmark = pytest.mark.k8s

POD = {
    "metadata": {
        "name": "wf-train-segment-1",
        "namespace": "training",
        "uid": "u-1",
        "annotations": {"batch.kubernetes.io/job-completion-index": "3"},
        "labels": {"app": "x"},
    },
    "spec": {"nodeName": "argo-steps", "serviceAccountName": "jax-recovery"},
}


@pytest.mark.parametrize(
    ("container", "argv"),
    [
        (
            {
                "command": ["/var/run/argo/argoexec", "emissary", "--loglevel", "info", "--", "python", "-m", "m"],
                "args": ["--a", "1"],
            },
            [sys.executable, "-m", "m", "--a", "1"],
        ),
        ({"command": ["python3", "-c", "pass"]}, [sys.executable, "-c", "pass"]),
        ({"command": ["/bin/true"], "args": ["--"]}, ["/bin/true", "--"]),  # no emissary prefix: taken as it is
    ],
)
def test_the_main_command_is_what_follows_the_emissary_prefix(container, argv):
    assert main_command(container) == argv


def test_output_parameters_are_saved_as_argo_saves_them(tmp_path):
    (tmp_path / "tmp/outputs").mkdir(parents=True)
    (tmp_path / "tmp/outputs/a").write_text("one\n\n")
    (tmp_path / "tmp/outputs/b").write_text("two")
    template = {
        "outputs": {
            "parameters": [
                {"name": "a", "valueFrom": {"path": "/tmp/outputs/a"}},
                {"name": "b", "valueFrom": {"path": "/tmp/outputs/b"}},
                {"name": "c", "valueFrom": {"path": "/tmp/outputs/c", "default": "dflt"}},
                {"name": "d", "valueFrom": {"path": "/tmp/outputs/d"}},
                {"name": "e", "valueFrom": {"path": "/tmp/outputs/b"}},
            ]
        }
    }
    params, error = save_parameters(template, tmp_path)
    assert [p.get("value") for p in params] == ["one\n", "two", "dflt", None, None]  # saving stops at d
    assert error == "open /tmp/outputs/d: no such file or directory"
    assert mount_points(template) == ["/tmp/outputs"]


def test_a_failed_container_under_fallback_to_logs_reports_its_logs_tail_as_the_kubelet_does(tmp_path):
    """FallbackToLogsOnError and a non-zero exit: the last 80 lines, at most 2048 bytes (kubelet v1.36.3); exit 0
    or the default policy (File): no message, for no process here has a termination-log file."""
    log = tmp_path / "main.log"
    log.write_text("".join(f"line {i}\n" for i in range(200)) + "train-segment: attempt 0 failed: worker 3 failed\n")
    fallback = {"name": "main", "terminationMessagePolicy": "FallbackToLogsOnError"}
    got = termination_message(fallback, log, 1)
    assert got.endswith("train-segment: attempt 0 failed: worker 3 failed\n") and got.startswith("line 121\n")
    assert len(got.splitlines()) == 80
    log.write_text("x" * 5000 + "\nwhy\n")
    assert termination_message(fallback, log, 1) == ("x" * 5000 + "\nwhy\n")[-2048:]
    assert termination_message(fallback, log, 0) == "" == termination_message({"name": "main"}, log, 1)


def test_downward_api_fields(tmp_path):
    assert field_value(POD, "metadata.annotations['batch.kubernetes.io/job-completion-index']") == "3"
    assert field_value(POD, "metadata.labels['app']") == "x"
    assert field_value(POD, "metadata.name") == "wf-train-segment-1"
    assert field_value(POD, "spec.serviceAccountName") == "jax-recovery"
    with pytest.raises(ValueError, match="status.podIPs"):
        field_value(POD, "status.podIPs")


@pytest.mark.parametrize(
    ("containers", "main"),
    [
        ([{"name": "wait"}, {"name": "main"}], "main"),  # an Argo step pod: its main container, not the wait sidecar
        ([{"name": "trainer"}], "trainer"),  # a JobSet worker: its only container
    ],
)
def test_the_container_run_is_argos_main_else_the_pods_only_one(containers, main):
    assert main_container({"spec": {"containers": containers}})["name"] == main


@pytest.mark.parametrize(
    ("volumes", "mounted"),
    [
        ([{"name": "kube-api-access-x", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}], True),
        ([{"name": "data", "emptyDir": {}}], False),  # automountServiceAccountToken: false (the workers' account)
        (None, False),
    ],
)
def test_a_token_is_given_only_when_admission_mounted_one(volumes, mounted):
    assert mounts_token({"spec": {"volumes": volumes}}) is mounted


def test_host_path_directories_are_mounted_and_other_kinds_refused():
    pod = {
        "spec": {
            "volumes": [
                {"name": "local", "hostPath": {"path": "/mnt/local", "type": "DirectoryOrCreate"}},
                {"name": "must", "hostPath": {"path": "/mnt/must", "type": "Directory"}},
                {"name": "sock", "hostPath": {"path": "/run/x.sock", "type": "Socket"}},
                {"name": "scratch", "emptyDir": {}},
            ]
        }
    }
    mounts = [{"name": "local", "mountPath": "/jaxrec-local"}, {"name": "must", "mountPath": "/m"}]
    assert host_path_mounts(pod, {"volumeMounts": [*mounts, {"name": "scratch", "mountPath": "/s"}]}) == [
        ("/mnt/local", "/jaxrec-local", True),
        ("/mnt/must", "/m", False),
    ]
    with pytest.raises(ValueError, match="hostPath volume sock .*Socket.* a whole directory only"):
        host_path_mounts(pod, {"volumeMounts": [{"name": "sock", "mountPath": "/run/x.sock"}]})
    with pytest.raises(ValueError, match="subPath a"):
        host_path_mounts(pod, {"volumeMounts": [{"name": "local", "mountPath": "/l", "subPath": "a"}]})


def test_a_host_path_is_the_node_s_own_directory_shared_by_its_pods_and_not_the_machine_s(
    real_cluster, argo, namespace
):
    """Two pods of one node mounting its hostPath see each other's files (a recreated worker finds its host's local
    checkpoint parts); the files lie in the node's folder, not at the path on the machine all nodes share."""
    host = "/jaxrec-test-hostpath"
    writer = worker_like_pod(real_cluster, namespace, "hostpath-a", share=False, host_paths={"/parts": host})
    assert kube_exec(real_cluster, namespace, writer, ["sh", "-c", "echo $POD_MARK > /parts/mark"])[2] == 0
    reader = worker_like_pod(real_cluster, namespace, "hostpath-b", share=True, host_paths={"/p": host})
    assert kube_exec(real_cluster, namespace, reader, ["cat", "/p/mark"]) == ("hostpath-a\n", "", 0)
    assert not os.path.exists(f"{host}/mark")  # the machine's own path is only a node's mount point


def test_worker_pods_get_a_pid_namespace_and_step_pods_do_not():
    wait = {"name": "wait", "env": [{"name": "ARGO_NODE_ID", "value": "n"}]}  # Argo's executor: a step pod
    step = {"spec": {"containers": [wait, {"name": "main"}]}}
    argv, extra = container_argv(step, ["prog"])
    assert "--pid" not in argv and argv[-1] == "prog" and extra == {}
    worker = {"spec": {"containers": [{"name": "trainer"}]}}
    argv, extra = container_argv(worker, ["prog"])
    assert "--pid" in argv and json.loads(extra["PODEXEC_INIT_ARGV"]) == ["prog"]  # the main process is PID 1
    worker["spec"]["shareProcessNamespace"] = True
    argv, extra = container_argv(worker, ["prog"])
    assert json.loads(extra["PODEXEC_INIT_ARGV"])[0] == sys.executable  # PID 1: the pause-like process
    assert json.loads(extra["PODEXEC_CONTAINER_ARGV"]) == ["prog"]


def test_the_exec_request_is_read_as_the_api_server_sends_it():
    q = "command=sh&command=-c&command=exit+3&output=1&error=1"
    assert exec_request("/exec/ns/pod/trainer", q) == ("ns", "pod", "trainer", ["sh", "-c", "exit 3"])
    for path, query, reason in [
        ("/attach/ns/pod/trainer", q, "serves /exec"),
        ("/exec/ns/pod/trainer", q + "&input=1", "no stdin"),
        ("/exec/ns/pod/trainer", q + "&tty=1", "no tty"),
        ("/exec/ns/pod/trainer", "command=true", "at least one of stdout or stderr"),
    ]:
        with pytest.raises(ExecRefused, match=reason):
            exec_request(path, query)


def test_the_exit_status_is_the_one_the_python_client_reads():
    assert exec_status(0) == {"metadata": {}, "status": "Success"}
    failed = exec_status(137)
    assert (failed["status"], failed["reason"]) == ("Failure", "NonZeroExitCode")
    assert int(failed["details"]["causes"][0]["message"]) == 137  # kubernetes/stream/ws_client.py: returncode


# --- exec through the API server -------------------------------------------------------------------------------

# Every process the exec sees: pid -> argv (its own included).
PS = (
    "import json, os; print(json.dumps({int(d): open(f'/proc/{d}/cmdline', 'rb').read().decode().split(chr(0))[:-1] "
    "for d in os.listdir('/proc') if d.isdigit()}))"
)


def test_exec_returns_the_output_and_the_exit_code(real_cluster, argo, namespace):
    """stdout and stderr come back apart, the exit code as the kubelet reports it (the Python client reads it from
    the status on channel 3), the command in the container's environment and working directory."""
    ns = namespace
    pod = worker_like_pod(real_cluster, ns, "exec-codes", share=False)
    assert kube_exec(real_cluster, ns, pod, ["sh", "-c", "echo out; echo err >&2; exit 3"]) == ("out\n", "err\n", 3)
    same_cwd = 'echo $POD_MARK; [ "$(pwd)" = "$(readlink /proc/1/cwd)" ] && echo same-cwd'
    assert kube_exec(real_cluster, ns, pod, ["sh", "-c", same_cwd]) == ("exec-codes\nsame-cwd\n", "", 0)
    assert kube_exec(real_cluster, ns, pod, ["sh", "-c", "kill -9 $$"])[2] == 137  # 128 + 9, as a runtime says


def test_exec_refuses_stdin_in_one_clear_error(real_cluster, argo, namespace):
    from kubernetes.client.exceptions import ApiException

    pod = worker_like_pod(real_cluster, namespace, "exec-stdin", share=False)
    with pytest.raises(ApiException, match="no stdin, no tty"):
        kube_exec(real_cluster, namespace, pod, ["cat"], stdin=True)


def test_each_worker_pod_has_its_pid_namespace_and_pid_1_is_the_main_process_unless_shared(
    real_cluster, argo, namespace
):
    """Without shareProcessNamespace the container's process is PID 1 of the pod's namespace; with it, a pause-like
    process is PID 1 and the container's process its child. An exec sees its own pod's processes only."""
    alone = worker_like_pod(real_cluster, namespace, "pid-alone", share=False)
    shared = worker_like_pod(real_cluster, namespace, "pid-shared", share=True)

    def ps(pod: str) -> dict[int, list[str]]:
        out, err, code = kube_exec(real_cluster, namespace, pod, ["python", "-c", PS])
        assert code == 0, err
        return {int(k): v for k, v in json.loads(out).items()}

    def mains(procs: dict[int, list[str]], pod: str) -> list[int]:
        return [pid for pid, argv in procs.items() if argv[-3:] == ["-m", "trainer", pod]]

    for pod, other in ((alone, shared), (shared, alone)):
        procs = ps(pod)
        assert not mains(procs, other), procs  # the other pod's process is not there
        [main] = mains(procs, pod)
        assert (main == 1) is (pod == alone), procs
        others = {pid: argv for pid, argv in procs.items() if pid not in (1, main)}
        assert all(PS in argv for argv in others.values()), procs  # nothing but the exec itself
    assert ps(shared)[1][-2:] != ["-m", "trainer"]  # PID 1: the pause-like process, not the trainer


def test_a_v5_websocket_exec_is_passed_through_to_the_node_that_declares_it(real_cluster, argo, namespace):
    """``kubectl exec``'s protocol, ``v5.channel.k8s.io``: the API server would translate it to SPDY, which podexec
    does not speak, but passes it through to a node declaring ExtendWebSocketsToKubelet, as podexec's nodes do."""
    import ssl
    from urllib.parse import urlencode

    import websocket

    pod = worker_like_pod(real_cluster, namespace, "exec-v5", share=True)
    pki = real_cluster.pki
    query = urlencode(
        [("command", "sh"), ("command", "-c"), ("command", "echo v5; exit 4"), ("stdout", "true"), ("stderr", "true")]
    )
    url = f"{real_cluster.server.replace('https', 'wss')}/api/v1/namespaces/{namespace}/pods/{pod}/exec?{query}"
    ssl_opts = {
        "cert_reqs": ssl.CERT_REQUIRED,
        "ca_certs": str(pki.ca),
        "certfile": str(pki.admin_cert),
        "keyfile": str(pki.admin_key),
    }
    ws = websocket.create_connection(url, subprotocols=["v5.channel.k8s.io"], sslopt=ssl_opts, timeout=60)
    assert ws.getsubprotocol() == "v5.channel.k8s.io"
    frames = []
    while (msg := ws.recv_data())[0] != websocket.ABNF.OPCODE_CLOSE:
        frames.append((msg[1][0], msg[1][1:]))
    ws.close()
    assert b"".join(data for channel, data in frames if channel == 1) == b"v5\n", frames
    [status] = [json.loads(data) for channel, data in frames if channel == 3 and data]
    assert (status["reason"], status["details"]["causes"]) == (
        "NonZeroExitCode",
        [{"reason": "ExitCode", "message": "4"}],
    )


def test_a_log_request_is_read_as_the_api_server_sends_it():
    from podexec import ExecRefused, LogOptions, log_request

    now = 1_800_000_000 * 10**9
    q = "follow=true&timestamps=true&tailLines=5&sinceSeconds=10&limitBytes=100"
    ns, pod, container, opts = log_request("/containerLogs/training/wf-1/main", q, now_ns=now)
    assert (ns, pod, container) == ("training", "wf-1", "main")
    assert opts == LogOptions(True, True, 5, now - 10 * 10**9, 100, False)
    _, _, _, opts = log_request("/containerLogs/t/p/c", "sinceTime=2027-01-15T08:00:00Z")
    assert opts.since_ns == now and not opts.follow and not opts.timestamps
    for path, query in (("/containerLogs/t/p", ""), ("/containerLogs/t/p/c", "tailLines=x")):
        with pytest.raises(ExecRefused):
            log_request(path, query)


def test_the_log_sent_is_the_lines_asked_for_with_their_times():
    from podexec import LogOptions, log_records, rfc3339_nano, select_log

    t0 = 1_800_000_000 * 10**9
    data = b"".join(f"{t0 + i * 10**9} {rfc3339_nano(t0 + i * 10**9)} line {i}\n".encode() for i in range(5))
    records, used = log_records(data + b"17 partial")  # a record being written waits for the next read
    assert len(records) == 5 and used == len(data)
    assert rfc3339_nano(t0 + 5) == "2027-01-15T08:00:00.000000005Z"
    assert select_log(records, LogOptions()) == b"".join(b"line %d\n" % i for i in range(5))
    assert select_log(records, LogOptions(tail_lines=2)) == b"line 3\nline 4\n"
    assert select_log(records, LogOptions(tail_lines=0)) == b""
    assert select_log(records, LogOptions(since_ns=t0 + 3 * 10**9)) == b"line 3\nline 4\n"
    assert select_log(records, LogOptions(timestamps=True, tail_lines=1)) == b"2027-01-15T08:00:04.000000000Z line 4\n"
    assert select_log(records, LogOptions(limit_bytes=9)) == b"line 0\nli"


def test_logs_come_through_the_api_server_as_kubectl_logs_reads_them(real_cluster, argo, namespace):
    """The container's output with the time of each line (RFC 3339, as ``argo logs`` needs), the last lines, a
    follow that ends with the container, and a clear refusal for a container the pod does not have."""
    from kubernetes.client.exceptions import ApiException

    pod = worker_like_pod(real_cluster, namespace, "logs-lines", share=False)
    core = real_cluster.core()
    kube_exec(real_cluster, namespace, pod, ["sh", "-c", "for i in 1 2 3; do echo line-$i > /proc/1/fd/1; done"])
    text = wait_for(
        "the three lines in the pod's log",
        lambda: (t := core.read_namespaced_pod_log(pod, namespace, container="trainer")).count("line-") == 3 and t,
        30,
    )
    assert text.splitlines()[-3:] == ["line-1", "line-2", "line-3"], text
    stamped = core.read_namespaced_pod_log(pod, namespace, container="trainer", timestamps=True, tail_lines=2)
    lines = stamped.splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["line-2", "line-3"], stamped
    for line in lines:  # RFC 3339 with nanoseconds, UTC, a moment ago
        at = datetime.fromisoformat(line.split(" ", 1)[0][:26] + "+00:00")
        assert abs(time.time() - at.timestamp()) < 60, line
    with pytest.raises(ApiException, match="not valid"):
        core.read_namespaced_pod_log(pod, namespace, container="sidecar")
    # follow: the log streams until the container ends (the pod deleted: SIGTERM, then gone).
    stream = core.read_namespaced_pod_log(pod, namespace, container="trainer", follow=True, _preload_content=False)
    real_cluster.core().delete_namespaced_pod(pod, namespace, grace_period_seconds=1)
    got = b"".join(stream.stream(1024, decode_content=False))
    assert b"line-3" in got
