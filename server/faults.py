"""Test-only fault injection routes: `POST /_fault/{kind}` arms one fault inside the engine process.

Off unless the environment variable PAGEDSERVE_ENABLE_FAULT_INJECTION=1 is set when the server starts (the
engine process inherits it and installs its hooks, engine/faults.py); the route sits behind the API key
like every other route. Kinds: forward, nan, kill (once); hold, slow (until release); release (see
engine/faults.py, and tests/README.md for how tests use them).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI

from engine.faults import ENV_VAR, KINDS, enabled
from server.engine_client import EngineClient
from server.errors import APIError

__all__ = ["enabled", "install_fault_routes"]
logger = logging.getLogger("pagedserve.server")


def install_fault_routes(app: FastAPI, client: EngineClient) -> None:
    logger.warning("%s=1: fault injection routes are enabled; never do this in production", ENV_VAR)

    @app.post("/_fault/{kind}", include_in_schema=False)
    async def arm_fault(kind: str) -> dict[str, str]:
        if kind not in KINDS:
            raise APIError(404, f"Unknown fault {kind!r}; faults are {', '.join(KINDS)}.")
        client.arm_fault(kind)
        return {"armed": kind}
