"""Monitoring: the metric table, the GMP manifests, the alert rules (with promtool) and the dashboard."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from support import promtool

from jaxrec.model.config import JobConfig, load_config
from jaxrec.model.metrics import ARGO_PREFIX, METRICS, exposed_name
from workflows import monitoring

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GKE_CONFIGS = [p for p in CONFIGS if not load_config(p).slice.is_cpu]
SCHEMAS = yaml.safe_load((ROOT / "tests" / "data" / "gmp_crd_schemas.yaml").read_text())
PROMTOOL = shutil.which("promtool")
RUNBOOK_SECTIONS = {
    "preemption",
    "infrastructure",
    "hang",
    "capacity",
    "application",
    "configuration",
    "unknown",
    "no-progress",
    "unsupervised",
}
ALLOWED_LABELS = {"run_id", "attempt", "process_index", "class", "reason", "status"}
SCRAPED_NAMES = {exposed_name(m.name, argo=True) for m in METRICS}
PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "time",
    "increase",
    "rate",
    "bool",
    "offset",
}


def _cfg(path: Path) -> JobConfig:
    return load_config(path)


def _variant(path: Path, **monitoring: int) -> JobConfig:
    cfg = _cfg(path)
    data = cfg.model_dump(mode="json")
    data["monitoring"].update(monitoring)
    return JobConfig.model_validate(data)


def _validate(doc: dict) -> None:
    schema = {"$defs": SCHEMAS["$defs"], **SCHEMAS[doc["kind"]]}
    jsonschema.validate(doc, schema)


def _manifests(cfg: JobConfig, stem: str = "job") -> list[dict]:
    text = monitoring.render_monitoring(cfg, stem)[f"{stem}.monitoring.yaml"]
    return [d for d in yaml.safe_load_all(text) if d]


def _metric_names(expr: str) -> set[str]:
    """Identifiers of ``expr`` that are neither PromQL words nor label names nor inside strings."""
    stripped = re.sub(r'"[^"]*"', "", expr)
    stripped = re.sub(r"\{[^}]*\}", "", stripped)  # label matchers
    stripped = re.sub(r"\b(by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", "", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)  # range selectors
    stripped = re.sub(r"\boffset\s+[0-9smhdwy]+", "", stripped)
    stripped = re.sub(r"\$\w+", "", stripped)  # dashboard variables
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped))
    return words - PROMQL_WORDS


# ---- the metric table ----------------------------------------------------------------------------


def test_metric_names_follow_prometheus_conventions():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert re.fullmatch(r"jaxrec_[a-z][a-z0-9_]*", m.name), m.name
        assert m.kind in {"gauge", "counter"}, m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), f"{m.name}: only counters end in _total"
        if "seconds" in m.help.lower() or "unix time" in m.help.lower() or "duration" in m.help.lower():
            assert m.name.endswith("_seconds"), f"{m.name}: a time in seconds must end in _seconds"
        assert not re.search(r"_(ms|milliseconds|minutes|hours)\b", m.name), m.name
        assert set(m.labels) <= ALLOWED_LABELS, m.name
        assert "run_id" in m.labels, m.name
        if m.scope == "worker":
            assert m.labels == ("run_id", "attempt", "process_index"), m.name
        else:
            assert m.scope == "run"
            assert "process_index" not in m.labels, m.name


def test_argo_prefix_applies_to_run_metrics_only():
    assert ARGO_PREFIX == "argo_workflows_"
    assert exposed_name("jaxrec_failures_total", argo=True) == "argo_workflows_jaxrec_failures_total"
    assert exposed_name("jaxrec_failures_total", argo=False) == "jaxrec_failures_total"
    assert exposed_name("jaxrec_train_step", argo=True) == "jaxrec_train_step"
    with pytest.raises(KeyError):
        exposed_name("jaxrec_not_a_metric", argo=True)


def test_monitoring_doc_metric_table_is_current():
    doc = (ROOT / "docs" / "MONITORING.md").read_text()
    assert monitoring.DOC_BEGIN in doc and monitoring.DOC_END in doc
    current = doc.split(monitoring.DOC_BEGIN, 1)[1].split(monitoring.DOC_END, 1)[0].strip()
    expected = monitoring.metric_table_markdown()
    assert current == expected, (
        "docs/MONITORING.md metric table is stale; replace the text between the markers with:\n" + expected
    )
    for m in METRICS:
        assert f"`{m.name}`" in current


def test_monitoring_doc_links_every_runbook_section_the_rules_use():
    doc = (ROOT / "docs" / "MONITORING.md").read_text()
    cfg = _cfg(GKE_CONFIGS[0])
    for rule in [*monitoring.worker_alerts(cfg), *monitoring.run_alerts(cfg)]:
        assert f"`{rule.alert}`" in doc, f"{rule.alert} is not documented"
    for section in RUNBOOK_SECTIONS:
        assert f"RUNBOOK.md#{section}" in doc, section


def test_every_runbook_link_lands_on_an_anchor_of_the_runbook():
    """The alerts' runbook URLs and the monitoring doc's links name anchors the runbook has (a heading's slug or
    an ``id``), so that a paged engineer lands on the class's row, not the top of the page."""
    runbook = (ROOT / "docs" / "RUNBOOK.md").read_text()
    slugs = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", runbook, re.M)
    }
    anchors = slugs | set(re.findall(r'<a id="([\w-]+)"></a>', runbook))
    doc = (ROOT / "docs" / "MONITORING.md").read_text()
    linked = set(re.findall(r"RUNBOOK\.md#([\w-]+)", doc)) | set(RUNBOOK_SECTIONS)
    assert linked and not linked - anchors, sorted(linked - anchors)


# ---- rendering and manifests ---------------------------------------------------------------------


def test_local_config_renders_nothing():
    local = [p for p in CONFIGS if _cfg(p).slice.is_cpu]
    assert local, "the repository has a local config"
    for p in local:
        assert monitoring.render_monitoring(_cfg(p), p.stem) == {}


@pytest.mark.parametrize("path", GKE_CONFIGS, ids=lambda p: p.stem)
def test_render_is_deterministic_and_named_after_the_config(path):
    cfg = _cfg(path)
    first = monitoring.render_monitoring(cfg, path.stem)
    assert set(first) == {
        f"{path.stem}.monitoring.yaml",
        f"{path.stem}.rules.yaml",
        f"{path.stem}.dashboard.json",
    }
    assert monitoring.render_monitoring(_cfg(path), path.stem) == first


@pytest.mark.parametrize("path", GKE_CONFIGS, ids=lambda p: p.stem)
def test_manifests_validate_against_the_crd_shapes(path):
    cfg = _cfg(path)
    docs = _manifests(cfg, path.stem)
    assert [d["kind"] for d in docs] == ["PodMonitoring", "Rules", "ClusterRules"]
    for d in docs:
        _validate(d)
    pm = docs[0]
    assert pm["metadata"]["namespace"] == cfg.namespace
    assert pm["spec"]["selector"] == {"matchLabels": {"jaxrec/run-id": cfg.run_id}}
    (endpoint,) = pm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["interval"] == f"{cfg.monitoring.scrape_interval_s}s"
    assert docs[1]["metadata"]["namespace"] == cfg.namespace
    assert "namespace" not in docs[2]["metadata"]


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: d["spec"].__setitem__("endpoint", d["spec"].pop("endpoints")), id="spec.endpoint"),
        pytest.param(lambda d: d["spec"]["endpoints"][0].__setitem__("intervall", "15s"), id="endpoint.intervall"),
        pytest.param(lambda d: d["spec"]["endpoints"][0].pop("port"), id="endpoint without port"),
        pytest.param(lambda d: d["spec"]["endpoints"][0].__setitem__("scheme", "tcp"), id="scheme tcp"),
        pytest.param(lambda d: d["spec"]["endpoints"][0].__setitem__("interval", "15"), id="interval no unit"),
        pytest.param(lambda d: d["spec"]["selector"].__setitem__("matchLabel", {}), id="selector.matchLabel"),
        pytest.param(lambda d: d.__setitem__("apiVersion", "monitoring.coreos.com/v1"), id="apiVersion"),
        pytest.param(lambda d: d["metadata"].pop("namespace"), id="no namespace"),
    ],
)
def test_pod_monitoring_schema_rejects_typos(mutate):
    pm = _manifests(_cfg(GKE_CONFIGS[0]))[0]
    bad = copy.deepcopy(pm)
    mutate(bad)
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: d["spec"]["groups"][0]["rules"][0].__setitem__("expression", "1"), id="rule.expression"),
        pytest.param(lambda d: d["spec"]["groups"][0].pop("interval"), id="group without interval"),
        pytest.param(lambda d: d["spec"]["groups"][0]["rules"][0]["labels"].__setitem__("n", 1), id="int label"),
        pytest.param(lambda d: d["spec"].__setitem__("group", []), id="spec.group"),
    ],
)
def test_rules_schema_rejects_typos(mutate):
    for doc in _manifests(_cfg(GKE_CONFIGS[0]))[1:]:
        bad = copy.deepcopy(doc)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            _validate(bad)


# ---- alert rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", GKE_CONFIGS, ids=lambda p: p.stem)
def test_rule_resources_and_plain_rules_hold_the_same_rules(path):
    cfg = _cfg(path)
    files = monitoring.render_monitoring(cfg, path.stem)
    plain = yaml.safe_load(files[f"{path.stem}.rules.yaml"])
    crd_groups = [g for d in _manifests(cfg, path.stem)[1:] for g in d["spec"]["groups"]]
    assert plain["groups"] == crd_groups
    alerts = [r["alert"] for g in crd_groups for r in g["rules"]]
    backup = ["JaxrecGcsBackupLag"] if cfg.checkpoint.local.enabled else []  # only with the local tiers
    assert alerts == [
        "JaxrecCheckpointLag",
        "JaxrecNoStep",
        "JaxrecWorkersBelowExpected",
        "JaxrecRunUnsupervised",
        *backup,
        "JaxrecRepeatedFailures",
        "JaxrecBudgetExhausted",
        "JaxrecRunFailed",
    ]
    for g in crd_groups:
        for r in g["rules"]:
            assert r["labels"]["severity"] in {"warning", "critical"}
            assert set(r["annotations"]) == {"summary", "description", "runbook"}
            anchor = r["annotations"]["runbook"].removeprefix("docs/RUNBOOK.md#")
            assert anchor in RUNBOOK_SECTIONS | {"{{ $labels.class }}"}, anchor
            if anchor == "{{ $labels.class }}":
                assert "class" in r["expr"], "a per-class runbook link needs the class label"
            assert f'run_id="{cfg.run_id}"' in r["expr"], "every rule is scoped to its run"
            names = _metric_names(r["expr"])
            assert names, r["expr"]
            assert names <= SCRAPED_NAMES, names - SCRAPED_NAMES


def test_rule_thresholds_come_from_the_config():
    path = GKE_CONFIGS[0]
    cfg = _variant(path, recovery_window_steps=777, no_step_alert_minutes=13, repeated_failures_threshold=4)
    exprs = {r["alert"]: r["expr"] for g in monitoring.prometheus_rules(cfg)["groups"] for r in g["rules"]}
    assert exprs["JaxrecCheckpointLag"].endswith("> 777")
    assert "> 780" in exprs["JaxrecNoStep"]
    assert exprs["JaxrecRepeatedFailures"].endswith(">= 4")
    assert "increase(argo_workflows_jaxrec_failures_total" in exprs["JaxrecRepeatedFailures"]
    assert "[1h]" in exprs["JaxrecRepeatedFailures"]


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (CI installs it; locally: apt-get install prometheus)")
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _write_rules_and_tests(tmp_path: Path, rules_cfg: JobConfig, tests_cfg: JobConfig, stem: str) -> None:
    (tmp_path / f"{stem}.rules.yaml").write_text(monitoring.render_monitoring(rules_cfg, stem)[f"{stem}.rules.yaml"])
    (tmp_path / f"{stem}.test.yaml").write_text(promtool.render_rule_tests(tests_cfg, stem))


VARIANTS = [
    pytest.param({}, id="as-configured"),
    pytest.param({"repeated_failures_threshold": 1, "no_step_alert_minutes": 1}, id="threshold-1"),
    pytest.param({"repeated_failures_threshold": 2, "recovery_window_steps": 1}, id="threshold-2"),
    pytest.param({"repeated_failures_threshold": 6, "no_step_alert_minutes": 75}, id="long"),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", GKE_CONFIGS, ids=lambda p: p.stem)
def test_promtool_checks_and_tests_the_rules(tmp_path, path, variant):
    cfg = _variant(path, **variant)
    _write_rules_and_tests(tmp_path, cfg, cfg, path.stem)
    check = _promtool("check", "rules", f"{path.stem}.rules.yaml", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = 7 + (1 if cfg.checkpoint.local.enabled else 0)  # JaxrecGcsBackupLag with the local tiers
    assert f"SUCCESS: {rules} rules found" in check.stdout
    test = _promtool("test", "rules", f"{path.stem}.test.yaml", cwd=tmp_path)
    assert test.returncode == 0, test.stdout + test.stderr


@pytest.mark.parametrize(
    ("change", "failing_alert"),
    [
        ({"recovery_window_steps": 10_000}, "JaxrecCheckpointLag"),
        ({"no_step_alert_minutes": 120}, "JaxrecNoStep"),
        ({"repeated_failures_threshold": 50}, "JaxrecRepeatedFailures"),
    ],
)
def test_promtool_tests_fail_when_rules_miss_the_threshold(tmp_path, change, failing_alert):
    path = GKE_CONFIGS[0]
    _write_rules_and_tests(tmp_path, _variant(path, **change), _cfg(path), "job")
    test = _promtool("test", "rules", "job.test.yaml", cwd=tmp_path)
    assert test.returncode != 0
    assert f"alertname: {failing_alert}" in test.stdout + test.stderr


@pytest.mark.parametrize("path", GKE_CONFIGS, ids=lambda p: p.stem)
def test_committed_promtool_files_are_current(path):
    """tests/promtool/ holds the rules and their tests per config, for running promtool by hand."""
    regen = ".venv/bin/python tests/support/promtool.py configs/<gke configs>"
    for name, text in promtool.committed(_cfg(path), path.stem).items():
        assert (promtool.FOLDER / name).exists(), f"missing; regenerate with: {regen}"
        assert (promtool.FOLDER / name).read_text() == text, f"stale: {regen}"


# ---- dashboard --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", GKE_CONFIGS, ids=lambda p: p.stem)
def test_dashboard_has_the_panels_and_uses_only_table_metrics(path):
    cfg = _cfg(path)
    board = json.loads(monitoring.render_monitoring(cfg, path.stem)[f"{path.stem}.dashboard.json"])
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["run_id"]["multi"] is True
    assert variables["run_id"]["current"]["value"] == [cfg.run_id]
    rows = [p for p in board["panels"] if p["type"] == "row"]
    assert len(rows) == 1 and rows[0]["repeat"] == "run_id"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    titles = [p["title"] for p in panels]
    for wanted in [
        "Training step",
        "Checkpoint step",
        "Checkpoint age",
        "Checkpoint duration",
        "Active vs expected workers",
        "Job status",
        "Attempts (restart count + 1)",
        "Last failure class and reason",
        "Recovery duration",
        "Time since last successful step",
    ]:
        assert wanted in titles, wanted
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    used = set()
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert '$run_id"' in t["expr"], f"{p['title']}: not filtered by the row's run"
            names = _metric_names(t["expr"])
            assert names and names <= SCRAPED_NAMES, (p["title"], names - SCRAPED_NAMES)
            used |= names
    query = variables["run_id"]["query"]["query"]
    assert _metric_names(query.replace("label_values", "").replace("run_id", "")) <= SCRAPED_NAMES
    workers = next(p for p in panels if p["title"] == "Active vs expected workers")
    assert {t["legendFormat"] for t in workers["targets"]} == {"active", "expected"}


def test_metric_name_check_catches_unknown_names():
    assert _metric_names('max by (run_id) (jaxrec_train_stepp{run_id="x"})') == {"jaxrec_train_stepp"}
    assert _metric_names('increase(argo_workflows_jaxrec_failures_total{run_id="x"}[1h]) >= 3') == {
        "argo_workflows_jaxrec_failures_total"
    }
