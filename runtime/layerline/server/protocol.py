"""The OpenAI API's request and response shapes: pydantic request models, error objects.

Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}}; a request the
server refuses raises BadRequest, which the router answers as one.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


# --- errors ------------------------------------------------------------------------------------


class BadRequest(Exception):
    """A request the server refuses: answered as an OpenAI error object with this HTTP status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type, self.headers = \
            message, param, code, status, type_, headers


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    # a union reports each branch; the field's own name is what a user needs
    param = str(first["loc"][0]) if first.get("loc") else None
    return f"{loc or 'body'}: {first.get('msg')}", param


# --- requests ----------------------------------------------------------------------------------


# OpenAI request fields that would change the answer and that this server does not implement, with
# the values that change nothing (a request naming one otherwise is a 400 that names it, never a
# silently different answer). Fields that change nothing (store, metadata, service_tier, user, ...)
# and names that are not OpenAI's are accepted and ignored.
UNIMPLEMENTED: dict[str, tuple] = {
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "best_of": (None, 1), "suffix": (None, ""), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "web_search_options": (None,),
    "verbosity": (None,),
}
SUPPORTED = ("model, prompt/messages, max_tokens, max_completion_tokens, temperature, top_p, seed, stop, stream, "
             "stream_options, n, logprobs, top_logprobs, logit_bias, presence_penalty, frequency_penalty, "
             "response_format, tools, tool_choice, parallel_tool_calls, echo, ignore_eos")


MAX_N = 16              # choices per request (n)
MAX_TOP_LOGPROBS = 20   # alternatives per token (top_logprobs; completions' logprobs)


class BaseRequest(BaseModel):
    # strict: "5" is not a number, "yes" not a boolean; other fields: see UNIMPLEMENTED
    model_config = ConfigDict(strict=True, extra="allow")

    def refuse_unimplemented(self) -> None:
        """A 400 naming the first OpenAI field given a value this server would silently ignore."""
        for name, value in (self.model_extra or {}).items():
            if name in UNIMPLEMENTED and not any(type(value) is type(ok) and value == ok
                                                 for ok in UNIMPLEMENTED[name]):
                raise BadRequest(f"{name}: not supported by this server; leave it out (supported: {SUPPORTED})",
                                 name, "unsupported_parameter")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)   # what a 64-bit generator seed holds
    stop: str | list[str] | None = Field(None)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    user: str | None = Field(None, max_length=256)
    n: int | None = Field(None, ge=1, le=MAX_N)
    ignore_eos: bool | None = False   # as vLLM: generate max_tokens whatever the model says
    # {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> bias in [-100, 100]
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(s) > 4:
            raise BadRequest("stop: at most 4 stop strings", "stop")
        return s


class CompletionRequest(BaseRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None


# --- responses -----------------------------------------------------------------------------------
# Dumped with `model_dump()` and json.dumps, field order as declared: the bodies are the OpenAI
# API's, plus `token_ids` on every choice (the generated ids, as vLLM's return_token_ids gives them).


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    token_ids: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    token_ids: list[int]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion", "chat.completion"]
    created: int
    model: str
    choices: list[Union[CompletionChoice, ChatChoice]]
    usage: UsageInfo
    system_fingerprint: None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    token_ids: list[int]


class StreamChunk(BaseModel):
    """One server-sent event of a stream (object "text_completion" or "chat.completion.chunk");
    usage only on the last chunk of a choice, or alone (no choices) with include_usage."""
    id: str
    object: Literal["text_completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[Union[CompletionChoice, ChatStreamChoice]]
    usage: UsageInfo | None = None

    def dump(self) -> dict:
        out = self.model_dump(exclude={"usage"} if self.usage is None else None)
        for c in out["choices"]:
            if "delta" in c:   # a chat delta names only what it carries
                c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
        return out


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "layerline"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
