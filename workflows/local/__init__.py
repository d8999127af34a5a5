"""The local Argo interpreter: runs a compiled Workflow on this machine, with local processes for the JobSet.

``python -m workflows.local argo/<job>.yaml [--inject ...]``. The parts: ``engine`` (the DAG and its
expressions, ``expr``), ``executor`` (container and resource templates as local processes, train-segment over
the JobSet stand-in), ``cluster`` (the run's JobSets by name: created, polled, stopped, shown as the API would),
``slices`` (a JobSet's worker processes and how the API would show them), ``inject`` (faults), ``incidents``
and ``metrics`` (what a run cost and exports), ``emulator`` (a real GCS emulator) and ``runner`` (the command).
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
