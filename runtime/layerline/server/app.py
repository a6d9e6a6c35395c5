"""The ASGI app: FastAPI with the router, its state on `app.state`, OpenAI-shaped errors for
everything else, and one log line per request.

app.state holds: config (ServerConfig), engine (AsyncEngine), metrics, serving (OpenAIServing),
ops (StageOps: the stages' health and route switches; None when nothing watches the stages).
"""
from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine
from .chat import TextSide
from .metrics import Metrics
from .protocol import error_body
from .router import ROUTES, router
from .serving import OpenAIServing, ServerConfig
from .stages import StageOps

log = logging.getLogger("layerline.server")


class JsonFormatter(logging.Formatter):
    """--log-format json: one JSON object per line (time, level, message; a request's fields as keys)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname.lower(), "logger": record.name}
        req = getattr(record, "request", None)
        if isinstance(req, dict):
            out.update(req)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class RequestLog:
    """Pure ASGI middleware: one log line per request (after a stream ends), requests by status."""

    def __init__(self, app: FastAPI, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500}
        scope.setdefault("state", {})

        async def send_logged(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)
        try:
            await self.app(scope, receive, send_logged)
        finally:
            path = scope.get("path", "")
            route = path if path in ROUTES else "other"
            self.metrics.requests.labels(route, str(status["code"])).inc()
            extra = scope["state"].get("log", "")
            client = scope.get("client") or ("-", 0)
            fields = {"client": client[0], "method": scope.get("method", "-"), "path": path,
                      "status": status["code"], "seconds": round(time.perf_counter() - t0, 3)}
            if isinstance(extra, dict):
                fields.update(extra)
                extra = " ".join(f"{k}={v!r}" if k == "user" else f"{k}={v}" for k, v in extra.items())
            elif extra:
                fields["note"] = extra
            log.info("%s %s %s %d %.3fs%s", client[0], scope.get("method", "-"), path, status["code"],
                     time.perf_counter() - t0, f" {extra}" if extra else "", extra={"request": fields})


def build_app(engine: AsyncEngine, text: TextSide, cfg: ServerConfig, ops: StageOps | None = None) -> RequestLog:
    """The server's ASGI app (FastAPI inside the request log)."""
    app = FastAPI(title="layerline", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = cfg
    app.state.engine = engine
    app.state.metrics = engine.metrics
    app.state.serving = OpenAIServing(engine, text, cfg)
    app.state.ops = ops
    app.include_router(router)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        msg = {404: f"{request.url.path}: no such route", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(msg, "invalid_request_error", None, None), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # the server never dies of a request
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {exc.__class__.__name__}", "server_error"), status_code=500)

    return RequestLog(app, engine.metrics)
