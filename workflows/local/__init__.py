"""The local Argo interpreter: runs a compiled Workflow on this machine, over one local cluster per run.

``python -m workflows.local argo/<job>.yaml [--inject ...]``. The parts: ``engine`` (the DAG and its
expressions, ``expr``), ``executor`` (every container template as a local process, given the cluster's API),
``apiserver`` (the cluster's Kubernetes API: one model of its objects, served on a unix socket), ``controllers``
(the JobSet and Job controllers and the kubelets that act on it), ``cluster`` (the run's JobSets by name: their
worker processes created, polled, stopped), ``slices`` (a JobSet's worker processes and the pods, nodes and Job the
API shows of them), ``inject`` (faults), ``outage`` (run-store outages), ``events`` and ``metrics`` (what a run
cost and exports), ``emulator`` (a real GCS emulator) and ``runner`` (the command, and the Workflow objects it keeps
in the API).
"""

from workflows.local.runner import (
    LocalRunError,
    LocalRunOptions,
    LocalRunResult,
    load_workflow,
    main,
    run,
    with_parameters,
)

__all__ = ["LocalRunError", "LocalRunOptions", "LocalRunResult", "load_workflow", "main", "run", "with_parameters"]
