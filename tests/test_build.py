"""`python -m workflows.build`: deterministic output, --check on stale files, bad configs, the extra-manifest hook."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from hera.workflows import Task
from pydantic import create_model

from jaxrec.model.config import load_config
from jaxrec.model.outputs import ClassifyOutputs, ProvisionOutputs, StepOutputs, UndeclaredOutput
from workflows import build, templates

REPO = Path(__file__).resolve().parents[1]


def _run(*args, **kw):
    out = io.StringIO()
    code = build.run(*args, out=out, **kw)
    return code, out.getvalue()


def test_committed_argo_folder_is_up_to_date():
    code, text = _run(REPO / "configs", REPO / "argo", check=True)
    assert code == 0, f"argo/ is stale; run `python -m workflows.build`:\n{text}"


def test_build_is_deterministic_and_check_names_stale_files(tmp_path):
    out = tmp_path / "argo"
    assert _run(REPO / "configs", out)[0] == 0
    first = {p.name: p.read_text() for p in out.iterdir()}
    gke = ("v5e-4x4", "v5p-64", "v6e-8x8")
    monitoring = {f"{s}.{kind}" for s in gke for kind in ("monitoring.yaml", "rules.yaml", "dashboard.json")}
    local = ("local-cpu.yaml", "local-image-classifier.yaml", "local-tiers.yaml", "local-tpu.yaml")
    assert set(first) == {*local, *(f"{s}.yaml" for s in gke), "rbac.yaml", *monitoring}
    assert all("creationTimestamp" not in t for t in first.values())
    shutil.rmtree(out)
    assert _run(REPO / "configs", out)[0] == 0
    assert {p.name: p.read_text() for p in out.iterdir()} == first
    assert _run(REPO / "configs", out, check=True)[0] == 0

    (out / "v5e-4x4.yaml").write_text(first["v5e-4x4.yaml"].replace("limit: 20", "limit: 21", 1))
    (out / "rbac.yaml").unlink()
    (out / "old-job.yaml").write_text("kind: Workflow\n")
    code, text = _run(REPO / "configs", out, check=True)
    assert code == 1
    assert "v5e-4x4.yaml" in text and "rbac.yaml" in text and "old-job.yaml" in text
    assert "local-cpu.yaml" not in text
    # --check writes nothing; a build repairs all three.
    assert not (out / "rbac.yaml").exists()
    assert _run(REPO / "configs", out)[0] == 0
    assert {p.name: p.read_text() for p in out.iterdir()} == first


def test_main_check_exit_code(tmp_path):
    shutil.copy(REPO / "configs" / "local-cpu.yaml", tmp_path / "local-cpu.yaml")
    out = tmp_path / "argo"
    assert build.main(["--configs", str(tmp_path), "--out", str(out), "--check"]) == 1
    assert build.main(["--configs", str(tmp_path), "--out", str(out)]) == 0
    assert build.main(["--configs", str(tmp_path), "--out", str(out), "--check"]) == 0


def test_bad_config_prints_its_problems_and_exits_2(tmp_path):
    (tmp_path / "bad.yaml").write_text(
        "run_id: Bad_Run\nimage: x\nslice: {accelerator: v5e, topology: 3x3}\nstorage: {root: /tmp/s}\nmodle: {}\n"
    )
    out = tmp_path / "argo"
    code, text = _run(tmp_path, out)
    assert code == 2
    assert "invalid config" in text and "bad.yaml" in text
    assert "run_id" in text and "slice.topology" in text and "modle: unknown key" in text
    assert "Traceback" not in text
    assert not out.exists()


def test_extra_renderers_write_next_to_the_workflow(tmp_path):
    def render(cfg, stem):
        return {} if cfg.slice.is_cpu else {f"{stem}.extra.yaml": f"run: {cfg.run_id}\n"}

    out = tmp_path / "argo"
    assert _run(REPO / "configs", out, extra_renderers=[render])[0] == 0
    assert (out / "v5e-4x4.extra.yaml").read_text() == "run: lm-v5e-4x4\n"
    assert not (out / "local-cpu.extra.yaml").exists()
    assert _run(REPO / "configs", out, extra_renderers=[render], check=True)[0] == 0
    # Without the renderer those files are no longer generated: stale.
    code, text = _run(REPO / "configs", out, check=True)
    assert code == 1 and "v5e-4x4.extra.yaml" in text and "v5e-4x4.monitoring.yaml" in text


def _renamed(declared: type[StepOutputs], old: str, new: str) -> type[StepOutputs]:
    """``declared`` with output ``old`` renamed to ``new``, as a change to jaxrec/model/outputs.py would rename it."""
    fields = {(new if n == old else n): (f.annotation, f) for n, f in declared.model_fields.items()}
    renamed = create_model(declared.__name__, __base__=StepOutputs, **fields)
    renamed.TEMPLATE = declared.TEMPLATE
    return renamed


def test_an_output_renamed_in_its_declaration_fails_the_build_naming_it(tmp_path, monkeypatch):
    shutil.copy(REPO / "configs" / "local-cpu.yaml", tmp_path / "local-cpu.yaml")
    monkeypatch.setattr(templates, "ClassifyOutputs", _renamed(ClassifyOutputs, "next_attempt", "next_attempt_no"))
    out = tmp_path / "argo"
    code, text = _run(tmp_path, out)
    assert code == 2 and "Traceback" not in text and len(text.splitlines()) == 1, text
    assert text.startswith("workflow wiring: ClassifyOutputs (classify-failure) declares no output 'next_attempt';")
    assert "next_attempt_no" in text
    assert not out.exists()
    assert build.main(["--configs", str(tmp_path), "--out", str(out), "--check"]) == 2


def test_a_misspelled_or_misplaced_output_reference_raises_at_build_time():
    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    classify = Task(name="classify-failure", template=templates.classify_template(cfg))
    assert templates.output_of(classify, ClassifyOutputs, "next_attempt") == (
        "{{tasks.classify-failure.outputs.parameters.next-attempt}}"
    )
    with pytest.raises(UndeclaredOutput, match="declares no output 'next_atempt'; declared: failure_class, "):
        templates.output_of(classify, ClassifyOutputs, "next_atempt")
    # The declaration of another step: its names are not this task's outputs.
    with pytest.raises(UndeclaredOutput, match="runs template 'classify-failure', not 'provision-slice'"):
        templates.output_of(classify, ProvisionOutputs, "jobset_name")
    with pytest.raises(UndeclaredOutput, match="declares no output 'failure-class'"):
        templates.own_output(ClassifyOutputs, "failure-class")  # the parameter's name, not the field's
