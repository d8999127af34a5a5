"""The areas of the product and the test modules that check each: one marker per area, put on every test of its
modules at collection (``tests/conftest.py``), so that ``pytest -m AREA`` runs the fast tests of one area and
``pytest -m "k8s and AREA"`` its tier tests. ``docs/TESTING.md`` has one row per area with the modules it covers and
its measured times; ``tests/test_docs.py`` holds the two to each other. A test module in no area fails collection.
"""

from __future__ import annotations

# area -> (the product modules it covers, the test modules that check them; tests/k8s ones under "k8s/").
AREAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "config": (
        "recovery_steps/validate_config.py, preflight.py; jaxrec/model/config.py, compat.py, tpu.py, tasks.py",
        ("test_config", "test_compat", "test_validate_config", "test_preflight", "test_fault_table", "test_tasks"),
    ),
    "workflow": (
        "workflows/build.py, templates.py, rbac.py, monitoring/; the generated argo/",
        (
            "test_build",
            "test_workflow_schema",
            "test_workflow_structure",
            "test_rbac",
            "test_monitoring",
            "test_worker_pods",
            "k8s/test_admission",
        ),
    ),
    "supervisor": (
        "recovery_steps/supervision.py, train_segment.py, provision_slice.py, kube_gang.py; "
        "jaxrec/adapters/kube.py, model/jobset.py, gang.py",
        ("test_supervision", "test_train_segment", "test_provision_slice", "test_step_skeleton", "k8s/test_supervisor"),
    ),
    "classify": (
        "recovery_steps/classify.py, evidence.py, closing.py, classify_failure.py, retry.py; jaxrec/model/snapshot.py, "
        "contract.py",
        ("test_classify", "test_classify_failure", "test_evidence", "test_retry", "test_transient"),
    ),
    "lease": (
        "recovery_steps/lease.py, hand_over.py, finalize.py, give_up.py, attempts.py",
        ("test_lease", "test_hand_over", "test_finalize", "k8s/test_run_lease"),
    ),
    "checkpoints": (
        "recovery_steps/restore_latest.py; jaxrec/adapters/checkpoints.py, restore.py, verify.py, model/tiers.py; "
        "trainer/local_*",
        (
            "test_restore",
            "test_restore_check",
            "test_restore_layout",
            "test_verify",
            "test_checkpoint_integrity",
            "test_tiers",
            "test_local_parts",
            "test_local_tiers_e2e",
        ),
    ),
    "store": (
        "jaxrec/adapters/store.py, documents.py, iam.py, model/records.py",
        ("test_store", "test_documents", "test_credentials"),
    ),
    "trainers": (
        "trainer/ (loop, hooks, lifecycle, checkpointing, tasks), examples/",
        (
            "test_trainer",
            "test_trainer_checkpointing",
            "test_trainer_loop",
            "test_trainer_records",
            "test_trainer_units",
            "test_agent",
            "test_tpu",
            "test_peer_notice",
            "test_preemption_plan",
            "test_e2e_tasks",
            "k8s/test_argo_trainer",
        ),
    ),
    "local": (
        "workflows/local/ (the local runner, its cluster, engine and injector)",
        (
            "test_local_engine",
            "test_e2e_local",
            "test_e2e_gcs_emulator",
            "test_e2e_store_outage",
            "test_local_metrics_scrape",
            "test_monitoring_local",
        ),
    ),
    "argo": (
        "the generated Workflow on Argo's real controller; the local stand-in's agreement with it",
        ("test_standin_replay", "k8s/test_argo", "k8s/test_argo_cli", "k8s/test_argo_ui", "k8s/test_podexec"),
    ),
    "drill": (
        "workflows/drill.py, faults.py (the one fault table)",
        ("test_drill", "k8s/test_argo_drill", "k8s/test_drill_trainers"),
    ),
    "report": (
        "workflows/report.py; jaxrec/adapters/incidents.py, model/totals.py, metrics.py",
        ("test_report", "test_goodput", "test_run_totals"),
    ),
    "chaos": (
        "the whole loop under faults (tests/k8s/chaos.py, toxiproxy)",
        ("k8s/test_chaos", "k8s/test_chaos_checks", "k8s/test_toxiproxy"),
    ),
    "house": (
        "layers, function length, the docs' tables; the tier's own control plane",
        ("test_layers", "test_function_length", "test_docs", "k8s/test_control_plane"),
    ),
}


def area_of(module: str) -> str | None:
    """The area of a test module (``test_x`` or ``k8s/test_x``), or None when it has none."""
    return next((a for a, (_, mods) in AREAS.items() if module in mods), None)
