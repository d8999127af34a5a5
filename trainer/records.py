"""Training data from record files: ArrayRecord files listed by a glob on ``gs://`` or a local path.

Each record is one example stored as an ``.npz`` (``encode_example``). The files are read in sorted name order, so
index ``i`` means the same record on every process and in every attempt. Their fingerprint (``fingerprint``) is the
dataset version every checkpoint records. ArrayRecord's reader opens local files only (its C++ file layer), so files
on ``gs://`` are copied once into a local cache (``TRAINER_DATA_CACHE``), keyed by their generation.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grain
import numpy as np

from jaxrec.adapters.checkpoints import crc32c_hex
from jaxrec.adapters.store import make_gcs_client, split_gcs_url

SUFFIX = ".array_record"
_BARE = "__array__"  # the npz key of an example that is a bare array


class DataFilesError(ValueError):
    """``data.files`` matches nothing or cannot be read; one line naming the field and the fix."""


@dataclass(frozen=True)
class RecordFile:
    """One file of the dataset: where it is, where it is read from, and what identifies its contents."""

    name: str  # as listed: a local path or gs://bucket/object
    size: int
    checksum: str  # crc32c (local) or generation:crc32c (GCS)
    local_path: str  # the file ArrayRecord opens


def encode_example(example: Any) -> bytes:
    """One example (an array or a flat dict of arrays) as ``.npz`` bytes."""
    arrays = example if isinstance(example, dict) else {_BARE: example}
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    return buf.getvalue()


def decode_example(data: bytes) -> Any:
    """The example ``encode_example`` wrote."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    return out[_BARE] if set(out) == {_BARE} else out


def _pattern(files: str) -> str:
    """A directory stands for every ``*.array_record`` in it."""
    if files.startswith("gs://"):
        return files.rstrip("/") + "/*" + SUFFIX if files.endswith("/") else files
    return str(Path(files) / ("*" + SUFFIX)) if os.path.isdir(files) else files


def list_files(files: str) -> list[RecordFile]:
    """The files ``data.files`` matches, sorted by name (a local glob or directory, or a gs:// glob).

    Raises:
        DataFilesError: Nothing matches.
    """
    pattern = _pattern(files)
    out = _list_gcs(pattern) if pattern.startswith("gs://") else _list_local(pattern)
    if not out:
        raise DataFilesError(
            f"data.files: {files!r} matches no file; write a dataset with python -m trainer.write_records "
            "or fix the glob"
        )
    return out


def _list_local(pattern: str) -> list[RecordFile]:
    out = []
    for path in sorted(glob.glob(pattern)):
        if os.path.isfile(path):
            data = Path(path).read_bytes()  # the checksum needs the contents; record files are read anyway
            out.append(RecordFile(path, len(data), crc32c_hex(data), path))
    return out


def _cache_dir() -> Path:
    return Path(os.environ.get("TRAINER_DATA_CACHE") or tempfile.gettempdir()) / "jaxrec-data"


def _glob_regex(key_glob: str) -> re.Pattern[str]:
    """An object-name glob as a regex: ``*`` and ``?`` stay within one ``/`` level, ``**`` crosses levels.

    The same as a local glob and as gcloud storage's wildcards ("Wildcard names" in the Cloud Storage docs);
    ``fnmatch``'s ``*`` would also match ``/`` and read the files of every folder below.
    """
    out, i, n = [], 0, len(key_glob)
    while i < n:
        c = key_glob[i]
        if key_glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := key_glob.find("]", i + 2)) != -1:
            body = key_glob[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def _list_gcs(pattern: str) -> list[RecordFile]:
    bucket, key_glob = split_gcs_url(pattern)
    prefix = key_glob.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
    client = make_gcs_client()
    out = []
    match = _glob_regex(key_glob).fullmatch
    for blob in sorted(client.list_blobs(bucket, prefix=prefix), key=lambda b: b.name):
        if not match(blob.name):
            continue
        name = f"gs://{bucket}/{blob.name}"
        local = _cache_dir() / bucket / f"{blob.name}.g{blob.generation}"
        if not local.exists():
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f"{local.name}.{os.getpid()}.tmp")
            # The generation pins the contents: a rewritten object has a new one (GCS object versioning docs).
            blob.download_to_filename(str(tmp), if_generation_match=blob.generation)
            os.replace(tmp, local)  # atomic: processes of one host may fetch the same file at once
        out.append(RecordFile(name, int(blob.size or 0), f"{blob.generation}:{blob.crc32c}", str(local)))
    return out


def fingerprint(files: Iterable[RecordFile]) -> str:
    """The dataset version of a file list: ``files-`` and 16 hex digits of sha256 over names, sizes, checksums."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.size}\0{f.checksum}\n".encode())
    return "files-" + h.hexdigest()[:16]


def record_dataset(files: list[RecordFile]) -> grain.MapDataset:
    """Every record of ``files`` (in order), decoded into examples."""
    source = grain.sources.ArrayRecordDataSource([f.local_path for f in files])
    return grain.MapDataset.source(source).map(decode_example)


def write_records(examples: Iterable[Any], out_dir: str | Path, num_files: int, prefix: str = "part") -> list[Path]:
    """Write ``examples`` round-robin into ``num_files`` ArrayRecord files under a local ``out_dir``.

    Returns:
        The files written, in name order.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = list(examples)
    paths = [out / f"{prefix}-{i:05d}-of-{num_files:05d}{SUFFIX}" for i in range(num_files)]
    per_file = -(-len(items) // num_files)
    for i, path in enumerate(paths):
        # Contiguous slices, so record i of the dataset (files in name order) is example i.
        writer = ArrayRecordWriter(str(path), "group_size:1")
        for ex in items[i * per_file : (i + 1) * per_file]:
            writer.write(encode_example(ex))
        writer.close()
    return paths
