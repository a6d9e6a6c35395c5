"""The HTTP routes (a FastAPI APIRouter): thin handlers over what `app.state` holds.

POST /v1/completions, POST /v1/chat/completions (layerline.server.serving), GET /v1/models[/{id}],
GET /health, GET /metrics, POST /admin/route (a drain or rejoin switches the route).
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..errors import LayerlineError
from . import auth
from .async_engine import AsyncEngine
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .protocol import BadRequest, error_response
from .serving import OpenAIServing, ServerConfig
from .stages import StageOps

router = APIRouter()
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/admin/route"})


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


def _ops(request: Request) -> StageOps | None:
    return request.app.state.ops


@router.post("/v1/completions")
async def completions(request: Request):
    return await _serving(request).completions(request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _serving(request).chat(request)


@router.get("/v1/models")
async def models(request: Request):
    return _serving(request).models(request)


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    return _serving(request).model(request, model_id)


@router.get("/health")
async def health(request: Request):
    ops = _ops(request)
    if ops is None:
        return {"status": "ok", "stages": []}
    engine: AsyncEngine = request.app.state.engine
    ok, stages = await asyncio.get_running_loop().run_in_executor(None, ops.health)
    ok = ok and engine.alive
    body = {"status": "ok" if ok else "unavailable", "stages": stages, "engine": engine.alive,
            "rows": engine.engine_rows, "standbys": ops.standbys()}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.post("/admin/route")
async def admin_route(request: Request):
    """Switch to another plan's stages (drain.yml, a rejoin): 200 with the new epoch, else the old route stays."""
    cfg: ServerConfig = request.app.state.config
    ops, metrics = _ops(request), request.app.state.metrics
    try:
        if not cfg.admin_keys or ops is None:
            raise BadRequest("admin routes are off: start the server with --admin-keys FILE", None,
                             "admin_disabled", 403)
        server = request.scope.get("server") or (None, None)
        why = auth.admin_reachable(request.client.host if request.client else None, server[0],
                                   request.url.scheme == "https")
        if why:
            raise BadRequest(why, None, "admin_not_here", 403)
        if not auth.check(cfg.admin_keys, request.headers.get("authorization")):
            raise BadRequest("missing or wrong admin key: send Authorization: Bearer ADMIN_KEY", None,
                             "invalid_admin_key", 401, headers={"WWW-Authenticate": "Bearer"})
        data = await _serving(request).read_json(request)
        plan = data.get("plan")
        if not isinstance(plan, dict):
            raise BadRequest("plan: give the new plan as {\"plan\": {...}} (layerline plan --json)", "plan",
                             "invalid_parameter")
        try:
            out = await asyncio.get_running_loop().run_in_executor(None, ops.switch, plan)
        except LayerlineError as e:
            metrics.route_switches.labels("refused").inc()
            raise BadRequest(str(e), "plan", "route_unchanged", 409) from None
        metrics.route_switches.labels("unchanged" if out.get("unchanged") else "switched").inc()
        request.scope["state"]["log"] = f"route epoch {out.get('epoch')}"
        return out
    except BadRequest as e:
        return error_response(e)


@router.get("/metrics")
async def prometheus(request: Request):
    metrics: Metrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
