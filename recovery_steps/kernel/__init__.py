"""The shared kernel: config, exit-code contract, typed run-store records and layout, compat rules, TPU table.

The trainer, the step programs and the workflow generator all import this package (with the metric names);
it imports none of them and nothing heavy (no JAX, no Kubernetes client at import time).
"""
