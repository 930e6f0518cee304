"""LoRA adapters: PEFT directories read into slot tables, batched per step (multi-LoRA serving)."""
