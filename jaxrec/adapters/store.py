"""The run store: one interface over ``gs://bucket/prefix`` and a local directory (layout: ``RunLayout``).

JSON documents go through google-cloud-storage (or plain files); arrays go through orbax/tensorstore, which take
``RunStore.url(...)`` as their directory. Every write of a JSON document is atomic (a local temp file renamed into
place; a single GCS object upload), and ``write_bytes`` accepts a generation precondition so that two writers cannot
silently overwrite each other.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

R = TypeVar("R", bound=BaseModel)


class PreconditionFailed(Exception):
    """A conditional write lost a race: the object changed since it was read."""


class Contended(PreconditionFailed):
    """``RunStore.update_record`` lost every race it ran: other writers kept changing the document."""


class StoreUnavailable(Exception):
    """The run store did not answer (network, HTTP 429/5xx): the step exits ``transient`` and Argo retries it."""


class DocumentError(Exception):
    """A run-store document is unreadable or of the wrong shape; ``str()`` is one line naming the file."""

    def __init__(self, url: str, problem: str):
        super().__init__(f"{url}: {problem}")
        self.url = url
        self.problem = problem


def parse_document(data: bytes, model: type[R], url: str, *, run_id: str | None = None) -> R:
    """Parse one stored document into its record, or raise ``DocumentError`` with one line.

    Args:
        data: The stored bytes.
        model: The record type the document must be.
        url: Where it was read from (named in the error).
        run_id: When given and the record has a ``run_id``, it must be this run's.
    """
    what = _label(model.__name__)
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise DocumentError(url, f"unreadable {what} (not JSON: {first_line(e)})") from None
    if not isinstance(obj, dict):
        raise DocumentError(url, f"unreadable {what} (expected a JSON object, found {type(obj).__name__})")
    try:
        # context: a record may hold a stored document to more than a constructed one (a list every writer writes).
        rec = model.model_validate(obj, context={"stored": True})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        more = f"; and {e.error_count() - 1} more" if e.error_count() > 1 else ""
        msg = err["msg"].removeprefix("Value error, ")
        raise DocumentError(url, f"unreadable {what} ({field + ': ' if field else ''}{msg}{more})") from None
    other = getattr(rec, "run_id", None) if "run_id" in type(rec).model_fields else None
    if run_id is not None and other is not None and other != run_id:
        raise DocumentError(url, f"unreadable {what} (it belongs to run {other!r}, not {run_id!r})")
    return rec


def _label(name: str) -> str:
    """``RestoreRecord`` -> ``restore record``: how a message names a document's type."""
    return "".join(f" {c.lower()}" if c.isupper() else c for c in name).strip()


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), or its type's name."""
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its path relative to the run, size in bytes, generation, and the store's CRC32C.

    ``crc32c`` (8 hex digits) is what GCS computed over the bytes it received and reports in every listing;
    None on a local directory, which keeps no checksum (a reader computes it, ``RunStore.crc32c``).
    """

    name: str
    size: int
    generation: int
    crc32c: str | None = None


CRC_CHUNK = 1 << 20
"""Bytes read at a time when a CRC32C is computed by streaming (the memory one file's check holds)."""


def gcs_crc32c_hex(value: str | None) -> str | None:
    """GCS's ``crc32c`` (base64 of the big-endian checksum) as 8 hex digits, or None when absent."""
    if not value:
        return None
    import base64

    return base64.b64decode(value).hex()


class RunLayout:
    """Relative paths of the documents of one run (the contract between all parts)."""

    CONFIG = "config.json"
    LEDGER = "ledger.json"
    CHECKPOINTS = "checkpoints"
    QUARANTINE = "quarantine"
    ATTEMPTS = "attempts"
    MANIFEST = "manifest.json"
    COMPILATION_CACHE = "compilation-cache"  # JAX's persistent cache (training.compilation_cache)

    @staticmethod
    def parse_step(name: str) -> int | None:
        """The step of a ``checkpoints/`` (or ``attempts/``) child named ``name``, or None when it is not one."""
        return int(name) if name.isdigit() else None

    @staticmethod
    def checkpoint(step: int) -> str:
        """Directory of the checkpoint at ``step``."""
        return f"checkpoints/{step}"

    @staticmethod
    def checkpoint_manifest(step: int) -> str:
        """The manifest of the checkpoint at ``step`` (written last, after orbax committed)."""
        return f"checkpoints/{step}/{RunLayout.MANIFEST}"

    @staticmethod
    def attempt(n: int) -> str:
        """Directory of attempt ``n``."""
        return f"attempts/{n}"

    @staticmethod
    def worker_reports(n: int) -> str:
        """Folder of the exit reports of attempt ``n``."""
        return f"attempts/{n}/workers"

    @staticmethod
    def worker_report(n: int, process_index: int) -> str:
        """Exit report of worker ``process_index`` in attempt ``n``."""
        return f"{RunLayout.worker_reports(n)}/{process_index}.json"

    @staticmethod
    def attempt_record(n: int) -> str:
        """The record ``classify-failure`` (or the exit handler) writes for attempt ``n``."""
        return f"attempts/{n}/record.json"

    @staticmethod
    def restore_record(n: int) -> str:
        """restore-latest's decision for attempt ``n`` (``RestoreRecord``)."""
        return f"attempts/{n}/restore.json"

    @staticmethod
    def tier_record(n: int) -> str:
        """The gang's choice among local, peer and GCS copies for attempt ``n`` (``TierRecord``)."""
        return f"attempts/{n}/tiers.json"

    @staticmethod
    def supervisor_losses(n: int) -> str:
        """When attempt ``n``'s gang was found running with no supervisor's verdict (``SupervisorLosses``)."""
        return f"attempts/{n}/supervisor-losses.json"

    @staticmethod
    def provision_record(n: int) -> str:
        """provision-slice's outcome for attempt ``n`` (exit code and message of its last try)."""
        return f"attempts/{n}/provision.json"

    @staticmethod
    def incident(n: int) -> str:
        """The incident record of the failure that ended attempt ``n`` (timings on one clock)."""
        return f"attempts/{n}/incident.json"

    @staticmethod
    def heartbeats(n: int) -> str:
        """Folder of the workers' heartbeats in attempt ``n``."""
        return f"attempts/{n}/heartbeats"

    @staticmethod
    def heartbeat(n: int, process_index: int) -> str:
        """Worker ``process_index``'s newest progress in attempt ``n`` (step and time, throttled)."""
        return f"{RunLayout.heartbeats(n)}/{process_index}.json"

    @staticmethod
    def restart_order(n: int) -> str:
        """The supervisor's ``RestartOrder`` to the agents of attempt ``n``'s gang (level 0, in place)."""
        return f"attempts/{n}/restart.json"

    @staticmethod
    def agent_state(n: int, process_index: int) -> str:
        """Worker ``process_index``'s ``AgentState`` in attempt ``n``'s gang."""
        return f"attempts/{n}/agents/{process_index}.json"

    @staticmethod
    def agent_wake(n: int) -> str:
        """The newest ``AgentState`` of a trainer exit in attempt ``n``'s gang: one object the supervisor polls.

        Any agent writes it when its trainer exits; its own state (``agent_state``) stays the evidence.
        """
        return f"attempts/{n}/agents/wake.json"

    @staticmethod
    def supervision(n: int) -> str:
        """What the train-segment supervisor saw and did in attempt ``n``."""
        return f"attempts/{n}/supervision.json"

    @staticmethod
    def quarantine(step: int, suffix: str = "") -> str:
        """Where a checkpoint that failed verification is moved."""
        return f"quarantine/{step}{suffix}"

    @staticmethod
    def quarantine_reason(target: str) -> str:
        """The ``QuarantineReason`` inside quarantine directory ``target`` (a path under ``quarantine/``)."""
        return f"{target}/QUARANTINE_REASON.json"

    LEASE = "lease.json"
    """``RunLease``: the one workflow that acts for the run."""

    PREFLIGHT = "preflight.json"
    """``PreflightCheck`` of the latest submission (written by validate-config's preflight)."""

    PREFLIGHT_PROBES = "preflight/probes"
    """Where the preflight writes, reads and deletes its probe objects."""

    LOCAL_SUMMARY = "local/summary.json"
    """``LocalSummary`` of a local run."""

    LOCAL_EVENTS = "local/events"
    """Copies of the workers' event files (``WorkerEvent`` lines) of a local run on gs://."""

    @staticmethod
    def local_events(name: str) -> str:
        """One worker's event file copied into the run store."""
        return f"local/events/{name}"


PUT_TRIES = 3
"""How many conditional tries a last-writer-wins write makes when other writers keep changing the object."""


class _Backend(Protocol):
    def url(self, rel: str) -> str: ...
    def read(self, rel: str) -> tuple[bytes, int] | None: ...
    def write(self, rel: str, data: bytes, if_generation_match: int | None) -> int: ...
    def list(self, prefix: str) -> list[ObjectInfo]: ...
    def delete(self, rel: str) -> None: ...
    def odd(self, prefix: str) -> list[str]: ...
    def kind(self, rel: str) -> str: ...
    def crc32c(self, rel: str) -> tuple[str, int] | None: ...
    def generation(self, rel: str) -> int: ...


class LocalBackend:
    """Plain files under a directory; generations are modification times in nanoseconds."""

    def __init__(self, root: Path):
        self.root = root

    def url(self, rel: str) -> str:
        """Absolute location of ``rel``."""
        return str(self.root / rel) if rel else str(self.root)

    def read(self, rel: str) -> tuple[bytes, int] | None:
        """Contents and generation of ``rel``, or None."""
        p = self.root / rel
        try:
            # Contents and generation from one open file: a concurrent replace cannot pair new with old.
            with open(p, "rb") as f:
                gen = os.fstat(f.fileno()).st_mtime_ns
                return f.read(), gen
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def write(self, rel: str, data: bytes, if_generation_match: int | None) -> int:
        """Write ``rel`` atomically, honouring the generation precondition."""
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with self._locked(p):
            current = p.stat().st_mtime_ns if p.exists() else 0
            if if_generation_match is not None and current != if_generation_match:
                raise PreconditionFailed(f"{p}: generation {current} != expected {if_generation_match}")
            tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
            gen = p.stat().st_mtime_ns
            if gen <= current:
                # File times are coarse (a clock tick): keep generations strictly increasing per file,
                # else a rewrite within one tick would look unchanged to a conditional writer.
                gen = current + 1
                os.utime(p, ns=(gen, gen))
            return gen

    @contextlib.contextmanager
    def _locked(self, p: Path):
        lock = p.with_name(f".{p.name}.lock")
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Regular files under ``prefix``; symbolic links and special files are not objects (see ``odd``).

        A file that disappears while the tree is walked (a concurrent move) is left out, not an error.
        """
        base = self.root / prefix if prefix else self.root
        try:
            st = base.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return []
        if stat.S_ISREG(st.st_mode):
            return [ObjectInfo(prefix, st.st_size, st.st_mtime_ns)]
        if not stat.S_ISDIR(st.st_mode):
            return []
        out = []
        # followlinks=False (the default): a symlinked directory is not walked into.
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.endswith(".lock") and name.startswith("."):
                    continue
                full = Path(dirpath) / name
                try:
                    st = full.lstat()
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append(ObjectInfo(str(full.relative_to(self.root)), st.st_size, st.st_mtime_ns))
        return sorted(out, key=lambda o: o.name)

    def odd(self, prefix: str) -> list[str]:
        """What under ``prefix`` is neither a directory nor a regular file, or cannot be read; one line each."""
        base = self.root / prefix
        out: list[str] = []

        def note(path: Path, what: str) -> None:
            rel = os.path.relpath(path, base)
            out.append(f"{'.' if rel == '.' else rel} {what}")

        def target(path: Path) -> str:
            try:
                return repr(os.readlink(path))
            except OSError:
                return "?"

        try:
            st = base.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return []
        if stat.S_ISLNK(st.st_mode):
            return [f". is a symbolic link (to {target(base)}; links are not followed)"]
        if not stat.S_ISDIR(st.st_mode):
            return []

        def walk_error(e: OSError) -> None:
            if e.errno != errno.ENOENT:
                note(Path(e.filename or base), f"cannot be read ({e.strerror})")

        for dirpath, dirs, files in os.walk(base, onerror=walk_error):
            for name in [*dirs, *files]:
                full = Path(dirpath) / name
                try:
                    st = full.lstat()
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(st.st_mode):
                    note(full, f"is a symbolic link (to {target(full)}; links are not followed)")
                elif not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                    note(full, "is not a regular file")
                elif stat.S_ISREG(st.st_mode) and not os.access(full, os.R_OK):
                    note(full, "cannot be read (permission denied)")
        return sorted(out)

    def crc32c(self, rel: str) -> tuple[str, int] | None:
        """CRC32C (hex) and size of ``rel``, read in ``CRC_CHUNK`` pieces (bounded memory); None when absent."""
        import google_crc32c

        h = google_crc32c.Checksum()
        n = 0
        try:
            with open(self.root / rel, "rb", buffering=0) as f:
                while chunk := f.read(CRC_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        return h.digest().hex(), n

    def generation(self, rel: str) -> int:
        """The generation of ``rel`` (its modification time in nanoseconds), 0 when absent."""
        try:
            return (self.root / rel).stat().st_mtime_ns
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return 0

    def kind(self, rel: str) -> str:
        """``dir``, ``file``, ``link``, ``other`` or ``absent`` for ``rel`` (links not followed)."""
        try:
            st = (self.root / rel).lstat()
        except (FileNotFoundError, NotADirectoryError):
            return "absent"
        if stat.S_ISLNK(st.st_mode):
            return "link"
        if stat.S_ISDIR(st.st_mode):
            return "dir"
        return "file" if stat.S_ISREG(st.st_mode) else "other"

    def delete(self, rel: str) -> None:
        """Delete ``rel`` if present."""
        with contextlib.suppress(FileNotFoundError):
            (self.root / rel).unlink()


MOVE_THREADS = 16
"""Objects a GCS move copies (then deletes) at a time: one by one, the 16 objects of a small torn step took 1.7 s to
set aside on a loaded emulator, on every restart's path."""

STORE_RETRY_DEADLINE_ENV = "JAXREC_STORE_RETRY_DEADLINE_S"
DEFAULT_STORE_RETRY_DEADLINE_S = 60.0


def store_retry_deadline_s() -> float:
    """How long one store call retries 429/5xx and connection errors before the step gives up (exits transient).

    google-cloud-storage retries those for up to 120 s by default (``google.cloud.storage.retry.DEFAULT_RETRY``);
    a shorter bound hands a longer outage to Argo's retryStrategy, which backs off between pods. Local rehearsals
    shorten it further with ``JAXREC_STORE_RETRY_DEADLINE_S``.
    """
    try:
        return float(os.environ.get(STORE_RETRY_DEADLINE_ENV, DEFAULT_STORE_RETRY_DEADLINE_S))
    except ValueError:
        return DEFAULT_STORE_RETRY_DEADLINE_S


class GcsBackend:
    """Objects under ``gs://bucket/prefix`` through google-cloud-storage (honours STORAGE_EMULATOR_HOST)."""

    def __init__(self, bucket: str, prefix: str, client: Any = None):
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self._client = client
        self._bucket = None
        self._retry = None

    def bounded(self, deadline_s: float) -> GcsBackend:
        """The same objects, each call retried for ``deadline_s`` at most."""
        from google.cloud.storage.retry import DEFAULT_RETRY

        twin = GcsBackend(self.bucket_name, self.prefix, self._client)
        twin._retry = DEFAULT_RETRY.with_deadline(deadline_s)
        return twin

    @property
    def retry(self):
        """The retry policy of every call: the library's, with this store's deadline."""
        if self._retry is None:
            from google.cloud.storage.retry import DEFAULT_RETRY

            self._retry = DEFAULT_RETRY.with_deadline(store_retry_deadline_s())
        return self._retry

    @property
    def bucket(self):
        """The bucket handle (client built on first use)."""
        if self._bucket is None:
            if self._client is None:
                self._client = make_gcs_client()
            self._bucket = self._client.bucket(self.bucket_name)
        return self._bucket

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if rel else self.prefix

    def url(self, rel: str) -> str:
        """Absolute location of ``rel``."""
        return f"gs://{self.bucket_name}/{self._key(rel)}"

    def read(self, rel: str) -> tuple[bytes, int] | None:
        """Contents and generation of ``rel``, or None."""
        from google.api_core import exceptions

        blob = self.bucket.blob(self._key(rel))
        try:
            data = blob.download_as_bytes(retry=self.retry)
        except exceptions.NotFound:
            return None
        return data, int(blob.generation or 0)

    def write(self, rel: str, data: bytes, if_generation_match: int | None) -> int:
        """Write ``rel`` atomically, honouring the generation precondition."""
        from google.api_core import exceptions

        blob = self.bucket.blob(self._key(rel))
        try:
            # Small uploads are multipart: the precondition is enforced (0 = "must not exist").
            # Retried only when conditional (a retried unconditional upload could overwrite a newer writer):
            # RunStore makes every write conditional (RunStore.write_bytes).
            retry = self.retry if if_generation_match is not None else None
            blob.upload_from_string(data, if_generation_match=if_generation_match, retry=retry)
        except exceptions.PreconditionFailed as e:
            raise PreconditionFailed(f"{self.url(rel)}: {e.message}") from None
        return int(blob.generation or 0)

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Objects under ``prefix``."""
        key = self._key(prefix)
        if prefix and not key.endswith("/"):
            key += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        blobs = self.bucket.client.list_blobs(self.bucket_name, prefix=key, retry=self.retry)
        out = [
            ObjectInfo(b.name[strip:], int(b.size or 0), int(b.generation or 0), gcs_crc32c_hex(b.crc32c))
            for b in blobs
        ]
        return sorted(out, key=lambda o: o.name)

    def crc32c(self, rel: str) -> tuple[str, int] | None:
        """CRC32C (hex) and size of ``rel`` as GCS keeps them (metadata only, no bytes read); None when absent."""
        blob = self.bucket.get_blob(self._key(rel), retry=self.retry)
        if blob is None or not blob.crc32c:
            return None
        return gcs_crc32c_hex(blob.crc32c) or "", int(blob.size or 0)

    def generation(self, rel: str) -> int:
        """The generation of ``rel`` as GCS keeps it (metadata only), 0 when absent."""
        blob = self.bucket.get_blob(self._key(rel), retry=self.retry)
        return 0 if blob is None else int(blob.generation or 0)

    def copy(self, rel: str, dst: str) -> bool:
        """Copy ``rel`` to ``dst`` inside the bucket (server-side rewrite: no byte passes through this host).

        Returns False when ``rel`` vanished (a concurrent mover took it).
        """
        from google.api_core import exceptions

        src = self.bucket.blob(self._key(rel))
        target = self.bucket.blob(self._key(dst))
        try:
            token, _, _ = target.rewrite(src, retry=self.retry)
            while token is not None:
                token, _, _ = target.rewrite(src, token=token, retry=self.retry)
        except exceptions.NotFound:
            return False
        return True

    def delete(self, rel: str) -> None:
        """Delete ``rel`` if present."""
        from google.api_core import exceptions

        with contextlib.suppress(exceptions.NotFound):
            self.bucket.blob(self._key(rel)).delete(retry=self.retry)

    def odd(self, prefix: str) -> list[str]:
        """Nothing: GCS holds only objects (no links, no special files)."""
        return []

    def kind(self, rel: str) -> str:
        """``file`` when an object has exactly this name, ``dir`` when objects lie under it, else ``absent``."""
        if self.bucket.blob(self._key(rel)).exists():
            return "file"
        key = self._key(rel).rstrip("/") + "/"
        under = self.bucket.client.list_blobs(self.bucket_name, prefix=key, max_results=1)
        return "dir" if any(True for _ in under) else "absent"


def make_gcs_client():
    """A google-cloud-storage client with the credentials ``credentials_source`` names."""
    from google.cloud import storage

    source = credentials_source()
    if source == "anonymous":
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=os.environ.get("GCS_PROJECT", "local"), credentials=AnonymousCredentials())
    if source == "adc":
        return storage.Client()
    return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT"), credentials=pod_credentials())


def credentials_source() -> str:
    """Where the store's credentials come from.

    ``anonymous`` against an emulator (unless a metadata server is configured beside it, as the real-controller
    tier does), ``pod`` in a pod with no key file (Workload Identity's metadata server), ``adc`` elsewhere (a key
    file, gcloud's login).
    """
    if os.environ.get("STORAGE_EMULATOR_HOST") and not os.environ.get("GCE_METADATA_HOST"):
        return "anonymous"
    from jaxrec.adapters.kube import in_pod

    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or not in_pod():
        return "adc"
    return "pod"


def pod_credentials():
    """The metadata server's credentials (Workload Identity on GKE), asking it nothing until a token is needed.

    ``google.auth.default()`` decides by pinging the metadata server (3 tries, 3 s each), and the GKE metadata
    server is known not to answer in a pod's first seconds (google-auth-library-python issue 1261): a blip then
    reads as "no credentials", a configuration error that ends the run. A metadata server that does not answer
    when a token is needed is a ``RefreshError`` that ``is_transient`` knows. The universe domain is given
    (``GOOGLE_CLOUD_UNIVERSE_DOMAIN``, default googleapis.com) so that making the client asks the metadata server
    nothing either (google-auth 2.63.0 ``compute_engine/credentials.py``).
    """
    from google.auth import compute_engine

    return compute_engine.Credentials(universe_domain=os.environ.get("GOOGLE_CLOUD_UNIVERSE_DOMAIN", "googleapis.com"))


def share_credentials_with_gcsfs() -> None:
    """In a pod: gcsfs takes the same metadata-server credentials as the store.

    gcsfs serves the ``gs://`` paths of orbax and of JAX's compilation cache (through etils.epath). Left to itself
    it asks ``google.auth.default()`` (a metadata ping) and, when that fails, goes on as an anonymous caller
    without a word (gcsfs ``credentials.py`` ``connect``: google_default, cache, cloud, anon): a metadata blip at
    start-up becomes a 401 on every read and the attempt an "application error". Set as fsspec's default for the
    ``gcs`` protocol (``fsspec.config.conf``), before any gcsfs filesystem is made.
    """
    if credentials_source() != "pod":
        return
    import fsspec.config

    fsspec.config.conf.setdefault("gcs", {})["token"] = pod_credentials()


def await_credentials(deadline_s: float, *, clock=time.monotonic, sleep=time.sleep) -> None:
    """In a pod: wait, up to ``deadline_s``, until the metadata server gives a token; raise its last error after.

    For a program whose other GCS clients decide once what credentials they have: tensorstore asks the metadata
    server whether it runs on GCE once per process, 3 tries within about a second, and without an answer works
    with no credentials for good (tensorstore ``internal/oauth2/google_auth_provider.cc``). A refusal (403, 404)
    is raised at once.
    """
    if credentials_source() != "pod":
        return
    from google.auth.exceptions import RefreshError
    from google.auth.transport.requests import Request

    creds, end, delay = pod_credentials(), clock() + deadline_s, 0.5
    while True:
        try:
            creds.refresh(Request())
            return
        except RefreshError as e:
            if not metadata_unavailable(e) or clock() + delay > end:
                raise
        sleep(delay)
        delay = min(2 * delay, 8.0)


def metadata_unavailable(e: BaseException) -> bool:
    """True when ``e`` is the metadata server unavailable, not refusing.

    Not answering, timing out, or answering 5xx or 429 after google-auth's own retries: its ``TransportError``, as
    the cause of a ``RefreshError`` when a token was asked for.
    """
    from google.auth.exceptions import RefreshError, TransportError

    cause = e.__cause__ if isinstance(e, RefreshError) else e
    if not isinstance(cause, TransportError):
        return False
    # google-auth passes the response only when the status was final (not one it retries): a 403 or 404 refuses.
    response = cause.args[1] if len(cause.args) > 1 else None
    status = getattr(response, "status", None)
    return status is None or status >= 500 or status == 429


def split_gcs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``."""
    rest = url.removeprefix("gs://")
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


class RunStore:
    """The documents and checkpoints of one run, under ``<root>/runs/<run_id>/``."""

    def __init__(self, root: str, run_id: str, *, gcs_client: Any = None):
        from jaxrec.model.config import run_id_problem

        # The run id names a folder: one syntax (the config's) keeps every write under runs/<run-id>/.
        problem = run_id_problem(run_id)
        if problem:
            raise ValueError(f"run store: {problem}")
        self.root = root
        self.run_id = run_id
        if root.startswith("gs://"):
            bucket, prefix = split_gcs_url(root)
            run_prefix = "/".join(p for p in (prefix, "runs", run_id) if p)
            self._b: _Backend = GcsBackend(bucket, run_prefix, gcs_client)
        else:
            self._b = LocalBackend(Path(root).resolve() / "runs" / run_id)
        self._generations: dict[str, int] = {}  # what this store last wrote at each path (write_bytes)

    @classmethod
    def for_config(cls, cfg: Any, **kw: Any) -> RunStore:
        """The run store of a JobConfig."""
        return cls(cfg.storage.root, cfg.run_id, **kw)

    def bounded(self, deadline_s: float) -> RunStore:
        """The same run's store with each call retried for ``deadline_s`` at most.

        For a writer on the training thread (a heartbeat), whose write is worth less than a step's wait.
        """
        twin = copy.copy(self)
        twin._generations = {}
        if isinstance(self._b, GcsBackend):
            twin._b = self._b.bounded(deadline_s)
        return twin

    @property
    def is_gcs(self) -> bool:
        """True when the store is on GCS."""
        return isinstance(self._b, GcsBackend)

    def url(self, rel: str = "") -> str:
        """Absolute location (``gs://...`` or a local path) of ``rel``, for orbax and for people."""
        return self._b.url(rel)

    def read_bytes(self, rel: str) -> bytes | None:
        """Contents of ``rel``, or None when absent."""
        got = self._b.read(rel)
        return None if got is None else got[0]

    def read_json(self, rel: str) -> Any | None:
        """Parsed JSON at ``rel``, or None when absent (raises ValueError when it is not JSON)."""
        data = self.read_bytes(rel)
        return None if data is None else json.loads(data)

    def read_json_versioned(self, rel: str) -> tuple[Any | None, int]:
        """Parsed JSON and its generation (0 when absent), for a later conditional write."""
        got = self._b.read(rel)
        if got is None:
            return None, 0
        return json.loads(got[0]), got[1]

    def write_bytes(
        self, rel: str, data: bytes, *, if_generation_match: int | None = None, idempotent: bool = False
    ) -> int:
        """Write ``rel`` atomically; with ``if_generation_match`` only if unchanged (0: only if absent).

        Every write is conditional, so the storage client retries it on a transient answer (a 429, a 503, a
        reset). Without ``if_generation_match`` the last writer wins: each try is conditional on the generation this
        store last wrote or saw there (its metadata read first when it has none), so a retry can never put an older
        try over a newer write; a precondition failure whose object holds these very bytes is an earlier try that
        succeeded unseen (its answer lost): done; one holding other bytes is another writer's, whose generation the
        next try takes (``PUT_TRIES`` in all). With ``if_generation_match`` a precondition failure is the caller's,
        unless ``idempotent``: the document is the same state whoever wrote it (a pinned config, a create-only
        record), so these very bytes there are done. A read-modify-write must not say so: another writer's equal
        bytes are a lost update there.

        Raises:
            PreconditionFailed: ``if_generation_match`` did not hold, or every try met another writer's object.
        """
        if if_generation_match is not None:
            try:
                gen = self._b.write(rel, data, if_generation_match)
            except PreconditionFailed:
                got = self._b.read(rel) if idempotent else None
                if got is None or got[0] != data:
                    raise
                gen = got[1]
            self._generations[rel] = gen
            return gen
        expected = self._generations.get(rel)
        for _ in range(PUT_TRIES):
            if expected is None:
                expected = self._b.generation(rel)
            try:
                gen = self._b.write(rel, data, expected)
            except PreconditionFailed:
                got = self._b.read(rel)
                if got is not None and got[0] == data:
                    gen = got[1]
                else:
                    expected = 0 if got is None else got[1]
                    continue
            self._generations[rel] = gen
            return gen
        self._generations.pop(rel, None)
        raise PreconditionFailed(f"{self.url(rel)}: another writer changed it on each of {PUT_TRIES} tries")

    def write_json(
        self, rel: str, obj: Any, *, if_generation_match: int | None = None, idempotent: bool = False
    ) -> int:
        """Write ``obj`` as indented, key-sorted JSON (see ``write_bytes``)."""
        return self.write_bytes(rel, _json_bytes(obj), if_generation_match=if_generation_match, idempotent=idempotent)

    def create_record(self, rel: str, record: BaseModel) -> int:
        """Write ``record`` at ``rel`` only if nothing is there, idempotent (``write_bytes``): retried when transient.

        Raises:
            PreconditionFailed: ``rel`` holds another document.
        """
        data = _json_bytes(record.model_dump(mode="json", by_alias=True))
        return self.write_bytes(rel, data, if_generation_match=0, idempotent=True)

    def read_record(self, rel: str, model: type[R]) -> R | None:
        """The record at ``rel``, or None when absent.

        Raises:
            DocumentError: The document is not JSON, not a ``model``, or another run's.
        """
        data = self.read_bytes(rel)
        return None if data is None else parse_document(data, model, self.url(rel), run_id=self.run_id)

    def read_record_versioned(self, rel: str, model: type[R]) -> tuple[R | None, int]:
        """The record at ``rel`` and its generation (None, 0 when absent), for a later conditional write."""
        got = self._b.read(rel)
        if got is None:
            return None, 0
        return parse_document(got[0], model, self.url(rel), run_id=self.run_id), got[1]

    def update_record(
        self,
        rel: str,
        model: type[R],
        mutate: Callable[[R | None], R | None],
        *,
        tries: int = 5,
        pause: Callable[[int], None] | None = None,
    ) -> R | None:
        """Read-modify-write the record at ``rel`` under its generation; a lost race reads and decides again.

        ``mutate(current)`` (None: absent) returns the record to write, or ``current`` itself (or None) to write
        nothing; it may raise to give up (what it raises goes to the caller). ``pause(i)`` runs after the
        ``i``-th lost race when another try follows (None: try again at once).

        Returns:
            The record as written, or as read when ``mutate`` wrote nothing.

        Raises:
            Contended: every one of ``tries`` conditional writes lost its race.
            DocumentError: the record there is damaged.
        """
        for i in range(tries):
            current, gen = self.read_record_versioned(rel, model)
            new = mutate(current)
            if new is None or new is current:
                return current
            try:
                self.write_record(rel, new, if_generation_match=gen)
                return new
            except PreconditionFailed:
                if pause is not None and i + 1 < tries:
                    pause(i)
        raise Contended(f"{self.url(rel)}: still contended after {tries} tries")

    def write_record(
        self, rel: str, record: BaseModel, *, if_generation_match: int | None = None, idempotent: bool = False
    ) -> int:
        """Write ``record`` at ``rel`` as JSON (see ``write_bytes``)."""
        dump = record.model_dump(mode="json", by_alias=True)
        return self.write_json(rel, dump, if_generation_match=if_generation_match, idempotent=idempotent)

    def checkpoint_steps(self) -> list[int]:
        """Steps of the directories under ``checkpoints/``, ascending (complete or not: verification decides)."""
        return self._numbered(RunLayout.CHECKPOINTS)

    def attempts(self) -> list[int]:
        """Numbers of the attempts that have a folder under ``attempts/``, ascending."""
        return self._numbered(RunLayout.ATTEMPTS)

    def _numbered(self, prefix: str) -> list[int]:
        return sorted(n for n in map(RunLayout.parse_step, self.children(prefix)) if n is not None)

    def exists(self, rel: str) -> bool:
        """True when ``rel`` is an object or a non-empty directory."""
        return self._b.read(rel) is not None or bool(self._b.list(rel))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursive), sorted by name, names relative to the run."""
        return self._b.list(prefix)

    def children(self, prefix: str) -> list[str]:
        """Names of the immediate children (files or folders) of ``prefix``."""
        base = prefix.rstrip("/") + "/"
        names = {o.name[len(base) :].split("/", 1)[0] for o in self._b.list(prefix) if o.name.startswith(base)}
        if not self.is_gcs:
            # Empty local directories hold no objects but are still children.
            d = Path(self.url(prefix))
            if d.is_dir():
                names |= {p.name for p in d.iterdir() if not p.name.startswith(".")}
        return sorted(names)

    def crc32c(self, rel: str) -> tuple[str, int] | None:
        """CRC32C (8 hex digits) and size of ``rel``, None when absent: GCS's metadata, or streamed locally."""
        return self._b.crc32c(rel)

    def odd(self, prefix: str) -> list[str]:
        """Entries under ``prefix`` that are not plain directories or readable regular files (local only)."""
        return self._b.odd(prefix)

    def kind(self, rel: str) -> str:
        """What ``rel`` is: ``dir``, ``file``, ``link``, ``other`` or ``absent`` (links are not followed)."""
        return self._b.kind(rel)

    def move(self, src_prefix: str, dst_prefix: str) -> int:
        """Move everything under ``src_prefix`` to ``dst_prefix``; return how many objects moved (0: nothing there).

        Local: one ``rename`` (atomic; POSIX rename(2) replaces an empty directory, so the destination is
        first created empty and exclusively: ``FileExistsError`` when it is taken); a source that is a
        link or a file is renamed into the new directory (``dst/<name>``). A source another
        process moved first is 0, not an error. GCS: every object is copied, then every object deleted;
        an object that vanished meanwhile (a concurrent mover got it) is skipped, so whichever mover
        deletes first has already copied everything it listed.
        """
        if not self.is_gcs:
            src, dst = Path(self.url(src_prefix)), Path(self.url(dst_prefix))
            if not os.path.lexists(src):
                return 0
            n = len(self._b.list(src_prefix))  # objects, as list() counts them (lock files excluded)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(dst)  # exclusive: raises FileExistsError when the name is taken
            # A link or a file is moved into a new directory of its own, so that what is written into the
            # quarantine entry afterwards (its reason) never goes through a link.
            try:
                os.rename(src, dst if src.is_dir() and not src.is_symlink() else dst / src.name)
            except FileNotFoundError:
                dst.rmdir()
                return 0
            return max(n, 1)
        objs = self._b.list(src_prefix)
        b = self._b
        assert isinstance(b, GcsBackend)
        # Server-side copies (a quarantined step of any size costs no memory and no traffic here), MOVE_THREADS at a
        # time: a step is one object per array chunk and file, and a restart waits for its torn step to be set
        # aside. Every copy has ended before the first delete.
        with ThreadPoolExecutor(max_workers=MOVE_THREADS) as pool:
            copied = sum(pool.map(lambda o: b.copy(o.name, dst_prefix + o.name[len(src_prefix) :]), objs))
            list(pool.map(lambda o: b.delete(o.name), objs))
        return copied

    def delete(self, rel: str) -> None:
        """Delete one object (never used on checkpoints: those are moved to quarantine)."""
        self._b.delete(rel)


@dataclass(frozen=True)
class AttemptRef:
    """One attempt of one run: the run store's root, the run id and the attempt number a step acts on."""

    store_root: str
    run_id: str
    attempt: int

    @classmethod
    def of(cls, args: Any) -> AttemptRef:
        """The attempt a step's parsed arguments name (``--store-root``, ``--run-id``, ``--attempt``)."""
        return cls(args.store_root, args.run_id, args.attempt)

    def store(self) -> RunStore:
        """The run's store."""
        return RunStore(self.store_root, self.run_id)


def _json_bytes(obj: Any) -> bytes:
    """A document as the store writes it: indented, key-sorted JSON."""
    return json.dumps(obj, indent=2, sort_keys=True, default=str).encode()


def store_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the run store cannot be reached (local files, GCS, its HTTP transport)."""
    import requests
    from google.api_core.exceptions import GoogleAPIError
    from google.auth.exceptions import GoogleAuthError

    return (OSError, GoogleAPIError, GoogleAuthError, requests.exceptions.RequestException)


def is_transient(e: BaseException) -> bool:
    """True when ``e`` says the store was unreachable or overloaded (retrying can help), not refused or absent."""
    import requests
    from google.api_core import exceptions as gexc
    from google.auth.exceptions import TransportError

    if isinstance(e, (gexc.TooManyRequests, gexc.ServerError, gexc.RetryError, TransportError)):
        return True
    if metadata_unavailable(e):
        return True
    if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError, TimeoutError)):
        return True
    # A local store on a network filesystem that went away (stale handle, I/O error, not connected).
    return isinstance(e, OSError) and e.errno in (errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.EHOSTDOWN)


@contextlib.contextmanager
def transient_as_unavailable(where: str):
    """Turn a transient store failure into ``StoreUnavailable`` with one line naming ``where``."""
    try:
        yield
    except store_errors() as e:
        if not is_transient(e):
            raise
        raise StoreUnavailable(f"run store {where} unreachable: {type(e).__name__}: {first_line(e)}") from None
