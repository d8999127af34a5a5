"""Preflight: before the slice is paid for, check that the run can use its store and its cluster objects.

Run by ``validate-config --preflight true``. What it checks: docs/DEPLOY.md, "Preflight"; why orbax needs
``storage.buckets.get``: its "RBAC and Workload Identity". A missing permission or object is class ``configuration``:
one line names it and the command that fixes it. An unreachable store or API server is ``transient`` (Argo retries the
step). The decisions over the results are pure (``cluster_problems``, ``dry_run_problems``); the adapters do the I/O.

Destructive acts: none. It writes and removes only a probe object of its own (a fresh random name) in the store,
and its cluster checks are reads, access reviews and a dry-run create (which the API server never persists).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxrec.adapters.iam import grant_command, permission_from_403
from jaxrec.adapters.kube import Kube
from jaxrec.adapters.store import RunLayout, RunStore, split_gcs_url
from jaxrec.model.config import JobConfig
from jaxrec.model.contract import ExitCode, FailureClass
from jaxrec.model.names import JOBSET_GROUP, STEP_VERBS
from jaxrec.model.records import PreflightCheck
from recovery_steps.step import k8s_client

log = logging.getLogger(__name__)

JOBSET_INSTALL = (
    "kubectl apply --server-side -f https://github.com/kubernetes-sigs/jobset/releases/download/v0.12.0/manifests.yaml"
)
RBAC_APPLY = "kubectl apply -f argo/rbac.yaml"


class PreflightUnreachable(Exception):
    """The store or the API server could not be asked: retrying the step can help."""


@dataclass(frozen=True)
class Problem:
    """One failed check: what is missing, and the one command that fixes it."""

    check: str
    missing: str
    fix: str

    def line(self) -> str:
        """The one line a user reads."""
        return f"preflight {self.check}: missing {self.missing}; fix: {self.fix}"


# --- the run store ----------------------------------------------------------------------------------


def check_store(cfg: JobConfig, store: RunStore, *, gcs_client: Any = None) -> list[Problem]:
    """Bucket metadata, then write, read and delete one object under the run.

    Raises:
        PreflightUnreachable: The store did not answer (network, HTTP 429/5xx).
    """
    if not store.is_gcs:
        return _check_local_store(store)
    from google.api_core import exceptions
    from google.cloud import storage

    from jaxrec.adapters.store import make_gcs_client, store_errors

    client = gcs_client or make_gcs_client()
    # The store's root, not the config's: a submission may point the run at another bucket (-p store-root=...).
    bucket_name, _ = split_gcs_url(store.root)
    probe = f"{RunLayout.PREFLIGHT_PROBES}/{secrets.token_hex(6)}"
    steps = [
        ("storage.buckets.get", lambda: storage.Bucket(client, bucket_name).reload()),
        ("storage.objects.create", lambda: store.write_bytes(probe, b"preflight", if_generation_match=0)),
        ("storage.objects.get", lambda: store.read_bytes(probe)),
        ("storage.objects.delete", lambda: store.delete(probe)),
    ]
    problems = []
    for permission, op in steps:
        try:
            op()
        except exceptions.NotFound as e:
            if permission == "storage.buckets.get":
                return [
                    Problem(
                        "store",
                        f"bucket gs://{bucket_name} ({e.code})",
                        f"gcloud storage buckets create gs://{bucket_name} --location=REGION",
                    )
                ]
        except exceptions.Forbidden as e:
            perm = permission_from_403(e.message, permission)
            problems.append(Problem("store", f"{perm} on gs://{bucket_name}", grant_command(cfg, perm)))
        except (exceptions.TooManyRequests, exceptions.ServerError) as e:
            raise PreflightUnreachable(f"run store {store.url()}: HTTP {e.code} {e.message}") from None
        except store_errors() as e:
            raise PreflightUnreachable(f"run store {store.url()} unreachable: {type(e).__name__}: {e}") from None
    return problems


def _check_local_store(store: RunStore) -> list[Problem]:
    probe = f"{RunLayout.PREFLIGHT_PROBES}/{secrets.token_hex(6)}"
    try:
        store.write_bytes(probe, b"preflight", if_generation_match=0)
        ok = store.read_bytes(probe) == b"preflight"
        store.delete(probe)
    except OSError as e:
        return [Problem("store", f"write access to {store.url()} ({e.strerror})", f"make {store.url()} writable")]
    if not ok:
        return [Problem("store", f"read-back of {store.url(probe)}", f"check the filesystem of {store.url()}")]
    return []


# --- the cluster ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiAnswer:
    """One Kubernetes API answer: HTTP status and the ``Status`` reason (``NotFound``, ``Forbidden``)."""

    status: int
    reason: str = ""
    allowed: bool | None = None
    labels: dict[str, str] | None = None  # the object's labels, where the query reads one (the namespace)


def cluster_problems(cfg: JobConfig, answers: dict[str, ApiAnswer]) -> list[Problem]:
    """Pure: the problems the API's answers show (``answers``: query key -> what the API answered)."""
    ns = cfg.namespace
    problems = []
    a = answers.get("namespace")
    if a is not None and a.status == 404:
        problems.append(Problem("cluster", f"namespace {ns}", f"kubectl create namespace {ns}"))
    if a is not None and a.status == 200:
        problems += pod_security_problems(cfg, a.labels or {})
    a = answers.get("jobset-crd")
    if a is not None and a.status == 404:
        problems.append(Problem("cluster", "the JobSet CRD (jobsets.jobset.x-k8s.io)", JOBSET_INSTALL))
    for sa in sorted({cfg.service_account, cfg.worker_service_account}):
        a = answers.get(f"serviceaccount/{sa}")
        if a is not None and a.status == 404:
            problems.append(Problem("cluster", f"ServiceAccount {ns}/{sa}", RBAC_APPLY))
    for key, ans in sorted(answers.items()):
        if key.startswith("can/") and ans.allowed is False:
            problems.append(
                Problem("cluster", f"RBAC {key[4:]} for ServiceAccount {ns}/{cfg.service_account}", RBAC_APPLY)
            )
        elif ans.status == 403:
            problems.append(Problem("cluster", f"RBAC to read {key} ({ans.reason})", RBAC_APPLY))
    return problems


# Pod Security admission's level label (kubernetes.io/docs/concepts/security/pod-security-admission): a namespace
# without it enforces "privileged" (the API server's default, which admits anything).
POD_SECURITY_ENFORCE = "pod-security.kubernetes.io/enforce"


def worker_pod_template(cfg: JobConfig) -> dict[str, Any]:
    """The pod template of the first replicated Job of the JobSet the config renders for attempt 0."""
    from jaxrec.model.jobset import JobSetParams, jobset_manifest

    params = JobSetParams(
        name=f"{cfg.run_id}-a0",
        run_id=cfg.run_id,
        store_root=cfg.storage.root,
        attempt="0",
        restore_step="-1",
        coordinator_port="8476",
        metrics_port=str(cfg.monitoring.metrics_port),
    )
    return jobset_manifest(cfg, params)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def dry_run_problems(status: int, message: str) -> list[Problem]:
    """Pure: what the API server's answer to the worker pod's dry-run create says (``status`` 201: admitted).

    A refusal is read as the supervisor reads a Job's FailedCreate (``supervision.pod_refusal``): one the
    configuration causes (Pod Security, a webhook's policy, a LimitRange, a missing account) is a problem with its
    fix, and so is one it does not recognise (a refusal of one pod as rendered is the gang's); a spent quota, a
    webhook that could not be called and a refusal that says it is transient are not the config's doing, and are
    left to the run (which classifies them if they last).
    """
    from recovery_steps.supervision import TRANSIENT_REFUSALS, one_line, pod_refusal

    if status < 400 or TRANSIENT_REFUSALS.search(message):
        return []
    known = pod_refusal(message)
    if known is not None and known[0] not in (FailureClass.CONFIGURATION, FailureClass.UNKNOWN):
        return []
    why = known[1] if known else f"refused with {status}: {one_line(message, 240)}"
    fix = (
        "see the refusal's own words; the Job controller would retry a refused pod for good"
        if known
        else "change what the cluster's policy refuses in the pod spec (worker_resources, checkpoint.local), or "
        "have the namespace exempted; the Job controller would retry a refused pod for good"
    )
    return [Problem("cluster", f"a worker pod the cluster admits (a dry-run create of one: {why})", fix)]


def pod_security_problems(cfg: JobConfig, labels: dict[str, str]) -> list[Problem]:
    """Pure: what the namespace's enforced Pod Security level refuses in the worker pods the config renders.

    The Job controller's retries of a refused pod never succeed, so it is said before any gang is created. Checked
    (Pod Security Standards, kubernetes.io/docs/concepts/security/pod-security-standards): ``baseline`` and
    ``restricted`` forbid hostPath volumes (``checkpoint.local``'s host directory); ``restricted`` also requires
    every container to run as non-root, without privilege escalation, with every capability dropped and a
    RuntimeDefault or Localhost seccomp profile, which the rendered pods do not set.
    """
    level = (labels.get(POD_SECURITY_ENFORCE) or "privileged").strip().lower()
    if level not in ("baseline", "restricted"):
        return []
    pod = worker_pod_template(cfg)["spec"]
    why = [f"hostPath volume {v['name']}" for v in pod.get("volumes") or [] if "hostPath" in v]
    if level == "restricted":
        why += _restricted_gaps(pod)
    if not why:
        return []
    ns = cfg.namespace
    fix = (
        f"kubectl label namespace {ns} {POD_SECURITY_ENFORCE}=privileged --overwrite (a level that admits TPU "
        "workers), or run the workers in a namespace that does"
        + (
            ", or turn checkpoint.local off (its host directory is a hostPath volume)"
            if cfg.checkpoint.local.enabled
            else ""
        )
    )
    return [
        Problem(
            "cluster",
            f"a Pod Security level that admits the worker pods (namespace {ns} enforces {level}, which refuses: "
            f"{'; '.join(why)})",
            fix,
        )
    ]


def _restricted_gaps(pod: dict[str, Any]) -> list[str]:
    """What the ``restricted`` Pod Security level requires that the pod spec does not set."""
    psc = pod.get("securityContext") or {}
    gaps = []
    for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            gaps.append(f"container {c['name']}: allowPrivilegeEscalation is not false")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            gaps.append(f"container {c['name']}: capabilities do not drop ALL")
        if not (sc.get("runAsNonRoot") if "runAsNonRoot" in sc else psc.get("runAsNonRoot")):
            gaps.append(f"container {c['name']}: runAsNonRoot is not true")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            gaps.append(f"container {c['name']}: no RuntimeDefault or Localhost seccomp profile")
    return gaps


def check_cluster(cfg: JobConfig, api_client: Any) -> list[Problem]:
    """Ask the API server what ``cluster_problems`` needs, through the steps' one client (``adapters.kube``).

    Raises:
        PreflightUnreachable: The API server did not answer or answered 429/5xx.
    """
    import urllib3
    from kubernetes.client import ApiException

    kube = Kube(api_client, cfg.namespace)

    def answer(read: Any) -> ApiAnswer:
        try:
            got = read()
        except ApiException as e:
            if e.status == 429 or e.status >= 500:
                raise
            return ApiAnswer(e.status, _status(e, "reason"))
        if not got:
            return ApiAnswer(404, "NotFound")
        labels = (got.get("metadata") or {}).get("labels") if isinstance(got, dict) else None
        return ApiAnswer(200, labels=dict(labels or {}))

    queries: dict[str, Any] = {
        "namespace": lambda: kube.get_namespace(cfg.namespace),
        # Listing in the namespace answers 404 "the server could not find the requested resource" when the
        # CRD is not installed, and needs only the list verb the steps have anyway.
        "jobset-crd": kube.jobsets_served,
    }
    for sa in sorted({cfg.service_account, cfg.worker_service_account}):
        queries[f"serviceaccount/{sa}"] = lambda sa=sa: kube.get_service_account(sa)
    try:
        answers = {key: answer(q) for key, q in queries.items()}
        for use in STEP_VERBS:
            if use.group == JOBSET_GROUP and answers["jobset-crd"].status == 404:
                continue
            allowed = kube.can(use.verb, use.resource, use.group, cluster_scoped=use.cluster_scoped)
            answers[f"can/{use.verb} {use.resource}"] = ApiAnswer(201, allowed=allowed)
        problems = cluster_problems(cfg, answers)
        if not problems:  # a refusal for a missing account or namespace is said once, above
            problems = dry_run_worker_pod(cfg, kube)
    except ApiException as e:
        raise PreflightUnreachable(f"Kubernetes API answered {e.status} {e.reason}") from None
    except urllib3.exceptions.HTTPError as e:
        raise PreflightUnreachable(f"Kubernetes API unreachable: {e}") from None
    return problems


def dry_run_worker_pod(cfg: JobConfig, kube: Kube) -> list[Problem]:
    """Create one worker pod as rendered with ``dryRun=All`` (admitted and validated, never stored); its problems.

    Raises:
        ApiException: 429 or 5xx (the caller's transient).
    """
    from kubernetes.client import ApiException

    template = worker_pod_template(cfg)
    meta = template.get("metadata") or {}
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**meta, "generateName": f"{cfg.run_id}-preflight-"},
        "spec": template["spec"],
    }
    try:
        kube.dry_run_pod(body)
    except ApiException as e:
        if e.status == 429 or e.status >= 500:
            raise
        if e.status == 403 and "cannot create resource" in _status(e, "message"):
            return []  # RBAC, not admission: the access review of create pods says it
        return dry_run_problems(e.status, _status(e, "message"))
    return []


def _status(e: Any, field: str) -> str:
    """A field (``message``, ``reason``) of the ``Status`` an ``ApiException`` carries; else its HTTP reason."""
    try:
        return str(json.loads(e.body).get(field) or e.reason)
    except (TypeError, ValueError):
        return str(e.reason)


# --- the step's part --------------------------------------------------------------------------------


def run(
    cfg: JobConfig, store: RunStore, *, api_client: Any = None, k8s_host: str | None = None, gcs_client: Any = None
) -> list[Problem]:
    """Every check that applies to ``cfg``; the problems found (empty: ready), recorded in the run store.

    Raises:
        PreflightUnreachable: The store or the API server could not be asked.
    """
    problems = check_store(cfg, store, gcs_client=gcs_client)
    if not cfg.slice.is_cpu:
        problems += check_cluster(cfg, api_client or k8s_client(k8s_host))
    if not any(p.check == "store" for p in problems):
        record = PreflightCheck(ok=not problems, problems=[p.line() for p in problems])
        store.write_record(RunLayout.PREFLIGHT, record)
    for p in problems:
        log.error("%s", p.line())
    return problems


def exit_code(problems: Sequence[Problem]) -> ExitCode:
    """Configuration when anything is missing (retrying cannot help), else OK."""
    return ExitCode.CONFIGURATION if problems else ExitCode.OK
