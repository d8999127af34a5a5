"""A host's part of a step on its local disk: written with its manifest last, checked on load, served to peers."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.local_parts import (
    MANIFEST,
    STATE_BIN,
    TOKEN_HEADER,
    Layout,
    LocalParts,
    PartProblem,
    PartServer,
    Shard,
)
from trainer.local_tier import assemble, host_shards

LAYOUT = Layout("run", "c" * 64, 2, 1, {"data": 2}, "v1")
META = {
    "process_count": 2,
    "local_devices": 1,
    "mesh_shape": {"data": 2},
    "config_hash": "c" * 64,
    "dataset_version": "v1",
    "attempt": 0,
}


def _shards(value: float = 1.0) -> list[Shard]:
    w = np.full((4, 3), value, np.float32)
    return [Shard("['w']", [[0, 4], [0, 3]], "float32", [4, 3], w), Shard("['step']", [], "int32", [], np.int32(7))]


def _write(parts: LocalParts, step: int = 10, part: int = 0, value: float = 1.0) -> None:
    parts.write(step, part, _shards(value), {"next_index": step}, META)


def test_a_part_round_trips_with_its_data_position(tmp_path):
    parts = LocalParts(tmp_path, "run", "n0")
    _write(parts)
    got = parts.load(10, 0, LAYOUT)
    w = got.shards[("['w']", ((0, 4), (0, 3)))]
    assert np.array_equal(np.frombuffer(w.data, np.float32).reshape(w.shape), np.ones((4, 3), np.float32))
    assert got.data_state == {"next_index": 10}
    m = parts.manifest(10, 0)
    assert (m.step, m.process_index, m.node) == (10, 0, "n0")
    assert {f.path for f in m.files} == {"state.bin", "state.json", "data.json"}
    assert all(f.sha256 and f.crc32c for f in m.files)


def test_a_flipped_byte_of_the_same_size_is_refused_on_load(tmp_path):
    parts = LocalParts(tmp_path, "run", "n0")
    _write(parts)
    f = parts.part_dir(10, 0) / STATE_BIN
    data = bytearray(f.read_bytes())
    data[5] ^= 0xFF
    f.write_bytes(bytes(data))
    parts.check(10, 0, LAYOUT)  # metadata alone cannot see it
    with pytest.raises(PartProblem, match="state.bin: checksum mismatch"):
        parts.load(10, 0, LAYOUT)


def test_a_part_of_another_config_or_layout_is_refused_with_what_differs(tmp_path):
    parts = LocalParts(tmp_path, "run", "n0")
    _write(parts)
    other = Layout("run", "d" * 64, 4, 1, {"data": 4}, "v1")
    with pytest.raises(PartProblem) as e:
        parts.check(10, 0, other)
    assert "config hash" in str(e.value) and "process count 2 (this run: 4)" in str(e.value)


def test_a_part_without_its_manifest_does_not_exist(tmp_path):
    parts = LocalParts(tmp_path, "run", "n0")
    _write(parts)
    (parts.part_dir(10, 0) / MANIFEST).unlink()
    assert list(parts.complete()) == []
    with pytest.raises(PartProblem, match="no part 0 of step 10"):
        parts.load(10, 0, LAYOUT)


def test_a_truncated_file_is_refused_from_metadata(tmp_path):
    parts = LocalParts(tmp_path, "run", "n0")
    _write(parts)
    f = parts.part_dir(10, 0) / STATE_BIN
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(PartProblem, match="size"):
        parts.check(10, 0, LAYOUT)


def test_gc_keeps_the_newest_steps_of_each_part(tmp_path):
    parts = LocalParts(tmp_path, "run", "n0")
    for step in (2, 4, 6):
        _write(parts, step, 0)
        _write(parts, step, 1)
    parts.gc(keep=2)
    assert sorted(parts.complete()) == [(4, 0), (4, 1), (6, 0), (6, 1)]


def test_a_peer_copies_a_part_over_http_and_checks_it(tmp_path):
    src = LocalParts(tmp_path / "a", "run", "n0")
    _write(src, value=3.0)
    server = PartServer(src, "tok", "127.0.0.1")
    try:
        dst = LocalParts(tmp_path / "b", "run", "n1")
        assert dst.fetch(server.address, "tok", 10, 0, LAYOUT) > 0
        m = dst.manifest(10, 0)
        assert (m.node, m.copied_to) == ("n0", "n1")
        assert dst.load(10, 0, LAYOUT).data_state == {"next_index": 10}
        with pytest.raises(PartProblem, match="no manifest"):
            dst.fetch(server.address, "wrong", 10, 0, LAYOUT)
        with pytest.raises(PartProblem, match="no manifest"):
            dst.fetch(server.address, "tok", 12, 0, LAYOUT)
    finally:
        server.close()


def test_the_part_server_serves_nothing_but_part_files(tmp_path):
    src = LocalParts(tmp_path / "a", "run", "n0")
    _write(src)
    (tmp_path / "a" / "secret").write_text("x")
    server = PartServer(src, "tok", "127.0.0.1")
    try:
        for path in ("/../../secret", "/10/part-0/../../../../secret", "/10/part-0/other", "/"):
            req = urllib.request.Request(f"http://{server.address}{path}", headers={TOKEN_HEADER: "tok"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 404
        req = urllib.request.Request(f"http://{server.address}/10/part-0/data.json", headers={TOKEN_HEADER: "tok"})
        assert json.loads(urllib.request.urlopen(req, timeout=5).read()) == {"next_index": 10}
    finally:
        server.close()


def test_a_copy_damaged_in_transit_is_not_kept(tmp_path):
    src = LocalParts(tmp_path / "a", "run", "n0")
    _write(src)
    f = src.part_dir(10, 0) / STATE_BIN
    data = bytearray(f.read_bytes())
    data[0] ^= 1
    f.write_bytes(bytes(data))
    server = PartServer(src, "tok", "127.0.0.1")
    try:
        dst = LocalParts(tmp_path / "b", "run", "n1")
        with pytest.raises(PartProblem, match="another checksum"):
            dst.fetch(server.address, "tok", 10, 0, LAYOUT)
        assert list(dst.complete()) == []
    finally:
        server.close()


def test_the_state_round_trips_through_a_part_in_its_shardings(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    state = {
        "w": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), sharded),
        "step": jax.device_put(jnp.int32(5), NamedSharding(mesh, P())),
    }
    parts = LocalParts(tmp_path, "run", "n0")
    parts.write(5, 0, host_shards(state), {}, META)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    got = assemble(parts.load(5, 0, LAYOUT), abstract)
    assert got["w"].dtype == jnp.bfloat16 and np.array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
    assert int(got["step"]) == 5 and got["w"].sharding == sharded
    wrong = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharded)}
    with pytest.raises(PartProblem, match="no shard"):
        assemble(parts.load(5, 0, LAYOUT), wrong)


class FakeKV:
    """The coordination service's key-value calls the local tier makes (jax's distributed client): a key is set
    once, a blocking get waits for it until its timeout."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            if key in self.values:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    def key_value_delete(self, key: str) -> None:
        with self.changed:
            self.values.pop(key, None)


def _gang_of_two(tmp_path, monkeypatch, kv: FakeKV) -> list:
    """The local tiers of processes 0 and 1 of one attempt, a part every step and one peer copy each."""
    from types import SimpleNamespace

    from trainer import local_tier

    cfg = SimpleNamespace(
        run_id="run",
        checkpoint=SimpleNamespace(local=SimpleNamespace(interval_steps=1, keep=4, peers=1, directory="/unused")),
        training=SimpleNamespace(init_timeout_s=5, total_steps=100),
    )
    monkeypatch.setattr(local_tier.jax, "process_count", lambda: 2)
    tiers = []
    for i in range(2):
        monkeypatch.setattr(local_tier.jax, "process_index", lambda i=i: i)
        env = {"TRAINER_LOCAL_DIR": str(tmp_path / f"n{i}"), "NODE_NAME": f"n{i}"}
        tiers.append(local_tier.LocalTier(cfg, None, 0, kv, env, LAYOUT))
    for t in tiers:
        t.addresses = {i: u.server.address for i, u in enumerate(tiers)}
    return tiers


def test_a_host_that_skips_a_local_save_says_so_and_its_peer_does_not_wait_for_the_part(tmp_path, monkeypatch):
    import concurrent.futures

    from trainer import local_tier

    kv = FakeKV()
    a, b = _gang_of_two(tmp_path, monkeypatch, kv)
    try:
        state = {"w": jnp.arange(6.0).reshape(2, 3)}
        for t in (a, b):
            assert t.save(1, state, {"next_index": 1})
        for t in (a, b):
            t._pending.result(timeout=10)
        # Each host holds its own part of step 1 and its peer's copy of the other.
        assert sorted(a.parts.complete()) == sorted(b.parts.complete()) == [(1, 0), (1, 1)]

        b._pending = concurrent.futures.Future()  # b's save of step 1 still runs when step 2 is due
        assert not b.save(2, state, {"next_index": 2})
        assert kv.values["jaxrec/tier/0/saved/2/1"] == local_tier.SKIPPED
        assert a.save(2, state, {"next_index": 2})
        a._pending.result(timeout=10)  # not PEER_WAIT_S: b said at once that part 1 of step 2 will not come
        assert (2, 0) in a.parts.complete() and (2, 1) not in a.parts.complete()
        assert b.skipped_saves == 1
    finally:
        for t in (a, b):
            t.server.close()
            t._saver.shutdown(wait=False, cancel_futures=True)


def test_a_host_keeps_only_its_newest_announcements(tmp_path, monkeypatch):
    from trainer import local_tier

    kv = FakeKV()
    a, b = _gang_of_two(tmp_path, monkeypatch, kv)
    try:
        for step in range(1, 12):
            a._announce(step, local_tier.SKIPPED if step % 2 else local_tier.SAVED)
        mine = sorted(
            int(k.split("/")[4]) for k in kv.values if k.startswith("jaxrec/tier/0/saved/") and k[-2:] == "/0"
        )
        assert mine == list(range(12 - local_tier.ANNOUNCEMENTS_KEPT, 12))
    finally:
        for t in (a, b):
            t.server.close()
