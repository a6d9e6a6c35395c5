"""The HTTP API (OpenAI-compatible): FastAPI routes, pydantic request models, SSE streams.

POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events ending in
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics. Errors are OpenAI error objects
{"error": {"message", "type", "param", "code"}}. One log line per request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import LayerlineError
from ..generate import Sampling
from . import auth
from .chat import Detokenizer, TemplateError, TextSide
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .scheduler import QueueFull, Scheduler

log = logging.getLogger("layerline.server")

# --- request models -----------------------------------------------------------------------------


class _Req(BaseModel):
    # strict: "5" is not a number, "yes" not a boolean; unknown fields are accepted and ignored
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)   # what a 64-bit generator seed holds
    stop: str | list[str] | None = Field(None)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    user: str | None = Field(None, max_length=256)
    n: int | None = Field(None, ge=1, le=1)
    ignore_eos: bool | None = False   # as vLLM: generate max_tokens whatever the model says

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(s) > 4:
            raise _BadRequest("stop: at most 4 stop strings", "stop")
        return s


class CompletionRequest(_Req):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class ChatRequest(_Req):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False


# --- errors ------------------------------------------------------------------------------------


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type, self.headers = \
            message, param, code, status, type_, headers


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(e: _BadRequest) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def _validation_message(err: ValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    # a union reports each branch; the field's own name is what a user needs
    param = str(first["loc"][0]) if first.get("loc") else None
    return f"{loc or 'body'}: {first.get('msg')}", param


# --- the app -------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    model_name: str
    context: int                       # tokens a sequence may reach (prompt + max_tokens)
    kv_tokens: int | None = None       # KV tokens every stage holds across sequences
    api_keys: list[bytes] | None = None
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256      # chat requests without max_tokens
    health: Callable[[], tuple[bool, list[dict]]] | None = None   # (all ok, per-stage reports); blocking
    standbys: Callable[[], list[dict]] | None = None  # the standby stages as the health monitor last saw them
    admin_keys: list[bytes] | None = None   # Bearer keys for /admin/*; None: the admin routes answer 403
    switch_route: Callable[[dict], dict] | None = None  # POST /admin/route (blocking)
    created: int = field(default_factory=lambda: int(time.time()))


ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/admin/route"}


class _RequestLog:
    """Pure ASGI middleware: one log line per request (after a stream ends), requests by status."""

    def __init__(self, app, metrics: Metrics):
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
            log.info("%s %s %s %d %.3fs%s", client[0], scope.get("method", "-"), path, status["code"],
                     time.perf_counter() - t0, f" {extra}" if extra else "")


def create_app(sched: Scheduler, text: TextSide, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="layerline", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = sched.metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        msg = {404: f"{request.url.path}: no such route", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(msg, "invalid_request_error", None, None), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # the server never dies of a request
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {exc.__class__.__name__}", "server_error"), status_code=500)

    def check_key(request: Request) -> None:
        if cfg.api_keys and not auth.check(cfg.api_keys, request.headers.get("authorization")):
            raise _BadRequest("missing or wrong API key: send Authorization: Bearer KEY", None, "invalid_api_key",
                              401, headers={"WWW-Authenticate": "Bearer"})

    async def read_json(request: Request) -> Any:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > cfg.max_body_bytes:
            raise _BadRequest(f"request body of {n} bytes is over the {cfg.max_body_bytes}-byte limit", None,
                              "body_too_large", 413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > cfg.max_body_bytes:
                raise _BadRequest(f"request body is over the {cfg.max_body_bytes}-byte limit", None,
                                  "body_too_large", 413)
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise _BadRequest(f"the body is not valid JSON ({e})", None, "invalid_json") from None
        except RecursionError:  # [[[[...]]]] deeper than the parser's stack
            raise _BadRequest("the body nests too deeply to parse", None, "invalid_json") from None
        if not isinstance(data, dict):
            raise _BadRequest("the body must be a JSON object", None, "invalid_json")
        return data

    def parse(model, data: dict):
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            msg, param = _validation_message(e)
            raise _BadRequest(msg, param, "invalid_parameter") from None
        if req.model != cfg.model_name:
            raise _BadRequest(f"model {req.model!r} is not served here; this server serves {cfg.model_name!r} "
                              "(GET /v1/models)", "model", "model_not_found")
        return req

    def check_ids(ids: list[int], param: str) -> None:
        if not ids:
            raise _BadRequest(f"{param}: the prompt is empty", param, "invalid_parameter")
        v = text.vocab_size
        if v is not None and any(not 0 <= t < v for t in ids):
            raise _BadRequest(f"{param}: token ids must be in [0, {v})", param, "invalid_parameter")

    def budget(ids: list[int], max_tokens: int | None, default: int) -> int:
        n = len(ids)
        if max_tokens is None:
            max_tokens = max(1, min(default, cfg.context - n))
        if n + max_tokens > cfg.context:
            raise _BadRequest(f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} tokens "
                              f"is over the model's context of {cfg.context} tokens; shorten the prompt or lower "
                              "max_tokens", "max_tokens", "context_length_exceeded")
        if cfg.kv_tokens is not None and n + max_tokens > cfg.kv_tokens:
            raise _BadRequest(f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} tokens "
                              f"is over the stages' KV budget of {cfg.kv_tokens} tokens", "max_tokens",
                              "context_length_exceeded")
        return max_tokens

    def start(request: Request, req: _Req, ids: list[int], max_tokens: int) -> tuple:
        stop = req.stops()
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        eos = frozenset() if req.ignore_eos else text.eos_ids
        try:
            st = sched.submit(ids, max_tokens, _SamplingArgs(temperature, top_p, req.seed), eos,
                              asyncio.get_running_loop())
        except QueueFull as e:
            raise _BadRequest(str(e), None, "queue_full", 429, "rate_limit_error",
                              {"Retry-After": str(e.retry_after)}) from None
        except LayerlineError as e:
            raise _BadRequest(str(e), None, "engine_down", 503, "server_error") from None
        return st, Detokenizer(text, stop)

    async def tokens(request: Request, st, det: Detokenizer, watch: bool):
        """(text delta, token ids, finish reason or None) as tokens come; cancels on a gone client or a stop.

        watch: look for a disconnected client every quarter second (sse-starlette does it for streams)."""
        done = False
        checked = time.monotonic()
        try:
            while True:
                ev = await st.next(0.25)
                if watch and time.monotonic() - checked >= 0.25:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if ev is None:
                    continue
                kind, value = ev
                if kind == "token":
                    delta = det.add(value)
                    if det.stopped:
                        yield delta, [value], "stop"
                        return
                    yield delta, [value], None
                elif kind == "done":
                    done = True
                    yield det.flush(), [], "stop" if value == "stop" else "length" if value == "length" else value
                    return
                elif kind == "unavailable":  # a stage is down and nothing took its place in time
                    done = True
                    raise _BadRequest(f"service unavailable: {value}", None, "stage_down", 503, "server_error",
                                      {"Retry-After": "5"})
                else:
                    done = True
                    raise _BadRequest(f"generation failed: {value}", None, "generation_failed", 502, "server_error")
        finally:
            if not done:
                sched.cancel(st.sid)  # the client went, or a stop string ended it: free the slot now

    def usage(st) -> dict:
        return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.completion_tokens,
                "total_tokens": st.prompt_tokens + st.completion_tokens}

    def note(request: Request, req: _Req, st, finish) -> None:
        ttft = (st.first_token - st.arrived) if st.first_token else None
        request.scope["state"]["log"] = (
            f"model={req.model} prompt={st.prompt_tokens} completion={st.completion_tokens} finish={finish} "
            f"stream={bool(req.stream)}" + (f" ttft={ttft:.3f}s" if ttft is not None else "")
            + (f" user={req.user!r}" if req.user else ""))

    async def respond(request: Request, req: _Req, ids: list[int], max_tokens: int, chat: bool):
        st, det = start(request, req, ids, max_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not req.stream:
            text_out, toks, finish = [], [], None
            try:
                async for delta, ids_, fin in tokens(request, st, det, True):
                    text_out.append(delta)
                    toks += ids_
                    finish = fin or finish
            except _BadRequest as e:
                note(request, req, st, "error")
                return _error_response(e)
            if finish is None:  # the client went away
                note(request, req, st, "disconnected")
                return Response(status_code=499)
            body = "".join(text_out)
            choice = ({"index": 0, "message": {"role": "assistant", "content": body}, "logprobs": None,
                       "finish_reason": finish} if chat else
                      {"index": 0, "text": body, "logprobs": None, "finish_reason": finish})
            choice["token_ids"] = toks
            note(request, req, st, finish)
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": cfg.model_name,
                                 "choices": [choice], "usage": usage(st), "system_fingerprint": None})

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, toks: list[int], finish, first: bool = False, use: dict | None = None) -> str:
            if chat:
                d = {} if delta is None else {"content": delta}
                if first:
                    d = {"role": "assistant", "content": ""}
                c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            c["token_ids"] = toks
            out = {"id": rid, "object": chunk_obj, "created": created, "model": cfg.model_name, "choices": [c]}
            if use is not None:
                out["usage"] = use
            return json.dumps(out)

        async def events():
            finish = None
            try:
                if chat:
                    yield {"data": chunk(None, [], None, first=True)}
                async for delta, toks, fin in tokens(request, st, det, False):
                    finish = fin
                    if fin is not None:
                        if delta:
                            yield {"data": chunk(delta, toks, None)}
                            toks = []
                        yield {"data": chunk(None if chat else "", toks, fin, use=usage(st))}
                    elif delta or toks:
                        yield {"data": chunk(delta, toks, None)}
                if finish is not None and (req.stream_options or {}).get("include_usage"):
                    yield {"data": json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                               "model": cfg.model_name, "choices": [], "usage": usage(st)})}
                if finish is not None:
                    yield {"data": "[DONE]"}
            except _BadRequest as e:
                finish = "error"
                yield {"data": json.dumps(error_body(e.message, e.type, e.param, e.code))}
                yield {"data": "[DONE]"}
            finally:
                note(request, req, st, finish or "disconnected")

        return EventSourceResponse(events(), sep="\n", ping=15)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            check_key(request)
            req = parse(CompletionRequest, await read_json(request))
            if req.echo or req.logprobs:
                raise _BadRequest("echo and logprobs are not supported", "echo" if req.echo else "logprobs",
                                  "unsupported_parameter")
            p = req.prompt
            if isinstance(p, list) and p and isinstance(p[0], (str, list)):
                if len(p) != 1:
                    raise _BadRequest(f"prompt: one prompt per request (got {len(p)})", "prompt", "invalid_parameter")
                p = p[0]
            try:
                ids = text.encode(p) if isinstance(p, str) else list(p)
            except TemplateError as e:
                raise _BadRequest(str(e), "prompt", "no_tokenizer") from None
            check_ids(ids, "prompt")
            max_tokens = budget(ids, req.max_tokens, 16)
            return await respond(request, req, ids, max_tokens, chat=False)
        except _BadRequest as e:
            return _error_response(e)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            check_key(request)
            req = parse(ChatRequest, await read_json(request))
            if req.logprobs:
                raise _BadRequest("logprobs are not supported", "logprobs", "unsupported_parameter")
            messages = []
            for m in req.messages:
                d = m.model_dump(exclude_none=True)
                if isinstance(m.content, list):
                    d["content"] = "".join(part.text for part in m.content)
                messages.append(d)
            try:
                ids = text.chat_ids(messages)
            except TemplateError as e:
                raise _BadRequest(str(e), "messages", "chat_template") from None
            check_ids(ids, "messages")
            max_tokens = budget(ids, req.max_completion_tokens or req.max_tokens, cfg.default_max_tokens)
            return await respond(request, req, ids, max_tokens, chat=True)
        except _BadRequest as e:
            return _error_response(e)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_key(request)
        except _BadRequest as e:
            return _error_response(e)
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": cfg.created,
                                            "owned_by": "layerline", "max_model_len": cfg.context}]}

    @app.get("/health")
    async def health():
        if cfg.health is None:
            return {"status": "ok", "stages": []}
        ok, stages = await asyncio.get_running_loop().run_in_executor(None, cfg.health)
        ok = ok and sched.alive
        body = {"status": "ok" if ok else "unavailable", "stages": stages, "engine": sched.alive,
                "rows": sched.engine_rows}
        if cfg.standbys is not None:
            body["standbys"] = cfg.standbys()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.post("/admin/route")
    async def admin_route(request: Request):
        """Switch to another plan's stages (drain.yml, a rejoin): 200 with the new epoch, else the old route stays."""
        try:
            if not cfg.admin_keys or cfg.switch_route is None:
                raise _BadRequest("admin routes are off: start the server with --admin-keys FILE", None,
                                  "admin_disabled", 403)
            if not auth.check(cfg.admin_keys, request.headers.get("authorization")):
                raise _BadRequest("missing or wrong admin key: send Authorization: Bearer ADMIN_KEY", None,
                                  "invalid_admin_key", 401, headers={"WWW-Authenticate": "Bearer"})
            data = await read_json(request)
            plan = data.get("plan")
            if not isinstance(plan, dict):
                raise _BadRequest("plan: give the new plan as {\"plan\": {...}} (layerline plan --json)", "plan",
                                  "invalid_parameter")
            try:
                out = await asyncio.get_running_loop().run_in_executor(None, cfg.switch_route, plan)
            except LayerlineError as e:
                metrics.route_switches.labels("refused").inc()
                raise _BadRequest(str(e), "plan", "route_unchanged", 409) from None
            metrics.route_switches.labels("unchanged" if out.get("unchanged") else "switched").inc()
            request.scope["state"]["log"] = f"route epoch {out.get('epoch')}"
            return out
        except _BadRequest as e:
            return _error_response(e)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return _RequestLog(app, metrics)


@dataclass
class _SamplingArgs:
    """Sampling as the request gives it (seed None: the scheduler draws one)."""
    temperature: float
    top_p: float
    seed: int | None


__all__ = ["create_app", "ServerConfig", "CompletionRequest", "ChatRequest", "Sampling", "error_body"]
