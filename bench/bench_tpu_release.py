"""On a TPU machine: how long a process that holds the chip takes to die after SIGKILL, and whether the next
program can open the chip at once after it (libtpu's lock gone with it).

A worker's exit is its pod's failure: on a TPU host the detection of a killed worker waits for the chip's release.
Prints the figures; without a TPU it says so and exits 0.

    python bench/bench_tpu_release.py [--tries 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

HOLD = (
    "import jax, time; jax.numpy.ones((1024, 1024)).block_until_ready(); "
    "print(jax.devices()[0].platform, flush=True); time.sleep(600)"
)
OPEN = "import jax; print(jax.devices()[0].platform)"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=3, help="attempts of the next program to open the chip")
    args = p.parse_args(argv)
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    platform = (holder.stdout.readline() if holder.stdout else "").strip()
    if platform != "tpu":
        holder.kill()
        holder.wait(30)
        print(f"no TPU here (JAX platform {platform or 'none'}): nothing measured")
        return 0
    t0 = time.monotonic()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(120)
    reaped = time.monotonic()
    print(f"a process holding the chip is reaped {reaped - t0:.2f} s after SIGKILL")
    for i in range(args.tries):
        t1 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", OPEN], capture_output=True, text=True, timeout=300)
        said = (r.stdout or r.stderr).strip().splitlines()[-1:] or [""]
        took = time.monotonic() - t1
        print(
            f"next program {i}: started {t1 - reaped:.2f} s after, rc {r.returncode} in {took:.2f} s: {said[0][:160]}"
        )
        if r.returncode == 0:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
