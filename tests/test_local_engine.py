"""Unit tests of the local Argo interpreter: expressions, depends, when, retries, recursion, exit handler."""

from __future__ import annotations

import json
import sys

import pytest

from workflows.local import expr as local_expr
from workflows.local.engine import WorkflowError, WorkflowRun, parse_duration, substitute
from workflows.local.executor import LocalExecutor


@pytest.mark.parametrize(
    ("text", "names", "expected"),
    [
        ("'retry' == 'retry'", {}, True),
        ("'stop' == 'retry'", {}, False),
        ("'a' != 'b' && 3 < 5", {}, True),
        ("1 > 2 || !(2 >= 3)", {}, True),
        ("asInt(lastRetry.exitCode) == 75", {"lastRetry.exitCode": "75"}, True),
        ("asInt(lastRetry.exitCode) == 75", {"lastRetry.exitCode": "1"}, False),
        (
            "lastRetry.status == 'Error' || asInt(lastRetry.exitCode) == 69",
            {"lastRetry.status": "Error", "lastRetry.exitCode": "-1"},
            True,
        ),
        ("asInt(lastRetry.exitCode) != 1 && asInt(lastRetry.exitCode) != 2", {"lastRetry.exitCode": "-1"}, True),
        ("asInt(lastRetry.exitCode) != 1 && asInt(lastRetry.exitCode) != 2", {"lastRetry.exitCode": "2"}, False),
        ("!(1 == 1)", {}, False),
        ("'2' == 2", {}, False),
        ("true && false", {}, False),
    ],
)
def test_boolean_expressions(text, names, expected):
    assert local_expr.evaluate_bool(text, names) is expected


@pytest.mark.parametrize(
    "text",
    [
        "retry == 'retry'",
        "'a' ==",
        "(1 == 1",
        "'open == 'x'",
        "1 @ 2",
        "nosuch(1)",
        "1 < 'a'",
        # features no compiled workflow uses are refused, not guessed at
        "1 + 1 == 2",
        "'a' in ['a']",
        "not true",
        "sprig.add(1, 2) == 3",
    ],
)
def test_bad_expressions_raise_expr_error(text):
    with pytest.raises(local_expr.ExprError):
        local_expr.evaluate_bool(text, {})


def test_unquoted_string_names_the_fix():
    with pytest.raises(local_expr.ExprError, match="quote string values"):
        local_expr.evaluate_bool("retry == 'retry'", {})


@pytest.mark.parametrize(
    ("depends", "phases", "expected"),
    [
        ("train-segment.Failed || train-segment.Errored", {"train-segment": "Failed"}, True),
        ("train-segment.Failed || train-segment.Errored", {"train-segment": "Error"}, True),
        ("train-segment.Failed || train-segment.Errored", {"train-segment": "Succeeded"}, False),
        ("a", {"a": "Skipped"}, True),
        ("a", {"a": "Failed"}, False),
        ("a", {"a": "Omitted"}, False),
        ("a.Succeeded && !b.Failed", {"a": "Succeeded", "b": "Succeeded"}, True),
        ("(a.Skipped || a.Omitted) && b", {"a": "Omitted", "b": "Succeeded"}, True),
    ],
)
def test_depends(depends, phases, expected):
    assert local_expr.evaluate_depends(depends, phases) is expected


def test_depends_tasks_in_order():
    assert local_expr.depends_tasks("(b.Failed || a) && !c-d.Succeeded && b") == ["b", "a", "c-d"]


@pytest.mark.parametrize(
    ("text", "seconds"), [("10", 10), ("10s", 10), ("2m", 120), ("1m30s", 90), ("500ms", 0.5), ("1.5s", 1.5)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0.5", "1.5x", "s"])
def test_durations_argo_cannot_parse_are_refused(text):
    with pytest.raises(WorkflowError, match="invalid duration"):
        parse_duration(text)


def test_substitute_names():
    names = {"inputs.parameters.attempt": "2", "workflow.name": "w"}
    assert substitute("{{workflow.name}}-{{ inputs.parameters.attempt }}", names) == "w-2"
    with pytest.raises(Exception, match="unresolved reference"):
        substitute("{{inputs.parameters.nope}}", names)


def _argo_workflows():
    from pathlib import Path

    import yaml

    for path in sorted((Path(__file__).resolve().parents[1] / "argo").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Workflow":
                yield path.name, doc


def test_every_expression_of_the_compiled_workflows_is_in_the_local_language():
    # The language was cut down to what argo/ uses: every depends, when and retry expression there must still parse
    # and evaluate (references substituted with a string value, as the engine substitutes them).
    seen = {"depends": 0, "when": 0, "expression": 0}
    for name, wf in _argo_workflows():
        for t in wf["spec"]["templates"]:
            for task in (t.get("dag") or {}).get("tasks", []):
                if task.get("depends"):
                    deps = local_expr.depends_tasks(task["depends"])
                    assert isinstance(local_expr.evaluate_depends(task["depends"], dict.fromkeys(deps, "Failed")), bool)
                    seen["depends"] += 1
                if task.get("when"):
                    assert isinstance(local_expr.evaluate_bool(substitute(task["when"], _AnyName())), bool), name
                    seen["when"] += 1
            rs = t.get("retryStrategy") or {}
            if rs.get("expression"):
                env = {"lastRetry.exitCode": "-1", "lastRetry.status": "Error"}
                assert isinstance(local_expr.evaluate_bool(rs["expression"], env), bool), name
                seen["expression"] += 1
    assert all(seen.values()), seen


class _AnyName(dict):
    def __contains__(self, key):
        return True

    def __getitem__(self, key):
        return "retry"


# ---- tiny workflows run for real (python -c steps) -------------------------------------------------

PY = sys.executable


def _c(code: str, outputs: list[str] | None = None, inputs: list[str] | None = None, **extra):
    return {
        "inputs": {"parameters": [{"name": n} for n in inputs or []]},
        "container": {"image": "x", "command": ["python", "-c", code]},
        "outputs": {"parameters": [{"name": n, "valueFrom": {"path": f"/tmp/outputs/{n}"}} for n in outputs or []]},
        **extra,
    }


def _wf(templates: dict, entry: str, on_exit: str | None = None, params: dict | None = None):
    spec = {
        "entrypoint": entry,
        "templates": [{"name": k, **v} for k, v in templates.items()],
        "arguments": {"parameters": [{"name": k, "value": v} for k, v in (params or {}).items()]},
    }
    if on_exit:
        spec["onExit"] = on_exit
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "t"}, "spec": spec}


def _run(wf, tmp_path, **kw):
    events = []
    ex = LocalExecutor(repo_root=tmp_path, work_dir=tmp_path / "work")
    run = WorkflowRun(
        wf, ex, progress=lambda kind, node, res: events.append((kind, node.task, res and res.phase)), **kw
    )
    return run, run.run(), events


WRITE = "import os,sys; os.makedirs('/tmp/outputs',exist_ok=True); open('/tmp/outputs/{n}','w').write({v})"


def test_recursion_until_a_counter_reaches_three(tmp_path):
    count = WRITE.format(n="next", v="str(int(sys.argv[1]) + 1)")
    templates = {
        "step": _c(count, outputs=["next"], inputs=["n"]),
        "loop": {
            "inputs": {"parameters": [{"name": "attempt"}]},
            "dag": {
                "tasks": [
                    {
                        "name": "count",
                        "template": "step",
                        "arguments": {"parameters": [{"name": "n", "value": "{{inputs.parameters.attempt}}"}]},
                    },
                    {
                        "name": "again",
                        "template": "loop",
                        "depends": "count",
                        "when": "{{tasks.count.outputs.parameters.next}} < 3",
                        "arguments": {
                            "parameters": [{"name": "attempt", "value": "{{tasks.count.outputs.parameters.next}}"}]
                        },
                    },
                ]
            },
        },
        "main": {
            "dag": {
                "tasks": [
                    {
                        "name": "first",
                        "template": "loop",
                        "arguments": {"parameters": [{"name": "attempt", "value": "0"}]},
                    }
                ]
            }
        },
    }
    templates["step"]["container"]["args"] = ["{{inputs.parameters.n}}"]
    run, status, events = _run(_wf(templates, "main"), tmp_path)
    assert status == "Succeeded"
    ends = [e for e in events if e[0] == "end"]
    assert [e[1] for e in ends] == ["count", "count", "count"]
    assert [n.attempt for n, _ in run.nodes] == ["0", "1", "2"]


def test_handled_failure_succeeds_and_give_up_fails(tmp_path):
    def wf(decision):
        return _wf(
            {
                "boom": _c("import sys; sys.exit(3)"),
                "classify": _c(WRITE.format(n="decision", v=repr(decision)), outputs=["decision"]),
                "give-up": _c("import sys; sys.exit(1)"),
                "ok": _c("pass"),
                "main": {
                    "dag": {
                        "tasks": [
                            {"name": "train", "template": "boom"},
                            {"name": "classify", "template": "classify", "depends": "train.Failed || train.Errored"},
                            {
                                "name": "retry",
                                "template": "ok",
                                "depends": "classify",
                                "when": "'{{tasks.classify.outputs.parameters.decision}}' == 'retry'",
                            },
                            {
                                "name": "give-up",
                                "template": "give-up",
                                "depends": "classify",
                                "when": "'{{tasks.classify.outputs.parameters.decision}}' == 'stop'",
                            },
                        ]
                    }
                },
            },
            "main",
        )

    _, status, events = _run(wf("retry"), tmp_path / "a")
    assert status == "Succeeded"
    assert ("end", "give-up", "Succeeded") not in events
    _, status, events = _run(wf("stop"), tmp_path / "b")
    assert status == "Failed"
    assert ("end", "give-up", "Failed") in events


def test_retry_strategy_expression_limit_and_backoff(tmp_path):
    marker = tmp_path / "count"
    code = (
        f"import sys,pathlib; p=pathlib.Path({str(marker)!r}); n=int(p.read_text()) if p.exists() else 0;"
        f"p.write_text(str(n+1)); sys.exit(75 if n < 2 else 0)"
    )
    sleeps = []
    tmpl = _c(
        code,
        retryStrategy={
            "limit": "3",
            "retryPolicy": "Always",
            "backoff": {"duration": "1s", "factor": "2", "cap": "3s"},
            "expression": "asInt(lastRetry.exitCode) == 75",
        },
    )
    run, status, _ = _run(_wf({"p": tmpl}, "p"), tmp_path, sleep=sleeps.append)
    assert status == "Succeeded"
    assert marker.read_text() == "3"
    assert sleeps == [1.0, 2.0]
    assert [n.retry for n, _ in run.nodes] == [0, 1, 2]


def test_retry_expression_false_stops_and_limit_caps(tmp_path):
    tmpl = _c("import sys; sys.exit(42)", retryStrategy={"limit": 5, "expression": "asInt(lastRetry.exitCode) == 75"})
    run, status, _ = _run(_wf({"p": tmpl}, "p"), tmp_path / "a", sleep=lambda s: None)
    assert status == "Failed" and len(run.nodes) == 1
    tmpl = _c("import sys; sys.exit(75)", retryStrategy={"limit": 2, "expression": "asInt(lastRetry.exitCode) == 75"})
    run, status, _ = _run(_wf({"p": tmpl}, "p"), tmp_path / "b", sleep=lambda s: None)
    assert status == "Failed" and len(run.nodes) == 3


def test_exit_handler_sees_status_and_failures(tmp_path):
    out = tmp_path / "exit.json"
    record = f"import sys,json; open({str(out)!r},'w').write(json.dumps(sys.argv[1:]))"
    exit_t = _c(record)
    exit_t["container"]["args"] = ["{{workflow.status}}", "{{workflow.failures}}", "{{workflow.parameters.p}}"]
    wf = _wf({"main": _c("import sys; sys.exit(2)"), "exit": exit_t}, "main", on_exit="exit", params={"p": "v"})
    _, status, _ = _run(wf, tmp_path)
    assert status == "Failed"
    st, failures, p = json.loads(out.read_text())
    assert st == "Failed" and p == "v"
    assert json.loads(failures)[0]["templateName"] == "main"


def test_suspend_and_raw_artifacts(tmp_path):
    sleeps = []
    check = _c("import sys; sys.exit(0 if open('/tmp/inputs/c.yaml').read() == 'a: 1' else 9)")
    check["inputs"]["artifacts"] = [{"name": "c", "path": "/tmp/inputs/c.yaml", "raw": {"data": "a: 1"}}]
    wf = _wf(
        {
            "wait": {
                "inputs": {"parameters": [{"name": "seconds"}]},
                "suspend": {"duration": "{{inputs.parameters.seconds}}"},
            },
            "check": check,
            "main": {
                "dag": {
                    "tasks": [
                        {
                            "name": "w",
                            "template": "wait",
                            "arguments": {"parameters": [{"name": "seconds", "value": "7"}]},
                        },
                        {"name": "c", "template": "check", "depends": "w"},
                    ]
                }
            },
        },
        "main",
    )
    _, status, _ = _run(wf, tmp_path, sleep=sleeps.append)
    assert status == "Succeeded"
    assert sleeps == [7.0]


def test_unknown_reference_is_an_error_not_a_traceback(tmp_path):
    bad = _c("pass")
    bad["container"]["args"] = ["{{inputs.parameters.missing}}"]
    run, status, _ = _run(_wf({"m": bad}, "m"), tmp_path)
    assert status == "Error"
    assert "unresolved reference {{inputs.parameters.missing}}" in run.nodes[0][1].message


def test_a_gke_workflow_is_refused_in_one_line_naming_what_to_run(capsys):
    from pathlib import Path

    from workflows import local

    path = Path(__file__).resolve().parents[1] / "argo" / "v5e-4x4.yaml"
    assert local.main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "argo submit -n training" in err[0] and "python -m workflows.local argo/local-cpu.yaml" in err[0]


# --- the local slice under train-segment's own supervisor ------------------------------------------------------

IDLE = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, lambda *a: exit(143)); time.sleep(60)",
]


def _local_segment(tmp_path, hosts=2, **supervision):
    from pathlib import Path

    from jaxrec.adapters.store import RunStore
    from jaxrec.model.config import SupervisionConfig, load_config
    from workflows.local.slices import LocalSlice, WorkerProc

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs" / "local-cpu.yaml")
    sup = {"startup_deadline_s": 0.5, "watch_interval_s": 0.1, "force_delete_grace_s": 0.2, **supervision}
    cfg = cfg.model_copy(
        update={"supervision": SupervisionConfig(**sup), "slice": cfg.slice.model_copy(update={"hosts": hosts})}
    )
    ex = LocalExecutor(repo_root=repo, work_dir=tmp_path / "work")
    sl = LocalSlice(f"{cfg.run_id}-a0", 0, IDLE, str(repo), tmp_path / "logs", grace_seconds=2)
    sl.workers = [WorkerProc(i, {}) for i in range(hosts)]
    return cfg, ex, sl, RunStore(str(tmp_path / "store"), cfg.run_id)


def _supervise(cfg, ex, sl, store):
    """Train-segment's supervisor over the local cluster's API, re-attaching to ``sl`` (left running)."""
    from jaxrec.adapters.kube import make_api_client
    from recovery_steps.kube_gang import KubeGang
    from recovery_steps.train_segment import Supervisor, SupervisorIO

    for w in sl.workers:
        if w.index not in sl.withheld and w.proc is None:
            sl.spawn(w)
    ex.controllers.adopt(sl)  # a gang left running by a supervisor that was lost
    manifest = {"kind": "JobSet", "metadata": {"name": sl.jobset}}
    lines: list[str] = []
    gang = KubeGang(make_api_client(ex.controllers.url), cfg.namespace, sl.jobset)
    try:
        rec = Supervisor(cfg, 0, gang, store, io=SupervisorIO(say=lines.append)).run(manifest)
    finally:
        ex.controllers.close()
    for w in sl.workers:  # the kubelets are stopped: reap the workers the stop ended
        if w.proc is not None:
            w.proc.wait(timeout=30)
    ex.cluster.poll(sl)
    return rec, lines


def test_a_local_gang_is_reattached_decided_and_stopped_by_train_segments_supervisor(tmp_path):
    from workflows.local.slices import UNSCHEDULABLE

    cfg, ex, sl, store = _local_segment(tmp_path)
    sl.withheld[1] = UNSCHEDULABLE
    rec, lines = _supervise(cfg, ex, sl, store)
    # The retried supervisor re-attached, and says so in its record as on GKE.
    assert rec.reattached and lines[0].startswith(f"re-attached to JobSet {sl.jobset}")
    assert (rec.outcome, rec.stall_kind, rec.worker) == ("stalled", "capacity", 1), rec
    # The snapshot is the Kubernetes adapter's model: a Pending pod the scheduler refused, a Running one.
    pods = {p.worker_index: p for p in rec.snapshot.pods}
    assert pods[1].phase == "Pending" and pods[1].condition("PodScheduled").reason == UNSCHEDULABLE
    assert pods[0].phase == "Running" and pods[0].node == "local-0" and pods[0].trainer().state == "running"
    # The stop deleted the JobSet: the running worker got SIGTERM and exited 143 within its grace.
    assert sl.workers[0].stopped_by_jobset and sl.workers[0].exit_code == 143
    assert rec.stopped_at is not None and rec.stopped_at >= rec.detected_at and not rec.force_deleted


def test_a_worker_on_a_lost_local_host_is_force_deleted_after_the_grace(tmp_path):
    import signal
    import time

    cfg, ex, sl, store = _local_segment(tmp_path, node_lost_grace_s=0.3)
    for w in sl.workers:
        sl.spawn(w)
    sl.signal_worker(1, signal.SIGSTOP)  # its host is gone: the worker neither runs nor gets SIGTERM
    sl.lost[1] = time.time()
    rec, _ = _supervise(cfg, ex, sl, store)
    assert (rec.outcome, rec.stall_kind, rec.worker) == ("stalled", "node-lost", 1), rec
    assert rec.force_deleted == [f"{sl.jobset}-workers-0-1"]
    assert sl.workers[1].exit_code == 137 and not sl.workers[1].stopped_by_jobset
    node = next(n for n in rec.snapshot.nodes if n.name == "local-1")
    assert node.unreachable and node.ready is None


def test_a_local_worker_s_termination_message_is_the_last_4096_bytes_of_its_file_as_the_kubelet_reads_it(tmp_path):
    from jaxrec.model.names import TERMINATION_LOG_ENV
    from workflows.local.slices import TERMINATION_MESSAGE_MAX, WorkerProc

    log = tmp_path / "w-0.termination-log"
    w = WorkerProc(0, {TERMINATION_LOG_ENV: str(log)})
    assert w.termination_message() is None  # no file: none
    log.write_text("")
    assert w.termination_message() is None  # empty: none
    log.write_text("a" * 1000 + "b" * TERMINATION_MESSAGE_MAX)
    assert w.termination_message() == "b" * TERMINATION_MESSAGE_MAX  # the tail (kubelet's tail.ReadAtMost)


# --- the local cluster as the Kubernetes API -------------------------------------------------------------------


def _jobset(name: str, hosts: int, command: list[str]) -> dict:
    pod = {"containers": [{"name": "trainer", "image": "worker:1", "command": command}]}
    pod["terminationGracePeriodSeconds"] = 2
    job = {"parallelism": hosts, "completions": hosts, "template": {"metadata": {"labels": {"app": "x"}}, "spec": pod}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": {"jaxrec/run-id": "r"}},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job}}]},
    }


def _worker(tmp_path, on_term: str) -> list[str]:
    """A worker that sets its SIGTERM handling, then says it is ready (its pod's file) and sleeps."""
    ready = f"open('{tmp_path}/ready-' + __import__('os').environ.get('JOB_COMPLETION_INDEX', 'x'), 'w')"
    return [
        sys.executable,
        "-c",
        f"import signal, time; signal.signal(signal.SIGTERM, {on_term}); {ready}; time.sleep(60)",
    ]


def _until(what, timeout=30.0):
    import time

    end = time.time() + timeout
    while time.time() < end:
        if got := what():
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


def test_a_jobset_created_through_the_local_api_runs_its_workers_and_a_delete_stops_them_with_the_pods_grace(
    tmp_path,
):
    from jaxrec.adapters.kube import Kube, make_api_client

    ex = LocalExecutor(repo_root=tmp_path, work_dir=tmp_path / "work")
    try:
        kube = Kube(make_api_client(ex.controllers.url), "default")
        # Each worker says it is ready once its SIGTERM handler is set: a SIGTERM before that would end it -15.
        assert kube.create_jobset(_jobset("js", 2, _worker(tmp_path, "lambda *a: exit(143)")))
        assert not kube.create_jobset(_jobset("js", 2, IDLE))  # 409: the name is taken
        # The Job controller's Job, the kubelets' Running pods on their nodes, as a cluster's API lists them.
        assert [j["metadata"]["name"] for j in kube.items(kube.list_jobs, "js")] == ["js-workers-0"]
        pods = _until(lambda: (p := kube.items(kube.list_pods, "js")) and all(
            x["status"]["phase"] == "Running" for x in p) and p)  # fmt: skip
        assert [p["metadata"]["name"] for p in pods] == ["js-workers-0-0", "js-workers-0-1"]
        assert all(p["metadata"]["labels"]["app"] == "x" for p in pods)  # the pod template's labels
        assert kube.get_node(pods[0]["spec"]["nodeName"])["status"]["conditions"][0]["status"] == "True"
        _until(lambda: len(list(tmp_path.glob("ready-*"))) == 2)
        # Force-deleting a pod SIGKILLs its worker; it does not come back.
        kube.force_delete_pod("js-workers-0-1")
        sl = ex.cluster.find("js")
        _until(lambda: sl.workers[1].returncode == -9)
        assert [p["metadata"]["name"] for p in kube.items(kube.list_pods, "js")] == ["js-workers-0-0"]
        # A foreground delete: the worker gets SIGTERM (exit 143), its pod is Terminating until then, and the JobSet
        # goes with its last pod.
        kube.delete_jobset("js")
        assert kube.get_jobset("js")["metadata"]["deletionTimestamp"]
        _until(lambda: kube.get_jobset("js") is None)
        assert sl.workers[0].returncode == 143 and sl.workers[0].stopped_by_jobset
        assert kube.items(kube.list_pods, "js") == [] and kube.items(kube.list_jobs, "js") == []
    finally:
        ex.controllers.close()


def test_a_pod_deleted_or_evicted_through_the_local_api_ends_as_the_kubelet_ends_it_and_its_job_counts_it(tmp_path):
    """The drill's own calls on the local API: a graceful pod delete SIGTERMs the worker (SIGKILL once the grace is
    over), the pod is Terminating until the worker exited, then gone, its end counted by the Job (backoff limit 0:
    FailureTarget); an eviction stamps DisruptionTarget first; a cordon stays on the node its kubelet publishes."""
    from jaxrec.adapters.kube import Kube, make_api_client
    from workflows import drill

    ex = LocalExecutor(repo_root=tmp_path, work_dir=tmp_path / "work")
    try:
        api = make_api_client(ex.controllers.url)
        kube, cluster = Kube(api, "default"), drill.Cluster(api, "default")

        def pod(name):
            return next(
                (p for p in kube.items(kube.list_pods, name.rsplit("-workers", 1)[0]) if p["metadata"]["name"] == name),
                None,
            )

        js = _jobset("js", 2, _worker(tmp_path, "lambda *a: exit(143)"))
        js["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = 0
        kube.create_jobset(js)
        sl = ex.cluster.find("js")
        _until(
            lambda: (
                len(cluster.pods("jobset.sigs.k8s.io/jobset-name=js")) == 2 and len(list(tmp_path.glob("ready-*"))) == 2
            )
        )
        cluster.evict("js-workers-0-1")
        evicted = pod("js-workers-0-1")
        assert evicted["metadata"]["deletionTimestamp"], evicted  # Terminating while its worker runs
        marked = next(c for c in evicted["status"]["conditions"] if c["type"] == "DisruptionTarget")
        assert (marked["reason"], marked["message"]) == ("EvictionByEvictionAPI", "Eviction API: evicting")
        _until(lambda: sl.workers[1].returncode == 143 and pod("js-workers-0-1") is None)
        failure = _until(
            lambda: [
                c for c in kube.items(kube.list_jobs, "js")[0]["status"]["conditions"] if c["type"] == "FailureTarget"
            ]
        )
        assert failure[0]["reason"] == "BackoffLimitExceeded", failure  # the evicted pod's end, counted
        cluster.cordon("local-0")
        cluster.delete_pod("js-workers-0-0")  # its worker leaves on SIGTERM (exit 143)
        _until(lambda: sl.workers[0].returncode == 143)
        assert kube.get_node("local-0")["spec"]["unschedulable"] is True
        # A worker that ignores SIGTERM is SIGKILLed once the grace asked for is over.
        for f in tmp_path.glob("ready-*"):
            f.unlink()
        kube.create_jobset(_jobset("stubborn", 1, _worker(tmp_path, "signal.SIG_IGN")))
        _until(lambda: cluster.pods("jobset.sigs.k8s.io/jobset-name=stubborn") and list(tmp_path.glob("ready-*")))
        cluster.delete_pod("stubborn-workers-0-0", grace_s=1)
        _until(lambda: ex.cluster.find("stubborn").workers[0].returncode == -9, timeout=10)
    finally:
        ex.controllers.close()


def test_a_jobset_the_local_cluster_cannot_read_is_refused_as_jobsets_webhook_refuses_it(tmp_path):
    from kubernetes.client import ApiException

    from jaxrec.adapters.kube import Kube, api_exit_code, make_api_client

    ex = LocalExecutor(repo_root=tmp_path, work_dir=tmp_path / "work")
    try:
        kube = Kube(make_api_client(ex.controllers.url), "default")
        bad = _jobset("bad", 1, IDLE)
        del bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
        with pytest.raises(ApiException) as e:
            kube.create_jobset(bad)
        assert e.value.status == 422 and api_exit_code(e.value) == 2 and b"containers" in e.value.body
        assert kube.get_jobset("bad") is None and not ex.cluster.slices
    finally:
        ex.controllers.close()


def test_the_local_api_needs_no_tcp_socket_where_a_machine_lets_no_process_open_one(tmp_path, monkeypatch):
    """The TPU machine refuses every TCP and UDP socket, even on loopback (errno 97): the local cluster's API is
    served, and reached by the steps' client, over a unix socket."""
    import errno
    import socket

    from jaxrec.adapters.kube import Kube, make_api_client

    real = socket.socket.__init__

    def unix_only(self, family=socket.AF_INET, *a, **k):
        if family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        real(self, family, *a, **k)

    monkeypatch.setattr(socket.socket, "__init__", unix_only)
    ex = LocalExecutor(repo_root=tmp_path, work_dir=tmp_path / "work")
    try:
        assert ex.controllers.url.startswith("unix://")
        kube = Kube(make_api_client(ex.controllers.url), "default")
        assert kube.create_jobset(_jobset("one", 1, IDLE)) and kube.get_jobset("one") is not None
    finally:
        ex.controllers.close()
        for sl in ex.cluster.slices:
            ex.cluster.kill(sl)


@pytest.mark.parametrize(
    ("affinity", "pools", "lands_on"),
    [
        (None, ("local-a", "local-b"), "local-a"),  # no preference: the first pool
        (("local-b", False), ("local-a", "local-b"), "local-b"),  # level 1: the pool the last gang left healthy
        (("local-a", True), ("local-a", "local-b"), "local-b"),  # level 2: any pool but the one that failed
        (("local-a", True), ("local-a",), "local-a"),  # a preference never keeps a gang from running
        (("gke-pool", False), ("local-a", "local-b"), "local-a"),  # a pool the cluster does not have
    ],
)
def test_a_gang_lands_on_the_pool_its_node_affinity_prefers(affinity, pools, lands_on):
    """The local cluster schedules a JobSet's gang on one of its node pools as the scheduler scores the product's
    preferred node affinity (``jobset.pool_affinity``), and names the nodes of each pool apart."""
    from jaxrec.model.jobset import pool_affinity
    from workflows.local.cluster import scheduled_pool
    from workflows.local.slices import node_name, node_pools

    spec = {} if affinity is None else {"affinity": pool_affinity(affinity[0], avoid=affinity[1])}
    assert scheduled_pool(spec, pools) == lands_on
    assert node_pools(2) == ("local-a", "local-b")
    assert (node_name(3, "local-a"), node_name(3, "local-b")) == ("local-3", "local-b-3")
