"""JAX's persistent compilation cache: on unless turned off, under the run store, one key for the whole gang.

JAX's cache key hashes the CPU client's own topology, which lists this process's devices: each process of a local
CPU gang gets another key, and only process 0 writes entries, so processes 1..N-1 never hit (JAX has no option for
it). For a multi-process CPU gang the trainer therefore keys that entry by the global device assignment, alike in
every process; on TPU the key is left as JAX makes it. The sources and measurements: docs/TRAINER.md ("One key for
every process of a local gang").
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import JobConfig

log = logging.getLogger(__name__)


def cache_dir(cfg: JobConfig, store: RunStore) -> str | None:
    """Where the cache lives: ``training.compilation_cache_dir``, else ``<root>/runs/<run-id>/compilation-cache``.

    ``None`` when ``training.compilation_cache`` is off. A ``gs://`` root gives a ``gs://`` directory.
    """
    t = cfg.training
    if not t.compilation_cache:
        return None
    return t.compilation_cache_dir or store.url(RunLayout.COMPILATION_CACHE)


def _use_gang_wide_cpu_key() -> bool:
    """Key the CPU accelerator config by the global device assignment (see the module docstring)."""
    try:
        from jax._src import cache_key
    except ImportError:
        return False
    original = getattr(cache_key, "_hash_accelerator_config", None)
    if original is None:
        return False
    if getattr(original, "gang_wide", False):
        return True

    def hash_accelerator_config(hash_obj: Any, accelerators: Any) -> None:
        if all(d.platform == "cpu" for d in accelerators.flat):
            for d in accelerators.flat:  # the global device assignment: alike in every process of the gang
                hash_obj.update(f"{d.platform}/{d.device_kind}/{d.id}/{d.process_index};".encode())
        else:
            original(hash_obj, accelerators)

    hash_accelerator_config.gang_wide = True  # type: ignore[attr-defined]
    cache_key._hash_accelerator_config = hash_accelerator_config
    return True


class CacheCounter:
    """Counts this process's persistent-cache requests and hits (JAX's ``/jax/compilation_cache/*`` events)."""

    def __init__(self) -> None:
        self.requests = 0
        self.hits = 0
        self._lock = threading.Lock()

    def __call__(self, event: str, **kwargs: Any) -> None:
        """A jax.monitoring event listener."""
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            with self._lock:
                self.requests += 1
        elif event == "/jax/compilation_cache/cache_hits":
            with self._lock:
                self.hits += 1


def enable(directory: str, *, platform: str, process_count: int) -> CacheCounter:
    """Turn the cache on at ``directory`` for every compilation, however short; return its counter."""
    import jax
    import jax.monitoring

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if platform == "cpu" and process_count > 1 and not _use_gang_wide_cpu_key():
        log.warning("this JAX has no cache_key._hash_accelerator_config: only process 0 gets cache hits")
    counter = CacheCounter()
    jax.monitoring.register_event_listener(counter)
    return counter
