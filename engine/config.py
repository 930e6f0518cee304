"""EngineConfig: every knob of the engine, validated once."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.cpu_dtype import cpu_auto_dtype
from engine.default_model import DEFAULT_MODEL
from engine.spec_decode.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
QUANTIZATION_CHOICES = ("auto", "gguf", "none", "q8_0", "q4_0")
POOLING_TYPES = ("last", "mean")   # how an embedding request pools the final hidden states (engine/pooling.py)


@dataclass(frozen=True)
class EngineConfig:
    # A built-in name (SmolLM2-135M-Instruct, tiny-random), a .gguf file or an HF checkpoint directory;
    # see engine.default_model.resolve.
    model: str = DEFAULT_MODEL
    device: str = "auto"              # "cpu" | "cuda" | "auto"
    dtype: str = "auto"               # "float32" | "float16" | "bfloat16" | "auto"
    # "gguf": a .gguf file's quantized tensors stay blocks and are computed with on CPU; "none": dequantized
    # into dtype at load; "auto": gguf for a .gguf file on CPU, else none (engine/loader.py).
    quantization: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size from memory (GPU) or max_num_seqs * max_model_len (CPU)
    max_model_len: int | None = None  # None: from the model's config
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    max_cudagraph_batch: int = 256
    # Launch step N+1 before step N's tokens reach the host. None: on for CUDA, where the device runs
    # asynchronously; off on CPU, where the forward would compete with the host work for the same cores.
    async_scheduling: bool | None = None
    max_logprobs: int = 20            # most logprobs / prompt_logprobs alternatives a request may ask for
    grammar_compile_timeout: float = 10.0   # seconds a structured-output grammar may take to compile
    pooling_type: str = "last"        # embedding requests: the last token's final hidden state, or the mean
    # LoRA adapters (engine/lora/): max_loras distinct adapters per step (slots in the model's tables), ranks up
    # to max_lora_rank, max_cpu_loras kept loaded on the host (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()   # (name, PEFT directory) loaded at startup, ids 1, 2, ...
    # Tensor parallelism (engine/distributed/): ranks in all, spread evenly over nnodes nodes; the ranks
    # meet at master_addr:master_port (None: env MASTER_ADDR / MASTER_PORT, else this host and a free port).
    # Speculative decoding (engine/spec_decode/): ngram or draft_model proposals, verified exactly
    speculative_config: SpeculativeConfig | None = None
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}.")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}.")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {self.quantization!r}.")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_cudagraph_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2 (block 0 is reserved).")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1.")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}.")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be > 0 seconds.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1].")
        self._check_parallel()
        self._check_lora()
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, SpeculativeConfig):    # a dict or JSON text
                object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
            if self.async_scheduling:
                raise ValueError("speculative decoding (--speculative-config) runs without async_scheduling: "
                                 "the drafts are proposed from the sampled tokens.")

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora (--enable-lora).")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be unique, got {names}.")

    def _check_parallel(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1 or nnodes < 1:
            raise ValueError("tensor_parallel_size and nnodes must be >= 1.")
        if tp % nnodes:
            raise ValueError(f"tensor_parallel_size {tp} must be a multiple of nnodes {nnodes} "
                             "(the same number of ranks on every node).")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be in [0, {nnodes - 1}], got {self.node_rank}.")
        if tp > 1 and self.async_scheduling:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1 yet.")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port (1-65535), got {self.master_port}.")

    def resolved(self) -> EngineConfig:
        """Replace every 'auto' by the concrete choice for this machine."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but no CUDA device is available; use --device cpu.")
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else cpu_auto_dtype(self._keeps_blocks())
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if device.startswith("cuda") else "cpu"
        overlap = device.startswith("cuda") if self.async_scheduling is None else self.async_scheduling
        # Workers would need the sampled tokens; drafts are proposed from them too.
        overlap = overlap and self.tensor_parallel_size == 1 and self.speculative_config is None
        if device.startswith("cuda") and self.tensor_parallel_size > 1:
            local_ranks, have = self.tensor_parallel_size // self.nnodes, torch.cuda.device_count()
            if local_ranks > have:
                raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs {local_ranks} GPUs on "
                                 f"this node but {have} are visible.")
        return replace(self, device=device, dtype=dtype, attention_backend=backend, async_scheduling=overlap)

    def _keeps_blocks(self) -> bool:
        """Whether the CPU model computes its linear layers from quantized blocks (engine/loader.py)."""
        from engine.default_model import default_model_file
        from engine.gguf_loader import is_gguf
        if self.quantization in ("q8_0", "q4_0", "gguf"):
            return True
        if self.quantization != "auto":
            return False
        return is_gguf(self.model) or (self.model == DEFAULT_MODEL and default_model_file() is not None)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
