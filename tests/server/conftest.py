"""Fixtures of the server tests: a tiny checkpoint, and a real server per module."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.server_proc import ServerProcess

MODEL_NAME = "tiny-test"
MAX_MODEL_LEN = 256


def pick_stop(text: str, start: int = 6, length: int = 3) -> str:
    """A stop string cut from generated text: printable ASCII without spaces at its ends, so that the test
    does not depend on how undecodable bytes render."""
    for i in range(start, len(text) - length + 1):
        window = text[i:i + length]
        if window.isascii() and window.isprintable() and window.strip() == window:
            return window
    raise AssertionError(f"no usable stop string in {text!r}")


_CHECKPOINT: list[Path] = []


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per session, also for tests/reliability (whose conftest re-exports this fixture)."""
    if not _CHECKPOINT:
        from engine.tiny_model import build_checkpoint
        _CHECKPOINT.append(build_checkpoint(tmp_path_factory.mktemp("server-ckpt") / "llama", "llama", seed=0))
    return _CHECKPOINT[0]


def start_server(checkpoint: Path, *extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    """Later flags in `extra` override the defaults here. fp32, not `--dtype auto`: the tests compare with
    transformers in fp32, and auto picks bf16 on CPUs where bf16 is faster (engine/cpu_dtype.py)."""
    return ServerProcess("--model", str(checkpoint), "--served-model-name", MODEL_NAME, "--device", "cpu",
                         "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
                         *extra, env=env).wait_ready()


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    proc = start_server(tiny_checkpoint)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        yield client
