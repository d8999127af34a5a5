"""The local Argo interpreter: runs a compiled Workflow on this machine, over one local cluster per run.

``python -m workflows.local argo/<job>.yaml [--inject ...]``; docs/LOCAL.md says what it models, each module its part.
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
