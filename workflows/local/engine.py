"""An interpreter of the Workflows ``workflows.build`` writes: DAGs, parameters, retries, suspend, exit handler.

It decides what runs next and with which values; running a container is delegated to an executor
(``workflows.local.executor``), so the same interpreter is tested with tiny ``python -c`` steps. docs/LOCAL.md says
what it models; ``tests/k8s/standin.py`` replays runs of Argo's real workflow-controller through it.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from jaxrec.model.contract import NodePhase
from jaxrec.model.records import now
from workflows.local import expr as local_expr

SUCCEEDED, FAILED, ERROR, SKIPPED, OMITTED = (
    NodePhase.SUCCEEDED,
    NodePhase.FAILED,
    NodePhase.ERROR,
    NodePhase.SKIPPED,
    NodePhase.OMITTED,
)
_DONE_BAD = (FAILED, ERROR)
# Argo's controller refuses a template call nested deeper than this (maxAllowedStackDepth = 100 in
# workflow/controller/controller.go): a recursive DAG that goes deeper Errors there, and here.
MAX_STACK_DEPTH = 100
_TEMPLATE_REF = re.compile(r"\{\{\s*(.*?)\s*\}\}", re.S)


class WorkflowError(Exception):
    """The workflow cannot be interpreted (bad reference, unknown template, unparsable expression)."""


class Aborted(Exception):
    """The run was stopped from outside (``WorkflowRun.abort``)."""


@dataclass
class NodeResult:
    """What one node (a template invocation) ended with."""

    phase: NodePhase
    outputs: dict[str, str] = field(default_factory=dict)
    exit_code: int | None = None
    message: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def duration(self) -> float:
        """Seconds the node ran."""
        return max(0.0, self.finished_at - self.started_at)


@dataclass
class NodeInfo:
    """A node as the executor and the progress printer see it."""

    id: str
    display: str
    task: str
    template: str
    attempt: str | None
    retry: int
    started_at: float = 0.0


class Executor(Protocol):
    """Runs the leaf templates (containers) of a workflow."""

    def run_container(self, node: NodeInfo, template: Mapping[str, Any]) -> NodeResult:
        """Run a container (or script) template whose fields are already substituted."""
        ...

    def stop_all(self) -> None:
        """Stop every process started so far (the run is aborted)."""
        ...


def parse_duration(text: Any) -> float:
    """Argo durations: ``"10"`` (whole seconds), ``"10s"``, ``"1.5s"``, ``"400ms"``, ``"2m"``, ``"1h"``, ``"1m30s"``.

    As Argo's ``ParseStringToDuration`` (``pkg/apis/workflow/v1alpha1/utils.go``): a bare number must be an
    integer; anything else is a Go duration with units, so ``"0.5"`` is an error there and here.
    """
    s = str(text).strip()
    if not s:
        return 0.0
    if re.fullmatch(r"[+-]?\d+", s):
        return float(int(s))
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+(?:\.\d+)?)(ms|s|m|h)", s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
        pos = m.end()
    if pos != len(s):
        raise WorkflowError(f"invalid duration {s!r}; use seconds or e.g. '30s', '2m', '1h'")
    return total


def substitute(text: str, names: Mapping[str, Any]) -> str:
    """Replace ``{{name}}`` in ``text`` with the value of a flat dotted name (``inputs.parameters.x``).

    Raises:
        WorkflowError: on an unknown name.
    """

    def repl(m: re.Match) -> str:
        if m.group(1) not in names:
            raise WorkflowError(f"unresolved reference {{{{{m.group(1)}}}}}")
        return str(names[m.group(1)])

    return _TEMPLATE_REF.sub(repl, text)


def substitute_tree(obj: Any, names: Mapping[str, Any]) -> Any:
    """``substitute`` applied to every string inside a JSON-like tree."""
    if isinstance(obj, str):
        return substitute(obj, names)
    if isinstance(obj, list):
        return [substitute_tree(x, names) for x in obj]
    if isinstance(obj, dict):
        return {k: substitute_tree(v, names) for k, v in obj.items()}
    return obj


ProgressHook = Callable[[str, NodeInfo, NodeResult | None], None]


class WorkflowRun:
    """One execution of a Workflow manifest (its uid: ``metadata.uid``, else a new one)."""

    def __init__(
        self,
        workflow: Mapping[str, Any],
        executor: Executor,
        *,
        parameters: Mapping[str, str] | None = None,
        name: str | None = None,
        progress: ProgressHook | None = None,
        sleep: Callable[[float], None] | None = None,
    ):
        self.wf = workflow
        self.spec = workflow.get("spec", {})
        self.templates = {t["name"]: t for t in self.spec.get("templates", [])}
        self.executor = executor
        meta = workflow.get("metadata", {})
        self.name = name or meta.get("name") or (meta.get("generateName", "workflow-") + "local")
        self.params = {
            p["name"]: str(p.get("value", p.get("default", "")))
            for p in self.spec.get("arguments", {}).get("parameters", [])
        }
        self.params.update({k: str(v) for k, v in (parameters or {}).items()})
        self.progress = progress or (lambda *_: None)
        self._abort = threading.Event()
        self._sleep = sleep
        self._ids = 0
        self.uid = meta.get("uid") or str(uuid.uuid4())
        self._lock = threading.Lock()
        self.failures: list[dict[str, Any]] = []
        self.status: NodePhase = NodePhase.RUNNING
        self.nodes: list[tuple[NodeInfo, NodeResult]] = []
        # The DAG nodes and the tasks a ``when`` or ``depends`` left out (Skipped, Omitted), as Argo lists them too.
        self.inner: list[tuple[NodeInfo, NodeResult]] = []

    # -- public ------------------------------------------------------------------------------------

    def run(self) -> str:
        """Run the entrypoint, then the exit handler; return ``Succeeded``, ``Failed`` or ``Error``."""
        entry = self.spec.get("entrypoint")
        if entry not in self.templates:
            raise WorkflowError(f"spec.entrypoint: template {entry!r} not found")
        try:
            res = self._invoke(entry, {}, display=self.name, task=self.name, attempt=None)
            self.status = SUCCEEDED if res.phase == SUCCEEDED else (ERROR if res.phase == ERROR else FAILED)
        except Aborted:
            self.status = FAILED
            return self.status
        on_exit = self.spec.get("onExit")
        if on_exit and not self._abort.is_set():
            try:
                ex = self._invoke(on_exit, {}, display=f"{self.name}.onExit", task="onExit", attempt=None)
            except Aborted:
                return self.status
            if ex.phase in _DONE_BAD:
                self.status = FAILED
        return self.status

    def abort(self) -> None:
        """Stop the run: no new node starts, running processes are stopped, sleeps end."""
        self._abort.set()
        self.executor.stop_all()

    @property
    def aborted(self) -> bool:
        """True once ``abort`` was called."""
        return self._abort.is_set()

    # -- scopes ------------------------------------------------------------------------------------

    def _global_names(self) -> dict[str, Any]:
        names: dict[str, Any] = {f"workflow.parameters.{k}": v for k, v in self.params.items()}
        names["workflow.name"] = self.name
        # Unique per run, as Argo's uid is per Workflow object: two local runs of one run id are two holders.
        names["workflow.uid"] = self.uid
        names["workflow.status"] = self.status
        names["workflow.failures"] = json.dumps(self.failures)
        return names

    def _sleep_for(self, seconds: float) -> None:
        if self._sleep is not None:
            self._sleep(seconds)
        elif self._abort.wait(max(0.0, seconds)):
            raise Aborted()
        if self._abort.is_set():
            raise Aborted()

    def _next_id(self) -> str:
        with self._lock:
            self._ids += 1
            return f"n{self._ids:04d}"

    # -- templates ---------------------------------------------------------------------------------

    def _invoke(
        self,
        template_name: str,
        args: Mapping[str, str],
        *,
        display: str,
        task: str,
        attempt: str | None,
        depth: int = 1,
    ) -> NodeResult:
        if self._abort.is_set():
            raise Aborted()
        tmpl = self.templates.get(template_name)
        if tmpl is None:
            raise WorkflowError(f"{display}: template {template_name!r} not found")
        if depth >= MAX_STACK_DEPTH:
            # Argo's controller counts the call it is about to make and errors it when the count reaches the limit
            # (argo-workflows v4 workflow/controller/operator.go ``executeTemplate``: ``currentStackDepth++``, then
            # ``currentStackDepth >= maxStackDepth``): the entry template is call 1, call 100 is refused.
            node = NodeInfo(self._next_id(), display, task, tmpl["name"], attempt, 0, now())
            res = NodeResult(ERROR, message=f"Maximum recursion depth exceeded ({MAX_STACK_DEPTH} nested calls)")
            with self._lock:
                self.nodes.append((node, res))
                self.failures.append(
                    {"displayName": display, "templateName": tmpl["name"], "message": res.message, "phase": ERROR}
                )
            return res
        inputs: dict[str, str] = {}
        for p in tmpl.get("inputs", {}).get("parameters", []):
            if p["name"] in args:
                inputs[p["name"]] = str(args[p["name"]])
            elif "value" in p or "default" in p:
                inputs[p["name"]] = str(p.get("value", p.get("default")))
            else:
                raise WorkflowError(f"{display}: input parameter {p['name']!r} of {template_name!r} not supplied")
        if "attempt" in inputs:
            attempt = inputs["attempt"]
        rs = tmpl.get("retryStrategy")
        retries = 0
        while True:
            shown = display if not retries else f"{display}({retries})"
            node = NodeInfo(self._next_id(), shown, task, tmpl["name"], attempt, retries, now())
            res = self._invoke_once(tmpl, inputs, node, display, depth)
            if res.phase == SUCCEEDED or rs is None:
                return res
            delay = self._retry_delay(rs, res, retries, inputs, display)
            if delay is None:
                return res
            self._sleep_for(delay)
            retries += 1

    def _retry_delay(
        self, rs: Mapping[str, Any], res: NodeResult, retries: int, inputs: dict, display: str
    ) -> float | None:
        """Seconds to wait before the next retry of a failed node, or None when it is not retried.

        The compiled workflows retry with ``retryPolicy: Always`` and an expression; without a policy a node is
        retried when it Failed (Argo's default, ``OnFailure``). ``lastRetry.exitCode`` of a node without an exit
        code (a deleted pod) is -1, as argo-workflows v4.0.5 ``buildRetryStrategyLocalScope`` sets it
        (workflow/controller/operator.go).
        """
        names = {**self._global_names(), **{f"inputs.parameters.{k}": v for k, v in inputs.items()}}
        if res.phase not in _DONE_BAD:
            return None
        if "limit" in rs and rs["limit"] is not None:
            limit = int(substitute(str(rs["limit"]), names))
            if retries >= limit:
                return None
        expression = rs.get("expression")
        policy = rs.get("retryPolicy") or ("Always" if expression else "OnFailure")
        if policy not in ("Always", "OnFailure"):
            raise WorkflowError(f"{display}: retryPolicy {policy!r} is not one the local runner models")
        if policy == "OnFailure" and res.phase != FAILED:
            return None
        # Argo waits out the backoff before it evaluates the policy and the expression, so a retry it will not
        # make still costs the first backoff (argo-workflows v4.0.5 workflow/controller/operator.go
        # processNodeRetries); here a refused retry costs nothing. The generated templates keep that first
        # backoff short (templates.SUPERVISOR_BACKOFF_S), and no check compares the two worlds' durations.
        if expression:
            env = {
                "lastRetry.exitCode": str(res.exit_code if res.exit_code is not None else -1),
                "lastRetry.status": res.phase,
                "lastRetry.duration": str(int(res.duration)),
                "lastRetry.message": res.message,
                "retries": str(retries),
            }
            try:
                if not local_expr.evaluate_bool(expression, env):
                    return None
            except local_expr.ExprError as e:
                raise WorkflowError(f"{display}: retryStrategy.expression: {e}") from None
        backoff = rs.get("backoff") or {}
        delay = 0.0
        if backoff.get("duration") is not None:
            factor = float(substitute(str(backoff.get("factor", 1)), names) or 1)
            delay = parse_duration(substitute(str(backoff["duration"]), names)) * factor**retries
            if backoff.get("cap"):
                delay = min(delay, parse_duration(backoff["cap"]))
        return delay

    def _invoke_once(
        self, tmpl: Mapping[str, Any], inputs: dict[str, str], node: NodeInfo, display: str, depth: int = 1
    ) -> NodeResult:
        attempt = node.attempt
        leaf = any(k in tmpl for k in ("container", "suspend"))
        if leaf:
            self.progress("start", node, None)
        names = {**self._global_names(), **{f"inputs.parameters.{k}": v for k, v in inputs.items()}}
        started = node.started_at
        try:
            if "dag" in tmpl:
                res = self._run_dag(tmpl, names, display, attempt, depth)
            elif "suspend" in tmpl:
                dur = parse_duration(substitute(str(tmpl["suspend"].get("duration", "0")), names))
                self._sleep_for(dur)
                res = NodeResult(SUCCEEDED)
            elif "container" in tmpl:
                body = substitute_tree({k: v for k, v in tmpl.items() if k not in ("metrics",)}, names)
                res = self.executor.run_container(node, body)
            else:
                raise WorkflowError(f"{display}: template {tmpl['name']!r} has no type this runner knows")
        except WorkflowError as e:
            res = NodeResult(ERROR, message=str(e))
        if self._abort.is_set():
            raise Aborted()
        res.started_at = res.started_at or started
        res.finished_at = res.finished_at or now()
        if leaf:
            self.progress("end", node, res)
            with self._lock:
                self.nodes.append((node, res))
                if res.phase in _DONE_BAD:
                    self.failures.append(
                        {
                            "displayName": node.display,
                            "message": res.message,
                            "templateName": tmpl["name"],
                            "phase": res.phase,
                            "podName": f"{self.name}-{node.id}",
                            "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(res.finished_at)),
                        }
                    )
        elif "dag" in tmpl:
            with self._lock:
                self.inner.append((node, res))
        return res

    def _record_gated(self, t: Mapping[str, Any], display: str, attempt: str | None, phase: str) -> None:
        node = NodeInfo(self._next_id(), display, t["name"], t["template"], attempt, 0, now())
        with self._lock:
            self.inner.append((node, NodeResult(phase, started_at=node.started_at, finished_at=node.started_at)))

    def _task_names(self, prefix: str, name: str, res: NodeResult) -> dict[str, Any]:
        names: dict[str, Any] = {f"{prefix}.{name}.outputs.parameters.{k}": v for k, v in res.outputs.items()}
        names[f"{prefix}.{name}.status"] = res.phase
        names[f"{prefix}.{name}.exitCode"] = "" if res.exit_code is None else str(res.exit_code)
        return names

    def _run_dag(
        self, tmpl: Mapping[str, Any], scope: dict[str, Any], display: str, attempt: str | None, depth: int = 1
    ) -> NodeResult:
        tasks = {t["name"]: t for t in tmpl["dag"]["tasks"]}
        deps: dict[str, list[str]] = {}
        for name, t in tasks.items():
            try:
                deps[name] = local_expr.depends_tasks(t["depends"]) if t.get("depends") else []
            except local_expr.ExprError as e:
                raise WorkflowError(f"{display}.{name}: depends: {e}") from None
            for d in deps[name]:
                if d not in tasks:
                    raise WorkflowError(f"{display}.{name}: depends on unknown task {d!r}")
        results: dict[str, NodeResult] = {}
        names = dict(scope)
        running: dict[Future, str] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(tasks))) as pool:
            while len(results) < len(tasks):
                progressed = False
                for name, t in tasks.items():
                    if name in results or name in running.values():
                        continue
                    if not all(d in results for d in deps[name]):
                        continue
                    decision = self._task_gate(t, deps[name], results, names, f"{display}.{name}")
                    if decision is not None:
                        results[name] = NodeResult(decision)
                        self._record_gated(t, f"{display}.{name}", attempt, decision)
                        progressed = True
                        continue
                    args = self._task_args(t, names)
                    fut = pool.submit(
                        self._invoke,
                        t["template"],
                        args,
                        display=f"{display}.{name}",
                        task=name,
                        attempt=attempt,
                        depth=depth + 1,
                    )
                    running[fut] = name
                    progressed = True
                if not running:
                    if progressed:
                        continue
                    break
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    name = running.pop(fut)
                    try:
                        res = fut.result()
                    except Aborted:
                        self._abort.set()
                        res = NodeResult(FAILED, message="aborted")
                    results[name] = res
                    names.update(self._task_names("tasks", name, res))
                if self._abort.is_set():
                    for f in running:
                        f.cancel()
                    raise Aborted()
        phase = self._dag_phase(tasks, deps, results)
        failed = [n for n, r in results.items() if r.phase in _DONE_BAD]
        return NodeResult(phase, message=f"failed: {', '.join(failed)}" if phase != SUCCEEDED else "")

    def _task_gate(
        self,
        t: Mapping[str, Any],
        deps: list[str],
        results: Mapping[str, NodeResult],
        names: Mapping[str, Any],
        where: str,
    ) -> str | None:
        """None when the task should run; otherwise its phase without running (Omitted or Skipped)."""
        phases = {d: results[d].phase for d in deps}
        try:
            ok = local_expr.evaluate_depends(t["depends"], phases) if t.get("depends") else True
        except local_expr.ExprError as e:
            raise WorkflowError(f"{where}: depends: {e}") from None
        if not ok:
            return OMITTED
        if t.get("when") is not None:
            text = substitute(str(t["when"]), names)
            try:
                if not local_expr.evaluate_bool(text, {}):
                    return SKIPPED
            except local_expr.ExprError as e:
                raise WorkflowError(f"{where}: when: {e}") from None
        return None

    def _task_args(self, t: Mapping[str, Any], names: Mapping[str, Any]) -> dict[str, str]:
        return {
            p["name"]: substitute(str(p.get("value", "")), names) for p in t.get("arguments", {}).get("parameters", [])
        }

    @staticmethod
    def _dag_phase(tasks: Mapping[str, Any], deps: Mapping[str, list[str]], results: Mapping[str, NodeResult]) -> str:
        """A failed task fails the DAG unless a task that depends on it ran (its failure was handled)."""
        phase = SUCCEEDED
        for name, res in results.items():
            if res.phase not in _DONE_BAD:
                continue
            handled = any(
                name in deps[other] and results.get(other, NodeResult(OMITTED)).phase not in (OMITTED,)
                for other in tasks
            )
            if not handled:
                phase = ERROR if res.phase == ERROR and phase == SUCCEEDED else FAILED
        return phase
