"""Every exchanged document is one typed record; every step's outputs are declared once."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from jaxrec.adapters.documents import read_run_config, read_worker_reports
from jaxrec.adapters.store import DocumentError, RunLayout, RunStore
from jaxrec.model import records
from jaxrec.model.config import load_config
from jaxrec.model.contract import (
    AttemptOutcome,
    Backend,
    Decision,
    FailureClass,
    FinalStatus,
    SkipKind,
    StallKind,
)
from jaxrec.model.outputs import STEP_OUTPUTS, ClassifyOutputs, RestoreOutputs, SegmentOutputs
from workflows.templates import build_workflow

RUN = "docs-run"


@pytest.fixture
def store(tmp_path) -> RunStore:
    return RunStore(str(tmp_path), RUN)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"null", "expected a JSON object, found NoneType"),
        (b"[]", "expected a JSON object, found list"),
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b'{"run_id": "docs-run", "attempts": "many"}', "attempts: Input should be a valid list"),
        (b'{"run_id": "docs-run", "surprise": 1}', "surprise: Extra inputs are not permitted"),
        (b'{"run_id": "another-run", "attempts": []}', "belongs to run 'another-run', not 'docs-run'"),
        # One record per attempt, in order; a stored ledger always lists its attempts (an absent list is no reset).
        (b'{"run_id": "docs-run"}', "no 'attempts' list"),
        (
            b'{"run_id": "docs-run", "attempts": [{"attempt": 1, "outcome": "failed"}, {"attempt": 1, "outcome": '
            b'"failed"}]}',
            "attempts: attempt 1 is recorded twice",
        ),
        (
            b'{"run_id": "docs-run", "attempts": [{"attempt": 2, "outcome": "failed"}, {"attempt": 1, "outcome": '
            b'"failed"}]}',
            "attempts: attempt 1 is recorded after attempt 2",
        ),
    ],
)
def test_a_damaged_ledger_is_one_line_naming_the_file(store, body, says):
    store.write_bytes(RunLayout.LEDGER, body)
    with pytest.raises(DocumentError) as e:
        store.read_record(RunLayout.LEDGER, records.Ledger)
    line = str(e.value)
    assert "\n" not in line and line.startswith(store.url(RunLayout.LEDGER) + ": unreadable ledger")
    assert says in line


def test_records_round_trip_through_their_paths(store):
    rec = records.RestoreRecord(
        attempt=2,
        run_id=RUN,
        config_hash="h",
        exit_code=0,
        restore_step=30,
        restore_path=store.url(RunLayout.checkpoint(30)),
        decided_at=1.0,
    )
    store.write_record(RunLayout.restore_record(2), rec)
    assert store.read_record(RunLayout.restore_record(2), records.RestoreRecord) == rec
    reason = records.QuarantineReason(step=5, from_="x", kind="manifest", reason="r", attempt=1, objects=3, moved_at=2)
    store.write_record(RunLayout.quarantine_reason("quarantine/5"), reason)
    assert json.loads(store.read_bytes("quarantine/5/QUARANTINE_REASON.json"))["from"] == "x"
    assert store.read_record(RunLayout.quarantine_reason("quarantine/5"), records.QuarantineReason) == reason
    assert store.read_record(RunLayout.provision_record(9), records.ProvisionRecord) is None


def test_closed_vocabularies_read_the_documents_written_before_they_were_enums(store):
    # The values are the interface: a document stored as plain strings reads into the enums and is written back
    # with the same strings.
    sup = (
        b'{"attempt": 1, "jobset": "js", "outcome": "stalled", "stall_kind": "image-pull", "reason": "r", '
        b'"detected_at": 1.0}'
    )
    store.write_bytes(RunLayout.supervision(1), sup)
    rec = store.read_record(RunLayout.supervision(1), records.SupervisionRecord)
    assert (rec.outcome, rec.stall_kind) == (AttemptOutcome.STALLED, StallKind.IMAGE_PULL) and rec.decided
    assert json.loads(rec.model_dump_json())["stall_kind"] == "image-pull"
    ledger = (
        b'{"run_id": "docs-run", "final_status": "Failed", "attempts": [{"attempt": 0, "outcome": "failed", '
        b'"backend": "gke"}], "hand_overs": [{"from_workflow": "a", "from_uid": "u", "to_workflow": "b", '
        b'"to_uid": "v", "next_attempt": 1, "at": 1.0, "backend": "local"}]}'
    )
    store.write_bytes(RunLayout.LEDGER, ledger)
    led = store.read_record(RunLayout.LEDGER, records.Ledger)
    assert led.final_status is FinalStatus.FAILED and led.attempts[0].outcome is AttemptOutcome.FAILED
    assert (led.attempts[0].backend, led.hand_overs[0].backend) == (Backend.GKE, Backend.LOCAL)
    assert json.loads(led.model_dump_json(exclude_defaults=True)) == json.loads(ledger)
    skipped = records.SkippedStep.model_validate_json(
        b'{"step": 5, "name": "5", "reason": "r", "kind": "non-canonical-name", "quarantined": false}'
    )
    assert skipped.kind is SkipKind.NAME
    event = records.WorkerEvent.model_validate_json(
        b'{"t": 1.0, "event": "save_committed", "attempt": 0, "process_index": 0, "step": 4}'
    )
    assert event.event is records.EventKind.SAVE_COMMITTED


@pytest.mark.parametrize(
    ("record", "doc", "field"),
    [
        (
            records.SupervisionRecord,
            {"attempt": 1, "jobset": "j", "outcome": "stuck", "reason": "r", "detected_at": 1},
            "outcome",
        ),
        (
            records.SupervisionRecord,
            {"attempt": 1, "jobset": "j", "outcome": "stalled", "stall_kind": "slow", "reason": "r", "detected_at": 1},
            "stall_kind",
        ),
        (records.AttemptRecord, {"attempt": 1, "outcome": "ok"}, "outcome"),
        (records.AttemptRecord, {"attempt": 1, "outcome": "failed", "backend": "aws"}, "backend"),
        (records.WorkerEvent, {"t": 1, "event": "steps", "attempt": 0, "process_index": 0}, "event"),
    ],
)
def test_a_value_outside_a_closed_vocabulary_is_refused_naming_the_field(record, doc, field):
    with pytest.raises(ValidationError) as e:
        record.model_validate(doc)
    assert [err["loc"] for err in e.value.errors()] == [(field,)]


_SUBSET_HOLDERS = [
    (
        records.SupervisionRecord.model_validate,
        {"attempt": 1, "jobset": "j", "reason": "r", "detected_at": 1},
        AttemptOutcome.SUPERVISION_OUTCOMES,
    ),
    (records.AttemptRecord.model_validate, {"attempt": 1}, AttemptOutcome.RECORD_OUTCOMES),
    (
        SegmentOutputs.parse,
        {
            "stall-kind": "",
            "reason": "r",
            "last-step": "3",
            "checkpoint-step": "-1",
            "placement": "",
            "restarted-in-place": "",
        },  # fmt: skip
        AttemptOutcome.SUPERVISION_OUTCOMES,
    ),
]


@pytest.mark.parametrize(("validate", "doc", "allowed"), _SUBSET_HOLDERS)
@pytest.mark.parametrize("outcome", [o.value for o in AttemptOutcome])
def test_each_record_holds_only_its_subset_of_the_outcomes(validate, doc, allowed, outcome):
    # One vocabulary, but supervision.json and the outcome output hold no "running" or "stopped", and an
    # attempt's record no "stalled" or "error": those are refused where the record is read, naming the field.
    if outcome in allowed:
        assert validate({**doc, "outcome": outcome}).outcome is AttemptOutcome(outcome)
        return
    with pytest.raises(ValidationError) as e:
        validate({**doc, "outcome": outcome})
    assert [err["loc"] for err in e.value.errors()] == [("outcome",)]
    assert f"no outcome {outcome!r}" in str(e.value)


def test_the_outcome_subsets_cover_the_vocabulary():
    assert AttemptOutcome.SUPERVISOR_VERDICTS == {"succeeded", "failed", "stalled"}
    assert AttemptOutcome.SUPERVISION_OUTCOMES == {"succeeded", "failed", "stalled", "error"}
    assert AttemptOutcome.RECORD_OUTCOMES == {"succeeded", "failed", "running", "stopped"}
    assert AttemptOutcome.SUPERVISION_OUTCOMES | AttemptOutcome.RECORD_OUTCOMES == set(AttemptOutcome)


def test_missing_config_names_the_step_to_run(store):
    with pytest.raises(DocumentError, match="run validate-config first"):
        read_run_config(store)


def test_one_damaged_worker_report_does_not_hide_the_others(store):
    good = records.WorkerExitReport(
        run_id=RUN, attempt=0, process_index=1, process_count=2, exit_code=20, exit_name="PEER_LOST"
    )
    store.write_record(RunLayout.worker_report(0, 1), good)
    store.write_bytes(RunLayout.worker_report(0, 0), b'{"run_id": "docs-run"}')
    reports, problems = read_worker_reports(store, 0)
    assert reports == [good]
    assert len(problems) == 1 and "0.json: unreadable worker exit report" in problems[0]


def test_store_lists_steps_and_attempts(store):
    for rel in (
        "checkpoints/20/a",
        "checkpoints/3/a",
        "checkpoints/7.orbax-checkpoint-tmp/a",
        "attempts/0/x",
        "attempts/11/x",
        "attempts/notes/x",
    ):
        store.write_bytes(rel, b"1")
    assert store.checkpoint_steps() == [3, 20]
    assert store.attempts() == [0, 11]


def test_outputs_round_trip_and_render_as_argo_reads_them(tmp_path):
    o = ClassifyOutputs(
        failure_class=FailureClass.HANG,
        decision=Decision.RETRY,
        reason="r",
        backoff_seconds=4,
        backoff_wait="1500ms",
        attempts_by_class={"hang": 1},
        next_attempt=3,
        budget_exhausted=False,
    )
    o.write(tmp_path)
    assert (tmp_path / "decision").read_text() == "retry" and (tmp_path / "backoff-wait").read_text() == "1500ms"
    assert (tmp_path / "budget-exhausted").read_text() == "0"
    assert (tmp_path / "attempts-by-class").read_text() == '{"hang": 1}'
    assert ClassifyOutputs.read(tmp_path) == o
    r = RestoreOutputs(restore_step=-1, restore_path="", skipped=[{"step": 5, "name": "5", "reason": "x"}])
    assert RestoreOutputs.parse(r.files()) == r
    # An optional output left unset is an empty file, as a `when` on it expects, and reads back as unset.
    seg = SegmentOutputs(
        outcome="failed",
        stall_kind="",
        reason="r",
        last_step=3,
        checkpoint_step=-1,
        placement="",
        restarted_in_place="",
    )
    assert seg.stall_kind is None and seg.files()["stall-kind"] == "" and SegmentOutputs.parse(seg.files()) == seg
    stalled = seg.model_copy(update={"outcome": AttemptOutcome.STALLED, "stall_kind": StallKind.NODE_LOST})
    assert stalled.files()["stall-kind"] == "node-lost" and SegmentOutputs.parse(stalled.files()) == stalled


@pytest.mark.parametrize("config", ["configs/local-cpu.yaml", "configs/v5e-4x4.yaml"])
def test_templates_declare_exactly_the_outputs_the_steps_write(config):
    wf = build_workflow(load_config(config)).to_dict()
    templates = {t["name"]: t for t in wf["spec"]["templates"]}
    for declared in STEP_OUTPUTS:
        params = templates[declared.TEMPLATE]["outputs"]["parameters"]
        assert [p["name"] for p in params] == declared.names()
        assert all(p["valueFrom"]["path"].endswith("/" + p["name"]) and p["description"] for p in params)
