"""A team of threads that goes through a whole decode step inside one numba parallel region.

Each numba parallel region (a ``prange``) costs its start and its join: on an Intel Xeon (2 cores,
TBB) the four mat-vecs of a 2B-4T layer streamed 17.7-19.8 GB/s each against 26.4 GB/s for the
largest one, about 30 us per region, ~4 ms of a 24 ms step over its 150 regions. Here the step
runs once per thread (``for t in prange(threads)``) and the threads meet at *phases* instead:

- a parallel phase (a mat-vec, the attention heads) is cut into chunks; a thread takes the next
  chunk with an atomic counter (:func:`claim`), counts it done (:func:`finish`) and, when no
  chunk is left, waits until every chunk is done (:func:`wait_done`);
- a serial phase (norms, quantization, residual adds) is a phase of one chunk: the first thread
  to claim it runs it, the others wait.

A thread only ever waits for a chunk another thread *took*, that is for a thread that is running.
A thread the scheduler has not started yet (TBB runs the shares of a region by work stealing, and
may run both on the calling thread when the other core is busy) finds every chunk taken and every
phase done when it arrives and returns, so a step never waits for a thread that never came. A
waiting thread spins with ``pause`` a while and then yields its core (``sched_yield``), so that on
a busy machine the thread it waits for gets the core.

Nothing a member runs may raise: a member that raised would leave the others waiting for its
phase forever. The functions of a step are compiled with ``error_model="numpy"`` (a float
division by zero gives inf or NaN, as it does in a ``prange`` body, instead of raising; a
hidden state gone non-finite is the screened head's to report), index checks are off, and
their arrays are allocated before the region or per thread.

Every thread runs the same sequence of phases, numbered from 0, and ``sync`` (int64
``[phases, SYNC_WIDTH]``, zeroed per call) holds each phase's two counters on cache lines of their
own. The atomics are seq_cst read-modify-writes and acquire loads, so what one thread wrote before
:func:`finish` is what another reads after :func:`wait_done`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys

from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

#: int64 columns per phase in ``sync``: the chunk counter at 0 and the done counter at
#: ``DONE``, 64 bytes apart
SYNC_WIDTH = 16
DONE = 8
#: ``pause`` instructions a waiting thread spins before it starts to yield its core (~40 cycles
#: each on recent x86: some 50-100 us, longer than any chunk)
SPINS = 2000

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _register_sched_yield() -> bool:
    """Make ``sched_yield`` (POSIX) resolvable by numba's JIT linker; False where absent."""
    name = ctypes.util.find_library("c")
    if name is None and not sys.platform.startswith("linux"):
        return False  # (Windows: no C library by that name, no sched_yield)
    try:
        libc = ctypes.CDLL(name)
        fn = libc.sched_yield
    except (OSError, AttributeError, TypeError):
        return False
    llvm.add_symbol("sched_yield", ctypes.cast(fn, ctypes.c_void_p).value)
    return True


_HAVE_YIELD = _register_sched_yield()


def _element(context, builder, aryty, ary, idx):
    a = context.make_array(aryty)(context, builder, ary)
    return builder.gep(a.data, [idx])


@intrinsic
def fetch_add(typingctx, sync, ph, col, val):
    """``old = sync[ph, col]; sync[ph, col] += val; return old``, atomically (seq_cst)."""
    sig = types.int64(sync, types.intp, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        arr, ph, col, val = args
        idx = builder.add(builder.mul(ph, ir.Constant(ph.type, SYNC_WIDTH)), col)
        ptr = _element(context, builder, signature.args[0], arr, idx)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return sig, codegen


@intrinsic
def load_acquire(typingctx, sync, ph, col):
    """``sync[ph, col]`` read with acquire ordering."""
    sig = types.int64(sync, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        arr, ph, col = args
        idx = builder.add(builder.mul(ph, ir.Constant(ph.type, SYNC_WIDTH)), col)
        ptr = _element(context, builder, signature.args[0], arr, idx)
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def relax(typingctx, spins):
    """One round of waiting: ``pause`` (x86) while ``spins < SPINS``, else ``sched_yield()``."""
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
        (spins,) = args
        mod = builder.module
        short = builder.icmp_signed("<", spins, ir.Constant(spins.type, SPINS))
        with builder.if_else(short) as (spin, give):
            with spin:
                if _X86:
                    fn = cgutils.get_or_insert_function(
                        mod, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
                    builder.call(fn, [])
            with give:
                if _HAVE_YIELD:
                    fn = cgutils.get_or_insert_function(
                        mod, ir.FunctionType(ir.IntType(32), []), "sched_yield")
                    builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def claim(sync, ph):
    """The next chunk of phase ``ph`` for this thread (0, 1, ...; past the last: none left)."""
    return fetch_add(sync, ph, 0, 1)


@njit(inline="always")
def finish(sync, ph):
    """Count one chunk of phase ``ph`` done (after writing its results)."""
    fetch_add(sync, ph, DONE, 1)


@njit(inline="always")
def take_guided(sync, ph, units, least, threads):
    """This thread's next run ``[u0, u1)`` of phase ``ph``'s ``units``, taken guided (as
    OpenMP's ``schedule(guided)``): 1 / (2 * threads) of the units nobody took yet, at least
    ``least``; ``u0 >= u1`` once none is left. Count the run done with :func:`finish_run`."""
    seen = load_acquire(sync, ph, 0)
    if seen >= units:
        return units, units
    take = max(least, (units - seen) // (2 * threads))
    u0 = fetch_add(sync, ph, 0, take)
    return u0, min(units, u0 + take)


@njit(inline="always")
def finish_run(sync, ph, n):
    """Count ``n`` units of phase ``ph`` done (a run from :func:`take_guided`)."""
    fetch_add(sync, ph, DONE, n)


@njit(inline="always")
def wait_done(sync, ph, chunks):
    """Return once all ``chunks`` chunks of phase ``ph`` are done."""
    spins = 0
    while load_acquire(sync, ph, DONE) < chunks:
        relax(spins)
        spins += 1


@njit(inline="always")
def serial(sync, ph):
    """True for the one thread that runs serial phase ``ph``; it calls :func:`finish` after."""
    return claim(sync, ph) == 0
