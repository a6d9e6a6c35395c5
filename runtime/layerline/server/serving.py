"""Serving the OpenAI API: completions and chat completions over the engine, and their streams.

A request is checked (API key, body size, JSON, its model, token ids, the context and KV
budgets), submitted to the engine (layerline.server.async_engine), and answered as one JSON body
or as server-sent events ending in `data: [DONE]`. A client that goes away, or a stop string,
cancels its sequence at once, which frees its KV slot. One log line per request (app.RequestLog)
carries what `note` leaves in the request's scope.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse

from ..errors import LayerlineError
from . import auth
from .async_engine import AsyncEngine, QueueFull, Stream
from .chat import Detokenizer, TemplateError, TextSide
from .protocol import (AssistantMessage, BadRequest, BaseRequest, ChatChoice, ChatRequest, ChatStreamChoice,
                       CompletionChoice, CompletionRequest, CompletionResponse, DeltaMessage, ModelCard, ModelList,
                       StreamChunk, UsageInfo, error_body, error_response, validation_message)


@dataclass
class ServerConfig:
    model_name: str
    context: int                       # tokens a sequence may reach (prompt + max_tokens)
    kv_tokens: int | None = None       # KV tokens every stage holds across sequences
    api_keys: list[bytes] | None = None
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256      # chat requests without max_tokens
    admin_keys: list[bytes] | None = None   # Bearer keys for /admin/*; None: the admin routes answer 403
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class SamplingArgs:
    """Sampling as the request gives it (seed None: the engine's thread draws one)."""
    temperature: float
    top_p: float
    seed: int | None


class OpenAIServing:
    """The completions and chat endpoints' logic (vLLM's OpenAIServingCompletion / Chat in one)."""

    def __init__(self, engine: AsyncEngine, text: TextSide, cfg: ServerConfig):
        self.engine, self.text, self.cfg = engine, text, cfg

    # -- checks

    def check_key(self, request: Request) -> None:
        if self.cfg.api_keys and not auth.check(self.cfg.api_keys, request.headers.get("authorization")):
            raise BadRequest("missing or wrong API key: send Authorization: Bearer KEY", None, "invalid_api_key",
                             401, headers={"WWW-Authenticate": "Bearer"})

    async def read_json(self, request: Request) -> Any:
        limit = self.cfg.max_body_bytes
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > limit:
            raise BadRequest(f"request body of {n} bytes is over the {limit}-byte limit", None, "body_too_large", 413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BadRequest(f"request body is over the {limit}-byte limit", None, "body_too_large", 413)
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON ({e})", None, "invalid_json") from None
        except RecursionError:  # [[[[...]]]] deeper than the parser's stack
            raise BadRequest("the body nests too deeply to parse", None, "invalid_json") from None
        if not isinstance(data, dict):
            raise BadRequest("the body must be a JSON object", None, "invalid_json")
        return data

    def parse(self, model: type[BaseModel], data: dict):
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            msg, param = validation_message(e)
            raise BadRequest(msg, param, "invalid_parameter") from None
        req.refuse_unimplemented()
        if req.model != self.cfg.model_name:
            raise BadRequest(f"model {req.model!r} is not served here; this server serves {self.cfg.model_name!r} "
                             "(GET /v1/models)", "model", "model_not_found")
        return req

    def check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise BadRequest(f"{param}: the prompt is empty", param, "invalid_parameter")
        v = self.text.vocab_size
        if v is not None and any(not 0 <= t < v for t in ids):
            raise BadRequest(f"{param}: token ids must be in [0, {v})", param, "invalid_parameter")

    def budget(self, ids: list[int], max_tokens: int | None, default: int) -> int:
        n, cfg = len(ids), self.cfg
        if max_tokens is None:
            max_tokens = max(1, min(default, cfg.context - n))
        if n + max_tokens > cfg.context:
            raise BadRequest(f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} tokens "
                             f"is over the model's context of {cfg.context} tokens; shorten the prompt or lower "
                             "max_tokens", "max_tokens", "context_length_exceeded")
        if cfg.kv_tokens is not None and n + max_tokens > cfg.kv_tokens:
            raise BadRequest(f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} tokens "
                             f"is over the stages' KV budget of {cfg.kv_tokens} tokens", "max_tokens",
                             "context_length_exceeded")
        return max_tokens

    # -- the endpoints

    async def completions(self, request: Request) -> Response:
        try:
            self.check_key(request)
            req = self.parse(CompletionRequest, await self.read_json(request))
            if req.echo or req.logprobs:
                raise BadRequest("echo and logprobs are not supported", "echo" if req.echo else "logprobs",
                                 "unsupported_parameter")
            p = req.prompt
            if isinstance(p, list) and p and isinstance(p[0], (str, list)):
                if len(p) != 1:
                    raise BadRequest(f"prompt: one prompt per request (got {len(p)})", "prompt", "invalid_parameter")
                p = p[0]
            try:
                ids = self.text.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            except TemplateError as e:
                raise BadRequest(str(e), "prompt", "no_tokenizer") from None
            self.check_ids(ids, "prompt")
            max_tokens = self.budget(ids, req.max_tokens, 16)
            return await self.respond(request, req, ids, max_tokens, chat=False)
        except BadRequest as e:
            return error_response(e)

    async def chat(self, request: Request) -> Response:
        try:
            self.check_key(request)
            req = self.parse(ChatRequest, await self.read_json(request))
            if req.logprobs:
                raise BadRequest("logprobs are not supported", "logprobs", "unsupported_parameter")
            messages = []
            for m in req.messages:
                d = m.model_dump(exclude_none=True)
                if isinstance(m.content, list):
                    d["content"] = "".join(part.text for part in m.content)
                messages.append(d)
            try:
                ids = self.text.chat_ids(messages)
            except TemplateError as e:
                raise BadRequest(str(e), "messages", "chat_template") from None
            self.check_ids(ids, "messages")
            max_tokens = self.budget(ids, req.max_completion_tokens or req.max_tokens, self.cfg.default_max_tokens)
            return await self.respond(request, req, ids, max_tokens, chat=True)
        except BadRequest as e:
            return error_response(e)

    def models(self, request: Request) -> Response | dict:
        try:
            self.check_key(request)
        except BadRequest as e:
            return error_response(e)
        cfg = self.cfg
        return ModelList(data=[ModelCard(id=cfg.model_name, created=cfg.created, max_model_len=cfg.context)]).model_dump()

    # -- one generation

    def start(self, req: BaseRequest, ids: list[int], max_tokens: int) -> tuple[Stream, Detokenizer]:
        stop = req.stops()
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        eos = frozenset() if req.ignore_eos else self.text.eos_ids
        try:
            st = self.engine.submit(ids, max_tokens, SamplingArgs(temperature, top_p, req.seed), eos,
                                    asyncio.get_running_loop())
        except QueueFull as e:
            raise BadRequest(str(e), None, "queue_full", 429, "rate_limit_error",
                             {"Retry-After": str(e.retry_after)}) from None
        except LayerlineError as e:
            raise BadRequest(str(e), None, "engine_down", 503, "server_error") from None
        return st, Detokenizer(self.text, stop)

    async def tokens(self, request: Request, st: Stream, det: Detokenizer, watch: bool):
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
                    raise BadRequest(f"service unavailable: {value}", None, "stage_down", 503, "server_error",
                                     {"Retry-After": "5"})
                else:
                    done = True
                    raise BadRequest(f"generation failed: {value}", None, "generation_failed", 502, "server_error")
        finally:
            if not done:
                self.engine.cancel(st.sid)  # the client went, or a stop string ended it: free the slot now

    @staticmethod
    def usage(st: Stream) -> UsageInfo:
        return UsageInfo(prompt_tokens=st.prompt_tokens, completion_tokens=st.completion_tokens,
                         total_tokens=st.prompt_tokens + st.completion_tokens)

    @staticmethod
    def note(request: Request, req: BaseRequest, st: Stream, finish) -> None:
        ttft = (st.first_token - st.arrived) if st.first_token else None
        request.scope["state"]["log"] = (
            f"model={req.model} prompt={st.prompt_tokens} completion={st.completion_tokens} finish={finish} "
            f"stream={bool(req.stream)}" + (f" ttft={ttft:.3f}s" if ttft is not None else "")
            + (f" user={req.user!r}" if req.user else ""))

    async def respond(self, request: Request, req: BaseRequest, ids: list[int], max_tokens: int,
                      chat: bool) -> Response:
        st, det = self.start(req, ids, max_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.cfg.model_name
        obj = "chat.completion" if chat else "text_completion"
        usage, note = self.usage, self.note
        if not req.stream:
            text_out, toks, finish = [], [], None
            try:
                async for delta, ids_, fin in self.tokens(request, st, det, True):
                    text_out.append(delta)
                    toks += ids_
                    finish = fin or finish
            except BadRequest as e:
                note(request, req, st, "error")
                return error_response(e)
            if finish is None:  # the client went away
                note(request, req, st, "disconnected")
                return Response(status_code=499)
            body = "".join(text_out)
            choice = (ChatChoice(message=AssistantMessage(content=body), finish_reason=finish, token_ids=toks) if chat
                      else CompletionChoice(text=body, finish_reason=finish, token_ids=toks))
            note(request, req, st, finish)
            return JSONResponse(CompletionResponse(id=rid, object=obj, created=created, model=model, choices=[choice],
                                                   usage=usage(st)).model_dump())

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, toks: list[int], finish, first: bool = False,
                  use: UsageInfo | None = None) -> str:
            if chat:
                d = DeltaMessage(role="assistant", content="") if first else DeltaMessage(content=delta)
                c = ChatStreamChoice(delta=d, finish_reason=finish, token_ids=toks)
            else:
                c = CompletionChoice(text=delta or "", finish_reason=finish, token_ids=toks)
            return json.dumps(StreamChunk(id=rid, object=chunk_obj, created=created, model=model, choices=[c],
                                          usage=use).dump())

        async def events():
            finish = None
            try:
                if chat:
                    yield {"data": chunk(None, [], None, first=True)}
                async for delta, toks, fin in self.tokens(request, st, det, False):
                    finish = fin
                    if fin is not None:
                        if delta:
                            yield {"data": chunk(delta, toks, None)}
                            toks = []
                        yield {"data": chunk(None if chat else "", toks, fin, use=usage(st))}
                    elif delta or toks:
                        yield {"data": chunk(delta, toks, None)}
                if finish is not None and (req.stream_options or {}).get("include_usage"):
                    yield {"data": json.dumps(StreamChunk(id=rid, object=chunk_obj, created=created, model=model,
                                                          choices=[], usage=usage(st)).dump())}
                if finish is not None:
                    yield {"data": "[DONE]"}
            except BadRequest as e:
                finish = "error"
                yield {"data": json.dumps(error_body(e.message, e.type, e.param, e.code))}
                yield {"data": "[DONE]"}
            finally:
                note(request, req, st, finish or "disconnected")

        return EventSourceResponse(events(), sep="\n", ping=15)
