"""Builds the native CPU kernels of this folder once per machine into one library and loads it with ctypes.

The sources (pool.cpp: the thread pool; attention.cpp: paged attention; linear.cpp: the small-batch linear;
ops.cpp: fused norm, RoPE and SiLU-and-mul; quant.cpp: linear layers and embedding rows from GGUF quantized
blocks; layer.cpp: a quantized decoder layer in one call) are
plain C++ (no torch headers), so they compile in a few seconds; they are compiled with -march=native for
the CPU it runs on (so each picks its AVX-512 / AVX2 / scalar path for that CPU) and cached under the
pagedserve cache dir ($PAGEDSERVE_CACHE, else ~/.cache/pagedserve, as the engine's), keyed by the sources,
the flags and the CPU's feature list. Without a C++ compiler the callers fall back to torch (a warning says so).
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

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in ("pool.cpp", "attention.cpp", "linear.cpp", "ops.cpp", "quant.cpp",
                                           "quant_tiles.cpp", "layer.cpp"))
HEADERS = tuple(_HERE / name for name in ("pool.h", "dtypes.h", "quant_blocks.h", "quant_tiles.h", "quant_x16.h",
                                           "vec_math.h"))
# The fast-math pieces that let GCC vectorize the dot products and softmax sums, but not -ffast-math itself:
# with -shared it links crtfastmath.o, which turns on flush-to-zero / denormals-are-zero for the WHOLE
# process when the library loads, silently changing torch's own arithmetic (a subnormal top_p became 0.0).
# No FMA contraction either: the RoPE kernel then rounds exactly as the torch reference does.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-std=c++17")


def _cache_dir() -> Path:
    """Where the built library is kept: the pagedserve cache dir's kernels/ (kernels never import engine)."""
    root = os.environ.get("PAGEDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "pagedserve")
    return Path(root) / "kernels"


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
    path = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
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
    lib.cpu_silu_and_mul.restype = i
    lib.cpu_silu_and_mul.argtypes = [p, p, i64, i, i64, i]
    lib.cpu_rope.restype = i
    lib.cpu_rope.argtypes = [p, p, p, p, i64, i, i, i, i64, i64, i64, p, p, f, i]
    lib.qlinear.restype = i
    lib.qlinear.argtypes = [p, p, i, i, i, i, i64, p, i64, i, i, i]
    lib.qdequant.restype = i
    lib.qlinear_max_rows.restype = i
    lib.qlinear_max_rows.argtypes = []
    lib.qlinear_has_int8.restype = i
    lib.qlinear_has_int8.argtypes = []
    lib.qdequant.argtypes = [p, i, i64, i, p, i, i, p, i]
    lib.qinterleave.restype = i
    lib.qinterleave.argtypes = [p, i, i, i, i64]
    lib.qlinear_has_interleaved.restype = i
    lib.qlinear_has_interleaved.argtypes = []
    return lib
