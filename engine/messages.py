"""The wire between the front end and the engine process (ZMQ, msgspec msgpack).

In: AddRequest / AbortRequest / LoadLoRA / UnloadLoRA / ArmFault / Shutdown. Out: EngineReady once (or EngineFailed), then one
StepOutput per engine step carrying every request's new tokens and the engine's stats, and EngineFailed
if the engine dies. The front end and the engine process each hold one Encoder and one Decoder.
"""
from __future__ import annotations

import msgspec

from engine.lora.request import LoRARequest
from engine.model_info import ModelInfo
from engine.outputs import EngineStats, RequestDelta
from engine.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float                # time.monotonic() in the front end (one clock per host)
    lora: LoRARequest | None = None    # the adapter it runs with (None: the base model)


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    seq_index: int | None = None       # None: every sample of the request
    finish_reason: str = "abort"


class LoadLoRA(msgspec.Struct, tag=True, array_like=True):
    """Loads an adapter; answered by a finished RequestDelta for `request_id` (error set if it failed)."""
    request_id: str
    lora: LoRARequest


class UnloadLoRA(msgspec.Struct, tag=True, array_like=True):
    """Forgets an adapter; answered like LoadLoRA."""
    request_id: str
    lora_int_id: int


LoRAControl = LoadLoRA | UnloadLoRA


class ArmFault(msgspec.Struct, tag=True, array_like=True):
    """Test-only fault injection (engine/faults.py), honoured only when the engine process enabled it."""
    kind: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class EngineReady(msgspec.Struct, tag=True, array_like=True):
    info: ModelInfo


class StepOutput(msgspec.Struct, tag=True, array_like=True):
    deltas: list[RequestDelta]
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag=True, array_like=True):
    """The engine could not start, or its loop died; `error` is what the operator should read."""
    error: str


EngineInput = AddRequest | AbortRequest | LoadLoRA | UnloadLoRA | ArmFault | Shutdown
EngineOutput = EngineReady | StepOutput | EngineFailed


def input_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineInput)


def output_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineOutput)
