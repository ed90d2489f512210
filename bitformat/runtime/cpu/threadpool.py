"""How numba's OpenMP threads wait between mat-vecs, set before the thread pool starts.

Every mat-vec of the ``cpu`` backend is one numba parallel region: OpenMP splits the rows
statically between the threads and the region ends at a barrier. GNU libgomp (numba's
``omp`` layer on Linux) makes a thread that reaches a barrier, or waits for the next region,
spin for 300,000 iterations before it sleeps. On an idle machine that spin is harmless. When
another process holds one of two cores it is a disaster: the thread that finished its half
spins on the one free core while the thread holding the other half waits for a core to run on,
so each of the ~150 mat-vecs of a token waits out a scheduler time slice. ``--threads 2`` on
the full-size 2B-4T fell from ~15 to 1-2 tokens/s that way.

With ``OMP_WAIT_POLICY=passive`` a waiting thread sleeps at once (a futex), handing its core to
the thread that still has work; a mat-vec then costs what it costs on the one core left (plus
a wake-up of microseconds), and an idle machine measured no slower (docs/benchmarks.md,
"Decode with one core busy"). libgomp reads the variable once, when it is loaded, which numba
does when it starts its thread pool: :func:`prefer_sleeping_waits` must run before the first
parallel kernel of the process. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins.
"""

from __future__ import annotations

import os

#: Environment variables that already say how OpenMP threads should wait.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def prefer_sleeping_waits() -> bool:
    """Ask OpenMP for sleeping waits unless the user chose a policy; True if this call set it.

    A no-op once numba's thread pool runs (libgomp read its environment then), and for numba's
    ``tbb`` and ``workqueue`` layers, whose waiting threads do not spin this way.
    """
    if any(v in os.environ for v in WAIT_VARIABLES) or _pool_started():
        return False
    os.environ["OMP_WAIT_POLICY"] = "passive"
    return True


def _pool_started() -> bool:
    """numba's pool runs, or libgomp is loaded already (by numba or another library)."""
    from numba.np.ufunc import parallel

    if getattr(parallel, "_is_initialized", False):
        return True
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as fh:
            return "libgomp" in fh.read()
    except OSError:  # not Linux: nothing to tell
        return False
