"""The job config: one frozen pydantic tree, parsed once at each entry point.

Static rules here run without importing JAX (this is what ``validate-config`` runs); rules that
need devices run in the trainer after ``jax.distributed.initialize()``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from yaml.constructor import ConstructorError

from jaxrec.model.contract import FAILURE_CLASSES, FailureClass
from jaxrec.model.names import POD_NAME_MAX, longest_pod_name
from jaxrec.model.tasks import BUILTIN_TASKS, TaskError, TaskSpec, resolve_task, validate_options
from jaxrec.model.tpu import LOCAL, TPU_TYPES

_GCS_URL = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$")
_NAMED = re.compile(r"^[a-z_]+(\.[a-z_]+)+: ")
_RUN_ID = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# An OCI image reference as the container runtimes parse it (github.com/distribution/reference, regexp.go): an
# optional registry host[:port], lowercase path components, an optional tag, an optional digest; the name
# (registry and path) is at most 255 characters.
_IMAGE_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_IMAGE_REF = re.compile(
    rf"^((?:{_IMAGE_HOST}/)?{_IMAGE_COMPONENT}(?:/{_IMAGE_COMPONENT})*)(?::\w[\w.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)

RUN_ID_MAX = 40
"""Longest run id (``_RUN_ID``); the slice's pod names may allow fewer (``run_id_pod_name_problem``)."""
ATTEMPT_CEILING = 99_999
"""Highest attempt number of any run: the step programs refuse a larger one. A run whose retry policy sets no
lower bound (a class budgeted ``since_progress``: a run that keeps checkpointing keeps retrying) must allow
attempt numbers of this many digits in its pod names."""
SEED_MAX = 2**31 - 1
"""Seeds are kept as int32 JAX arrays in the training state (and numpy refuses negative seeds)."""
MAX_CONFIG_BYTES = 1 << 20
"""A job config is a few KB; anything beyond 1 MiB is refused unread."""
MAX_DEPTH = 32
"""Deepest YAML nesting accepted (the config tree is four levels deep)."""
MAX_ALIASES = 32
"""YAML aliases accepted per file: enough for shared anchors, too few for an alias bomb."""
MAX_NODES = 20_000
"""Values in the config after aliases are expanded."""
RUN_PATH_RESERVE = 200
"""Bytes kept for the longest path the run writes under ``runs/<run-id>/`` (a checkpoint's array chunk moved to
``quarantine/<step>.attempt<n>.<k>/``, under 120 bytes), with room for orbax's own names."""
MAX_PROBLEMS = 20
"""Problems listed per rejected config; the rest are counted."""
MAX_LINE = 300
"""Characters per problem line."""


def run_id_problem(value: str) -> str | None:
    """Why ``value`` is not a valid run id, or None. The one run-id syntax of the project (config, CLIs, store)."""
    if _RUN_ID.match(value):
        return None
    shown = value if len(value) <= 60 else value[:57] + "..."
    return (
        f"{shown!r} is not a valid run id; use 1-40 lowercase letters, digits and '-', starting and "
        "ending with a letter or digit"
    )


MAX_TERMINATION_GRACE_S = 3600
"""Longest pod grace accepted: GKE's node shutdown gives at most 120 s; a deleted pod waits its full grace."""

INT_MAX = 2**31 - 1
"""Largest integer any config field takes: steps, seeds and counters live in int32 arrays or Argo parameters."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kinds(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (unions and a mapping's values looked into)."""
    args = get_args(annotation)
    if get_origin(annotation) is dict:
        return _kinds(args[1])
    if not args:
        return {annotation}
    return set().union(*(_kinds(a) for a in args))


class _Section(BaseModel):
    # allow_inf_nan=False: an infinite backoff or a NaN rate cannot be acted on; refuse it here.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic reads `true` as 1 where a number is meant (`hosts: true` would be one host): refuse it.
        kinds = _kinds(cls.model_fields[info.field_name].annotation) if info.field_name else set()
        values = v.values() if isinstance(v, dict) else (v,)
        if bool not in kinds and kinds & {int, float} and any(isinstance(x, bool) for x in values):
            raise ValueError(f"{_short(v)} is a boolean where a number is meant; give a number")
        return v

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_ints(cls, v: Any) -> Any:
        values = v.values() if isinstance(v, dict) else (v,)
        for x in values:
            if isinstance(x, int) and not isinstance(x, bool) and abs(x) > INT_MAX:
                raise ValueError(f"{_short(x)} is out of range; integers here are at most {INT_MAX}")
        return v


class SliceConfig(_Section):
    """Where the gang runs: a TPU slice on GKE (one host or many), or local CPU processes."""

    accelerator: str = Field(description=f"TPU type ({', '.join(TPU_TYPES)}) or '{LOCAL}' for CPU processes.")
    topology: str | None = Field(
        default=None,
        description="TPU topology such as '4x4' or '4x4x4' (a single-host one such as '2x2' or '2x2x1' is a gang "
        "of one process); required for TPU, unset for local.",
    )
    hosts: int | None = Field(
        default=None,
        ge=1,
        description="Number of hosts (one JAX process each). Required for local; derived from the topology "
        "for TPU (if given, it must agree).",
    )
    devices_per_host: int = Field(
        default=1, ge=1, le=8, description="Local only: CPU devices per process (XLA host platform devices)."
    )
    local_devices: Literal["cpu", "accelerator"] = Field(
        default="cpu",
        description="Local only: 'cpu' (XLA host devices, the default) or 'accelerator': the worker uses this "
        "machine's own accelerator (a TPU VM's chips); one program at a time can hold a chip, so hosts must be 1.",
    )
    spot: bool = Field(default=False, description="Schedule on Spot VMs (preemptible; TPU only).")
    reservation: str | None = Field(default=None, description="GKE reservation name to consume (TPU only).")
    maintenance_window_s: int = Field(
        default=7200,
        ge=0,
        description="provision-slice: a node whose scheduled maintenance (cloud.google.com/scheduled-maintenance-time) "
        "falls within this many seconds is not used (see on_scheduled_maintenance).",
    )
    on_scheduled_maintenance: Literal["wait", "proceed"] = Field(
        default="wait",
        description="'wait': provision-slice exits 75 (capacity, retried with backoff) while maintenance is due "
        "within maintenance_window_s; 'proceed': start anyway (the attempt may be cut short).",
    )
    worker_cpu: float | None = Field(
        default=None,
        gt=0,
        description="CPU request of each worker pod (TPU only; default: 80% of the machine type's vCPUs, from the "
        "TPU table). google.com/tpu alone does not count for QoS: without it a worker is BestEffort.",
    )
    worker_memory_gib: float | None = Field(
        default=None, gt=0, description="Memory request of each worker pod in GiB (TPU only; default: 80% of the VM)."
    )
    termination_grace_s: int = Field(
        default=30,
        ge=1,
        le=MAX_TERMINATION_GRACE_S,
        description="terminationGracePeriodSeconds of each worker pod: SIGTERM to SIGKILL when the pod is deleted "
        "(JobSet teardown, eviction). GKE Spot VMs get a 30 s preemption notice; host errors and auto-repair give "
        "no graceful shutdown at all (GKE docs 'Spot VMs', 'Handle disruption for GPU and TPU nodes').",
    )
    shutdown_window_s: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TERMINATION_GRACE_S,
        description="Seconds the node really gives a worker between SIGTERM and the kill on a node shutdown "
        "(unset: termination_grace_s). On Spot, non-system pods get the first 15 s of the 30 s notice unless "
        "graceful node shutdown is configured longer (GKE >= 1.35 node system config, up to 120 s). The trainer "
        "saves on SIGTERM only when its measured save time fits this window.",
    )

    @field_validator("reservation")
    @classmethod
    def _check_reservation(cls, v: str | None) -> str | None:
        # A GCE resource name (RFC 1035 label): it goes into a node selector value.
        if v is not None and not re.match(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$", v):
            raise ValueError(f"{_short(v)} is not a reservation name; use 1-63 lowercase letters, digits and '-'")
        return v

    @model_validator(mode="after")
    def _check_shutdown_window(self) -> SliceConfig:
        w = self.shutdown_window_s
        if w is not None and w > self.termination_grace_s:
            # The kubelet kills the container after the pod's grace period whatever the node would allow
            # (Kubernetes docs "Graceful node shutdown": pods get min(their grace, the node's period)).
            raise ValueError(
                f"slice.shutdown_window_s: {w} exceeds slice.termination_grace_s {self.termination_grace_s}; "
                "the pod is killed after its grace period whatever the node gives: make it at most "
                f"{self.termination_grace_s} or raise termination_grace_s"
            )
        return self

    @property
    def preemption_window_s(self) -> int:
        """Seconds between SIGTERM and the kill a worker can count on (the node's window, else the pod's grace)."""
        return self.termination_grace_s if self.shutdown_window_s is None else self.shutdown_window_s

    @model_validator(mode="after")
    def _check_shape(self) -> SliceConfig:
        acc = self.accelerator
        if acc == LOCAL:
            if self.hosts is None:
                raise ValueError("slice.hosts: required for accelerator 'local' (e.g. hosts: 4)")
            if self.topology is not None:
                raise ValueError(
                    f"slice.topology: {self.topology!r} given for accelerator 'local'; remove it "
                    "(local slices have only a host count)"
                )
            if self.local_devices == "accelerator" and self.hosts != 1:
                raise ValueError(
                    f"slice.local_devices: 'accelerator' with hosts {self.hosts}; one program at a time can hold "
                    "this machine's chips: set hosts: 1 (a gang of one)"
                )
            return self
        tpu = TPU_TYPES.get(acc)
        if tpu is None:
            raise ValueError(f"slice.accelerator: unknown accelerator {acc!r}; valid: {', '.join([*TPU_TYPES, LOCAL])}")
        valid = (
            f"single-host: {', '.join(tpu.single_host_topologies)}; multi-host: {', '.join(tpu.multi_host_topologies)}"
        )
        if self.topology is None:
            raise ValueError(f"slice.topology: required for {acc} ({valid})")
        if self.topology not in tpu.topologies:
            raise ValueError(f"slice.topology: {self.topology!r} is not a valid {acc} topology ({valid})")
        vm = tpu.vm(self.topology)
        if self.local_devices != "cpu":
            raise ValueError(
                f"slice.local_devices: applies to accelerator 'local' only; a {acc} slice runs on its chips: remove it"
            )
        # Not "given at all": a stored config carries every field, the default (1) included.
        if self.devices_per_host != 1:
            raise ValueError(
                f"slice.devices_per_host: applies to accelerator 'local' only; a {acc} {self.topology} VM "
                f"({vm.name}) has {vm.chips} chips (from the TPU table): remove it"
            )
        derived = tpu.hosts(self.topology)
        if self.hosts is not None and self.hosts != derived:
            raise ValueError(
                f"slice.hosts: {self.hosts} contradicts topology {self.topology} of {acc} "
                f"({tpu.chips(self.topology)} chips / {vm.chips} per VM = {derived} hosts); "
                f"set hosts: {derived} or remove it"
            )
        return self

    @property
    def is_cpu(self) -> bool:
        """The CPU slice (``accelerator: local``): one machine's CPU processes stand in for the hosts of a slice.

        A kind of slice, not a world: it runs under the local runner's cluster and on a real one alike.
        """
        return self.accelerator == LOCAL

    @property
    def num_hosts(self) -> int:
        """Number of hosts (JAX processes) in the gang."""
        if self.is_cpu:
            assert self.hosts is not None
            return self.hosts
        return TPU_TYPES[self.accelerator].hosts(self.topology or "")

    def worker_requests(self) -> dict[str, str]:
        """CPU and memory requests of one worker pod (empty for the CPU slice)."""
        if self.is_cpu:
            return {}
        vm = TPU_TYPES[self.accelerator].vm(self.topology or "")
        cpu = self.worker_cpu if self.worker_cpu is not None else vm.worker_cpu
        mem = self.worker_memory_gib if self.worker_memory_gib is not None else vm.worker_memory_gib
        return {"cpu": f"{cpu:g}", "memory": f"{mem:g}Gi"}

    @property
    def devices_per_process(self) -> int:
        """Accelerator devices each process sees (TPU chips per VM, or local CPU devices)."""
        return self.devices_per_host if self.is_cpu else TPU_TYPES[self.accelerator].vm(self.topology or "").chips


class StorageConfig(_Section):
    """The run store: where config, checkpoints, ledger and reports live."""

    root: str = Field(
        description="'gs://bucket/prefix' on GKE, or a local directory (relative paths are relative to "
        "the working directory)."
    )
    durable_mount: bool = Field(
        default=False,
        description="Declare that a local root is a durable volume mounted at the same path in every pod "
        "(for example Cloud Storage FUSE or Filestore); required for a local root on a TPU slice.",
    )

    @field_validator("root")
    @classmethod
    def _check_root(cls, v: str) -> str:
        if v.startswith("gs://"):
            if not _GCS_URL.match(v):
                raise ValueError(
                    f"{v!r} is not a GCS bucket URL; expected gs://BUCKET[/PREFIX] with a bucket name of "
                    "3-222 lowercase letters, digits, '-', '_' or '.'"
                )
            return v.rstrip("/")
        if "://" in v:
            raise ValueError(f"{v!r}: only gs:// URLs or local directories are supported")
        if not v.strip():
            raise ValueError("empty or blank; give gs://BUCKET/PREFIX or a local directory")
        if len(v) > 1024 or "\x00" in v:
            raise ValueError(f"{_short(v)} is not a usable path; give a local directory of at most 1024 characters")
        return v

    @property
    def is_gcs(self) -> bool:
        """True when the run store is on GCS."""
        return self.root.startswith("gs://")


class ModelConfig(_Section):
    """Decoder-only transformer language model sizes."""

    vocab_size: int = Field(default=256, ge=2, description="Vocabulary size.")
    d_model: int = Field(default=64, ge=8, description="Residual stream width.")
    n_layers: int = Field(default=2, ge=1, description="Number of transformer blocks.")
    n_heads: int = Field(default=4, ge=1, description="Attention heads per block.")
    d_ff: int = Field(default=256, ge=8, description="Hidden width of the MLP.")
    seq_len: int = Field(default=32, ge=2, description="Tokens per training sequence.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="Compute dtype; 'auto' is bfloat16 on TPU and float32 on the CPU."
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.n_heads: {self.n_heads} does not divide model.d_model {self.d_model}; "
                "choose n_heads that divides d_model"
            )
        return self


class OptimizerConfig(_Section):
    """AdamW with linear warm-up, cosine decay and gradient clipping."""

    name: Literal["adamw"] = Field(default="adamw", description="Optimizer type.")
    learning_rate: float = Field(default=3e-3, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(default=10, ge=0, description="Linear warm-up steps.")
    end_learning_rate_fraction: float = Field(
        default=0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak (cosine decay)."
    )
    weight_decay: float = Field(default=0.01, ge=0, description="Decoupled weight decay.")
    b1: float = Field(default=0.9, gt=0, lt=1, description="Adam beta1.")
    b2: float = Field(default=0.95, gt=0, lt=1, description="Adam beta2.")
    grad_clip_norm: float = Field(default=1.0, gt=0, description="Global gradient norm clip.")


class DataConfig(_Section):
    """The deterministic input pipeline: grain over the task's generated examples or over record files."""

    dataset: Literal["synthetic", "records"] = Field(
        default="synthetic",
        description="'synthetic': the examples the task generates from data.seed (nothing is read); "
        "'records': ArrayRecord files matched by data.files.",
    )
    files: str | None = Field(
        default=None,
        description="dataset 'records' only: a glob of ArrayRecord files, gs://BUCKET/PATH/*.array_record or "
        "a local path; the files' fingerprint (names, sizes, checksums) is the dataset version.",
    )
    dataset_version: str = Field(
        default="synthetic-v1", description="Version recorded in every checkpoint; a change is incompatible."
    )
    num_records: int = Field(default=4096, ge=1, description="Sequences in the dataset (one epoch).")
    global_batch_size: int = Field(default=16, ge=1, description="Sequences per step across all hosts.")
    seed: int = Field(default=1234, ge=0, le=SEED_MAX, description="Seed of the data order (0 to 2**31-1).")
    resume_mode: Literal["exact", "reshuffle"] = Field(
        default="exact",
        description="'exact': resume at the same logical dataset position; 'reshuffle': a new order "
        "seeded by the restored step.",
    )
    worker_count: int = Field(
        default=0, ge=0, description="grain worker processes per host: only 0 (in-process) is supported."
    )
    read_threads: int = Field(
        default=4, ge=1, le=64, description="Threads per host preparing local batches ahead of the step."
    )
    prefetch_batches: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Local batches prepared ahead of the step per host. Each prefetched element is a whole "
        "batch; grain's default buffer of 500 would prepare 500 steps ahead at every (re)start.",
    )

    @model_validator(mode="after")
    def _check_files(self) -> DataConfig:
        if self.dataset == "records" and not self.files:
            raise ValueError(
                "data.files: required for dataset 'records'; give a glob such as gs://BUCKET/data/*.array_record "
                "(write one with python -m trainer.write_records)"
            )
        if self.dataset != "records" and self.files:
            raise ValueError("data.files: only read with dataset: records; remove it or set dataset: records")
        if self.files and ("://" in self.files and not self.files.startswith("gs://")):
            raise ValueError(f"data.files: {_short(self.files)}: only gs:// globs or local paths are supported")
        if self.worker_count:
            raise ValueError(
                f"data.worker_count: {self.worker_count}: grain worker processes are not used by this trainer "
                "(batches are prepared in-process by data.read_threads threads); set it to 0"
            )
        return self


class TaskConfig(_Section):
    """What is trained: a built-in task or the user's ``package.module:ATTR`` TaskSpec, and its options."""

    name: str = Field(
        default="lm",
        description=f"Built-in task ({', '.join(BUILTIN_TASKS)}) or 'package.module:ATTR' naming a TaskSpec in a "
        "module that imports without JAX.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's options, validated by the task's own options model (the built-in lm task "
        "reads its options from the model section instead).",
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        # Resolved here, once: the options are replaced by their validated form (defaults filled in), so
        # the config hash and the manifest's options hash do not depend on how they were spelt.
        if not isinstance(data, dict) or not isinstance(data.get("name", "lm"), str):
            return data
        name = data.get("name", "lm")
        options = data.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"task.options: must be a mapping of option names to values, got {_short(options)}")
        try:
            spec = resolve_task(name)
            if name in BUILTIN_TASKS:
                if options:
                    raise TaskError(
                        f"task.options: the built-in {name} task reads its options from the model section; "
                        "move them there"
                    )
                return data
            valid = validate_options(spec, options)
        except TaskError as e:
            raise ValueError(str(e)) from None
        return {**data, "options": valid.model_dump(mode="json")}

    def spec(self) -> TaskSpec:
        """The TaskSpec ``name`` stands for (imports its JAX-free module)."""
        return resolve_task(self.name)


class TrainingConfig(_Section):
    """Length of training, parallelism, and the timeouts that make a failure visible fast."""

    total_steps: int = Field(default=60, ge=1, description="Training ends (exit 0) after this many steps.")
    seed: int = Field(
        default=0, ge=0, le=SEED_MAX, description="Seed of parameter init and the step RNG (0 to 2**31-1)."
    )
    sharding: Literal["data", "fsdp"] = Field(
        default="data", description="'data': replicated parameters; 'fsdp': parameters sharded over hosts."
    )
    heartbeat_timeout_s: int = Field(
        default=5,
        ge=1,
        description="JAX coordination heartbeat timeout: a dead peer is noticed within it. Default 5 locally, "
        "1200 on TPU (TPU_TIMEOUT_DEFAULTS).",
    )
    init_timeout_s: int = Field(
        default=120,
        ge=5,
        description="How long jax.distributed.initialize waits for every process. Default 120 locally, 1800 on TPU.",
    )
    shutdown_timeout_s: int = Field(default=10, ge=1, description="JAX distributed shutdown barrier timeout.")
    steps_ahead: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Steps the host dispatches beyond the one whose loss it reads: a pause of the host shorter "
        "than this many steps (an asynchronous save's own work held it up to 1 s on a TPU v5e) costs the "
        "accelerator nothing; a stop read in step n takes effect after step n + steps_ahead, and the queue "
        "empties only at a save that reads the live state (synchronous, or no device copy fits). About 1 s of "
        "steps on an "
        "accelerator (docs/PERFORMANCE.md).",
    )
    hang_timeout_s: int = Field(
        default=60,
        ge=1,
        description="Watchdog: exit with the hang code when no step completes within this many seconds "
        "(the first step's compilation is allowed compile_grace_s more).",
    )
    compile_grace_s: int = Field(
        default=240,
        ge=0,
        description="Extra watchdog time for the first step; never less than twice the longest start-up (runtime "
        "ready to first step) of the run's latest earlier attempts, as their exit reports say.",
    )
    compilation_cache: bool = Field(
        default=True,
        description="JAX's persistent compilation cache, on unless false: the next attempt reuses the compiled "
        "step instead of compiling it again.",
    )
    compilation_cache_dir: str | None = Field(
        default=None,
        description="Where the compilation cache lives (local path or gs://); default "
        "<storage.root>/runs/<run_id>/compilation-cache.",
    )
    step_delay_s: float = Field(
        default=0.0, ge=0, description="Sleep after each step (local rehearsals: stretch a run to watch it)."
    )


class LocalTierConfig(_Section):
    """The host-local checkpoint tiers: each host saves its part to its own disk and copies it to peer hosts.

    A local or peer copy carries the same kind of manifest as a GCS step (sizes, CRC32C, SHA-256, written last)
    and is restored only when it verifies; see docs/CHECKPOINTS.md, "Local and peer tiers".
    """

    interval_steps: int | None = Field(
        default=None,
        ge=1,
        description="Save each host's part to its local directory every this many steps (unset: no local tiers).",
    )
    directory: str = Field(
        default="/jaxrec-local",
        description="Where the local directory is mounted in each worker pod (a node-local volume, never emptyDir).",
    )
    host_path: str = Field(
        default="/mnt/stateful_partition/jaxrec-local",
        description="The node's directory mounted there (hostPath; GKE: local SSD or a RAM disk mounted on the node).",
    )
    keep: int = Field(default=2, ge=1, description="Newest local steps kept per part on each host.")
    peers: int = Field(default=1, ge=0, description="Copies of each host's part on the next hosts (0: own disk only).")

    @field_validator("directory", "host_path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") == "":
            raise ValueError(f"{_short(v)} is not an absolute directory; give one such as /jaxrec-local")
        return v.rstrip("/")

    @property
    def enabled(self) -> bool:
        """Whether hosts save local parts."""
        return self.interval_steps is not None


class CheckpointConfig(_Section):
    """Orbax checkpointing policy."""

    interval_steps: int = Field(default=10, ge=1, description="Save every this many steps.")
    keep: int = Field(default=3, ge=1, description="Keep this many newest checkpoints.")
    async_save: bool = Field(default=True, description="Save in the background while training continues.")
    local: LocalTierConfig = Field(
        default_factory=LocalTierConfig, description="Host-local and peer tiers beside GCS (off unless set)."
    )


class BackoffConfig(_Section):
    """Exponential, capped backoff before the next attempt."""

    base_s: float = Field(default=10, ge=0, description="Backoff before the first retry of a class.")
    factor: float = Field(default=2.0, ge=1, description="Multiplier per further retry of the same class.")
    max_s: float = Field(default=600, ge=0, le=86_400, description="Cap on any backoff (at most a day).")

    @model_validator(mode="after")
    def _check_order(self) -> BackoffConfig:
        if self.base_s > self.max_s:
            raise ValueError(f"base_s {self.base_s} exceeds max_s {self.max_s}; make base_s <= max_s")
        return self


def _default_budgets() -> dict[FailureClass, int]:
    return {c.cls: c.budget for c in FAILURE_CLASSES}


BudgetScope = Literal["run", "since_progress"]


def _default_scopes() -> dict[FailureClass, str]:
    return {c.cls: c.scope for c in FAILURE_CLASSES}  # why each: the table's comment


ARGO_MAX_DEPTH = 100
"""Argo's ``maxStackDepth``: the template call whose count reaches it is refused (argo-workflows v4
workflow/controller/operator.go ``executeTemplate``: ``currentStackDepth++``, then ``>= maxStackDepth``)."""


def segment_pod_depth(attempts: int, resupervised: int = 0) -> int:
    """The template-call depth of the last attempt's train-segment and classify-failure pods in one Workflow.

    ``main`` (1) calls ``attempt`` (2), which calls ``segment`` (3), which runs the pods (4); each next attempt is
    called from the segment before it (two calls deeper: ``attempt``, ``segment``), each supervisor that re-attached
    (``resupervise``: ``segment`` calls ``segment``) one deeper. The workflows tests hold the count to the DAG.

    Args:
        attempts: Attempts this Workflow ran, the last included (1 for its first).
        resupervised: Supervisors re-attached in this Workflow so far.
    """
    return 4 + 2 * (attempts - 1) + resupervised


MAX_ATTEMPTS_PER_WORKFLOW = max(n for n in range(1, ARGO_MAX_DEPTH) if segment_pod_depth(n) < ARGO_MAX_DEPTH)
"""The most attempts one Workflow runs before Argo would refuse the last one's pods (48)."""


LEASE_RENEW_MAX_S = 600.0
"""The supervisor renews the run lease six times per TTL, and at least this often (``recovery_steps.lease``)."""


def lease_renew_every(ttl_s: float) -> float:
    """Seconds between the supervisor's renewals of a lease of ``ttl_s``."""
    return min(ttl_s / 6, LEASE_RENEW_MAX_S)


class RetryConfig(_Section):
    """Retry budgets per failure class, backoff, and the no-progress guard."""

    budgets: dict[FailureClass, Annotated[int, Field(ge=0)]] = Field(
        default_factory=_default_budgets,
        description="Retries allowed per failure class, counted over budget_scopes (classes left out keep defaults).",
    )
    budget_scopes: dict[FailureClass, BudgetScope] = Field(
        default_factory=_default_scopes,
        description="Per class: 'run' counts its failures over the whole run; 'since_progress' only those since "
        "the last attempt that advanced the checkpoint step (default for preemption and capacity).",
    )
    backoff: dict[FailureClass, BackoffConfig] = Field(
        default_factory=dict,
        description="Backoff per failure class; classes left out use default_backoff.",
    )
    default_backoff: BackoffConfig = Field(
        default_factory=BackoffConfig, description="Backoff for classes without their own."
    )
    no_progress_attempts: int = Field(
        default=3,
        ge=1,
        description="Stop after this many consecutive failed attempts without the checkpoint step advancing "
        "(capacity and preemption failures are not counted: their budgets, counted since the last progress, bound "
        "them).",
    )
    in_place_budget: int = Field(
        default=0,
        ge=0,
        description="Restarts in place (level 0: every worker's trainer restarted in its running pod, no new JobSet) "
        "allowed over the run, for an application error, a hang, a killed process or a lost peer while every host "
        "is healthy. Each is an attempt of its class in the ledger (the class budgets count it too). 0: every "
        "failure recreates the gang, and the workers run the trainer without the agent.",
    )
    in_place_tries: int = Field(
        default=2,
        ge=1,
        description="Restarts in place in a row that do not advance the checkpoint, after which the next failure "
        "recreates the gang (level 1): a fault that survives a restart in place may be the host's or the pod's.",
    )
    in_place_hold_s: float = Field(
        default=60,
        gt=0,
        le=3600,
        description="How long a worker's agent keeps its pod after its trainer failed, waiting for the supervisor's "
        "order; then it exits with the trainer's code and the pod fails (the gang is recreated).",
    )
    in_place_standby: bool = Field(
        default=True,
        description="Whether each worker's agent keeps the next trainer started ahead, its imports done and no "
        "device opened, from its trainer's first step on: a restart in place then skips the imports (seconds), at "
        "the cost of one idle interpreter's host memory per worker. Off: a restart in place starts a new process, "
        "as a container restart would.",
    )
    max_attempts: int | None = Field(
        default=None,
        ge=1,
        description="Optional hard cap on attempts of one run, whatever the class (None: no cap; the budgets and "
        "the no-progress guard bound a run, so one that keeps progressing is never stopped by arithmetic).",
    )
    attempts_per_workflow: int = Field(
        default=30,
        ge=1,
        le=MAX_ATTEMPTS_PER_WORKFLOW,
        description="Attempts one Workflow runs before it hands the run over to a continuation Workflow of the "
        "same run id, at most 48: each attempt nests two template calls deeper and Argo refuses the 100th "
        "(a supervisor that re-attached nests one more; the hand-over counts those too, so it may come earlier). "
        "The Workflow object also grows by every attempt's nodes. Numbering, budgets and history carry over in "
        "the ledger.",
    )
    provision_retry_limit: int = Field(
        default=10, ge=0, description="provision-slice retries while capacity is not available yet."
    )
    provision_backoff_s: int = Field(default=30, ge=1, description="First provision-slice retry backoff.")
    lease_ttl_s: int = Field(
        default=86400,
        ge=60,
        description="The run lease expires this long after its last renewal (validate-config and provision-slice "
        "renew it, and train-segment while a segment runs, every min(ttl/6, 10 min)). An expired lease is taken "
        "over only when its holder's Workflow is not known to be alive (a holder in another cluster or namespace: "
        "never known), so keep it well above the longest backoff between attempts.",
    )
    transient_retry_limit: int = Field(
        default=5,
        ge=0,
        description="Retries of one step whose pod Errored (evicted, node lost) or that exited transient (store or "
        "API unreachable, HTTP 429/5xx); retried in place, never counted against a failure class.",
    )
    transient_backoff_s: int = Field(default=10, ge=1, description="First backoff of a transient retry (doubles).")

    @field_validator("budgets", mode="after")
    @classmethod
    def _fill_budgets(cls, v: dict[FailureClass, int]) -> dict[FailureClass, int]:
        return {**_default_budgets(), **v}

    @field_validator("budget_scopes", mode="after")
    @classmethod
    def _fill_scopes(cls, v: dict[FailureClass, str]) -> dict[FailureClass, str]:
        return {**_default_scopes(), **v}

    @property
    def lease_renew_every_s(self) -> float:
        """Seconds between the supervisor's renewals of the run lease while a segment runs."""
        return lease_renew_every(self.lease_ttl_s)

    def scope(self, cls_: FailureClass) -> str:
        """Over what ``cls_``'s budget is counted: 'run' or 'since_progress'."""
        return self.budget_scopes[cls_]

    def budget(self, cls_: FailureClass) -> int:
        """Retries allowed for ``cls_``."""
        return self.budgets[cls_]

    def backoff_for(self, cls_: FailureClass) -> BackoffConfig:
        """Backoff policy of ``cls_``."""
        return self.backoff.get(cls_, self.default_backoff)


class SupervisionConfig(_Section):
    """Deadlines of the train-segment supervisor: when an attempt that has not ended is over anyway.

    Kubernetes never fails a Job whose pod is Pending or pulling an image (no exit code, so no
    ``podFailurePolicy`` rule matches), and a pod on an unreachable node stays Terminating: without
    these deadlines such an attempt waits forever. The graces keep it from ending an attempt that
    Kubernetes is about to end itself (a node shutting down) or that recovers (a kubelet restart).
    """

    startup_deadline_s: float = Field(
        default=900,
        gt=0,
        description="End the attempt (capacity) when a worker pod is still unscheduled this long after it was "
        "created while the scheduler reports no room, or when the gang has fewer pods than hosts this long.",
    )
    image_pull_deadline_s: float = Field(
        default=300,
        gt=0,
        description="End the attempt (configuration) when a worker container has waited this long on a failure "
        "that waiting cannot heal: an image pull refused as not found, manifest unknown, denied or 403 Forbidden, "
        "or CreateContainerConfigError (InvalidImageName and ErrImageNeverPull end it at once). The clock restarts "
        "when the failure changes or the container starts.",
    )
    transient_pull_deadline_s: float = Field(
        default=900,
        gt=0,
        description="End the attempt (stall kind image-pull, class infrastructure) when a worker container has "
        "waited this long on any other image pull or container creation failure (registry 5xx, i/o timeout, a "
        "runtime timeout). The kubelet keeps reporting its last pull failure while it retries, also through a slow "
        "multi-GB pull that follows one transient error: this must exceed the image's pull time. A pull whose "
        "credentials were not accepted (401 Unauthorized: an expired token the kubelet fetches again) waits this "
        "long too, then ends as configuration (missing credentials).",
    )
    node_lost_grace_s: float = Field(
        default=120,
        ge=0,
        description="End the attempt (node-lost) only once a worker's node has been NotReady, unreachable or gone "
        "this long (from its Ready condition's lastTransitionTime, else from when the supervisor first saw it "
        "lost); a failed worker pod or a Job's FailureTarget ends it earlier. The kubelet marks its node NotReady "
        "('node is shutting down') as a graceful shutdown begins, while the workers still save "
        "(pkg/kubelet/nodeshutdown), and a kubelet restart flaps Ready; Kubernetes itself waits 300 s (the default "
        "tolerationSeconds for not-ready and unreachable nodes) before evicting pods.",
    )
    hang_timeout_s: float = Field(
        default=600,
        gt=0,
        description="End the attempt (hang) when a worker's heartbeat shows no new step this long after its "
        "first step.",
    )
    compile_grace_s: float = Field(
        default=1800,
        gt=0,
        description="Before a worker's first step: how long after every worker runs it may take to report a "
        "step (startup, restore and the first compilation) before the attempt counts as hung; never less than "
        "twice the longest start-up the supervisors recorded for the run's latest earlier attempts.",
    )
    save_timeout_s: float = Field(
        default=900,
        gt=0,
        description="While a worker's loop waits for a checkpoint save to commit (the worker's heartbeat says "
        "which, and since when), this replaces hang_timeout_s for the supervisor and the worker's own watchdog: a "
        "save slowed by a storage outage is not a hang, a save that never commits still ends the attempt (hang).",
    )
    force_delete_grace_s: float = Field(
        default=60,
        ge=0,
        description="When stopping an attempt: how long a pod may stay Terminating on a NotReady or "
        "unreachable node before it is force-deleted (grace period 0).",
    )
    heartbeat_interval_s: float = Field(
        default=30,
        gt=0,
        description="Each worker writes its step and time to the run store at most this often.",
    )
    watch_interval_s: float = Field(
        default=5,
        gt=0,
        description="The supervisor re-decides at least this often (and on every watch event).",
    )
    config_conditions: tuple[str, ...] = Field(
        default=("ConfigIssue",),
        description="Custom pod condition types (set True by an admission or policy controller) that mean the "
        "pod can never start: the attempt ends at once as configuration.",
    )

    @model_validator(mode="after")
    def _check_heartbeat(self) -> SupervisionConfig:
        if self.hang_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"supervision.hang_timeout_s: {self.hang_timeout_s:g} is less than twice "
                f"supervision.heartbeat_interval_s ({self.heartbeat_interval_s:g}); a healthy worker would look "
                f"hung between heartbeats; use at least {2 * self.heartbeat_interval_s:g}"
            )
        return self


class MonitoringConfig(_Section):
    """Metrics and alert thresholds."""

    metrics_port: int = Field(
        default=9431,
        ge=0,
        le=65535,
        description="Port of each worker's Prometheus endpoint (1024-65535); 0: none (local runs only, for a machine "
        "where no process may open a socket).",
    )

    @field_validator("metrics_port")
    @classmethod
    def _check_metrics_port(cls, v: int) -> int:
        if 0 < v < 1024:
            raise ValueError(f"{v} is a privileged port; use 1024-65535, or 0 for no endpoint (local runs)")
        return v

    scrape_interval_s: int = Field(default=15, ge=1, description="PodMonitoring scrape interval.")
    recovery_window_steps: int = Field(
        default=200,
        ge=1,
        description="Alert when current step minus checkpoint step exceeds this (work a crash would lose).",
    )
    no_step_alert_minutes: int = Field(
        default=10, ge=1, description="Alert when no step completes for this long while the run is active."
    )
    repeated_failures_threshold: int = Field(
        default=3, ge=1, description="Alert when one failure class fails this many attempts within an hour."
    )


# Timeouts a TPU job gets unless its config sets them. JAX's own heartbeat default is 100 s; a long XLA compile
# or a slow host start on a large slice has tripped it, and GoogleCloudPlatform/ml-auto-solutions#1166 raised it
# to 1200 s. A dead peer is still noticed at once on GKE: JobSet stops the whole gang on the first worker exit,
# and the step watchdog (hang_timeout_s) ends a silent hang. init: every pod of a large slice must be scheduled,
# pulled and started before jax.distributed.initialize returns.
TPU_TIMEOUT_DEFAULTS = {"heartbeat_timeout_s": 1200, "init_timeout_s": 1800}


class JobConfig(_Section):
    """A whole training job: what to train, where, and how to recover from failures."""

    @model_validator(mode="before")
    @classmethod
    def _tpu_timeout_defaults(cls, data: Any) -> Any:
        """On TPU, timeouts the config leaves out take TPU_TIMEOUT_DEFAULTS (local runs keep the short ones)."""
        if not isinstance(data, dict):
            return data
        sl = data.get("slice")
        training = data.get("training", {})
        if not isinstance(sl, dict) or sl.get("accelerator", LOCAL) == LOCAL or not isinstance(training, dict):
            return data
        return {**data, "training": {**TPU_TIMEOUT_DEFAULTS, **training}}

    run_id: str = Field(
        description="Run identifier (lowercase letters, digits, '-'; at most 40): names the run store "
        "folder, the JobSets and the Workflow label. validate-config also refuses a run id whose worker pod names "
        "(<run-id>-a<attempt>-workers-0-<host> and a 5-character suffix) would pass JobSet's 63 characters at the "
        "highest attempt the retry policy allows (attempt 99999 unless retry.max_attempts or run-scoped budgets "
        "bound it): at most 38 characters for up to 10 hosts then."
    )
    namespace: str = Field(default="default", description="Kubernetes namespace of the workflow and JobSets.")
    image: str = Field(description="Worker container image (trainer and step programs).")
    service_account: str = Field(
        default="jax-recovery",
        description="Kubernetes ServiceAccount of the workflow's steps (RBAC of argo/rbac.yaml; the run store).",
    )
    worker_service_account: str = Field(
        default="jax-recovery-worker",
        description="Kubernetes ServiceAccount of the workers: no Kubernetes API access, only the bucket "
        "(Workload Identity).",
    )
    slice: SliceConfig = Field(description="The slice of hosts the gang runs on.")
    storage: StorageConfig = Field(description="The run store.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="What is trained (the task) and its options.")
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="Options of the built-in lm task: the language model's sizes."
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    data: DataConfig = Field(default_factory=DataConfig, description="Input pipeline.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Training loop.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    retry: RetryConfig = Field(default_factory=RetryConfig, description="Recovery policy.")
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig, description="Metrics and alerts.")
    supervision: SupervisionConfig = Field(
        default_factory=SupervisionConfig, description="Deadlines of the train-segment supervisor."
    )

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, v: str) -> str:
        problem = run_id_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("namespace", "service_account")
    @classmethod
    def _check_k8s_name(cls, v: str) -> str:
        # Kubernetes names: namespaces are RFC 1123 labels, ServiceAccounts DNS subdomains (kubernetes
        # docs "Object Names and IDs"); a label is the stricter of the two and fits both.
        if not _DNS_LABEL.match(v):
            raise ValueError(f"{_short(v)} is not a Kubernetes name; use 1-63 lowercase letters, digits and '-'")
        return v

    @field_validator("image")
    @classmethod
    def _check_image(cls, v: str) -> str:
        name = _IMAGE_REF.match(v)
        if not name or len(name.group(1)) > 255:
            raise ValueError(
                f"{_short(v)} is not a container image reference; e.g. REGISTRY/NAME:TAG or "
                "REGISTRY/NAME@sha256:DIGEST (lowercase repository, tag of letters, digits, '_', '.', '-', at most 128)"
            )
        return v

    @model_validator(mode="after")
    def _check_root_length(self) -> JobConfig:
        # Every object the run writes is named <root>/runs/<run-id>/<path>: refuse a root that leaves no room for the
        # longest path, rather than a checkpoint save that fails hours in.
        root = self.storage.root
        if self.storage.is_gcs:
            named, limit, why = root.removeprefix("gs://").partition("/")[2], 1024, "GCS object names are at most"
        else:
            named, limit, why = root, 4096, "Linux paths are at most"
            long_part = next((c for c in root.split("/") if len(c.encode()) > 255), None)
            if long_part is not None:
                raise ValueError(
                    f"storage.root: {_short(long_part)} is a path component over 255 bytes (NAME_MAX); shorten it"
                )
        longest = len(named.encode()) + len(f"/runs/{self.run_id}/".encode()) + RUN_PATH_RESERVE
        if longest > limit:
            room = limit - longest + len(named.encode())
            raise ValueError(
                f"storage.root: {_short(root)} leaves no room for the run's paths: runs/{self.run_id}/ and the longest "
                f"path the run writes ({RUN_PATH_RESERVE} bytes) make {longest} bytes and {why} {limit}; "
                f"shorten the root's {'prefix' if self.storage.is_gcs else 'path'} to at most {max(room, 0)} bytes"
            )
        return self

    @model_validator(mode="after")
    def _check_batch(self) -> JobConfig:
        devices = self.slice.num_hosts * self.slice.devices_per_process
        if self.data.global_batch_size % devices:
            raise ValueError(
                f"data.global_batch_size: {self.data.global_batch_size} is not divisible by the "
                f"{devices} devices of the slice; use a multiple of {devices}"
            )
        return self

    @model_validator(mode="after")
    def _check_contradictions(self) -> JobConfig:
        problems = []
        # Compared with the defaults, not the keys given: config.json holds every section, defaults included.
        if self.task.name not in BUILTIN_TASKS and self.model != ModelConfig():
            problems.append(
                f"model: the options of the built-in lm task, but task.name is {self.task.name!r}; remove the "
                "model section and give the task's options under task.options"
            )
        if not self.slice.is_cpu and not self.storage.is_gcs and not self.storage.durable_mount:
            problems.append(
                f"storage.root: {_short(self.storage.root)} is a local path on a TPU slice: the checkpoints "
                "would live on the pods' disks and die with them; use gs://BUCKET/PREFIX, or declare a durable "
                "volume mounted there in every pod with storage.durable_mount: true"
            )
        ck, tr = self.checkpoint, self.training
        if ck.interval_steps > tr.total_steps:
            problems.append(
                f"checkpoint.interval_steps: {ck.interval_steps} exceeds training.total_steps {tr.total_steps}: "
                "no checkpoint would be saved before the end; make it at most total_steps"
            )
        if ck.keep < 2:
            problems.append(
                f"checkpoint.keep: {ck.keep} leaves nothing to fall back to when the newest checkpoint is "
                "damaged; keep at least 2"
            )
        problems += self._local_tier_problems()
        if not self.slice.is_cpu and self.monitoring.metrics_port == 0:
            problems.append(
                "monitoring.metrics_port: 0 (no endpoint) is for local runs; a TPU slice's workers are scraped at "
                "their metrics port: give one (default 9431)"
            )
        if self.slice.is_cpu and self.monitoring.metrics_port + self.slice.num_hosts - 1 > 65535:
            problems.append(
                f"monitoring.metrics_port: {self.monitoring.metrics_port} + one port per local host "
                f"({self.slice.num_hosts}) passes 65535; use a lower port"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _local_tier_problems(self) -> list[str]:
        lt, hosts = self.checkpoint.local, self.slice.num_hosts
        if not lt.enabled:
            return []
        out = []
        if lt.interval_steps > self.checkpoint.interval_steps:  # type: ignore[operator]
            out.append(
                f"checkpoint.local.interval_steps: {lt.interval_steps} is longer than checkpoint.interval_steps "
                f"{self.checkpoint.interval_steps}: the local tier would save less often than GCS; make it shorter"
            )
        if hosts > 1 and lt.peers >= hosts:
            out.append(
                f"checkpoint.local.peers: {lt.peers} copies need {lt.peers + 1} hosts, the slice has {hosts}; "
                f"make it at most {hosts - 1}"
            )
        return out

    def task_options(self) -> BaseModel:
        """The task's validated options: the model section for the built-in lm task, else task.options."""
        if self.task.name in BUILTIN_TASKS:
            return self.model
        return self.task.spec().options.model_validate(self.task.options)

    def config_hash(self) -> str:
        """Stable hash of the whole config (sha256 of its canonical JSON)."""
        return hashlib.sha256(canonical_json(self).encode()).hexdigest()


def largest_attempt(retry: RetryConfig, first_attempt: int = 0) -> int:
    """The highest attempt number a run with this retry policy can reach (attempts are numbered from 0).

    ``retry.max_attempts`` stops the run after attempt ``max_attempts - 1`` (``recovery_steps/retry.py``
    ``decide``). When every class is budgeted over the whole run, the run stops at the first class failing once
    more than its budget, so at most ``sum(budgets)`` failed attempts come before the last one. Otherwise (a class
    budgeted ``since_progress``, the default for preemption and capacity) nothing but ``ATTEMPT_CEILING`` bounds
    the number. Hand-over continuations continue the numbering and add no attempts; a resubmitted run continues
    it too, so its first attempt (``first_attempt``, read from the run store) is reached in any case.
    """
    bound = ATTEMPT_CEILING
    if retry.max_attempts is not None:
        bound = min(bound, retry.max_attempts - 1)
    if all(retry.scope(c) == "run" for c in FailureClass):
        bound = min(bound, sum(retry.budget(c) for c in FailureClass))
    return min(ATTEMPT_CEILING, max(bound, first_attempt))


def longest_run_id(hosts: int, attempt: int) -> int:
    """The longest run id whose worker pod names fit JobSet's limit up to attempt ``attempt`` (at most 40)."""
    return min(RUN_ID_MAX, POD_NAME_MAX - len(longest_pod_name("", attempt, hosts)))


def run_id_pod_name_problem(cfg: JobConfig, first_attempt: int = 0) -> str | None:
    """Why ``cfg.run_id`` is too long for some worker pod name the run can reach, or None.

    Checked by ``validate-config`` when a run is submitted, not at every parse: a run already under way keeps its
    ``config.json`` readable by every step and the trainer.
    """
    attempt = largest_attempt(cfg.retry, first_attempt)
    hosts = cfg.slice.num_hosts
    name = longest_pod_name(cfg.run_id, attempt, hosts)
    if len(name) <= POD_NAME_MAX:
        return None
    longest = longest_run_id(hosts, attempt)
    # The attempt digits this run id leaves room for: a cap on the attempts below them is the other fix.
    digits = POD_NAME_MAX - len(longest_pod_name(cfg.run_id, "", hosts))
    cap = f", or set retry.max_attempts to at most {10**digits}" if 0 < digits and first_attempt < 10**digits else ""
    return (
        f"run_id: {cfg.run_id!r} is too long: at attempt {attempt} its pod names on {hosts} hosts would have "
        f"{len(name)} characters, JobSet admits {POD_NAME_MAX} (<run-id>-a<attempt>-workers-0-<host>-<5 random>); "
        f"use a run id of at most {longest} characters{cap}"
    )


def canonical_json(cfg: BaseModel) -> str:
    """Canonical JSON of a config (sorted keys, no whitespace): what the hash is taken over."""
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


class ConfigError(Exception):
    """A config that cannot be used. ``problems`` holds one readable line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))

    def render(self) -> str:
        """The message a user sees: one line per problem."""
        lines = [f"invalid config {self.source}: {len(self.problems)} problem(s)"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def _loc(loc: tuple[Any, ...]) -> str:
    text = ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-")))
    return text if len(text) <= 120 else text[:117] + "..."


def _bounded(line: str) -> str:
    line = " ".join(line.split())
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


def _describe(err: dict[str, Any]) -> list[str]:
    loc = _loc(err["loc"])
    kind = err["type"]
    msg = err["msg"]
    if msg.startswith("Value error, "):
        # Model-level validators already name their field ("slice.topology: ...").
        parts = msg[len("Value error, ") :].splitlines()
        return [part if not loc or _NAMED.match(part) else f"{loc}: {part}" for part in parts]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(err["loc"][:-1])
        hint = f"; valid keys here: {', '.join(allowed)}" if allowed else ""
        return [f"{loc}: unknown key{hint}"]
    if kind == "missing":
        return [f"{loc}: required field is missing"]
    return [f"{loc}: {msg} (got {_short(err.get('input'))})"]


def _allowed_keys(parent: tuple[Any, ...]) -> list[str]:
    model: Any = JobConfig
    for part in parent:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return sorted(model.model_fields)


def parse_config(data: Any, source: str = "<config>") -> JobConfig:
    """Validate a config mapping; raise ConfigError with one message per problem (bounded in number and length)."""
    if not isinstance(data, dict):
        raise ConfigError(source, [f"top level must be a mapping of config sections, got {type(data).__name__}"])
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(source, [f"top-level key {_short(bad_keys[0])} is not a string; use section names"])
    try:
        return JobConfig.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        shown: dict[str, None] = {}  # ordered and unique
        for i, err in enumerate(errors):
            if len(shown) >= MAX_PROBLEMS:
                shown[f"... and {len(errors) - i} more problem(s)"] = None
                break
            for line in _describe(err):
                shown[_bounded(line)] = None
        raise ConfigError(source, list(shown)) from None


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader for configs: duplicate keys, deep nesting and alias bombs are errors, not surprises.

    PyYAML's ``SafeLoader`` keeps the last of two equal keys and expands aliases by reference, so a
    few lines can stand for billions of values once pydantic walks them; its composer recurses once
    per nesting level.
    """

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: D102 - PyYAML hook
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                problem = f"more than {MAX_ALIASES} aliases: refusing a possible alias bomb"
                raise ConstructorError(None, None, problem, self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                problem = f"nested deeper than {MAX_DEPTH} levels"
                raise yaml.composer.ComposerError(None, None, problem, self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:  # noqa: D102 - PyYAML hook
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                problem = (
                    "a YAML merge key ('<<') is not supported in a config: write the keys out in full "
                    "(a merged key is silently overridden by the mapping's own)"
                )
                raise ConstructorError(None, None, problem, key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                raise ConstructorError(None, None, "a mapping key must be a plain value", key_node.start_mark) from None
            if duplicate:
                problem = f"duplicate key {_short(key)} (the first value would be silently lost)"
                raise ConstructorError(None, None, problem, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(data: Any, limit: int) -> int:
    """Values in ``data`` counting shared (aliased) subtrees once per use; stops counting past ``limit``."""
    count, stack = 0, [data]
    while stack and count <= limit:
        x = stack.pop()
        count += 1
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return count


def load_config(path: str | Path) -> JobConfig:
    """Read and validate a YAML (or JSON) config file; raise ConfigError on any problem.

    The file is refused unparsed when it is larger than ``MAX_CONFIG_BYTES`` or not UTF-8; the YAML
    loader refuses duplicate keys, nesting deeper than ``MAX_DEPTH`` and more than ``MAX_ALIASES``
    aliases, so a hostile file costs bounded memory and time and still gets one line.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL in the path
        raise ConfigError(str(p)[:200], [f"cannot read the file: {getattr(e, 'strerror', None) or e}"]) from None
    source = str(p)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(source, [f"the file is larger than {MAX_CONFIG_BYTES} bytes; a job config is a few KB"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        problem = f"not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); save it as UTF-8"
        raise ConfigError(source, [problem]) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader is a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(source, [_bounded(f"YAML syntax error{where}: {problem}")]) from None
    except RecursionError:
        raise ConfigError(source, [f"YAML nested too deeply; a job config is at most {MAX_DEPTH} levels"]) from None
    if _expanded_size(data, MAX_NODES) > MAX_NODES:
        raise ConfigError(source, [f"more than {MAX_NODES} values once aliases are expanded; not a job config"])
    return parse_config(data, source)
