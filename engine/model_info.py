"""ModelInfo: what the front end may know about a loaded engine, frozen, and the checks made at the door.

The engine process sends one ModelInfo when it is ready; the front end never looks at the live engine.
Everything a request is validated against (context length, vocabulary, KV capacity) is here, so the
HTTP server and the offline LLM refuse the same requests with the same messages, before any is submitted.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.structured.grammar import check_structured

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenizerSource(msgspec.Struct, frozen=True):
    """Where the front end loads the model's tokenizer from: a Hugging Face checkpoint directory, or the
    directory and file name of a GGUF checkpoint (the tokenizer is embedded in the file)."""
    path: str
    gguf_file: str | None = None

    @classmethod
    def of(cls, model_path: str | Path) -> "TokenizerSource":
        from engine.gguf_loader import is_gguf
        path = Path(model_path)
        return cls(str(path.parent), path.name) if is_gguf(path) else cls(str(path))

    def load(self) -> PreTrainedTokenizerBase:
        """The same loaders the engine uses, so both processes see the same tokenizer."""
        from engine import gguf_loader, loader
        if self.gguf_file is not None:
            return gguf_loader.load_tokenizer(Path(self.path) / self.gguf_file)
        return loader.load_tokenizer(Path(self.path))


class ModelInfo(msgspec.Struct, frozen=True):
    model_name: str                    # what --model named
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int                 # block 0 is reserved: num_kv_blocks - 1 are usable
    block_size: int
    max_num_seqs: int
    tokenizer: TokenizerSource
    # Sampling defaults from generation_config.json (temperature, top_p, ...): the fields a request omits.
    default_sampling: dict[str, int | float] = {}
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "torch"
    cuda_graphs: bool = False          # decode steps replay CUDA graphs
    device_name: str = ""              # e.g. "NVIDIA H100 80GB HBM3"
    weight_bytes: int = 0              # weights one decode step reads (engine/device_info.py)
    kv_bytes_per_token: int = 0
    memory_bandwidth: float | None = None   # bytes/s of device memory; None on a CPU
    max_logprobs: int = 20             # --max-logprobs
    model_weight_bytes: int = 0        # weights the engine holds, all ranks summed (GGUF blocks at their size)
    weight_format: str = ""            # "Q4_1+Q8_0 blocks, float32 rest" (--quantization gguf) or the dtype
    max_loras: int = 0                 # LoRA adapters per step (0: --enable-lora is off)
    lora_modules: tuple[LoRARequest, ...] = ()   # the adapters loaded at startup (--lora-modules)
    num_speculative_tokens: int = 0    # draft tokens per step at most (0: no speculative decoding)
    speculative_method: str = ""       # "ngram" | "draft_model"

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError (HTTP 400) for a request that can never run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token.")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if params.embed and n > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n} tokens in the input for embedding generation. Please reduce the length of the input.")
        if n + max_tokens > self.max_model_len or max_tokens < params.min_max_tokens:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + max(max_tokens, 0)} tokens ({n} in the prompt, {max(max_tokens, 0)} for the completion). "
                f"Please reduce the prompt or max_tokens.")
        # After the length check: a prompt of millions of ids is refused without scanning them.
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size - 1}].")
        params.check_vocab(self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(f"{name} asks for {asked} alternatives, more than this server's --max-logprobs "
                                 f"({self.max_logprobs}).")
        if params.structured_outputs is not None:     # a schema, regex or grammar that does not parse
            check_structured(params.structured_outputs)
        self.check_kv_fit(n, max_tokens, params.n)

    def check_kv_fit(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        """The prompt and every sample's max_tokens, in blocks, must fit the whole KV cache. A request
        beyond it could never run even alone; one within it always runs eventually (the scheduler is live)."""
        tokens = num_prompt_tokens + n * max_tokens
        blocks = -(-tokens // self.block_size)
        usable = self.num_kv_blocks - 1
        if blocks > usable:
            samples = f" + n x max_tokens = {n} x {max_tokens}" if n > 1 else f" + max_tokens {max_tokens}"
            raise ValueError(
                f"the request needs {blocks} KV blocks of {self.block_size} tokens (prompt {num_prompt_tokens}"
                f"{samples} = {tokens} tokens) but the KV cache holds only {usable} blocks "
                f"({usable * self.block_size} tokens); shorten the prompt, or lower max_tokens or n.")
