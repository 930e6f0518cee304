"""Compile every kernel launch for an H100 (sm_90) on a machine without a GPU.

The interpreter never runs Triton's compiler, so code that passes the CPU tests can still fail to compile
(dot shapes, loop-carried types, shared memory). This script calls the public wrappers with tensors on the
`meta` device, records each kernel launch instead of running it, and compiles the recorded launch through the
JIT's own argument specialisation (divisibility by 16, as a CUDA run would see it) down to a cubin with the
bundled ptxas. Run it without TRITON_INTERPRET:  python -m tests.kernels.sm90_compile [--dump DIR]
It prints one JSON line per launch: kernel, constexprs, shared memory, whether the loads were software-pipelined.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

H100_SHARED_BYTES = 232448  # per-block opt-in limit


def _compile(jit_fn, args: tuple, kwargs: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target, options=options.__dict__)


class _Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the launch."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, grid, args, kwargs))


def record_launches() -> list:
    """Calls every public kernel wrapper on meta tensors at H100-like shapes; returns the recorded launches."""
    from kernels import activation, kv_cache, norm, rope
    from kernels import paged_attention as pa

    launches: list = []
    modules = {activation: ["_silu_and_mul_kernel"], kv_cache: ["_store_kv_cache_kernel"],
               norm: ["_rms_norm_kernel"], rope: ["_rope_kernel"],
               pa: ["_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel"]}
    for mod, names in modules.items():
        for name in names:
            setattr(mod, name, _Recorder(getattr(mod, name), launches))
    meta, bf16 = torch.device("meta"), torch.bfloat16
    for hq, hkv, d in ((16, 8, 128), (32, 8, 64)):
        kc = torch.empty(4096, 16, hkv, d, dtype=bf16, device=meta)
        bt = torch.empty(64, 256, dtype=torch.int32, device=meta)
        lens = torch.empty(64, dtype=torch.int32, device=meta)
        for splits in (1, 8):
            pa.paged_decode_attention(torch.empty(64, hq, d, dtype=bf16, device=meta), kc, kc, bt, lens,
                                      d ** -0.5, splits)
        cu = torch.empty(65, dtype=torch.int32, device=meta)
        pa.paged_prefill_attention(torch.empty(4096, hq, d, dtype=bf16, device=meta), kc, kc, bt, lens, cu,
                                   2048, d ** -0.5)
        kv = torch.empty(64, hkv, d, dtype=bf16, device=meta)
        kv_cache.store_kv_cache(kv, kv, kc, kc, torch.empty(64, dtype=torch.int64, device=meta))
        q = torch.empty(64, hq, d, dtype=bf16, device=meta)
        cache = torch.empty(4096, d, dtype=torch.float32, device=meta)
        pos = torch.empty(64, dtype=torch.int64, device=meta)
        w = torch.empty(d, dtype=bf16, device=meta)
        rope.apply_rope(q, kv, pos, cache)
        rope.qk_norm_rope(q, kv, pos, cache, w, w, 1e-6)
    x = torch.empty(64, 2048, dtype=bf16, device=meta)
    norm.rms_norm(x, torch.empty(2048, dtype=bf16, device=meta), 1e-6)
    norm.fused_add_rms_norm(x, x.clone(), torch.empty(2048, dtype=bf16, device=meta), 1e-6)
    activation.silu_and_mul(torch.empty(64, 2 * 8192, dtype=bf16, device=meta))
    return launches


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, help="write each kernel's TTGIR and PTX here")
    opts = parser.parse_args()
    failures = 0
    for i, (fn, grid, args, kwargs) in enumerate(record_launches()):
        consts = {k: v for k, v in kwargs.items() if k.isupper()}
        try:
            compiled = _compile(fn, args, kwargs)
        except Exception as exc:  # report every failing launch, not just the first
            failures += 1
            print(json.dumps({"kernel": fn.__name__, "constexprs": consts, "error": str(exc)[:2000]}))
            continue
        ttgir = compiled.asm["ttgir"]
        shared = compiled.metadata.shared
        failures += shared > H100_SHARED_BYTES
        print(json.dumps({"kernel": fn.__name__, "constexprs": consts, "grid": [str(g) for g in grid],
                          "shared_bytes": shared, "pipelined": "async_copy" in ttgir or "async_tma" in ttgir}))
        if opts.dump:
            opts.dump.mkdir(parents=True, exist_ok=True)
            (opts.dump / f"{i:02d}_{fn.__name__}.ttgir").write_text(ttgir)
            (opts.dump / f"{i:02d}_{fn.__name__}.ptx").write_text(compiled.asm["ptx"])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
