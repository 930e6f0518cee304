"""Every kernel launch compiles for an H100 (sm_90) with Triton's real compiler, even on a CPU-only machine.

The interpreter never runs the compiler, so this catches what the CPU tests cannot: dot shapes below the
tensor-core minimum, loop-carried type changes, shared memory over the limit, and attention loops that lose
their software pipelining (cp.async), which would cost most of the decode bandwidth.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the bundled CUDA toolchain")
def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = {r["kernel"] for r in rows}
    assert {"_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_store_kv_cache_kernel",
            "_rope_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel"} <= kernels
    for r in rows:
        if r["kernel"] in ("_decode_kernel", "_prefill_kernel"):
            assert r["pipelined"], f"{r['kernel']} {r['constexprs']}: KV loads are no longer pipelined"
