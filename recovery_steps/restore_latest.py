"""``restore-latest``: choose the newest verified checkpoint, quarantine bad ones, and say which step to restore.

Arguments and outputs: docs/CONTRACTS.md; the decision is also recorded in ``attempts/<n>/restore.json``.

Destructive acts and their evidence: it deletes nothing. A step directory moves to ``quarantine/`` (with a file
saying why) only on positive evidence against it, read after every candidate was inspected: a file its own
manifest lists that is missing, of another size, CRC32C, SHA-256 or generation; a write after the ledger closed
the attempt that made it; a config it is incompatible with; a name or entry orbax would misread. An unfinished or
uncommitted GCS save and anything that is not a step are left in place; a store it cannot read moves nothing.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxrec.adapters import cli

# The decision lives in jaxrec.adapters.restore (the trainer runs it too); the step is its command line and outputs.
from jaxrec.adapters.restore import RestoreResult, run
from jaxrec.adapters.store import RunStore, transient_as_unavailable
from jaxrec.adapters.verify import Selection
from jaxrec.model.outputs import RestoreOutputs
from recovery_steps.step import Step

log = logging.getLogger(__name__)


def outputs(r: RestoreResult) -> RestoreOutputs:
    """The step's output parameters."""
    sel = r.selection or Selection()
    return RestoreOutputs(
        restore_step=sel.step, restore_path=r.restore_path, skipped=[s.as_output() for s in sel.skipped]
    )


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    p = cli.StepArgumentParser(prog="python -m recovery_steps.restore_latest", description=__doc__.splitlines()[0])
    p.add_argument("--store-root", required=True, type=cli.store_root, help="gs://bucket/prefix or a local directory")
    p.add_argument("--run-id", required=True, type=cli.run_id)
    p.add_argument("--attempt", required=True, type=cli.attempt, help="the attempt about to start")
    p.add_argument("--output-dir", required=True, type=cli.output_dir)
    return p


def act(args: argparse.Namespace) -> tuple[int, str]:
    """Decide, write the outputs (whatever the code: classify-failure and the trainer read them) and say why."""
    store = RunStore(args.store_root, args.run_id)
    with transient_as_unavailable(store.url()):
        r = run(store, args.attempt)
    outputs(r).write(args.output_dir)
    if r.message:
        print(r.message, file=sys.stderr)
    if r.selection is not None:
        for s in r.selection.skipped:
            log.info("skipped %s: %s%s", s.name, s.reason, " (quarantined)" if s.quarantine and r.code == 0 else "")
        log.info("restore step %d %s", r.selection.step, r.restore_path or "(fresh start)")
    return int(r.code), ""


# A store that answers with an error other than unavailability is not retried (exit 1), as before the skeleton.
STEP = Step("restore-latest", parser, act, outputs=RestoreOutputs, store_code=1)
main = STEP.main


if __name__ == "__main__":
    sys.exit(main())
