"""The shared foundation of the trainer, the step programs and the workflow generator, in two halves.

``jaxrec.model``: documents and tables, no I/O (the config and its validation, the exit-code contract, the run
store's typed records and layout, names, the TPU table, compat rules, tiers, the cluster snapshot, the JobSet a
config renders, the steps' outputs, the metric names). ``jaxrec.adapters``: what reads and writes the world
(the run store, the one Kubernetes client, checkpoint files and their verification, the restore decision, the
incident records, GCS permissions, the command-line helpers).

The trainer, the steps and the generator import this package; it imports none of them, the model half imports
nothing of the adapters nor of a client library, and nothing here is heavy at import time (no JAX, no Kubernetes
client): ``tests/test_layers.py``.
"""
