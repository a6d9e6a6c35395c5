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
from ..model.grammar import (Constraint, GrammarError, GrammarUnavailable, check_grammar, json_schema_grammar,
                             lark_grammar)
from . import tools
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
    aliases: tuple[str, ...] = ()      # other ids a request may name the model by (the file's name, the GGUF's)

    def serves(self, model: str) -> bool:
        return model == self.model_name or model in self.aliases


@dataclass
class SamplingArgs:
    """Sampling as the request gives it (seed None: the engine's thread draws one)."""
    temperature: float
    top_p: float
    seed: int | None


@dataclass
class Output:
    """What a request asks of its output beyond sampling: a grammar (response_format, or a tool call
    that tool_choice requires), logprobs, logit_bias, and where its tool calls are to be read."""
    grammar: str | None = None
    grammar_param: str | None = None         # the field that asked for the grammar (its errors name it)
    logprobs: int | None = None              # alternatives per token; None: no logprobs
    bias: dict[int, float] | None = None
    penalties: tuple[float, float] | None = None   # (presence, frequency)
    tool_format: str | None = None           # layerline.server.tools: parse tool calls in this format
    one_call: bool = False                   # parallel_tool_calls false: the first call only
    echo: str = ""                           # completions' echo: the prompt's text before the answer


@dataclass
class Choice:
    """One of a request's n generations as it goes."""
    index: int
    st: Stream
    det: Detokenizer
    text: list[str] = field(default_factory=list)
    toks: list[int] = field(default_factory=list)
    lps: list = field(default_factory=list)            # (token, logprob, [(id, logprob)]) per token
    finish: str | None = None


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
        if not self.cfg.serves(req.model):
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

    # -- what a request asks of its output

    async def output(self, req: BaseRequest, chat: bool) -> Output:
        """The request's grammar, logprobs, logit_bias and tool-call format, checked (400s name the field)."""
        try:
            return await self._output(req, chat)
        except GrammarUnavailable as e:
            raise BadRequest(str(e), "response_format" if req.response_format else "tool_choice",
                             "grammar_unavailable", 501, "server_error") from None

    async def _output(self, req: BaseRequest, chat: bool) -> Output:
        out = Output()
        if req.logit_bias:
            out.bias = {}
            v = self.text.vocab_size
            for k, b in req.logit_bias.items():
                if not k.lstrip("-").isdigit() or (v is not None and not 0 <= int(k) < v) or int(k) < 0:
                    raise BadRequest(f"logit_bias: {k!r} is not a token id" + (f" in [0, {v})" if v else ""),
                                     "logit_bias", "invalid_parameter")
                if not -100 <= b <= 100:
                    raise BadRequest(f"logit_bias: {b} for token {k} is outside [-100, 100]", "logit_bias",
                                     "invalid_parameter")
                out.bias[int(k)] = float(b)
        if req.presence_penalty or req.frequency_penalty:
            out.penalties = (float(req.presence_penalty or 0.0), float(req.frequency_penalty or 0.0))
        if chat:
            if req.top_logprobs and not req.logprobs:
                raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs", "invalid_parameter")
            out.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            out.logprobs = req.logprobs
        grammar, param = self.response_grammar(req.response_format), "response_format"
        if chat and req.tools and req.tool_choice != "none":
            out.tool_format = tools.tool_format(self.text.template)
            out.one_call = req.parallel_tool_calls is False
            tg = self.tool_choice_grammar(req, out.tool_format)
            if tg is not None:
                if grammar is not None:
                    raise BadRequest("response_format and a tool_choice that requires a call both constrain the "
                                     "output: give one of them", "response_format", "invalid_parameter")
                grammar, param = tg, "tool_choice"
        elif chat and req.tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice: a required or named tool call needs tools", "tool_choice",
                             "invalid_parameter")
        if grammar is not None:
            try:
                tok = self.text.grammar_tokenizer()
                await asyncio.to_thread(check_grammar, tok, grammar)   # the first builds the tokenizer (~0.2 s)
            except TemplateError as e:
                raise BadRequest(str(e), param, "no_tokenizer") from None
            except GrammarError as e:
                raise BadRequest(f"{param}: the grammar does not compile: {e}", param, "invalid_schema") from None
            out.grammar, out.grammar_param = grammar, param
        return out

    @staticmethod
    def response_grammar(rf: dict | None) -> str | None:
        if rf is None or rf.get("type") == "text":
            return None
        kind = rf.get("type")
        try:
            if kind == "json_object":
                return json_schema_grammar({"type": "object"})
            if kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                    raise BadRequest("response_format.json_schema: give {\"name\": ..., \"schema\": {...}}",
                                     "response_format", "invalid_parameter")
                return json_schema_grammar(js.get("schema") or {"type": "object"})
        except GrammarError as e:
            raise BadRequest(f"response_format: the schema does not compile: {e}", "response_format",
                             "invalid_schema") from None
        raise BadRequest(f"response_format: type {kind!r} is not one of text, json_object, json_schema",
                         "response_format", "invalid_parameter")

    @staticmethod
    def tool_choice_grammar(req: ChatRequest, fmt: str) -> str | None:
        choice = req.tool_choice
        defs = [t.model_dump(exclude_none=True) for t in req.tools]
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise BadRequest('tool_choice: give "none", "auto", "required" or {"type": "function", '
                                 '"function": {"name": NAME}}', "tool_choice", "invalid_parameter")
            if name not in [d["function"]["name"] for d in defs]:
                raise BadRequest(f"tool_choice: no tool named {name!r} in tools", "tool_choice", "invalid_parameter")
        g = tools.tool_grammar(fmt, defs, choice)
        return None if g is None else lark_grammar(g)

    def chat_messages(self, req: ChatRequest) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools as the template takes them. A template that knows no tools gets them
        as a system message, earlier calls as their text and tool results as user turns."""
        defs = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" \
            else None
        takes = tools.template_takes_tools(self.text.template)
        messages = []
        for m in req.messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                d["content"] = "".join(part.text for part in m.content)
            calls = d.get("tool_calls")
            if isinstance(calls, list):
                for c in calls:   # templates read arguments as an object (Hugging Face's convention)
                    f = c.get("function") if isinstance(c, dict) else None
                    if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                        try:
                            f["arguments"] = json.loads(f["arguments"])
                        except ValueError:
                            raise BadRequest("messages: a tool call's arguments are not JSON", "messages",
                                             "invalid_parameter") from None
                if not takes and req.tools:
                    text = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                                   "arguments": c["function"].get("arguments", {})})
                                      + "\n</tool_call>" for c in calls if isinstance(c, dict) and "function" in c)
                    d = {"role": "assistant", "content": ((d.get("content") or "") + "\n" + text).strip()}
            if d.get("role") == "tool" and not takes and req.tools:
                d = {"role": "user", "content": f"<tool_response>\n{d.get('content', '')}\n</tool_response>"}
            if d.get("content") is None and d.get("role") == "assistant" and not takes:
                d["content"] = ""
            messages.append(d)
        if defs and not takes:
            sys_text = tools.tools_system_prompt(defs)
            if messages[0].get("role") == "system":
                messages[0] = {**messages[0], "content": sys_text + "\n\n" + str(messages[0].get("content") or "")}
            else:
                messages.insert(0, {"role": "system", "content": sys_text})
            defs = None
        return messages, defs

    # -- the endpoints

    async def completions(self, request: Request) -> Response:
        try:
            self.check_key(request)
            req = self.parse(CompletionRequest, await self.read_json(request))
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
            out = await self.output(req, chat=False)
            if req.echo:
                out.echo = p if isinstance(p, str) else self.text.decode(ids)
            return await self.respond(request, req, ids, max_tokens, False, out)
        except BadRequest as e:
            return error_response(e)

    async def chat(self, request: Request) -> Response:
        try:
            self.check_key(request)
            req = self.parse(ChatRequest, await self.read_json(request))
            messages, defs = self.chat_messages(req)
            try:
                ids = self.text.chat_ids(messages, defs)
            except TemplateError as e:
                raise BadRequest(str(e), "messages", "chat_template") from None
            self.check_ids(ids, "messages")
            max_tokens = self.budget(ids, req.max_completion_tokens or req.max_tokens, self.cfg.default_max_tokens)
            out = await self.output(req, chat=True)
            return await self.respond(request, req, ids, max_tokens, True, out)
        except BadRequest as e:
            return error_response(e)

    def card(self) -> ModelCard:
        cfg = self.cfg
        return ModelCard(id=cfg.model_name, created=cfg.created, max_model_len=cfg.context)

    def models(self, request: Request) -> Response | dict:
        try:
            self.check_key(request)
        except BadRequest as e:
            return error_response(e)
        return ModelList(data=[self.card()]).model_dump()

    def model(self, request: Request, model_id: str) -> Response | dict:
        """GET /v1/models/{id}: the card, under the id or an alias; else 404 model_not_found."""
        try:
            self.check_key(request)
            if not self.cfg.serves(model_id):
                raise BadRequest(f"model {model_id!r} is not served here; this server serves "
                                 f"{self.cfg.model_name!r}", "model", "model_not_found", 404)
        except BadRequest as e:
            return error_response(e)
        return self.card().model_dump()

    # -- one generation

    def start(self, req: BaseRequest, ids: list[int], max_tokens: int, out: Output) -> list[Choice]:
        stop = req.stops()
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        eos = frozenset() if req.ignore_eos else self.text.eos_ids
        loop = asyncio.get_running_loop()
        choices: list[Choice] = []
        try:
            for i in range(req.n or 1):
                # n choices of one seeded request: seeds seed, seed+1, ... (each reproducible alone)
                seed = None if req.seed is None else (req.seed + i) & 0xFFFF_FFFF_FFFF_FFFF
                constraint = Constraint(self.text.grammar_tokenizer(), out.grammar) if out.grammar else None
                st = self.engine.submit(ids, max_tokens, SamplingArgs(temperature, top_p, seed), eos, loop,
                                        constraint=constraint, logprobs=out.logprobs, bias=out.bias,
                                        penalties=out.penalties)
                choices.append(Choice(i, st, Detokenizer(self.text, stop)))
        except (QueueFull, LayerlineError, GrammarError) as e:
            for c in choices:
                self.engine.cancel(c.st.sid)
            if isinstance(e, QueueFull):
                raise BadRequest(str(e), None, "queue_full", 429, "rate_limit_error",
                                 {"Retry-After": str(e.retry_after)}) from None
            if isinstance(e, GrammarError):
                raise BadRequest(f"{out.grammar_param}: {e}", out.grammar_param, "invalid_schema") from None
            raise BadRequest(str(e), None, "engine_down", 503, "server_error") from None
        return choices

    async def tokens(self, request: Request, st: Stream, det: Detokenizer, watch: bool):
        """(text delta, token ids, logprobs of those tokens, finish reason or None) as tokens come; cancels
        on a gone client or a stop.

        watch: look for a disconnected client every quarter second (sse-starlette does it for streams)."""
        done = False
        checked = time.monotonic()
        lp = None
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
                if kind == "logprobs":
                    lp = value
                elif kind == "token":
                    lps = [(value, *lp)] if lp is not None else []
                    lp = None
                    delta = det.add(value)
                    if det.stopped:
                        yield delta, [value], lps, "stop"
                        return
                    yield delta, [value], lps, None
                elif kind == "done":
                    done = True
                    yield det.flush(), [], [], "stop" if value == "stop" else "length" if value == "length" else value
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
    def usage(choices: list[Choice]) -> UsageInfo:
        prompt = choices[0].st.prompt_tokens
        completion = sum(c.st.completion_tokens for c in choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def note(self, request: Request, req: BaseRequest, choices: list[Choice], finish) -> None:
        """The request's log fields, and the vLLM-named request metrics (one per choice)."""
        st = choices[0].st
        m = self.engine.metrics
        now = time.perf_counter()
        for c in choices:
            reason = c.finish or ("abort" if finish == "disconnected" else "error" if finish == "error" else "abort")
            reason = {"tool_calls": "stop", "cancelled": "abort"}.get(reason, reason)
            m.v_success.labels(m.model_name, reason).inc()
            m.v_e2e.observe((c.st.last_token or now) - c.st.arrived)
            m.v_req_generation.observe(c.st.completion_tokens)
        m.v_req_prompt.observe(st.prompt_tokens)
        ttft = (st.first_token - st.arrived) if st.first_token else None
        fields = {"model": req.model, "prompt": st.prompt_tokens,
                  "completion": sum(c.st.completion_tokens for c in choices), "finish": finish,
                  "stream": bool(req.stream)}
        if len(choices) > 1:
            fields["n"] = len(choices)
        if ttft is not None:
            fields["ttft"] = round(ttft, 3)
        if req.user:
            fields["user"] = req.user
        request.scope["state"]["log"] = fields

    # -- logprobs as the API gives them

    def chat_logprobs(self, lps: list) -> dict:
        def entry(tok: int, lp: float) -> dict:
            t = self.text.token_text(tok)
            return {"token": t, "logprob": max(lp, -9999.0), "bytes": list(t.encode("utf-8"))}
        return {"content": [{**entry(tok, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                            for tok, lp, top in lps], "refusal": None}

    def completion_logprobs(self, lps: list, offset: int) -> dict:
        tokens, offsets, tops = [], [], []
        for tok, _, top in lps:
            t = self.text.token_text(tok)
            tokens.append(t)
            offsets.append(offset)
            offset += len(t)
            tops.append({self.text.token_text(i): max(v, -9999.0) for i, v in top})
        return {"tokens": tokens, "token_logprobs": [max(lp, -9999.0) for _, lp, _ in lps],
                "top_logprobs": tops, "text_offset": offsets}

    # -- the answer

    async def respond(self, request: Request, req: BaseRequest, ids: list[int], max_tokens: int,
                      chat: bool, out: Output) -> Response:
        choices = self.start(req, ids, max_tokens, out)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if not req.stream:
            return await self.whole(request, req, choices, rid, created, chat, out)
        return self.stream(request, req, choices, rid, created, chat, out)

    async def whole(self, request: Request, req: BaseRequest, choices: list[Choice], rid: str, created: int,
                    chat: bool, out: Output) -> Response:
        for n, c in enumerate(choices):
            try:
                async for delta, toks, lps, fin in self.tokens(request, c.st, c.det, True):
                    c.text.append(delta)
                    c.toks += toks
                    c.lps += lps
                    c.finish = fin or c.finish
            except BadRequest as e:
                for rest in choices[n + 1:]:
                    self.engine.cancel(rest.st.sid)
                self.note(request, req, choices, "error")
                return error_response(e)
            if c.finish is None:  # the client went away
                for rest in choices[n + 1:]:
                    self.engine.cancel(rest.st.sid)
                self.note(request, req, choices, "disconnected")
                return Response(status_code=499)
        body = []
        for c in choices:
            text = "".join(c.text)
            if chat:
                content, calls = (tools.parse(out.tool_format, text) if out.tool_format else (text, []))
                if out.one_call:
                    calls = calls[:1]
                if calls:
                    c.finish = "tool_calls" if c.finish == "stop" else c.finish
                msg = AssistantMessage(content=content if calls else text,
                                       tool_calls=[k.dump() for k in calls] or None)
                body.append(ChatChoice(index=c.index, message=msg, finish_reason=c.finish, token_ids=c.toks,
                                       logprobs=self.chat_logprobs(c.lps) if out.logprobs is not None else None))
            else:
                lp = self.completion_logprobs(c.lps, len(out.echo)) if out.logprobs is not None else None
                body.append(CompletionChoice(index=c.index, text=out.echo + text, finish_reason=c.finish,
                                             token_ids=c.toks, logprobs=lp))
        self.note(request, req, choices, ",".join(sorted({str(c.finish) for c in choices})))
        return JSONResponse(CompletionResponse(id=rid, object="chat.completion" if chat else "text_completion",
                                               created=created, model=self.cfg.model_name, choices=body,
                                               usage=self.usage(choices)).model_dump())

    def stream(self, request: Request, req: BaseRequest, choices: list[Choice], rid: str, created: int,
               chat: bool, out: Output) -> Response:
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        model = self.cfg.model_name

        def chunk(c: Choice, delta: str | None, toks: list[int], finish=None, lps=None, calls=None,
                  first: bool = False, use: UsageInfo | None = None) -> dict:
            if chat:
                d = (DeltaMessage(role="assistant", content="") if first else
                     DeltaMessage(tool_calls=calls) if calls else DeltaMessage(content=delta))
                lp = self.chat_logprobs(lps) if lps else None
                ch = ChatStreamChoice(index=c.index, delta=d, finish_reason=finish, token_ids=toks, logprobs=lp)
            else:
                lp = self.completion_logprobs(lps, 0) if lps else None
                ch = CompletionChoice(index=c.index, text=delta or "", finish_reason=finish, token_ids=toks,
                                      logprobs=lp)
            return {"data": json.dumps(StreamChunk(id=rid, object=chunk_obj, created=created, model=model,
                                                   choices=[ch], usage=use).dump())}

        def usage_of(c: Choice) -> UsageInfo:
            return self.usage([c])

        async def one(c: Choice):
            """This choice's chunks."""
            parser = tools.StreamParser(out.tool_format) if chat and out.tool_format else None
            ncalls = 0

            def call_deltas(calls):
                nonlocal ncalls
                if out.one_call:
                    calls = calls[:max(0, 1 - ncalls)]
                ds = []
                for k in calls:
                    ds.append({"index": ncalls, **k.dump()})
                    ncalls += 1
                return ds
            if chat:
                yield chunk(c, None, [], first=True)
            elif out.echo:
                yield chunk(c, out.echo, [])
            async for delta, toks, lps, fin in self.tokens(request, c.st, c.det, False):
                c.toks += toks
                calls = []
                if parser is not None:
                    delta, got = parser.feed(delta)
                    calls = call_deltas(got)
                    if fin is not None:
                        rest, got = parser.end()
                        delta += rest
                        calls += call_deltas(got)
                    if ncalls and not delta.strip():   # the whitespace between calls, as the whole parse drops it
                        delta = ""
                if calls:
                    yield chunk(c, None, [], calls=calls)
                if fin is not None:
                    c.finish = "tool_calls" if ncalls and fin == "stop" else fin
                    if delta or lps:
                        yield chunk(c, delta, toks, lps=lps)
                        toks = []
                    yield chunk(c, None if chat else "", toks, c.finish, use=usage_of(c))
                elif delta or toks:
                    yield chunk(c, delta, toks, lps=lps)

        async def merged():
            if len(choices) == 1:
                async for ev in one(choices[0]):
                    yield ev
                return
            q: asyncio.Queue = asyncio.Queue()

            async def pump(c: Choice):
                try:
                    async for ev in one(c):
                        await q.put(ev)
                except BadRequest as e:
                    await q.put(e)
                finally:
                    await q.put(None)
            tasks = [asyncio.ensure_future(pump(c)) for c in choices]
            try:
                left = len(tasks)
                while left:
                    ev = await q.get()
                    if ev is None:
                        left -= 1
                    elif isinstance(ev, BadRequest):
                        raise ev
                    else:
                        yield ev
            finally:
                for t in tasks:
                    t.cancel()

        async def events():
            finish = None
            try:
                async for ev in merged():
                    yield ev
                if all(c.finish is not None for c in choices):
                    finish = ",".join(sorted({str(c.finish) for c in choices}))
                    if (req.stream_options or {}).get("include_usage"):
                        yield {"data": json.dumps(StreamChunk(id=rid, object=chunk_obj, created=created, model=model,
                                                              choices=[], usage=self.usage(choices)).dump())}
                    yield {"data": "[DONE]"}
            except BadRequest as e:
                finish = "error"
                yield {"data": json.dumps(error_body(e.message, e.type, e.param, e.code))}
                yield {"data": "[DONE]"}
            finally:
                for c in choices:
                    if c.finish is None:
                        self.engine.cancel(c.st.sid)
                self.note(request, req, choices, finish or "disconnected")

        return EventSourceResponse(events(), sep="\n", ping=15)
