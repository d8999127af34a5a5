"""Checkpoint listing and verification: an adapter that reads the run store, and a pure selection over its facts.

``inspect_candidate`` reads one step directory (commit marker, manifest, files) into a plain
``CandidateInfo``; ``judge`` and ``select_restore_step`` decide over those records without any I/O.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jaxrec.adapters.checkpoints import (
    GCS_COMMIT,
    LOCAL_METADATA,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_FILES,
    stream_digests,
)
from jaxrec.adapters.store import ObjectInfo, RunLayout, RunStore
from jaxrec.model.compat import check_compatible
from jaxrec.model.contract import SkipKind
from jaxrec.model.records import CheckpointManifest, Ledger, ManifestFile
from jaxrec.model.tasks import TaskError, resolve_task

TMP_MARK = ".orbax-checkpoint-tmp"
"""Orbax names a local step directory ``<step>.orbax-checkpoint-tmp-<n>`` until the save is committed."""

_STEP_NAME = re.compile(r"^(\d+)(.*)$")


class StoreLayoutError(Exception):
    """The run store is not laid out as a run store (a file where a directory must be): nothing can be decided."""


@dataclass(frozen=True)
class CandidateInfo:
    """Facts about one directory under ``checkpoints/``, as read from the store (no decisions)."""

    name: str
    step: int | None
    on_gcs: bool
    temporary: bool = False
    entry_kind: str = "dir"
    """What the entry under ``checkpoints/`` is: ``dir``, ``file``, ``link`` or ``other`` (links not followed)."""
    canonical: bool = True
    """False for a digits-only name with leading zeros (``060``)."""
    odd: tuple[str, ...] = ()
    """Symbolic links, special files and unreadable entries inside the step directory."""
    file_count: int = 0
    committed: bool = False
    manifest_problem: str | None = None
    manifest_attempt: int | None = None
    manifest_wall_time: float | None = None
    compat_problems: tuple[str, ...] = ()
    file_problems: tuple[str, ...] | None = None
    """None until the files were checked against the manifest."""
    file_basis: str | None = None
    """How the files were checked (``integrity_basis``), once they were."""


@dataclass(frozen=True)
class Skip:
    """One directory that was not restored, why, and whether it is moved to quarantine."""

    name: str
    step: int | None
    kind: SkipKind
    reason: str
    quarantine: bool

    def as_output(self) -> dict[str, Any]:
        """The ``{step, reason}`` entry of the ``skipped`` output."""
        return {"step": self.step, "name": self.name, "reason": self.reason}


@dataclass
class Selection:
    """What ``restore-latest`` decided."""

    step: int = -1
    name: str | None = None
    skipped: list[Skip] = field(default_factory=list)
    renamed: tuple[str, int] | None = None
    """An intact checkpoint newer than ``step`` under a name orbax does not read (its directory, its step)."""

    @property
    def incompatible(self) -> bool:
        """Checkpoints exist, none was selected, and at least one was skipped as incompatible with the config."""
        return self.step < 0 and any(s.kind is SkipKind.INCOMPATIBLE for s in self.skipped)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def judge(c: CandidateInfo, closed_at: Mapping[int, float]) -> Skip | None:
    """Whether candidate ``c`` can be restored: None, or the ``Skip`` saying why and whether to quarantine it.

    ``closed_at``: for each attempt the ledger closed, when it was closed (epoch seconds).
    """

    def skip(kind: SkipKind, reason: str, quarantine: bool) -> Skip:
        return Skip(c.name, c.step, kind, reason, quarantine)

    if c.step is None:
        return skip(SkipKind.NOT_A_STEP, f"{c.name!r} is not a step directory (left in place)", False)
    if c.temporary:
        return skip(
            SkipKind.TEMPORARY,
            "temporary directory of an unfinished save (left in place: orbax removes it when it saves that step again)",
            False,
        )
    if c.entry_kind == "file" or c.entry_kind == "other":
        return skip(
            SkipKind.NOT_A_DIRECTORY,
            f"{c.name!r} is a {'file' if c.entry_kind == 'file' else 'special file'}, not a step directory "
            "(left in place: move it away from checkpoints/)",
            False,
        )
    if not c.canonical:
        # orbax reads a digits-only name as its integer (``step_from_checkpoint_name``: ``int(name)``) but
        # builds a step's path from the integer (``60``), so the trainer would never open ``060``: it is
        # not restorable, and left in place it would be a second step 60 to orbax's retention.
        return skip(
            SkipKind.NAME,
            f"{c.name!r} is not orbax's name for step {c.step} (expected {str(c.step)!r}); the trainer would "
            f"read checkpoints/{c.step}",
            True,
        )
    if c.odd:
        shown = "; ".join(c.odd[:3]) + (f" (+{len(c.odd) - 3} more)" if len(c.odd) > 3 else "")
        # Links are not followed: orbax would read through them into data outside the verified tree.
        # Moving a link moves the link, never what it points to.
        return skip(SkipKind.ODD_ENTRIES, f"not a plain orbax step directory: {shown}", True)
    if c.file_count == 0:
        return skip(SkipKind.EMPTY, "empty step directory", not c.on_gcs)
    if not c.committed:
        if c.on_gcs:
            return skip(
                SkipKind.UNCOMMITTED,
                f"no {GCS_COMMIT}: orbax never committed this save (left in place: orbax removes it when it "
                "saves that step again)",
                False,
            )
        return skip(SkipKind.UNCOMMITTED, f"no {LOCAL_METADATA}: not a finished orbax save", True)
    if c.manifest_problem is not None:
        return skip(SkipKind.MANIFEST, c.manifest_problem, True)
    if c.manifest_attempt is not None and c.manifest_wall_time is not None:
        closed = closed_at.get(c.manifest_attempt)
        if closed is not None and c.manifest_wall_time > closed:
            return skip(
                SkipKind.CLOSED_ATTEMPT,
                f"written by attempt {c.manifest_attempt} at {_when(c.manifest_wall_time)}, after the ledger "
                f"closed that attempt at {_when(closed)} (a straggler's write)",
                True,
            )
    if c.compat_problems:
        return skip(SkipKind.INCOMPATIBLE, "incompatible with the config: " + "; ".join(c.compat_problems), True)
    if c.file_problems:
        shown = "; ".join(c.file_problems[:3])
        more = f" (+{len(c.file_problems) - 3} more)" if len(c.file_problems) > 3 else ""
        return skip(SkipKind.FILES, f"damaged data: {shown}{more}", True)
    return None


def order_newest_first(candidates: Iterable[CandidateInfo]) -> list[CandidateInfo]:
    """Newest step first; at equal steps the final directory before temporary ones; unnamed last."""
    return sorted(candidates, key=lambda c: (c.step is not None, c.step or 0, not c.temporary, c.name), reverse=True)


def select_restore_step(candidates: list[CandidateInfo], closed_at: Mapping[int, float]) -> Selection:
    """Pick the newest restorable checkpoint and say why each newer directory was skipped.

    Args:
        candidates: Facts about every directory under ``checkpoints/`` (any order). A candidate whose
            ``file_problems`` is None was not read back; it is selected only if every other check passes,
            so the adapter reads files of the one it is about to select.
        closed_at: Attempt number -> when the ledger closed it.

    Returns:
        The selection: ``step`` -1 when nothing is restorable (a fresh start, or a stop when
        ``incompatible``), and the skipped directories newer than the selected one.
    """
    sel = Selection()
    for c in order_newest_first(candidates):
        verdict = judge(c, closed_at)
        if verdict is None:
            assert c.step is not None
            sel.step, sel.name = c.step, c.name
            break
        sel.skipped.append(verdict)
    return sel


# ---- adapter: the store -> CandidateInfo ---------------------------------------------------------


def _parse_name(name: str) -> tuple[int | None, bool]:
    m = _STEP_NAME.match(name)
    if not m or not m.group(1).isascii() or len(m.group(1)) > 10:
        return None, False
    rest = m.group(2)
    if rest and not rest.startswith(TMP_MARK):
        return None, False
    return int(m.group(1)), bool(rest)


def check_layout(store: RunStore, rel: str) -> None:
    """Raise ``StoreLayoutError`` unless ``rel`` is a directory or absent (links are not followed)."""
    kind = store.kind(rel)
    if kind not in ("dir", "absent"):
        what = {"link": "a symbolic link (links are not followed)", "file": "a file"}.get(kind, "a special file")
        raise StoreLayoutError(
            f"{store.url(rel)} is {what}, not a directory; move it aside (or make it a directory) and rerun"
        )


def list_step_dirs(store: RunStore) -> dict[str, list[ObjectInfo]]:
    """Every directory under ``checkpoints/`` with its objects (names relative to the step directory).

    Raises:
        StoreLayoutError: ``checkpoints`` itself is a file or a link, not a directory.
    """
    check_layout(store, RunLayout.CHECKPOINTS)
    base = RunLayout.CHECKPOINTS + "/"
    out: dict[str, list[ObjectInfo]] = {name: [] for name in store.children(RunLayout.CHECKPOINTS)}
    for o in store.list(RunLayout.CHECKPOINTS):
        rel = o.name[len(base) :]
        name, _, inner = rel.partition("/")
        if not inner or inner.endswith("/"):
            continue  # a folder placeholder object, or a stray file at the top
        out.setdefault(name, []).append(ObjectInfo(inner, o.size, o.generation, o.crc32c))
    return out


def read_manifest(store: RunStore, name: str, step: int, run_id: str) -> tuple[CheckpointManifest | None, str | None]:
    """The manifest of step directory ``name``, or None and a readable reason why it is unusable."""
    rel = f"{RunLayout.CHECKPOINTS}/{name}/{RunLayout.MANIFEST}"
    data = store.read_bytes(rel)
    if data is None:
        return None, f"no {RunLayout.MANIFEST}: the save never completed its transaction"
    try:
        m = CheckpointManifest.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "document"
        return None, f"{RunLayout.MANIFEST} is unreadable ({where}: {first['msg']})"
    if m.step != step:
        return None, f"{RunLayout.MANIFEST} is for step {m.step}, not {step}"
    if m.run_id != run_id:
        return None, f"{RunLayout.MANIFEST} is for run {m.run_id!r}, not {run_id!r}"
    return m, None


def manifest_compat_problems(manifest: CheckpointManifest, config: Mapping[str, Any], num_hosts: int) -> list[str]:
    """Readable reasons why a checkpoint written as ``manifest`` cannot be restored under ``config``."""
    problems = [p.render() for p in check_compatible(manifest.config, config)]
    total = (config.get("training") or {}).get("total_steps")
    if isinstance(total, int) and manifest.step > total:
        # Training under this config ends at total_steps: a later step is another config's (or not a step
        # this run could have written), and restoring it would start past the end.
        problems.append(f"step {manifest.step} is beyond training.total_steps {total}")
    if manifest.process_count != num_hosts:
        problems.append(
            f"written by {manifest.process_count} processes, the slice has {num_hosts} (orbax could reshard, "
            "but the per-host data state does not carry over)"
        )
    data = config.get("data", {})
    dataset_version = data.get("dataset_version")
    # Record files are versioned by their fingerprint, which only a reader of the files can compute: the
    # trainer checks it at restore and refuses or reshuffles as data.resume_mode says.
    if (
        data.get("dataset") != "records"
        and manifest.dataset_version != dataset_version
        and not any(p.startswith("data.dataset_version") for p in problems)
    ):
        problems.append(f"dataset version {manifest.dataset_version!r} -> {dataset_version!r}")
    try:
        spec = resolve_task((config.get("task") or {}).get("name", "lm"))
    except TaskError:
        spec = None  # the config diff already names a task that does not resolve
    if spec is not None and manifest.task_name == spec.name and manifest.task_version != spec.version:
        problems.append(f"task version {manifest.task_version!r} -> {spec.version!r} (the task's state changed)")
    return problems


def inspect_candidate(
    store: RunStore, name: str, objects: list[ObjectInfo], config: Mapping[str, Any], num_hosts: int, run_id: str
) -> CandidateInfo:
    """Read the cheap facts of one step directory: name, commit marker, manifest, compatibility (not file data)."""
    step, temporary = _parse_name(name)
    c = CandidateInfo(name=name, step=step, on_gcs=store.is_gcs, temporary=temporary, file_count=len(objects))
    if step is None or temporary:
        return c
    rel = f"{RunLayout.CHECKPOINTS}/{name}"
    odd = tuple(store.odd(rel))
    kind = "dir" if objects else store.kind(rel)  # a kind probe costs a request on GCS: only when in doubt
    c = replace(c, entry_kind=kind, canonical=str(step) == name, odd=odd)
    if kind in ("file", "other", "absent") or not c.canonical or c.odd or not objects:
        return c
    names = {o.name for o in objects}
    committed = GCS_COMMIT in names if store.is_gcs else LOCAL_METADATA in names
    c = replace(c, committed=committed)
    if not committed:
        return c
    size = next(o.size for o in objects if o.name == RunLayout.MANIFEST) if RunLayout.MANIFEST in names else 0
    if size > MAX_MANIFEST_BYTES:  # refused unread: parsing it would hold several times its size in memory
        return replace(c, manifest_problem=f"{RunLayout.MANIFEST} has {size} bytes, more than {MAX_MANIFEST_BYTES}")
    manifest, problem = read_manifest(store, name, step, run_id)
    if manifest is None:
        return replace(c, manifest_problem=problem)
    return replace(
        c,
        manifest_attempt=manifest.attempt,
        manifest_wall_time=manifest.wall_time,
        compat_problems=tuple(manifest_compat_problems(manifest, config, num_hosts)),
    )


def integrity_basis(manifest: CheckpointManifest, on_gcs: bool) -> str:
    """How a step's files are checked against ``manifest``: one line for the log and the tests."""
    if not on_gcs:
        if manifest.files and all(f.sha256 for f in manifest.files):
            return "size, CRC32C and SHA-256, streamed from each file, and orbax's own metadata against the step"
        return (
            "size and CRC32C, streamed from each file; the manifest records no SHA-256 (written before it was "
            "recorded), so a file of the same size that ends with its own CRC32C is not told apart"
        )
    if manifest.files and all(f.generation is not None for f in manifest.files):
        return "size, CRC32C and generation from one listing (no bytes read)"
    return (
        "size and CRC32C from one listing (no bytes read); the manifest records no generations (written before "
        "they were recorded), so a rewrite with the same bytes is not told apart"
    )


def check_step(
    store: RunStore, name: str, objects: list[ObjectInfo], *, threads: int = 8
) -> tuple[list[str], str | None]:
    """The step's problems against its manifest, closed-world, one line each, and how its files were checked.

    How they were checked is ``integrity_basis`` (None without a manifest). Closed world: a file the manifest does
    not know (an extra array chunk, say) could be read by orbax without ever having been checked, and nothing but
    the manifest itself is exempt (docs/CHECKPOINTS.md). On GCS no byte is read (the listing in ``objects`` carries
    size, CRC32C and generation); locally each file is streamed in ``CRC_CHUNK`` pieces on ``threads`` threads.
    """
    raw = store.read_bytes(f"{RunLayout.CHECKPOINTS}/{name}/{RunLayout.MANIFEST}")
    if raw is None:
        return [f"{RunLayout.MANIFEST} vanished while being checked"], None
    try:
        manifest = CheckpointManifest.model_validate_json(raw)
    except ValidationError:
        return [f"{RunLayout.MANIFEST} changed while being checked and is unreadable"], None
    problems = file_problems(store, name, manifest, objects, threads=threads)
    if not problems:
        problems = metadata_problems(store, name, manifest)
    return problems, integrity_basis(manifest, store.is_gcs)


def file_problems(
    store: RunStore, name: str, manifest: CheckpointManifest, objects: list[ObjectInfo], *, threads: int = 8
) -> list[str]:
    """The problems of step directory ``name`` (objects as listed) against ``manifest``; see ``check_step``."""
    by_name = {o.name: o for o in objects}
    problems: list[str] = []
    if not manifest.files:
        return ["the manifest lists no files"]
    if len(manifest.files) > MAX_MANIFEST_FILES:
        return [f"the manifest lists {len(manifest.files)} files, more than the {MAX_MANIFEST_FILES} a step may have"]
    counts = Counter(f.path for f in manifest.files)
    twice = sorted(p for p, n in counts.items() if n > 1)
    problems += [f"{p} is listed twice in the manifest" for p in twice[:3]]
    unlisted = sorted(set(by_name) - set(counts) - {RunLayout.MANIFEST})
    problems += [f"{p} is not in the manifest (an unverified file)" for p in unlisted]
    to_sum = []
    for f in manifest.files:
        o = by_name.get(f.path)
        if o is None:
            problems.append(f"{f.path} is missing")
        elif o.size != f.size:
            problems.append(f"{f.path} has {o.size} bytes, the manifest says {f.size}")
        elif o.crc32c is not None and o.crc32c != f.crc32c:
            problems.append(f"{f.path} has CRC32C {o.crc32c}, the manifest says {f.crc32c}")
        elif f.generation is not None and o.generation != f.generation:
            # Same size and CRC32C, another object: a copy from another step, or a rewrite after the commit.
            problems.append(
                f"{f.path} is generation {o.generation}, the manifest says {f.generation} (rewritten or replaced "
                "after the step was committed)"
            )
        elif o.crc32c is None:
            to_sum.append(f)

    return problems + streamed_problems(store, name, to_sum, threads=threads)


def _digests(store: RunStore, rel: str) -> tuple[str, str | None] | None:
    """CRC32C and (locally) SHA-256 of ``rel``, streamed; None when it is gone."""
    if store.is_gcs:
        got = store.crc32c(rel)
        return None if got is None else (got[0], None)
    streamed = stream_digests(Path(store.url(rel)))
    return None if streamed is None else (streamed[0], streamed[1])


def streamed_problems(store: RunStore, name: str, files: list[ManifestFile], *, threads: int = 8) -> list[str]:
    """Stream ``files`` of step directory ``name`` (``CRC_CHUNK`` at a time) and compare them with their entries.

    The CRC32C, and the SHA-256 where the entry has one: a file that ends with its own CRC32C (every OCDBT
    file does) has the same whole-file CRC32C as any other such file, so only the SHA-256 tells a file of the
    same size from another step, or one left over from an earlier write, apart from the one that was saved.
    """
    problems = []
    rels = [f"{RunLayout.CHECKPOINTS}/{name}/{f.path}" for f in files]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for f, got in zip(files, pool.map(lambda r: _digests(store, r), rels), strict=True):
            if got is None:
                problems.append(f"{f.path} vanished while being read")
            elif got[0] != f.crc32c:
                problems.append(f"{f.path} has CRC32C {got[0]}, the manifest says {f.crc32c}")
            elif f.sha256 and got[1] is not None and got[1] != f.sha256:
                problems.append(
                    f"{f.path} has SHA-256 {got[1][:16]}..., the manifest says {f.sha256[:16]}... (same size and "
                    "CRC32C: another file's contents, a copy from another step or a leftover of an earlier write)"
                )
    return problems


def closed_attempts(store: RunStore) -> dict[int, float]:
    """Attempt -> when the ledger closed it (empty when there is no ledger yet)."""
    ledger = store.read_record(RunLayout.LEDGER, Ledger)
    if ledger is None:
        return {}
    return {a.attempt: a.closed_at for a in ledger.attempts if a.closed_at is not None}


def verify_checkpoints(
    store: RunStore, config: Mapping[str, Any], num_hosts: int, closed_at: Mapping[int, float]
) -> tuple[Selection, list[CandidateInfo]]:
    """List the run's checkpoints, verify them newest first, and select the one to restore.

    Files are checked only for the candidate about to be selected: on GCS from the listing already made
    (no bytes read), locally by streaming each file of that candidate once; older steps are never touched.
    ``config`` is the run's canonical dict, ``num_hosts`` the processes of the slice the restore is for.

    Returns:
        The selection and the candidates as inspected (newest first).
    """
    dirs = list_step_dirs(store)
    cheap = [inspect_candidate(store, n, objs, config, num_hosts, store.run_id) for n, objs in dirs.items()]
    inspected: list[CandidateInfo] = []
    for c in order_newest_first(cheap):
        if judge(c, closed_at) is None:
            problems, basis = check_step(store, c.name, dirs[c.name])
            c = replace(c, file_problems=tuple(problems), file_basis=basis)
        inspected.append(c)
        if judge(c, closed_at) is None:
            break
    sel = select_restore_step(inspected, closed_at)
    sel.renamed = renamed_intact(store, dirs, sel.step, config, num_hosts, closed_at)
    return sel, inspected


def renamed_intact(
    store: RunStore,
    dirs: Mapping[str, list[ObjectInfo]],
    newer_than: int,
    config: Mapping[str, Any],
    num_hosts: int,
    closed_at: Mapping[int, float],
) -> tuple[str, int] | None:
    """An intact checkpoint newer than ``newer_than`` under a name orbax does not read: its directory and step.

    Such a name is a temporary one (``<step>.orbax-checkpoint-tmp-*``), a non-canonical one (``060``) or any
    other (``60.bak``); None when there is none. Restoring an older step (or starting fresh) while the only
    intact copy of a newer one sits under such a name loses that progress for good (orbax's next save of the
    step cleans a temporary directory up): the caller refuses instead and says what to rename. Only
    directories holding a manifest of a newer step are checked, with every check a step under its own name gets.
    """
    for name, objects in sorted(dirs.items()):
        step, temporary = _parse_name(name)
        orbax_reads = step is not None and not temporary and str(step) == name
        if orbax_reads or RunLayout.MANIFEST not in {o.name for o in objects}:
            continue
        try:
            m = CheckpointManifest.model_validate_json(
                store.read_bytes(f"{RunLayout.CHECKPOINTS}/{name}/{RunLayout.MANIFEST}") or b""
            )
        except ValidationError:
            continue
        if m.step <= newer_than or m.run_id != store.run_id or store.odd(f"{RunLayout.CHECKPOINTS}/{name}"):
            continue
        names = {o.name for o in objects}
        c = CandidateInfo(
            name=str(m.step),
            step=m.step,
            on_gcs=store.is_gcs,
            file_count=len(objects),
            committed=(GCS_COMMIT if store.is_gcs else LOCAL_METADATA) in names,
            manifest_attempt=m.attempt,
            manifest_wall_time=m.wall_time,
            compat_problems=tuple(manifest_compat_problems(m, config, num_hosts)),
        )
        if judge(c, closed_at) is None:
            c = replace(c, file_problems=tuple(check_step(store, name, objects)[0]))
            if judge(c, closed_at) is None:
                return name, m.step
    return None


_ITERATOR_STATE = re.compile(r"^(?:(.*)/)?process_(\d+)-of-(\d+)\.json$")
"""grain's per-process iterator state in an item directory (``grain.checkpoint`` names it so)."""


def _iterator_problems(store: RunStore, name: str, manifest: CheckpointManifest) -> list[str]:
    """The data iterator's saved position against the step: one file per process, all at the same batch <= step."""
    items: dict[str, dict[int, int]] = {}
    for f in manifest.files:
        m = _ITERATOR_STATE.match(f.path)
        if m:
            item, index, count = m.group(1) or ".", int(m.group(2)), int(m.group(3))
            if count != manifest.process_count:
                return [
                    f"{f.path} is the state of a {count}-process gang; the step was saved by {manifest.process_count}"
                ]
            items.setdefault(item, {})[index] = -1
    problems = []
    for item, got in items.items():
        if len(got) != manifest.process_count:
            problems.append(f"{item}: data iterator state of {len(got)} of {manifest.process_count} processes")
            continue
        for index in got:
            path = f"{item}/process_{index}-of-{manifest.process_count}.json".removeprefix("./")
            raw = store.read_bytes(f"{RunLayout.CHECKPOINTS}/{name}/{path}")
            try:
                got[index] = int(json.loads(raw or b"null")["next_index"])
            except (ValueError, TypeError, KeyError):
                problems.append(f"{path} holds no data iterator position")
        positions = set(got.values()) - {-1}
        if len(positions) > 1:
            problems.append(f"{item}: the processes' data iterators stopped at different batches {sorted(positions)}")
        elif positions and not 0 <= (at := positions.pop()) <= manifest.step:
            problems.append(f"{item}: data iterator at batch {at}, beyond step {manifest.step}")
    return problems


def _ocdbt_locations(tree: Any) -> Iterable[str]:
    """Every location string (``btreenode::``, ``versionnode::``, ``value:``) in a ``tensorstore.ocdbt.dump`` result."""
    if isinstance(tree, str):
        if tree.startswith(("btreenode:", "versionnode:", "value:")):
            yield tree
    elif isinstance(tree, dict | list):
        for v in tree.values() if isinstance(tree, dict) else tree:
            yield from _ocdbt_locations(v)


def _ocdbt_problems(store: RunStore, name: str, manifest: CheckpointManifest) -> list[str]:
    """Local directory: every file the newest version of each OCDBT database in the step reads is listed, whole.

    Walks each ``manifest.ocdbt`` with tensorstore's own reader (``tensorstore.ocdbt.dump``: the manifest, then
    the B-tree nodes of its newest version, which are metadata: keys and locations ``kind:base:path:offset:length``
    of the values). A reference to a file the manifest does not list, or past a listed file's end, is a step
    orbax could not read whole.
    """
    sizes = {f.path: f.size for f in manifest.files}
    roots = sorted(p for p in sizes if p == "manifest.ocdbt" or p.endswith("/manifest.ocdbt"))
    if not roots:
        return []
    try:
        import tensorstore as ts
    except ImportError:  # the step image always has it (orbax depends on it)
        return []
    step_dir = Path(store.url(f"{RunLayout.CHECKPOINTS}/{name}"))
    problems: list[str] = []
    for root in roots:
        db = root[: -len("manifest.ocdbt")]
        try:
            kv = ts.KvStore.open({"driver": "file", "path": f"{step_dir / db}/"}).result()
            top = ts.ocdbt.dump(kv).result()
            newest = (top.get("versions") or [{}])[-1]
            todo, seen = list(_ocdbt_locations(newest)), set()
            while todo:
                loc = todo.pop()
                kind, base, rel, offset, length = loc.split(":")
                path = f"{db}{base}{rel}"
                if sizes.get(path) is None:
                    problems.append(f"{root} reads {path}, which the manifest does not list")
                elif int(offset) + int(length) > sizes[path]:
                    problems.append(f"{root} reads {path} up to byte {int(offset) + int(length)}, it has {sizes[path]}")
                elif kind == "btreenode" and loc not in seen:
                    seen.add(loc)
                    todo += _ocdbt_locations(ts.ocdbt.dump(kv, loc).result())
                if len(problems) >= 3:
                    return problems
        except (ValueError, RuntimeError) as e:  # tensorstore reports a damaged node or manifest as ValueError
            problems.append(f"{root} cannot be read by tensorstore ({str(e).splitlines()[0][:160]})")
    return problems


def metadata_problems(store: RunStore, name: str, manifest: CheckpointManifest) -> list[str]:
    """Orbax's own metadata in the step against the step: the data iterator's position, the OCDBT references.

    On GCS only the iterator state is read (one small object per process); the OCDBT roots are not walked
    there: every object is pinned by the generation it had when the manifest was written, so the roots are
    those orbax committed, referencing what orbax wrote.
    """
    problems = _iterator_problems(store, name, manifest)
    if not problems and not store.is_gcs:
        problems = _ocdbt_problems(store, name, manifest)
    return problems


def share_of(files: list[ManifestFile], part: int, parts: int) -> list[ManifestFile]:
    """The files process ``part`` of ``parts`` checks: the largest first, each to the least loaded process.

    Deterministic (every process computes every share alike) and balanced by bytes, so the slowest process
    reads about ``1/parts`` of the checkpoint.
    """
    load = [0] * max(1, parts)
    mine = []
    for f in sorted(files, key=lambda f: (-f.size, f.path)):
        p = min(range(len(load)), key=lambda i: (load[i], i))
        load[p] += f.size
        if p == part:
            mine.append(f)
    return mine


def part_problems(
    store: RunStore, name: str, manifest: CheckpointManifest, part: int, parts: int, *, threads: int = 4
) -> list[str]:
    """Process ``part``'s check of step directory ``name`` while the gang restores it; one line per problem.

    GCS: process 0 alone compares one listing with the manifest (size, CRC32C, generation; no byte read).
    An object keeps its generation for life and GCS serves only the bytes it checksummed, so the same
    generations after the read mean the workers read the objects the manifest pinned. Local directory: each
    process streams its share (``share_of``) of the files through CRC32C and SHA-256, the bytes orbax has
    just read (in the page cache); process 0 also checks the closed world (sizes, unlisted files).
    """
    if store.is_gcs:
        if part != 0:
            return []
        objects = list_step_dirs_one(store, name)
        return file_problems(store, name, manifest, objects, threads=threads)
    problems = []
    if part == 0:
        listed = {o.name: o.size for o in list_step_dirs_one(store, name)}
        for f in manifest.files:
            if listed.get(f.path) != f.size:
                problems.append(f"{f.path} has {listed.get(f.path, 'no')} bytes, the manifest says {f.size}")
        known = {f.path for f in manifest.files} | {RunLayout.MANIFEST}
        problems += [f"{p} is not in the manifest (an unverified file)" for p in sorted(set(listed) - known)]
    return problems + streamed_problems(store, name, share_of(manifest.files, part, parts), threads=threads)


def list_step_dirs_one(store: RunStore, name: str) -> list[ObjectInfo]:
    """The objects of step directory ``name`` (names relative to it), from one listing."""
    base = f"{RunLayout.CHECKPOINTS}/{name}/"
    return [
        ObjectInfo(o.name[len(base) :], o.size, o.generation, o.crc32c)
        for o in store.list(f"{RunLayout.CHECKPOINTS}/{name}")
        if not o.name[len(base) :].endswith("/")
    ]
