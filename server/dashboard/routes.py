"""GET /dashboard (the page, its script and style: public, they hold no data) and GET /v1/stats (the data,
behind --api-key like every other route). Neither exists with --no-dashboard (404)."""
from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from server.dashboard.collector import StatsCollector

# Served without the API key: the page asks for the key and sends it only to /v1/stats.
PAGE_PATHS = {"/dashboard": ("index.html", "text/html; charset=utf-8"),
              "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
              "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
# The page runs only its own script and style, talks only to this server, and cannot be framed.
_PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                            "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
                 "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}


def install_dashboard(app: FastAPI, collector: StatsCollector, api_key_required: bool) -> None:
    static = resources.files("server.dashboard") / "static"
    for path, (name, media_type) in PAGE_PATHS.items():
        body = (static / name).read_bytes()
        # The page asks for the key before its first request, rather than after a 401.
        body = body.replace(b"{{API_KEY_REQUIRED}}", b"required" if api_key_required else b"no")
        _add_page(app, path, body, media_type)

    @app.get("/v1/stats", include_in_schema=False)
    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(collector.snapshot(time.monotonic()), headers={"Cache-Control": "no-store"})


def _add_page(app: FastAPI, path: str, body: bytes, media_type: str) -> None:
    async def page() -> Response:
        return Response(body, media_type=media_type, headers=_PAGE_HEADERS)
    app.add_api_route(path, page, methods=["GET"], include_in_schema=False)
