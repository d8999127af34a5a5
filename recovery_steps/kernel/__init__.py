"""The shared kernel: what the trainer, the steps and the generator share.

Config, exit-code contract, typed run-store records and layout, compat rules, TPU table, checkpoint
verification and the restore decision, GCS permissions. The trainer, the step programs and the workflow
generator all import this package (with the metric names); it imports none of them (``tests/test_layers.py``)
and nothing heavy (no JAX, no Kubernetes client at import time).
"""
