"""PEFT adapters with random, non-zero weights for tiny checkpoints, and peft's own greedy output as reference."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import greedy_of, hf_gguf_model


def _base(path: Path):
    """A fresh transformers model (peft changes the one it wraps): a checkpoint directory or a GGUF file."""
    from transformers import AutoModelForCausalLM
    if str(path).endswith(".gguf"):
        return hf_gguf_model(str(path))
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def make_adapter(base: Path, out: Path, targets: list[str], rank: int = 8, alpha: int = 16, rslora: bool = False,
                 seed: int = 0) -> Path:
    """An adapter as `peft` saves it (adapter_config.json + adapter_model.safetensors). Both A and B are random
    (PEFT's init_lora_weights=False), so every adapted projection changes the output."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = _base(base)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:     # large enough to change greedy tokens, small enough to keep logits sane
                param.copy_(torch.randn_like(param) * 0.2)
    peft_model.save_pretrained(str(out))
    return out


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers + peft (the adapter not merged) greedy tokens; adapter None: the base model."""
    from peft import PeftModel
    model = _base(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    return greedy_of(model, prompt, max_new_tokens)[0]
