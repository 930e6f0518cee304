"""What one decode step moves through memory, and how fast the device's memory is.

The bandwidth floor of the benchmarks and the serving efficiency gauge both divide bytes read per decode
step (every weight once, plus the KV of every running sequence) by the device's memory bandwidth.
"""
from __future__ import annotations

import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:     # torch is imported where it is used: the benchmark client reads the table without it
    import torch

# Measured HBM copy bandwidth (bytes/s) of the GPUs we benchmark on; matched against the device name.
HBM_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.0e12),
    ("H100", 3.0e12),
    ("A100", 1.6e12),
)


def _table(module: torch.nn.Module) -> object:
    """The embedding's or LM head's weight: its GGUF blocks when it keeps them, else the parameter."""
    q = getattr(module, "qweight", None)
    return q if q is not None else module.weight


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied ones once), except an
    untied input embedding, of which a step gathers only a few rows."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[id(p)] = p.numel() * p.element_size()
    for module in model.modules():      # weights kept as GGUF blocks (engine/layers/quantized.py)
        q = getattr(module, "qweight", None)
        if q is not None:
            seen[id(q)] = q.nbytes
    embed, head = _table(model.embed_tokens), _table(model.lm_head)
    tied = embed is head or (hasattr(embed, "data_ptr") and hasattr(head, "data_ptr")
                             and embed.data_ptr() == head.data_ptr())
    if not tied:
        seen.pop(id(embed), None)
    return sum(seen.values())


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    cfg = model.config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def device_bandwidth(name: str | None) -> float | None:
    """Measured HBM copy bandwidth for a known GPU name, None when unknown (or a CPU)."""
    if not name:
        return None
    for key, value in HBM_BANDWIDTH:
        if key.lower() in name.lower():
            return value
    return None


def memory_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of the device's memory: the measured figure for a known GPU, else the theoretical peak the
    driver reports (memory clock x bus width, double data rate); None on a CPU."""
    if device.type != "cuda":
        return None
    known = device_bandwidth(device_name(device))
    if known is not None:
        return known
    import torch
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None
