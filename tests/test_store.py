"""The run store against a local directory and the GCS emulator: documents, conditional writes, listing, moves."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pydantic import BaseModel

from jaxrec.adapters.store import Contended, PreconditionFailed, RunLayout, RunStore


class _Counter(BaseModel):
    n: int = 0


@pytest.fixture
def store(store_root):
    return RunStore(store_root, "run-a")


def test_json_round_trip_and_absent_documents(store):
    assert store.read_json("ledger.json") is None
    assert store.read_json_versioned("ledger.json") == (None, 0)
    store.write_json("ledger.json", {"run_id": "run-a", "attempts": [1, 2]})
    assert store.read_json("ledger.json") == {"run_id": "run-a", "attempts": [1, 2]}
    assert store.exists("ledger.json") and not store.exists("other.json")


def test_write_if_absent_refuses_an_existing_object(store):
    store.write_json("config.json", {"v": 1}, if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        store.write_json("config.json", {"v": 2}, if_generation_match=0)
    assert store.read_json("config.json") == {"v": 1}


def test_two_writers_from_the_same_generation_one_loses(store):
    store.write_json("ledger.json", {"n": 0})
    _, gen_a = store.read_json_versioned("ledger.json")
    _, gen_b = store.read_json_versioned("ledger.json")
    assert gen_a == gen_b != 0
    new_gen = store.write_json("ledger.json", {"n": "a"}, if_generation_match=gen_a)
    assert new_gen != gen_a
    with pytest.raises(PreconditionFailed):
        store.write_json("ledger.json", {"n": "b"}, if_generation_match=gen_b)
    assert store.read_json("ledger.json") == {"n": "a"}
    # The loser re-reads and succeeds on the new generation.
    doc, gen = store.read_json_versioned("ledger.json")
    store.write_json("ledger.json", {"n": doc["n"] + "b"}, if_generation_match=gen)
    assert store.read_json("ledger.json") == {"n": "ab"}


def test_concurrent_read_modify_write_loses_no_update(store):
    store.write_json("counter.json", {"n": 0})
    losses = []

    def bump(times: int) -> None:
        for _ in range(times):
            while True:
                doc, gen = store.read_json_versioned("counter.json")
                try:
                    store.write_json("counter.json", {"n": doc["n"] + 1}, if_generation_match=gen)
                    break
                except PreconditionFailed:
                    losses.append(1)

    threads = [threading.Thread(target=bump, args=(5,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a writer did not finish within 120 s"
    assert store.read_json("counter.json") == {"n": 20}


def test_update_record_decides_again_on_what_won_the_race_and_writes_nothing_when_told(store):
    """A writer that lands between the read and the write makes update_record read and decide again (never
    overwrite); ``mutate`` returning what it read writes nothing; a race lost every time is Contended."""
    seen: list[int | None] = []

    def bump(current):
        seen.append(None if current is None else current.n)
        if len(seen) == 1:  # another writer lands between this read and this write
            store.write_record("counter.json", _Counter(n=10))
        return _Counter(n=(current.n if current else 0) + 1)

    assert store.update_record("counter.json", _Counter, bump).n == 11
    assert seen == [None, 10] and store.read_record("counter.json", _Counter).n == 11
    _, gen = store.read_record_versioned("counter.json", _Counter)
    assert store.update_record("counter.json", _Counter, lambda c: c).n == 11
    assert store.read_record_versioned("counter.json", _Counter)[1] == gen  # nothing written

    def always_beaten(current):
        store.write_record("counter.json", _Counter(n=current.n + 100))
        return _Counter(n=-1)

    pauses: list[int] = []
    with pytest.raises(Contended, match="still contended after 3 tries"):
        store.update_record("counter.json", _Counter, always_beaten, tries=3, pause=pauses.append)
    assert pauses == [0, 1] and store.read_record("counter.json", _Counter).n == 311


def test_list_children_and_url(store):
    for rel in ("checkpoints/10/a.bin", "checkpoints/10/sub/b.bin", "checkpoints/20/c.bin", "ledger.json"):
        store.write_bytes(rel, rel.encode())
    listed = store.list("checkpoints")
    assert [o.name for o in listed] == ["checkpoints/10/a.bin", "checkpoints/10/sub/b.bin", "checkpoints/20/c.bin"]
    assert [o.size for o in listed] == [len(o.name) for o in listed]
    assert store.children("checkpoints") == ["10", "20"]
    assert store.children("checkpoints/10") == ["a.bin", "sub"]
    assert store.children("nothing") == []
    # A prefix is a folder, not a string prefix: "checkpoints/1" does not match "checkpoints/10".
    assert store.list("checkpoints/1") == []
    if store.is_gcs:
        assert store.url("ledger.json") == f"{store.root}/runs/run-a/ledger.json"
    else:
        assert Path(store.url("ledger.json")) == (Path(store.root) / "runs/run-a/ledger.json").resolve()


def test_move_to_quarantine_keeps_every_byte(store):
    files = {"checkpoints/20/a.bin": b"x" * 1000, "checkpoints/20/state/b.bin": b"y" * 10}
    for rel, data in files.items():
        store.write_bytes(rel, data)
    store.write_bytes("checkpoints/10/keep.bin", b"k")

    moved = store.move(RunLayout.checkpoint(20), RunLayout.quarantine(20))

    assert moved == 2
    assert store.list("checkpoints/20") == [] and not store.exists("checkpoints/20")
    assert store.children("checkpoints") == ["10"]
    for rel, data in files.items():
        assert store.read_bytes(rel.replace("checkpoints/", "quarantine/")) == data
    assert store.move("checkpoints/99", "quarantine/99") == 0


def test_a_create_only_record_retried_after_its_own_unseen_success_is_done(store):
    """A create-only write whose first try landed but whose answer was lost (a reset): the retry's precondition
    failure on the very same bytes is success; another document there is refused."""
    from pydantic import BaseModel

    class Doc(BaseModel):
        run_id: str
        step: int

    first = store.create_record("checkpoints/5/manifest.json", Doc(run_id="run-a", step=5))
    assert store.create_record("checkpoints/5/manifest.json", Doc(run_id="run-a", step=5)) == first
    with pytest.raises(PreconditionFailed):
        store.create_record("checkpoints/5/manifest.json", Doc(run_id="run-a", step=6))
    assert store.read_json("checkpoints/5/manifest.json") == {"run_id": "run-a", "step": 5}


def test_a_last_writer_wins_write_takes_another_writers_generation_and_lands(store):
    """Two stores rewrite one record (a supervisor and its replacement): each write is conditional on the generation
    its store last saw, and one that finds another writer's object takes its generation and lands on top."""
    other = RunStore(store.root, store.run_id)
    store.write_json("attempts/0/supervision.json", {"by": "first"})
    other.write_json("attempts/0/supervision.json", {"by": "second"})
    store.write_json("attempts/0/supervision.json", {"by": "first, again"})  # its cached generation is stale
    assert other.read_json("attempts/0/supervision.json") == {"by": "first, again"}
    other.delete("attempts/0/supervision.json")
    store.write_json("attempts/0/supervision.json", {"by": "first, after a delete"})
    assert other.read_json("attempts/0/supervision.json") == {"by": "first, after a delete"}


def test_a_gcs_move_copies_many_objects_at_once_and_deletes_none_before_every_copy_ended(gcs_bucket, monkeypatch):
    """A step is many objects and a restart waits for its torn one to be set aside: the copies overlap (the
    emulator answers each after a delay here), and the first delete comes after the last copy, so a mover cut off
    anywhere leaves every object at least in one place."""
    import os
    import time

    from jaxrec.adapters import store as store_mod

    store = RunStore(f"gs://{gcs_bucket}/move-{os.getpid()}", "run-a")
    names = [f"checkpoints/15/state/chunk-{i}" for i in range(24)]
    for name in names:
        store.write_bytes(name, name.encode())
    log: list[tuple[str, float, float]] = []
    copy, delete = store_mod.GcsBackend.copy, store_mod.GcsBackend.delete

    def timed(kind, real):
        def call(self, *args):
            t0 = time.monotonic()
            time.sleep(0.05)
            out = real(self, *args)
            log.append((kind, t0, time.monotonic()))
            return out

        return call

    monkeypatch.setattr(store_mod.GcsBackend, "copy", timed("copy", copy))
    monkeypatch.setattr(store_mod.GcsBackend, "delete", timed("delete", delete))

    assert store.move(RunLayout.checkpoint(15), RunLayout.quarantine(15)) == len(names)
    copies = [(t0, t1) for kind, t0, t1 in log if kind == "copy"]
    deletes = [(t0, t1) for kind, t0, t1 in log if kind == "delete"]
    overlap = max(sum(1 for a, b in copies if a <= t < b) for t, _ in copies)
    assert overlap > 1, "the copies ran one at a time"
    assert max(t1 for _, t1 in copies) <= min(t0 for t0, _ in deletes)
    assert store.list("checkpoints/15") == []
    assert [store.read_bytes(n.replace("checkpoints/", "quarantine/")) for n in names] == [n.encode() for n in names]
