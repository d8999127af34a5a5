"""``python -m trainer.write_records``: write a task's generated examples as ArrayRecord files (tests, rehearsals)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from jaxrec.adapters import cli
from jaxrec.model.config import ConfigError, load_config


def run(config_path: str, out_dir: str, num_files: int, num_records: int | None = None) -> list[str]:
    """Write the examples the config's task generates (``data.num_records`` of them) into ``out_dir``.

    Args:
        config_path: A job config; its task and ``data`` section say what to generate.
        out_dir: Local directory to write ``part-XXXXX-of-NNNNN.array_record`` files into.
        num_files: How many files to split the examples over.
        num_records: Examples to write (default ``data.num_records``).

    Returns:
        The files written.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the examples are numpy; no accelerator needed
    from trainer import records

    cfg = load_config(config_path)
    task = cfg.task.spec().build(cfg.task_options())
    data = cfg.data.model_copy(update={"num_records": num_records or cfg.data.num_records})
    examples = task.dataset(data)
    paths = records.write_records((examples[i] for i in range(len(examples))), out_dir, num_files)
    return [str(p) for p in paths]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, write the files, print where they are."""
    p = cli.StepArgumentParser(prog="python -m trainer.write_records", description=__doc__)
    p.add_argument("--config", required=True, help="Job config whose task generates the examples.")
    p.add_argument("--out", required=True, help="Local directory to write the ArrayRecord files into.")
    p.add_argument("--files", type=cli.bounded_int(1, 10_000, "a file count"), default=4, help="Number of files.")
    p.add_argument(
        "--num-records",
        type=cli.bounded_int(1, 2**31 - 1, "a count"),
        default=None,
        help="Examples to write (default: data.num_records).",
    )
    a = p.parse_args(argv)
    try:
        paths = run(a.config, a.out, a.files, a.num_records)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} files to {a.out}: data.dataset: records, data.files: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
