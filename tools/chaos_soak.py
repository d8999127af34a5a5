"""The chaos soak: run N seeds of the chaos tests under a wall-time limit, one result line per seed, then the totals.

    .venv/bin/python tools/chaos_soak.py --rounds 20 --first-seed 101 --limit-s 7200 --results soak.jsonl &

Each seed's line (appended to ``--results`` by the tier's conftest as the run ends, whatever ended it) holds the
test, the seed, its outcome, its seconds, its faults by kind and its invariant violations; ``--totals FILE`` prints
the totals of a results file without running anything. A seed that fails is replayed with
``pytest -m chaos --chaos-seed N`` and becomes a regression seed (``tests/k8s/test_chaos.py``) with its fix, or an
open finding with what is known.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def totals(path: Path) -> str:
    """The totals of a results file: runs, passed, seconds, faults by kind, violations, failing seeds."""
    lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    kinds: Counter[str] = Counter()
    for r in lines:
        kinds.update(r.get("faults") or {})
    failing = [f"{r['test']}[seed{r['seed']}]: {r['outcome']}" for r in lines if r["outcome"] != "passed"]
    secs = [r["seconds"] for r in lines]
    out = [
        f"chaos soak: {len(lines)} run(s), {len(lines) - len(failing)} passed, "
        f"{sum(r.get('violations') or 0 for r in lines)} invariant violation(s), "
        f"{sum(kinds.values())} fault(s) ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items())) or 'none'})",
        f"seconds per run: min {min(secs, default=0):.0f}, max {max(secs, default=0):.0f}, "
        f"mean {sum(secs) / max(len(secs), 1):.0f}",
        *failing,
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the soak (or, with ``--totals``, only print a results file's totals); the pytest exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="seeds to run (default 20)")
    ap.add_argument("--first-seed", type=int, default=101, help="the first seed (default 101)")
    ap.add_argument("--limit-s", type=int, default=7200, help="wall-time limit of the whole soak (default 2 h)")
    ap.add_argument("--results", type=Path, default=Path("chaos-soak.jsonl"), help="results file (appended)")
    ap.add_argument("-k", default="", help="pytest -k expression (default: every chaos test)")
    ap.add_argument("--totals", type=Path, default=None, help="print the totals of this results file and exit")
    args = ap.parse_args(argv)
    if args.totals is not None:
        print(totals(args.totals))
        return 0
    cmd = [
        sys.executable, "-m", "pytest", "-m", "chaos and k8s", "-q", "-p", "no:cacheprovider",
        "--chaos-rounds", str(args.rounds), "--chaos-first-seed", str(args.first_seed),
        "--chaos-results", str(args.results.resolve()),
    ]  # fmt: skip
    if args.k:
        cmd += ["-k", args.k]
    t0 = time.monotonic()
    try:
        code = subprocess.run(cmd, cwd=REPO, timeout=args.limit_s).returncode
    except subprocess.TimeoutExpired:
        print(f"chaos soak: stopped at its limit of {args.limit_s} s; the seeds that ended are recorded")
        code = 124
    print(f"chaos soak: {time.monotonic() - t0:.0f} s; results in {args.results}")
    print(totals(args.results))
    return code


if __name__ == "__main__":
    sys.exit(main())
