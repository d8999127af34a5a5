"""A host's part of a step on its local disk: written with its manifest last, checked on load, served to peers."""

from __future__ import annotations

import json
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
