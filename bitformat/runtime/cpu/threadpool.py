"""Which numba threading layer runs the mat-vecs: TBB where it is installed, chosen before the
thread pool starts.

Every mat-vec of the ``cpu`` backend is one numba parallel region (``prange`` over rows). On
numba's ``omp`` layer (GNU libgomp on Linux) the rows are split statically, one share per
thread, and the region ends at a barrier where a finished thread spins (300,000 iterations)
before it sleeps. On an idle machine that is the fastest choice. When another process holds
one of two cores it collapses: the thread that finished spins on the one free core while the
thread holding the other share waits for a core, so each of the ~150 mat-vecs of a token
waits out a scheduler time slice (``run --threads 2`` on the full-size 2B-4T: ~20 tokens/s
idle, 6-7 with one core busy, 1-2 when the other process is itself multi-threaded). Sleeping
at once instead (``OMP_WAIT_POLICY=passive``) fixes the busy case but costs a wake-up of tens
of microseconds per region on a VM: idle decode fell from ~19 to ~14.5 tokens/s.

TBB schedules by work stealing: the calling thread runs the shares no other thread has taken,
so a descheduled worker that never started delays nothing, and waiting threads back off to
yielding and sleeping. Measured on the same model (docs/benchmarks.md, "Decode with one core
busy"): idle as fast as libgomp's spinning, busy as fast as one thread alone.

pip installs ``libtbb.so.12`` into ``<prefix>/lib``, which the dynamic loader does not search,
so numba would silently fall back to ``omp``. :func:`load_tbb` loads that library by its path
first; numba's default layer order (tbb, omp, workqueue) then finds it by its soname.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

#: File name of the TBB runtime numba's ``tbbpool`` links against, per platform.
LIBTBB = {"linux": "libtbb.so.12", "darwin": "libtbb.12.dylib", "win32": "tbb12.dll"}
#: Layer settings under which numba may pick tbb (``NUMBA_THREADING_LAYER``).
TBB_LAYERS = ("default", "tbb", "safe", "threadsafe", "forksafe")


def load_tbb() -> Path | None:
    """Make the pip-installed TBB loadable for numba; return the library loaded, or None.

    None (nothing done) where numba's pool runs already, the user asked for another layer
    with ``NUMBA_THREADING_LAYER``, or the ``tbb`` package is not installed; numba then uses
    ``omp`` as before.
    """
    if os.environ.get("NUMBA_THREADING_LAYER", "default").lower() not in TBB_LAYERS:
        return None
    if _pool_started():
        return None
    lib = installed_libtbb()
    if lib is None:
        return None
    try:
        ctypes.CDLL(str(lib), mode=getattr(ctypes, "RTLD_GLOBAL", 0))
    except OSError:
        return None
    return lib


def installed_libtbb() -> Path | None:
    """Path of the TBB runtime the ``tbb`` distribution installed, if it did."""
    from importlib import metadata

    want = LIBTBB.get(sys.platform)
    try:
        files = metadata.files("tbb") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == want:
            path = Path(f.locate()).resolve()
            if path.is_file():
                return path
    return None


def _pool_started() -> bool:
    from numba.np.ufunc import parallel

    return bool(getattr(parallel, "_is_initialized", False))
