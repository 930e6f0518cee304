"""--dtype auto on CPU: the activation dtype that is faster on the CPU the engine runs on, and why.

The rule, from measurements on three CPU kinds (docs/benchmarks.md, "--dtype auto on CPU"):
- AMX tiles (Intel Sapphire Rapids and later): bf16; AMX multiplies bf16 matrices many times faster.
- AVX512_BF16 on AMD (Zen 4 / Zen 5): bf16; SmolLM2 at batch 64 ran 2.5x faster than in fp32 on a Zen 5.
- AVX512_BF16 on Intel without AMX: fp32; oneDNN's bf16 GEMMs ran at about half of MKL's fp32 speed there.
- neither (AVX2 only): fp32; bf16 is converted in software, a 1536x576 GEMM ran 3-6x slower than in fp32.
A model whose linear layers are quantized blocks (a .gguf file, --quantization q8_0/q4_0) stays fp32 on every
CPU: the blocks kernel rounds its inputs to int16 itself, so bf16 activations would only add a rounding, and
in bf16 a prompt prefilled whole (dequantized GEMMs) and one continued from a cached prefix (the blocks
kernel) drifted apart within 40 greedy tokens.
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


@functools.cache
def cpu_auto_dtype(quantized_blocks: bool = False) -> str:
    dtype, why = ("float32", "quantized blocks: the kernel rounds its inputs to int16 itself") if quantized_blocks \
        else auto_dtype(this_cpu())
    log.info("--dtype auto on this CPU: %s (%s)", dtype, why)
    return dtype
