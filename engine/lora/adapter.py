"""A PEFT LoRA adapter directory read into the model's fused, per-rank projection layout.

PEFT keeps one (A [r, in], B [out, r]) pair per adapted nn.Linear (q_proj, k_proj, ...). The engine fuses q/k/v
and gate/up into one matmul each, so an adapter becomes one pair per fused projection: A stacks the
sub-projections' A matrices ([S * R, in], R = --max-lora-rank, S = 3 for qkv, 2 for gate_up, else 1) and B is
block-diagonal ([out, S * R]: the q rows read only q's rank columns). One shrink and one expand per projection
then serve every sub-projection; unused rank rows and columns stay 0. The scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA) is folded into B.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.distributed import parallel_state
from engine.loader import checkpoint_target, rank_part
from engine.lora.request import LoRARequest
from engine.models.config import ModelConfig

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# PEFT's module name -> (our fused projection, its index among the fused sub-projections)
_SUB_INDEX = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}
_PEFT_NAME = {("qkv_proj", "q"): "q_proj", ("qkv_proj", "k"): "k_proj", ("qkv_proj", "v"): "v_proj",
              ("o_proj", None): "o_proj", ("gate_up_proj", 0): "gate_proj", ("gate_up_proj", 1): "up_proj",
              ("down_proj", None): "down_proj"}
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def num_subprojections(projection: str) -> int:
    return {"qkv_proj": 3, "gate_up_proj": 2}.get(projection, 1)


@dataclass
class LoRAWeights:
    """An adapter in slot layout: (layer, projection) -> (A [S*R, in_local], B [out_local, S*R]), on the host."""
    request: LoRARequest
    rank: int                                              # the largest rank among its modules
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not path.is_dir():
        raise ValueError(f"LoRA adapter directory {str(path)!r} does not exist.")
    if not config_file.is_file():
        raise ValueError(f"{str(path)!r} is not a PEFT adapter: adapter_config.json is missing.")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}.") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file} must hold a JSON object.")
    unsupported = {
        "peft_type": cfg.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") != "none",
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
    }
    refused = [f"{k}={cfg.get(k)!r}" for k, bad in unsupported.items() if bad]
    if refused:
        raise ValueError(f"LoRA adapter {str(path)!r}: {', '.join(refused)} is not supported (plain LoRA on "
                         f"{', '.join(TARGET_MODULES)} is).")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {str(path)!r}: r must be a positive integer, got {rank!r}.")
    return cfg


def _weights_file(path: Path) -> Path:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_model.safetensors.")
    return file


def _module_of(name: str, num_layers: int, path: Path) -> tuple[int, str, object, str]:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' -> (3, 'qkv_proj', 'q', 'lora_A')."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(f"LoRA adapter {str(path)!r}: unexpected tensor {name!r} (only lora_A / lora_B weights "
                         f"of {', '.join(TARGET_MODULES)} are supported).")
    module = ".".join(parts[:-2]).removeprefix("base_model.model.")
    target, shard = checkpoint_target(module + ".weight")
    pieces = target.split(".")
    if (len(pieces) != 5 or pieces[0] != "layers" or not pieces[1].isdigit() or pieces[3] not in PROJECTIONS
            or int(pieces[1]) >= num_layers):
        raise ValueError(f"LoRA adapter {str(path)!r} targets {module!r}, which the model does not have "
                         f"(supported: {', '.join(TARGET_MODULES)} of layers 0..{num_layers - 1}).")
    return int(pieces[1]), pieces[3], shard, parts[-2]


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """Reads and checks the adapter (ValueError saying what is wrong) and lays it out for this rank."""
    path = Path(request.lora_path)
    config = _config(path)
    alpha, rslora = float(config.get("lora_alpha", config["r"])), bool(config.get("use_rslora"))
    found: dict[tuple[int, str, object], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(_weights_file(path)), framework="pt") as f:
            for name in f.keys():
                layer, projection, shard, kind = _module_of(name, cfg.num_layers, path)
                found.setdefault((layer, projection, shard), {})[kind] = f.get_tensor(name).float()
    except ValueError:
        raise
    except Exception as e:      # safetensors' own errors: a truncated or corrupt file
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_model.safetensors cannot be read ({e}).") from None
    if not found:
        raise ValueError(f"LoRA adapter {str(path)!r} holds no LoRA weights.")
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for (layer, projection, shard), ab in found.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {projection} has only {', '.join(ab)}.")
        rank = ab["lora_A"].shape[0]
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {str(path)!r} has rank {rank}, above --max-lora-rank {max_rank}.")
        top_rank = max(top_rank, rank)
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        a, b = _pair(layer, projection, max_rank, cfg, dtype, pairs)
        where = f"layer {layer} {_PEFT_NAME[projection, shard]}"
        _place(a, b, ab["lora_A"], ab["lora_B"] * scale, projection, shard, rank, max_rank, cfg, f"{path}: {where}")
    return LoRAWeights(request, top_rank, pairs)


def _pair(layer: int, projection: str, max_rank: int, cfg: ModelConfig, dtype: torch.dtype,
          pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    if (layer, projection) not in pairs:
        in_local, out_local = projection_shape(projection, cfg)
        width = num_subprojections(projection) * max_rank
        pairs[layer, projection] = (torch.zeros(width, in_local, dtype=dtype), torch.zeros(out_local, width, dtype=dtype))
    return pairs[layer, projection]


def projection_shape(projection: str, cfg: ModelConfig) -> tuple[int, int]:
    """(in_features, out_features) of this rank's part of a fused projection."""
    tp = parallel_state.tp_world_size()
    local = parallel_state.shard_config(cfg, tp)
    q, kv = local.num_heads * cfg.head_dim, local.num_kv_heads * cfg.head_dim
    return {"qkv_proj": (cfg.hidden_size, q + 2 * kv), "o_proj": (q, cfg.hidden_size),
            "gate_up_proj": (cfg.hidden_size, 2 * local.intermediate_size),
            "down_proj": (local.intermediate_size, cfg.hidden_size)}[projection]


def _place(a: torch.Tensor, b: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, projection: str,
           shard: object, rank: int, max_rank: int, cfg: ModelConfig, where: str) -> None:
    """Copies this rank's part of one module's A and B into the fused pair: rows of A and columns of B at the
    sub-projection's rank slot; column-parallel layers split B's rows, row-parallel ones A's columns."""
    target = f"layers.0.{'self_attn' if projection in ('qkv_proj', 'o_proj') else 'mlp'}.{projection}.weight"
    part = rank_part(target, shard, cfg, parallel_state.tp_rank(), parallel_state.tp_world_size())
    full_out = part.full if part.start is not None and part.dim == 0 else b.shape[0]
    full_in = part.full if part.start is not None and part.dim == 1 else a.shape[1]
    if tuple(lora_a.shape) != (rank, full_in) or tuple(lora_b.shape) != (full_out, rank):
        raise ValueError(f"LoRA adapter {where} has A {list(lora_a.shape)} and B {list(lora_b.shape)}; the model "
                         f"needs A [r, {full_in}] and B [{full_out}, r] (an adapter of another base model?).")
    cols = slice(_SUB_INDEX[shard] * max_rank, _SUB_INDEX[shard] * max_rank + rank)
    if part.start is None:
        a[cols], b[:, cols] = lora_a, lora_b
    elif part.dim == 0:
        a[cols] = lora_a
        b[part.row:part.row + part.length, cols] = lora_b[part.start:part.start + part.length]
    else:
        a[cols] = lora_a[:, part.start:part.start + part.length]
        b[:, cols] = lora_b
