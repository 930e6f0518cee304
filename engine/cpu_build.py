"""Builds the engine's C++ CPU kernels once per machine into one library and loads it with ctypes.

The sources (a thread pool, paged attention, the small-batch linear, fused norm and RoPE) are plain C++
(no torch headers), so they compile in a few seconds; they are compiled
with -march=native for the CPU it runs on and cached under the pagedserve cache dir, keyed by the sources,
the flags and the CPU's feature list. Without a C++ compiler the callers fall back to torch (a warning says
so).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.tiny_model import cache_dir

log = logging.getLogger(__name__)

_ENGINE = Path(__file__).parent
SOURCES = (_ENGINE / "cpu_pool.cpp", _ENGINE / "attention" / "cpu_kernel.cpp",
           _ENGINE / "layers" / "cpu_linear.cpp", _ENGINE / "layers" / "cpu_ops.cpp")
HEADERS = (_ENGINE / "cpu_pool.h", _ENGINE / "cpu_dtypes.h")
# The fast-math pieces that let GCC vectorize the dot products and softmax sums, but not -ffast-math itself:
# with -shared it links crtfastmath.o, which turns on flush-to-zero / denormals-are-zero for the WHOLE
# process when the library loads, silently changing torch's own arithmetic (a subnormal top_p became 0.0).
# No FMA contraction either: the RoPE kernel then rounds exactly as the torch reference does.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-std=c++17")


def _cpu_features() -> str:
    """The flags line of /proc/cpuinfo: -march=native code must not move to a CPU without them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compile(out: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(tmp_out)], check=True, capture_output=True,
                       text=True)
        os.replace(tmp_out, out)  # atomic: concurrent builders each publish a whole file


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here."""
    sources = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    key = hashlib.sha256(sources + " ".join(FLAGS).encode() + _cpu_features().encode())
    path = cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _compile(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU kernels unavailable (%s); using torch's attention reference and linear layers", detail)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int  # pointers are tensors' data_ptr()
    lib.paged_attention.restype = i
    i64, f = ctypes.c_int64, ctypes.c_float
    lib.paged_attention.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, p, i64, p, p, i, i, i, i, i, f, i]
    lib.cpu_pool_start.restype = i
    lib.cpu_pool_start.argtypes = [i]
    lib.cpu_pool_start(torch.get_num_threads())  # the pool's threads: as many as torch's
    lib.linear_small_m.restype = i
    lib.linear_small_m.argtypes = [p, p, p, p, i, i, i, i]
    lib.cpu_rms_norm.restype = i
    lib.cpu_rms_norm.argtypes = [p, p, p, p, p, i64, i, i64, f, i]
    lib.cpu_rope.restype = i
    lib.cpu_rope.argtypes = [p, p, p, p, i64, i, i, i, i64, i64, i64, p, p, f, i]
    return lib
