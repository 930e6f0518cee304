"""A .gguf file dequantized into a Hugging Face checkpoint directory (fp32 safetensors), for peers that cannot
read GGUF blocks (vLLM's CPU build): transformers reads the file, the weights are saved as they came out.

    python benchmarks/gguf_to_hf.py OUT_DIR [--model FILE.gguf]     # default: the default model's file
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=None, help="a .gguf file (default: the default model's)")
    a = p.parse_args()
    if a.model is None:
        from engine.default_model import DEFAULT_MODEL, resolve
        a.model = str(resolve(DEFAULT_MODEL).path)
    path = Path(a.model)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    a.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)       # safetensors refuses shared tensors; the config ties it back
    save_file(state, a.out / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(a.out)
    tokenizer.save_pretrained(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
