"""Process-wide settings that make a CPU forward fast: the C library's allocator.

Every CPU forward allocates activations of several MB (a 2048-token prefill chunk of SmolLM2 makes 25 MB
gate/up outputs) and frees them within the step. glibc's defaults hand such blocks back to the kernel on
free (mmap'd chunks above a dynamic threshold, heap tops above a trim threshold, per-thread heaps shrunk
with madvise), so the next step touches fresh pages and takes a page fault per 4 KiB: about 1M faults in
the first 40 steps of the batch-64 benchmark, a third of its time (docs/benchmarks.md). Keeping freed
memory in the process costs nothing on a server whose peak is reached every step anyway.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Blocks up to this size come from the heap, not from mmap: the largest value glibc accepts for its
# per-thread arenas (half their 64 MiB heap size), which covers every activation of a 2048-token chunk of
# models up to about 1B parameters.
MMAP_THRESHOLD_BYTES = 32 << 20
# Freed memory at the top of a heap is returned to the kernel only beyond this much (int: at most 2 GiB).
TRIM_THRESHOLD_BYTES = (1 << 31) - 1

_tuned = False


def keep_freed_memory() -> bool:
    """Tunes glibc's malloc once per process; False (and nothing changed) on other C libraries."""
    global _tuned
    if _tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.debug("mallopt refused the allocator settings; CPU steps may page-fault on fresh memory")
    _tuned = ok
    return ok
