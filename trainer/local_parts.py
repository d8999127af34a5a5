"""One host's part of a step on a host-local disk: written, checked, listed, served to peers and fetched from them.

The part's files, its manifest and what counts as a copy: docs/CHECKPOINTS.md ("Local and peer tiers"). Nothing is
fsynced: a copy torn by a host crash fails its check and is not used. Peers copy parts over HTTP from a small
read-only server each host runs beside training (as orbax's p2p manager serves its local shards over TCP:
google/orbax, checkpoint/orbax/checkpoint/experimental/emergency/p2p), on ``POD_IP`` (loopback when unset), only to
requests carrying the gang's token (a random value process 0 hands out through the coordination service).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import os
import re
import shutil
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
from pydantic import ValidationError

from jaxrec.model.records import LocalPartManifest, ManifestFile, now

log = logging.getLogger(__name__)

STATE_BIN, STATE_INDEX, DATA_FILE, MANIFEST = "state.bin", "state.json", "data.json", "manifest.json"
CHUNK = 1 << 20
FETCH_TIMEOUT_S = 60.0
_PART_NAME = re.compile(r"^part-(\d+)$")
_URL_PATH = re.compile(r"^/(\d+)/part-(\d+)/(state\.bin|state\.json|data\.json|manifest\.json)$")
TOKEN_HEADER = "X-Jaxrec-Part-Token"


class PartProblem(Exception):
    """A part copy that cannot be used, and why (one line)."""


@dataclass(frozen=True)
class Layout:
    """What a part must match to be restored by this gang: the run, its config and the device layout."""

    run_id: str
    config_hash: str
    process_count: int
    local_devices: int
    mesh_shape: dict[str, int]
    dataset_version: str

    def problems(self, m: LocalPartManifest) -> list[str]:
        """Why manifest ``m`` was written for another run, config or layout (empty: it fits)."""
        out = []
        for name, want, got in (
            ("run", self.run_id, m.run_id),
            ("config hash", self.config_hash[:12], m.config_hash[:12]),
            ("process count", self.process_count, m.process_count),
            ("devices per process", self.local_devices, m.local_devices),
            ("mesh", self.mesh_shape, m.mesh_shape),
            ("dataset version", self.dataset_version, m.dataset_version),
        ):
            if want != got:
                out.append(f"{name} {got} (this run: {want})")
        return out


@dataclass
class Shard:
    """One shard of one leaf: its place in the global array and its bytes."""

    leaf: str
    index: list[list[int]]
    dtype: str
    shape: list[int]
    data: Any = field(repr=False, default=None)  # numpy array (write) or memoryview (load)


@dataclass
class LoadedPart:
    """A part read and checked: its shards by (leaf, index) and its data position."""

    step: int
    part: int
    shards: dict[tuple[str, tuple[tuple[int, int], ...]], Shard]
    data_state: dict[str, Any]


def index_key(index: list[list[int]] | tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """A hashable form of a shard's index (start, stop per dimension)."""
    return tuple((int(a), int(b)) for a, b in index)


class _Digest:
    """CRC32C, SHA-256 and size of bytes as they pass."""

    def __init__(self, data: bytes = b"") -> None:
        self.crc, self.sha, self.size = google_crc32c.Checksum(), hashlib.sha256(), 0
        self.update(data)

    def update(self, b: bytes | memoryview) -> None:
        if isinstance(b, memoryview):  # google_crc32c's C extension takes bytes only: a chunk at a time
            for i in range(0, len(b), CHUNK):
                self.crc.update(bytes(b[i : i + CHUNK]))
        else:
            self.crc.update(b)
        self.sha.update(b)
        self.size += len(b)

    def entry(self, path: str) -> ManifestFile:
        return ManifestFile(path=path, size=self.size, crc32c=self.crc.digest().hex(), sha256=self.sha.hexdigest())


class LocalParts:
    """The part directories of one run under one host's local directory."""

    def __init__(self, base: Path | str, run_id: str, node: str):
        self.base = Path(base)
        self.run_id = run_id
        self.node = node
        self.dir = self.base / run_id / "steps"

    def part_dir(self, step: int, part: int) -> Path:
        """Where ``step``'s part ``part`` lives when complete."""
        return self.dir / str(step) / f"part-{part}"

    def _tmp(self, step: int, part: int) -> Path:
        d = self.dir / str(step) / f".part-{part}.tmp-{uuid.uuid4().hex[:8]}"
        d.mkdir(parents=True)
        return d

    def _commit(self, tmp: Path, step: int, part: int, manifest: LocalPartManifest) -> None:
        (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=1))
        final = self.part_dir(step, part)
        if final.exists():  # the same step written again (a later attempt): replace it whole
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)

    def write(self, step: int, part: int, shards: list[Shard], data_state: dict[str, Any], meta: dict[str, Any]) -> int:
        """Write a part (``meta``: the manifest's other fields); returns the bytes written."""
        tmp = self._tmp(step, part)
        try:
            files, index, offset = [], [], 0
            d = _Digest()
            with open(tmp / STATE_BIN, "wb") as f:
                for s in shards:
                    # As bytes: a buffer of bfloat16 (ml_dtypes) cannot be exported as such.
                    buf = memoryview(np.ascontiguousarray(s.data).view(np.uint8).reshape(-1))
                    f.write(buf)
                    d.update(buf)
                    index.append(
                        dict(leaf=s.leaf, index=s.index, dtype=s.dtype, shape=s.shape, offset=offset, nbytes=len(buf))
                    )
                    offset += len(buf)
            files.append(d.entry(STATE_BIN))
            for name, obj in ((STATE_INDEX, index), (DATA_FILE, data_state)):
                raw = json.dumps(obj).encode()
                (tmp / name).write_bytes(raw)
                files.append(_Digest(raw).entry(name))
            manifest = LocalPartManifest(
                run_id=self.run_id, step=step, process_index=part, node=self.node, files=files, wall_time=now(), **meta
            )
            self._commit(tmp, step, part, manifest)
            return offset
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def manifest(self, step: int, part: int) -> LocalPartManifest:
        """The manifest of a complete part (PartProblem when missing or unreadable)."""
        path = self.part_dir(step, part) / MANIFEST
        try:
            return LocalPartManifest.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            raise PartProblem(f"no part {part} of step {step} on node {self.node}") from None
        except (ValidationError, OSError, ValueError) as e:
            raise PartProblem(f"manifest unreadable ({str(e).splitlines()[0][:120]})") from None

    def complete(self) -> Iterator[tuple[int, int]]:
        """(step, part) of every complete part directory, newest step first."""
        if not self.dir.is_dir():
            return
        for step_dir in sorted((p for p in self.dir.iterdir() if p.name.isdigit()), key=lambda p: -int(p.name)):
            for p in sorted(step_dir.iterdir()):
                m = _PART_NAME.match(p.name)
                if m and (p / MANIFEST).is_file():
                    yield int(step_dir.name), int(m.group(1))

    def check(self, step: int, part: int, layout: Layout) -> LocalPartManifest:
        """Metadata check of a copy (manifest, identity, file sizes); no byte read. PartProblem when it fails."""
        m = self.manifest(step, part)
        bad = layout.problems(m)
        if m.step != step or m.process_index != part:
            bad.append(f"manifest says step {m.step} part {m.process_index}")
        if bad:
            raise PartProblem("written for another " + "; ".join(bad))
        for f in m.files:
            try:
                size = (self.part_dir(step, part) / f.path).stat().st_size
            except FileNotFoundError:
                raise PartProblem(f"{f.path} is missing") from None
            if size != f.size:
                raise PartProblem(f"{f.path}: size {size} != {f.size}")
        return m

    def load(self, step: int, part: int, layout: Layout) -> LoadedPart:
        """Read a part whole and check every file's size, CRC32C and SHA-256 over the bytes read (PartProblem)."""
        m = self.check(step, part, layout)
        raw: dict[str, bytes] = {}
        for f in m.files:
            data = (self.part_dir(step, part) / f.path).read_bytes()
            got = _Digest(data).entry(f.path)
            if (got.size, got.crc32c, got.sha256) != (f.size, f.crc32c, f.sha256):
                raise PartProblem(f"{f.path}: checksum mismatch (crc32c {got.crc32c} != {f.crc32c})")
            raw[f.path] = data
        view = memoryview(raw[STATE_BIN])
        shards = {}
        for e in json.loads(raw[STATE_INDEX]):
            s = Shard(e["leaf"], e["index"], e["dtype"], e["shape"], view[e["offset"] : e["offset"] + e["nbytes"]])
            shards[(s.leaf, index_key(s.index))] = s
        return LoadedPart(step, part, shards, json.loads(raw[DATA_FILE]))

    def gc(self, keep: int) -> None:
        """Keep the ``keep`` newest complete steps of each part; drop older ones and leftover temporaries."""
        seen: dict[int, int] = {}
        for step, part in list(self.complete()):
            seen[part] = seen.get(part, 0) + 1
            if seen[part] > keep:
                shutil.rmtree(self.part_dir(step, part), ignore_errors=True)
        if not self.dir.is_dir():
            return
        for step_dir in self.dir.iterdir():
            for p in step_dir.iterdir() if step_dir.is_dir() else ():
                if p.name.startswith(".") and now() - p.stat().st_mtime > 600:
                    shutil.rmtree(p, ignore_errors=True)
            if step_dir.is_dir() and not any(step_dir.iterdir()):
                step_dir.rmdir()

    def fetch(self, address: str, token: str, step: int, part: int, layout: Layout) -> int:
        """Copy a complete part from a peer's server, checking every file as it arrives; returns the bytes copied."""
        base = f"http://{address}/{step}/part-{part}/"
        try:
            m = LocalPartManifest.model_validate_json(_get(base + MANIFEST, token))
        except (OSError, ValidationError, ValueError) as e:
            raise PartProblem(f"peer {address}: no manifest for part {part} of step {step} ({e})") from None
        bad = layout.problems(m)
        if bad:
            raise PartProblem(f"peer {address}: part written for another " + "; ".join(bad))
        tmp = self._tmp(step, part)
        try:
            for f in m.files:
                d = _Digest()
                with open(tmp / f.path, "wb") as out, _open(base + f.path, token) as resp:
                    while chunk := resp.read(CHUNK):
                        out.write(chunk)
                        d.update(chunk)
                got = d.entry(f.path)
                if (got.size, got.crc32c, got.sha256) != (f.size, f.crc32c, f.sha256):
                    raise PartProblem(f"peer {address}: {f.path} arrived with another checksum or size")
            self._commit(tmp, step, part, m.model_copy(update={"copied_to": self.node}))
            return sum(f.size for f in m.files)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise PartProblem(f"peer {address}: {e}") from None
            raise


def _open(url: str, token: str) -> Any:
    req = urllib.request.Request(url, headers={TOKEN_HEADER: token})
    return urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S)  # noqa: S310 - http to a peer of the gang


def _get(url: str, token: str) -> bytes:
    with _open(url, token) as r:
        return r.read()


class PartServer:
    """Serves this host's complete parts of one run, read-only, to the gang's peers (token required)."""

    def __init__(self, parts: LocalParts, token: str, host: str):
        root, want = parts.dir, token

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                m = _URL_PATH.match(self.path)
                path = root / m.group(1) / f"part-{m.group(2)}" / m.group(3) if m else None
                if self.headers.get(TOKEN_HEADER) != want or path is None or not path.is_file():
                    self.send_error(404)
                    return
                try:
                    with open(path, "rb") as f:
                        self.send_response(200)
                        self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
                        self.end_headers()
                        shutil.copyfileobj(f, self.wfile, CHUNK)
                except OSError:  # removed by the next gc while serving: the peer's check refuses the copy
                    return

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
                log.debug("part server: " + format, *args)

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.address = f"{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, name="part-server", daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()
