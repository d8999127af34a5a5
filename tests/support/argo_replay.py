"""Replays a run of Argo's real workflow-controller through the local stand-in's interpreter.

A recording (``record``) keeps what the real controller decided for one Workflow: its spec as submitted, its phase
and every node's phase, message, exit code, inputs and outputs. ``replay`` runs the same spec with
``workflows.local.engine.WorkflowRun`` over an executor that answers each container node the stand-in starts with
what the real node of that template ended with, in the order the real controller ran them. The steps' own results
are therefore the same in both worlds; what can differ is what the stand-in makes of them: which nodes it runs,
how often it retries a template, which ``when``/``depends`` branches it takes, the suspend nodes, the phase of
the Workflow and the ``{{workflow.status}}`` its exit handler is given. ``disagreements`` lists every difference.
"""

from __future__ import annotations

import copy
import re
from collections import Counter, defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from workflows.local.engine import ERROR, NodeInfo, NodeResult, WorkflowRun

LEAF_TYPES = ("Pod", "Suspend")
CONFIG_LEFT_OUT = "# left out of the recording: a replay runs no step"
_RETRY_SUFFIX = re.compile(r"\((\d+)\)$")
_NODE_FIELDS = ("id", "displayName", "type", "templateName", "phase", "message", "startedAt", "finishedAt", "children")


def record(wf: Mapping[str, Any]) -> dict[str, Any]:
    """What a finished Workflow object says, reduced to what a replay and a reader of the comparison need."""
    status = wf.get("status") or {}
    nodes = []
    for n in (status.get("nodes") or {}).values():
        kept = {k: n[k] for k in _NODE_FIELDS if k in n}
        kept["inputs"] = _params(n.get("inputs"))
        kept["outputs"] = _params(n.get("outputs"))
        code = (n.get("outputs") or {}).get("exitCode")
        if code is not None:
            kept["exitCode"] = str(code)
        nodes.append(kept)
    nodes.sort(key=lambda n: (n.get("startedAt") or "", n["id"]))
    meta = wf.get("metadata") or {}
    spec = copy.deepcopy(wf["spec"])
    for t in spec.get("templates", []):
        for art in (t.get("inputs") or {}).get("artifacts") or []:
            if "raw" in art:  # the job config validate-config reads: the replay runs no step
                art["raw"]["data"] = CONFIG_LEFT_OUT
    return {
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")},
        "spec": spec,
        "phase": status.get("phase"),
        "nodes": nodes,
    }


def _params(part: Mapping[str, Any] | None) -> dict[str, str]:
    return {p["name"]: str(p.get("value", "")) for p in ((part or {}).get("parameters") or [])}


def retry_index(node: Mapping[str, Any]) -> int:
    """Which try of its template a node is: Argo names a retry child ``<task>(<n>)``."""
    m = _RETRY_SUFFIX.search(node.get("displayName") or "")
    return int(m.group(1)) if m else 0


def leaves(rec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The nodes that ran something (pods) or waited (suspend), oldest first."""
    return [n for n in rec["nodes"] if n.get("type") in LEAF_TYPES]


def _epoch(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


@dataclass
class ReplayExecutor:
    """The stand-in's executor, answering each container node with the real node of its template, in order."""

    real: Mapping[str, Any]
    queues: dict[str, deque] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    exit_status: list[str] = field(default_factory=list)  # the --status each exit-handler try was given

    def __post_init__(self) -> None:
        by_template: dict[str, list] = defaultdict(list)
        for n in leaves(self.real):
            if n["type"] == "Pod":
                by_template[n["templateName"]].append(n)
        for name, nodes in by_template.items():
            self.queues[name] = deque(sorted(nodes, key=lambda n: (n.get("startedAt") or "", retry_index(n))))

    def run_container(self, node: NodeInfo, template: Mapping[str, Any]) -> NodeResult:
        queue = self.queues.get(node.template)
        if not queue:
            self.problems.append(
                f"the stand-in ran {node.template} (attempt {node.attempt}, try {node.retry}); "
                "the real controller did not"
            )
            return NodeResult(ERROR, message="not run by the real controller")
        real = queue.popleft()
        where = f"{node.template} {real['displayName']}"
        if retry_index(real) != node.retry:
            self.problems.append(f"{where}: the stand-in ran it as try {node.retry}")
        if "attempt" in real["inputs"] and real["inputs"]["attempt"] != node.attempt:
            self.problems.append(f"{where}: attempt {real['inputs']['attempt']}; the stand-in's {node.attempt}")
        if node.template == "exit-handler":
            args = list(template["container"].get("args", []))
            self.exit_status.append(args[args.index("--status") + 1] if "--status" in args else "")
        code = real.get("exitCode")
        return NodeResult(
            real["phase"],
            dict(real["outputs"]),
            int(code) if code is not None else None,
            real.get("message", ""),
            _epoch(real.get("startedAt")),
            _epoch(real.get("finishedAt")),
        )

    def stop_all(self) -> None:
        """Nothing runs."""


@dataclass
class Replay:
    """The stand-in's run of a recorded Workflow."""

    status: str
    nodes: list[tuple[NodeInfo, NodeResult]]
    inner: list[tuple[NodeInfo, NodeResult]]
    executor: ReplayExecutor

    def table(self) -> Counter:
        """(template, attempt, try, phase) of every node the stand-in ran, counted."""
        return standin_tables(self.nodes, self.inner)[0]

    def inner_table(self) -> Counter:
        """(kind, template, attempt, phase) of its DAG nodes and of the tasks it left out, counted."""
        return standin_tables(self.nodes, self.inner)[1]

    def attempts(self) -> list[tuple[int, str, str | None, str | None]]:
        """(attempt, outcome, failure class, decision) of every attempt the stand-in closed, as the ledger has them.

        An attempt is failed when classify-failure ran for it and did not send it back to its gang
        (``resupervise``), succeeded when its last train-segment node succeeded.
        """
        out: dict[int, tuple[int, str, str | None, str | None]] = {}
        for n, r in sorted(self.nodes, key=lambda x: x[1].started_at):
            if n.attempt is None:
                continue
            a = int(n.attempt)
            if n.template == "train-segment" and r.phase == "Succeeded":
                out[a] = (a, "succeeded", None, None)
            elif n.template == "classify-failure" and r.phase == "Succeeded":
                if r.outputs.get("decision") != "resupervise":
                    out[a] = (a, "failed", r.outputs.get("failure-class"), r.outputs.get("decision"))
        return [out[a] for a in sorted(out)]


def standin_tables(
    nodes: Sequence[tuple[NodeInfo, NodeResult]], inner: Sequence[tuple[NodeInfo, NodeResult]]
) -> tuple[Counter, Counter]:
    """The stand-in's nodes (``WorkflowRun.nodes`` and ``.inner``), counted as ``real_tables`` counts Argo's."""
    ran = Counter((n.template, n.attempt, n.retry, r.phase) for n, r in nodes)
    left = Counter(
        ("DAG" if r.phase not in ("Skipped", "Omitted") else "Skipped", n.template, n.attempt, r.phase)
        for n, r in inner
    )
    return ran, left


def table_differences(real: tuple[Counter, Counter], mine: tuple[Counter, Counter]) -> list[str]:
    """One line per (node kind, template, attempt, phase) the two runs have a different number of."""
    out = []
    for theirs, ours in zip(real, mine, strict=True):
        for key in sorted(set(theirs) | set(ours), key=str):
            if theirs[key] != ours[key]:
                out.append(f"{key}: real controller {theirs[key]}, the stand-in {ours[key]}")
    return out


def replay(rec: Mapping[str, Any]) -> Replay:
    """Run the recorded spec through the stand-in's interpreter, with the real nodes' results and no waiting."""
    ex = ReplayExecutor(rec)
    wf = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": rec["metadata"], "spec": rec["spec"]}
    run = WorkflowRun(wf, ex, name=rec["metadata"]["name"], sleep=lambda _s: None)
    status = run.run()
    return Replay(status, run.nodes, run.inner, ex)


def real_tables(rec: Mapping[str, Any]) -> tuple[Counter, Counter]:
    """What the real controller ran, counted as ``Replay.table`` and ``Replay.inner_table`` count the stand-in's.

    A node's attempt is its own ``attempt`` input, else its nearest ancestor's (a DAG's input): the stand-in
    carries the attempt down the same way.
    """
    by_id = {n["id"]: n for n in rec["nodes"]}
    parent: dict[str, str] = {}
    for n in rec["nodes"]:
        for c in n.get("children") or []:
            parent[c] = n["id"]
    ran: Counter = Counter()
    inner: Counter = Counter()
    for n in rec["nodes"]:
        attempt = _attempt_of(n, by_id, parent)
        if n.get("type") in LEAF_TYPES:
            ran[(n["templateName"], attempt, retry_index(n), n["phase"])] += 1
        elif n.get("type") in ("DAG", "Skipped"):
            inner[(n["type"], n["templateName"], attempt, n["phase"])] += 1
    return ran, inner


def _attempt_of(n: Mapping[str, Any], by_id: Mapping[str, Any], parent: Mapping[str, str]) -> str | None:
    cur: Mapping[str, Any] | None = n
    while cur is not None:
        if "attempt" in cur.get("inputs", {}):
            return cur["inputs"]["attempt"]
        cur = by_id.get(parent.get(cur["id"], ""))
    return None


def disagreements(rec: Mapping[str, Any], rep: Replay) -> list[str]:
    """Every way the stand-in's replay differs from what the real controller did (empty: they agree)."""
    out = list(rep.executor.problems)
    if rep.status != rec["phase"]:
        out.append(f"workflow phase: real {rec['phase']}, stand-in {rep.status}")
    out += table_differences(real_tables(rec), standin_tables(rep.nodes, rep.inner))
    for name, queue in rep.executor.queues.items():
        for n in queue:
            out.append(f"{name} {n['displayName']} ({n['phase']}): run by the real controller, not by the stand-in")
    return out
