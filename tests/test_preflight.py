"""Preflight: the store on the real GCS emulator (behind an IAM-denying proxy); the cluster at its HTTP boundary."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from support.fake_k8s import FakeCluster, status
from support.iam_proxy import IamProxy, gcs_error_403

from jaxrec.adapters import iam
from jaxrec.adapters.kube import make_api_client
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import load_config, parse_config
from jaxrec.model.names import STEP_VERBS
from jaxrec.model.records import PreflightCheck
from recovery_steps import preflight, validate_config

REPO = Path(__file__).resolve().parents[1]
BUCKET = "test-bucket"
NS = "training"


def _cfg(root: str, name: str = "v5e-4x4.yaml", **top):
    data = yaml.safe_load((REPO / "configs" / name).read_text())
    data["storage"]["root"] = root
    data.update(top)
    return parse_config(data)


@pytest.fixture
def proxy_factory(gcs_emulator):
    made = []

    def make(denied=()):
        made.append(IamProxy(gcs_emulator.url, set(denied)))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _gcs_root(request) -> str:
    return f"gs://{BUCKET}/preflight-{request.node.name.replace('[', '-').replace(']', '')}-{os.getpid()}"


def test_store_checks_pass_against_the_emulator_and_leave_no_probe(gcs_emulator, request):
    cfg = _cfg(_gcs_root(request), "local-cpu.yaml")
    store = RunStore.for_config(cfg)
    assert preflight.run(cfg, store) == []
    assert store.list(RunLayout.PREFLIGHT_PROBES) == []
    assert store.read_record(RunLayout.PREFLIGHT, PreflightCheck).ok


def test_the_bucket_checked_is_the_store_roots_not_the_configs(gcs_emulator, request):
    """``-p store-root=gs://B/...`` points the run at another bucket than the config's ``storage.root``: the
    bucket whose metadata is read is the one the run writes to (the shipped config names a bucket that does not
    exist here)."""
    cfg = _cfg("gs://my-training-bucket/jax-recovery", "v5e-4x4.yaml")
    store = RunStore(_gcs_root(request), cfg.run_id)
    assert preflight.check_store(cfg, store) == []


@pytest.mark.parametrize(
    "denied, role",
    [
        ("storage.buckets.get", "roles/storage.legacyBucketReader"),
        ("storage.objects.create", "roles/storage.objectUser"),
        ("storage.objects.delete", "roles/storage.objectUser"),
    ],
)
def test_a_denied_storage_permission_names_itself_and_the_grant(proxy_factory, request, denied, role):
    proxy = proxy_factory([denied])
    cfg = _cfg(_gcs_root(request), "local-cpu.yaml")
    client = proxy.client()
    store = RunStore.for_config(cfg, gcs_client=client)
    problems = preflight.check_store(cfg, store, gcs_client=client)
    assert [p.missing for p in problems] == [f"{denied} on gs://{BUCKET}"]
    line = problems[0].line()
    assert "\n" not in line
    assert f"gcloud storage buckets add-iam-policy-binding gs://{BUCKET} --role={role}" in line
    assert "subject/ns/default/sa/jax-recovery" in line
    assert preflight.exit_code(problems) == 2


def test_local_store_write_read_delete(tmp_path):
    cfg = _cfg(str(tmp_path / "store"), "local-cpu.yaml")
    store = RunStore.for_config(cfg)
    assert preflight.run(cfg, store) == []
    assert store.list(RunLayout.PREFLIGHT_PROBES) == []


# --- the cluster --------------------------------------------------------------------------------


def _cluster(*, namespace=True, crd=True, accounts=("jax-recovery", "jax-recovery-worker"), denied=()):
    """The API the preflight reads: the run's namespace, the JobSet CRD, the ServiceAccounts, RBAC's answers."""
    kube = FakeCluster(namespace=NS)
    if not namespace:
        kube.remove("namespaces", NS)
    if not crd:
        kube.uninstall("jobsets")
    for name in accounts:
        kube.put("serviceaccounts", {"kind": "ServiceAccount", "apiVersion": "v1", "metadata": {"name": name}})
    kube.denied = set(denied)
    return kube


@pytest.fixture
def cluster_factory():
    made = []

    def make(**kw):
        made.append(_cluster(**kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_a_ready_cluster_passes_and_every_verb_is_reviewed(cluster_factory, tmp_path):
    kube = cluster_factory()
    cfg = _cfg(f"gs://{BUCKET}/cluster-only")
    assert preflight.check_cluster(cfg, make_api_client(kube.url)) == []
    asked = {(r["verb"], r["resource"], r.get("namespace")) for r in kube.reviews}
    for use in STEP_VERBS:
        assert (use.verb, use.resource, None if use.cluster_scoped else NS) in asked, use
    # One worker pod as rendered went through admission as a dry run, and nothing was stored.
    (dry,) = kube.queries("POST", f"/api/v1/namespaces/{NS}/pods")
    assert dry["dryRun"] == "All" and not kube.pods
    (_, _, body) = kube.requests_of("POST", "/pods")[0]
    assert body["spec"] == preflight.worker_pod_template(cfg)["spec"]


# Each a pod create's refusal as kube-apiserver v1.36 words it; GKE Autopilot's is its Warden webhook's, whose
# "admission webhook ... denied the request" prefix is GKE's documented one (cloud.google.com/kubernetes-engine/docs/
# troubleshooting/autopilot-privileged-workloads); the constraint's own words after it are illustrative.
WARDEN = (
    'pods "r-preflight-x1" is forbidden: admission webhook "warden-validating.common-webhooks.networking.gke.io" '
    "denied the request: GKE Warden rejected the request because it violates one or more constraints."
)


@pytest.mark.parametrize(
    "code, message, said",
    [
        (403, WARDEN, "admission webhook warden-validating.common-webhooks.networking.gke.io denied them"),
        (422, 'Pod "r-preflight-x1" is invalid: spec.volumes[0].hostPath.path: Invalid value', "refused with 422"),
        (403, 'pods "r-preflight-x1" is forbidden: node pool policy says no', "for a reason the classifier does not"),
        (403, 'pods "r-preflight-x1" is forbidden: exceeded quota: tpu, requested: google.com/tpu=4', None),
        (403, 'pods "r-preflight-x1" is forbidden: status unknown for quota: tpu, resources: google.com/tpu', None),
    ],
    ids=["autopilot-warden", "unrecognised", "unknown-forbidden", "spent-quota", "quota-not-counted-yet"],
)
def test_a_worker_pod_the_cluster_refuses_at_admission_is_one_line_before_any_slice(
    cluster_factory, code, message, said
):
    """The dry-run create of one worker pod is refused at admission: a refusal the config causes, or one not
    recognised, is one problem with the API's words; a spent quota or a quota not counted yet belongs to the run."""
    kube = cluster_factory()
    kube.inject("/pods", code, status(code, "Forbidden" if code == 403 else "Invalid", message), method="POST")
    problems = preflight.check_cluster(_cfg(f"gs://{BUCKET}/cluster-only"), make_api_client(kube.url))
    if said is None:
        assert problems == []
        return
    (p,) = problems
    assert said in p.missing and "a dry-run create" in p.missing, p.line()
    assert "\n" not in p.line()


def test_a_dry_run_the_steps_may_not_make_is_the_rbac_line_alone(cluster_factory):
    """Without create pods the access review says it (kubectl apply -f argo/rbac.yaml); no dry run is tried."""
    kube = cluster_factory(denied=[("create", "pods")])
    problems = preflight.check_cluster(_cfg(f"gs://{BUCKET}/cluster-only"), make_api_client(kube.url))
    assert [p.missing for p in problems] == [f"RBAC create pods for ServiceAccount {NS}/jax-recovery"]
    assert kube.queries("POST", f"/api/v1/namespaces/{NS}/pods") == []


@pytest.mark.parametrize(
    "kw, missing, fix",
    [
        ({"crd": False}, "the JobSet CRD (jobsets.jobset.x-k8s.io)", "kubectl apply --server-side -f https://"),
        ({"namespace": False}, f"namespace {NS}", f"kubectl create namespace {NS}"),
        ({"accounts": ["jax-recovery"]}, f"ServiceAccount {NS}/jax-recovery-worker", "kubectl apply -f argo/rbac.yaml"),
        (
            {"denied": [("delete", "jobsets")]},
            f"RBAC delete jobsets for ServiceAccount {NS}/jax-recovery",
            "kubectl apply -f argo/rbac.yaml",
        ),
    ],
    ids=["no-crd", "no-namespace", "no-worker-account", "no-delete-verb"],
)
def test_a_missing_cluster_object_or_verb_is_one_line(cluster_factory, tmp_path, kw, missing, fix):
    kube = cluster_factory(**kw)
    cfg = _cfg(f"gs://{BUCKET}/cluster-only")
    problems = preflight.check_cluster(cfg, make_api_client(kube.url))
    assert [p.missing for p in problems] == [missing]
    assert fix in problems[0].line()


def test_validate_config_preflight_exits_2_with_one_line_per_problem(cluster_factory, tmp_path, capsys):
    kube = cluster_factory(crd=False)
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text((REPO / "configs" / "v5e-4x4.yaml").read_text())
    args = [
        "--config",
        str(cfg_file),
        "--store-root",
        str(tmp_path / "store"),
        "--output-dir",
        str(tmp_path / "o"),
        "--preflight",
        "true",
        "--k8s-host",
        kube.url,
    ]
    assert validate_config.main(args) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert line.startswith("configuration: preflight cluster: missing the JobSet CRD") and "Traceback" not in err
    assert not (tmp_path / "o" / "first-attempt").exists()
    rec = RunStore(str(tmp_path / "store"), load_config(cfg_file).run_id).read_record(
        RunLayout.PREFLIGHT, PreflightCheck
    )
    assert rec is not None and not rec.ok and "JobSet CRD" in rec.problems[0]


def test_validate_config_preflight_unreachable_api_is_transient(tmp_path, capsys):
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text((REPO / "configs" / "v5e-4x4.yaml").read_text())
    args = [
        "--config",
        str(cfg_file),
        "--store-root",
        str(tmp_path / "store"),
        "--output-dir",
        str(tmp_path / "o"),
        "--preflight",
        "true",
        "--k8s-host",
        "http://127.0.0.1:9",
    ]
    assert validate_config.main(args) == 69
    err = capsys.readouterr().err
    assert "Kubernetes API unreachable" in err and "Traceback" not in err


def test_permission_from_403_reads_the_gcs_message():
    msg = gcs_error_403("storage.buckets.get")["error"]["message"]
    assert iam.permission_from_403(msg, "x") == "storage.buckets.get"
    assert iam.permission_from_403("Forbidden", "storage.objects.get") == "storage.objects.get"


def _enforcing(kube, level: str) -> None:
    ns = kube.namespaces[NS]
    ns["metadata"]["labels"] = {"pod-security.kubernetes.io/enforce": level}
    kube.put("namespaces", ns)


@pytest.mark.parametrize(
    ("level", "local_tier", "refused"),
    [
        ("privileged", True, []),
        ("baseline", False, []),
        ("baseline", True, ["hostPath volume jaxrec-local"]),
        ("restricted", False, ["container trainer: runAsNonRoot is not true", "allowPrivilegeEscalation"]),
    ],
    ids=["privileged", "baseline", "baseline-with-the-local-tier", "restricted"],
)
def test_a_pod_security_level_that_refuses_the_worker_pods_is_said_before_any_gang(
    cluster_factory, level, local_tier, refused
):
    """The namespace's enforced Pod Security level refuses what the rendered worker pods carry: said by preflight
    in one line with the fix, before a Job controller retries a refused pod for good."""
    kube = cluster_factory()
    _enforcing(kube, level)
    data = yaml.safe_load((REPO / "configs" / "v5e-4x4.yaml").read_text())
    data["storage"]["root"] = f"gs://{BUCKET}/pod-security"
    if local_tier:
        data["checkpoint"]["local"] = {"interval_steps": 50, "keep": 2}
    cfg = parse_config(data)
    problems = preflight.check_cluster(cfg, make_api_client(kube.url))
    if not refused:
        assert problems == []
        return
    (p,) = problems
    assert f"namespace {NS} enforces {level}" in p.missing and all(r in p.missing for r in refused), p.line()
    assert "pod-security.kubernetes.io/enforce=privileged" in p.fix
    assert ("checkpoint.local off" in p.fix) is local_tier
