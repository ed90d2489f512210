"""The ``cpu`` backend: numba kernels over the container bytes (``backend.py``), by job:
ternary mat-vecs and the LM head (``kernels.py``), rANS decoded in the mat-vec (``rans.py``),
the small per-token steps (``ops.py``)."""

from . import kernel_cache as _kernel_cache

_kernel_cache.check()  # before any kernel module loads its cached code
