"""--dtype auto on CPU: the activation dtype that is faster on the CPU the engine runs on, and why.

The rule, from measurements on three CPU kinds (docs/benchmarks.md, "--dtype auto on CPU"):
- AMX tiles (Intel Sapphire Rapids and later): bf16; AMX multiplies bf16 matrices many times faster.
- AVX512_BF16 on AMD (Zen 4 / Zen 5): bf16; SmolLM2 at batch 64 ran 2.5x faster than in fp32 on a Zen 5.
- AVX512_BF16 on Intel without AMX: fp32; oneDNN's bf16 GEMMs ran at about half of MKL's fp32 speed there.
- neither (AVX2 only): fp32; bf16 is converted in software, a 1536x576 GEMM ran 3-6x slower than in fp32.
A model whose linear layers are quantized blocks (a .gguf file, --quantization q8_0/q4_0) multiplies in
integers whatever the activation dtype, so the rule differs:
- AVX512_BF16 with AVX-512 VNNI (the blocks kernel's tiles take every step, no float GEMM): bf16; it halves
  the KV cache and activation bytes, and lets the projections take int8 inputs (LinearBase.int8_for). SmolLM2's Q4_1
  file at batch 64 on a Zen 4 core: 582 against 305 output tok/s in fp32, one stream 9.9 against 14.3 ms per
  token (int8 inputs, docs/benchmarks.md); perplexity 23.58 against 23.53 (+0.2%). Measured on AMD
  only: no Intel CPU with AVX512_BF16 was at hand.
- otherwise: fp32; without VNNI many-row steps dequantize into the activation dtype for torch's GEMM, where
  bf16 without AMX or AVX512_BF16 is the slow case above.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuKind:
    vendor: str                 # /proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD, ...
    flags: frozenset[str]

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags


def this_cpu() -> CpuKind:
    vendor, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id" and not vendor:
                vendor = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:     # not Linux: torch's own AMX probe below still answers
        pass
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        flags |= {"amx_bf16"}
    return CpuKind(vendor, flags)


def auto_dtype(cpu: CpuKind) -> tuple[str, str]:
    """(dtype, the reason) for this CPU."""
    if cpu.amx:
        return "bfloat16", "AMX tiles multiply bf16 matrices"
    if cpu.avx512_bf16 and cpu.vendor == "AuthenticAMD":
        return "bfloat16", "AVX512_BF16 on AMD: bf16 GEMMs measured 2.5x faster than fp32 on Zen 5"
    if cpu.avx512_bf16:
        return "float32", "AVX512_BF16 without AMX: oneDNN's bf16 GEMMs measured at half of fp32's speed on a Xeon"
    return "float32", "no AVX512_BF16 or AMX: bf16 would be converted in software (3-6x slower GEMMs measured)"


def auto_blocks_dtype(cpu: CpuKind) -> tuple[str, str]:
    """(dtype, the reason) for a model computed from quantized blocks on this CPU."""
    if cpu.avx512_bf16 and "avx512_vnni" in cpu.flags:
        return "bfloat16", ("quantized blocks with AVX-512 VNNI and AVX512_BF16: bf16 inputs take int8 tiles "
                            "(fp32's int16) and halve the KV cache and activation bytes (1.9x at batch 64 "
                            "measured on Zen 4)")
    return "float32", "quantized blocks without AVX-512 VNNI and AVX512_BF16: steps of many rows use float GEMMs"


@functools.cache
def cpu_auto_dtype(quantized_blocks: bool = False) -> str:
    dtype, why = auto_blocks_dtype(this_cpu()) if quantized_blocks else auto_dtype(this_cpu())
    log.info("--dtype auto on this CPU: %s (%s)", dtype, why)
    return dtype
