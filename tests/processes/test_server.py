"""The server, live: `python -m layerline.server` (uvicorn on a free loopback port) over three real
worker processes, driven with the official openai client, httpx and curl."""
from __future__ import annotations

import concurrent.futures
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from helpers import stop_process

from layerline.checkpoint import read_index, write_demo_checkpoint
from layerline.cli import local_stages, stop_local
from layerline.local import controller_keys
from layerline.driver import Pipeline
from layerline.generate import generate
from layerline.model.loader import load_stage

import openai  # noqa: E402  (the test extra has it: never skipped)

KEY = "sk-test-0123456789abcdef"
MODEL = "tiny-chat"
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ raise_exception('tool messages are not supported') }}{% endif %}"
            "<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tokenizer(ckpt: Path, vocab_size: int, template: str | None) -> None:
    """A word-level tokenizer over the checkpoint's vocab (special tokens, some words, filler), and a template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in WORDS:
        vocab[w] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL[1:])
    tok.save(str(ckpt / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "unk_token": "<unk>"}
    if template is not None:
        cfg["chat_template"] = template
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))


def free_port() -> int:
    from layerline.local import free_ports   # this test process's own range (tests/conftest.py)
    return free_ports(1)[0]


class Server:
    def __init__(self, args: list[str], tmp: Path, key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        self.err = open(tmp / f"server-{self.port}.err", "w")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.proc = subprocess.Popen([sys.executable, "-m", "layerline.server", *args, "--port", str(self.port),
                                      "--log-file", str(self.log)], stdout=subprocess.DEVNULL, stderr=self.err,
                                     stdin=subprocess.DEVNULL)

    def wait(self, timeout: float = 150) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}: {self.stderr()}"
            try:
                if httpx.get(self.url + "/v1/models", headers=self.headers, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server did not come up: {self.stderr()}")

    def stderr(self) -> str:
        self.err.flush()
        return Path(self.err.name).read_text()[-3000:]

    def stop(self) -> None:
        stop_process(self.proc)
        self.err.close()

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("srv") / "tiny-chat"
    write_demo_checkpoint(out, layers=3, hidden=64, vocab=300, dtype="float32", seed=1)
    write_tokenizer(out, 300, TEMPLATE)
    return out


@pytest.fixture(scope="module")
def bare_ckpt(ckpt, tmp_path_factory) -> Path:
    """The same model's text side without a chat template."""
    out = tmp_path_factory.mktemp("srv") / "bare"
    out.mkdir()
    shutil.copy(ckpt / "config.json", out / "config.json")
    write_tokenizer(out, 300, None)
    return out


def plan_of(first: str, keys: str) -> dict:
    """A plan naming the running stages, found by following each worker's next hop (asked as the
    controller, keys: its keys dir; control sockets run CURVE always)."""
    from layerline.driver import control
    from layerline.worker import control_endpoint
    stages, ep, peer = [], first, "stage0"
    while ep:
        h = control(control_endpoint(ep), "health", keys_dir=keys, peer=peer)
        stages.append({"host": h["name"], "role": "active", "layers": h["layers"], "endpoint": ep, "device": "cpu",
                       "precision": "fp32", "weight_bytes": 0, "kv_bytes": 0, "kv_dtype": "fp32",
                       "mem_budget_bytes": 0, "predicted_s": 0.0})
        ep, peer = h.get("next"), h.get("next_key")
    return {"precision": "fp32", "objective": "throughput", "num_layers": stages[-1]["layers"][1],
            "predicted_token_s": 0.0, "bottleneck_s": 0.0,
            "kv": {"context": 4096, "dtype": "fp32", "bytes_per_token": 0}, "stages": stages}


@pytest.fixture(scope="module")
def stages(ckpt):
    procs, first, tmp, _ = local_stages(str(ckpt), 3, "fp32", threads=1)
    keys = controller_keys(tmp)
    try:
        yield procs, first, plan_of(first, keys), keys
    finally:
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def servers(stages, ckpt, bare_ckpt, tmp_path_factory):
    """The main server (stage 0's endpoint, API keys, chat template) and a small one (the plan, one
    running sequence, a queue of one, no chat template, no prefix cache), both over the same three stages."""
    tmp = tmp_path_factory.mktemp("srvlogs")
    keys = tmp / "keys"
    keys.write_text(f"# test keys\n{KEY}\n")
    keys.chmod(0o600)
    _, first, plan, ctl_keys = stages
    (tmp / "plan.json").write_text(json.dumps(plan))
    main = Server(["--first", first, "--first-key", "stage0", "--keys", ctl_keys, "--checkpoint", str(ckpt),
                   "--model-name", MODEL, "--api-keys", str(keys), "--max-body-bytes", "65536",
                   "--ready-file", str(tmp / "ready.json")], tmp, KEY)
    main.ready = tmp / "ready.json"
    small = Server(["--plan", str(tmp / "plan.json"), "--keys", ctl_keys, "--checkpoint", str(bare_ckpt),
                    "--model-name", MODEL, "--max-running", "1", "--max-queue", "1", "--prefix-cache", "off"], tmp)
    try:
        yield main.wait(), small.wait()
    finally:
        main.stop()
        small.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def full(ckpt):
    torch.set_num_threads(1)
    return load_stage(str(ckpt), 0, read_index(ckpt).num_layers, True, True, "fp32")


@pytest.fixture(scope="module")
def tok(ckpt):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


EOS = 2


def greedy(stage, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding in one process (one KV cache), stopping after the eos token."""
    cache = stage.new_cache(1, len(prompt) + n + 1)
    logits = stage(torch.tensor([prompt]), start_pos=0, cache=cache)
    out = []
    for i in range(n):
        t = int(logits[0, -1].argmax())
        out.append(t)
        if t == EOS:
            break
        logits = stage(torch.tensor([[t]]), start_pos=len(prompt) + i, cache=cache)
    return out


def ids_of(choice) -> list[int]:
    return (choice.model_extra or {})["token_ids"]


def post(server, path: str, body, headers=None, raw: bytes | None = None) -> httpx.Response:
    h = dict(server.headers)
    h.update(headers or {})
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body).encode(),
                      headers={"Content-Type": "application/json", **h}, timeout=60)


# --- the happy paths -------------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok" and len(body["stages"]) == 3 and all(s["ok"] for s in body["stages"])
    ready = json.loads(server.ready.read_text())  # what a supervisor waits for
    assert ready["port"] == server.port and ready["model"] == MODEL and len(ready["stages"]) == 3


def test_completion_equals_generate(server, client, stages, full):
    prompt = [7, 8, 9, 10, 11]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    want = greedy(full, prompt, 8)
    assert ids_of(r.choices[0]) == want
    assert r.choices[0].finish_reason == ("stop" if want[-1] == EOS else "length")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == len(want)
    with Pipeline(stages[1], timeout_s=60, keys_dir=stages[3], first_key="stage0") as pipe:  # driven directly
        assert generate(pipe, [prompt], 8, eos=EOS).tokens[0] == want


def test_completion_streaming_matches(client, tok, full):
    prompt = "hello world the cat"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    streamed = [t for c in chunks for t in ids_of(c.choices[0])]
    assert streamed == ids_of(plain.choices[0]) == greedy(full, ids, 10)
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert plain.choices[0].text == tok.decode(streamed, skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(streamed)


def test_chat_uses_the_template(client, tok, full):
    messages = [{"role": "system", "content": "the dog"}, {"role": "user", "content": "hello cat"}]
    rendered = "<s><|system|> the dog </s>\n<|user|> hello cat </s>\n<|assistant|>"
    ids = tok.encode(rendered, add_special_tokens=False).ids
    want = greedy(full, ids, 12)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, user="u1")
    assert ids_of(r.choices[0]) == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_sixteen_concurrent_requests_equal_alone(client, full):
    prompts = [[(13 * i + k) % 290 + 6 for k in range(3 + i % 5)] for i in range(16)]
    want = [greedy(full, p, 12) for p in prompts]

    def one(p, stream):
        if stream:
            return [t for c in client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                                         stream=True) for t in ids_of(c.choices[0])]
        return ids_of(client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0])
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, prompts, [i % 2 == 0 for i in range(16)]))
    assert got == want


def test_long_prompt_is_prefilled_in_chunks_beside_a_running_stream(client, full):
    """A 300-token prompt goes in chunks (128, or 64 while others decode) and still decodes exactly."""
    long = [(7 * k) % 290 + 6 for k in range(300)]
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        running = ex.submit(lambda: ids_of(client.completions.create(
            model=MODEL, prompt=[4, 5, 6], max_tokens=40, temperature=0).choices[0]))
        time.sleep(0.05)
        got = ids_of(client.completions.create(model=MODEL, prompt=long, max_tokens=6, temperature=0).choices[0])
        assert running.result() == greedy(full, [4, 5, 6], 40)
    assert got == greedy(full, long, 6)


def test_sampling_is_seeded(client):
    kw = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=10, temperature=1.0, top_p=0.9, seed=42,
              extra_body={"ignore_eos": True})
    a = ids_of(client.completions.create(**kw).choices[0])
    assert a == ids_of(client.completions.create(**kw).choices[0])
    others = {tuple(ids_of(client.completions.create(**{**kw, "seed": s}).choices[0])) for s in range(3)}
    assert len(others | {tuple(a)}) > 1


def test_stop_string_ends_the_text(client, tok, full):
    prompt = [20, 21, 22]
    want = greedy(full, prompt, 10)
    words = tok.decode(want, skip_special_tokens=True).split()
    assert len(words) >= 3
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[words[2]])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == " ".join(words[:2]) + " "


def test_curl(server):
    body = json.dumps({"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 4, "temperature": 0})
    r = subprocess.run(["curl", "-sS", "--max-time", "60", "-H", f"Authorization: Bearer {KEY}",
                        "-H", "Content-Type: application/json", "-d", body, server.url + "/v1/completions"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] >= 1
    s = subprocess.run(["curl", "-sSN", "--max-time", "60", "-H", f"Authorization: Bearer {KEY}",
                        "-H", "Content-Type: application/json", "-d", body[:-1] + ', "stream": true}',
                        server.url + "/v1/completions"], capture_output=True, text=True, timeout=90)
    events = [ln[len("data: "):] for ln in s.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]] == out["choices"][0]["token_ids"]


# --- bad input, limits, keys -----------------------------------------------------------------------


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_malformed_json_is_400(server):
    err = _error(post(server, "/v1/completions", None, raw=b'{"model": "tiny-chat", "prompt": '), 400)
    assert "JSON" in err["message"]
    _error(post(server, "/v1/chat/completions", None, raw=b"[1, 2]"), 400)


def test_unknown_model_is_400(server):
    err = _error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hello"}), 400)
    assert err["param"] == "model" and err["code"] == "model_not_found" and MODEL in err["message"]


@pytest.mark.parametrize("field,value", [("max_tokens", "5"), ("max_tokens", 0), ("temperature", -1),
                                         ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("seed", 1.5),
                                         ("stream", "yes"), ("stop", ["a", "b", "c", "d", "e"]), ("n", 17),
                                         ("prompt", [1, "x"]), ("prompt", [100000])])
def test_bad_parameter_is_400(server, field, value):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, field: value}
    err = _error(post(server, "/v1/completions", body), 400)
    assert err["param"] == field, err


def test_bad_chat_messages_are_400(server):
    _error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400)
    _error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}),
           400)
    err = _error(post(server, "/v1/chat/completions",
                      {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}), 400)
    assert "tool messages are not supported" in err["message"]  # the template's raise_exception


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", {"name": "f"}),
    ("prediction", {"type": "content", "content": "hello"}), ("reasoning_effort", "high")])
def test_an_openai_field_the_server_would_ignore_is_a_400_naming_it(client, field, value):
    """Through the official client: never a silently different answer."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2,
                                       **{field: value})
    assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_parameter", e.value.body


def test_openai_fields_at_values_that_change_nothing_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2,
                                       presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"},
                                       logit_bias={}, store=False, metadata={"k": "v"}, user="u1")
    assert r.choices[0].message is not None and r.usage.completion_tokens >= 1


def test_prompt_plus_max_tokens_beyond_context_is_400(server):
    err = _error(post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 100, "max_tokens": 5000}), 400)
    assert "100" in err["message"] and "5000" in err["message"] and "4096" in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_body_over_the_limit_is_413(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hello " * 20000})
    _error(r, 413)


def test_keys(server):
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert _error(r, 401)["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"},
                   timeout=30)
    _error(r, 401)
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-nope", max_retries=0).models.list()


def _serve_fails(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerline.server", *args], capture_output=True, text=True,
                          timeout=60)


def test_off_loopback_without_keys_is_refused():
    r = _serve_fails("--first", "tcp://127.0.0.1:1", "--host", "0.0.0.0")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "--api-keys" in r.stderr and "loopback" in r.stderr


def test_loose_keys_file_is_refused(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o644)
    r = _serve_fails("--first", "tcp://127.0.0.1:1", "--api-keys", str(keys))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "chmod 600" in r.stderr


def test_server_from_a_plan(servers, full):
    small = servers[1]
    body = httpx.get(small.url + "/health", timeout=10).json()
    assert body["status"] == "ok" and [s["name"] for s in body["stages"]] == ["stage0", "stage1", "stage2"]
    r = post(small, "/v1/completions", {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 5, "temperature": 0})
    assert r.json()["choices"][0]["token_ids"] == greedy(full, [7, 8, 9], 5)


def test_chat_without_template_is_400(servers):
    small = servers[1]
    err = _error(post(small, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                    "content": "hello"}]}), 400)
    assert "chat template" in err["message"]


def test_queue_full_is_429(servers):
    small = servers[1]
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", small.url + "/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # held: a dropped iterator closes the connection
            next(lines)  # running
            with c.stream("POST", small.url + "/v1/completions", json=body) as second:  # waits for a slot
                r = c.post(small.url + "/v1/completions", json={**body, "stream": False})
                err = _error(r, 429)
                assert err["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
                assert second.status_code == 200
                assert small.metric("layerline_queue_depth") == 1
    deadline = time.time() + 10
    while small.metric("layerline_running_sequences") != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert small.metric("layerline_running_sequences") == 0
    assert small.metric("layerline_queue_depth") == 0


def test_client_disconnect_frees_the_slot(server):
    body = {"model": MODEL, "prompt": [9, 9, 9], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=server.headers) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert server.metric("layerline_running_sequences") >= 1
    deadline = time.time() + 5
    while server.metric("layerline_running_sequences") != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("layerline_running_sequences") == 0


def test_non_streaming_client_that_gives_up_frees_the_slot(server):
    body = {"model": MODEL, "prompt": [8, 8, 8], "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=1.0)
    deadline = time.time() + 5
    while server.metric("layerline_running_sequences") != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("layerline_running_sequences") == 0
    lines = server.log.read_text().splitlines()
    assert any("finish=disconnected" in ln and "stream=False" in ln for ln in lines)


def test_a_shared_prefix_is_reused_and_answers_as_without_the_cache(servers, client):
    """A prompt that extends an earlier one (a conversation one turn on) starts from that one's KV at
    every stage (the metrics count the hit and the tokens reused), and its greedy answer is the one
    the server without a prefix cache gives (the first prompt is two whole chunks of 128, so both cut
    the second at the same bounds)."""
    server, small = servers
    off = openai.OpenAI(base_url=small.url + "/v1", api_key="none", max_retries=0, timeout=120)
    first = [10 + (i * 37) % 280 for i in range(256)]
    second = first + [10 + (i * 11) % 280 for i in range(40)]

    def count(name: str, srv=server) -> float:
        v = srv.metric(name)
        return 0.0 if v != v else v   # nan: not counted yet
    hits, reused = count("layerline_prefix_hits_total"), count("layerline_prefix_reused_tokens_total")
    client.completions.create(model=MODEL, prompt=first, max_tokens=4, temperature=0)
    got = client.completions.create(model=MODEL, prompt=second, max_tokens=12, temperature=0)
    assert count("layerline_prefix_hits_total") > hits
    assert count("layerline_prefix_reused_tokens_total") >= reused + 256
    assert 0 < server.metric("layerline_prefix_hit_ratio") <= 1 and server.metric("layerline_prefix_entries") >= 1
    want = off.completions.create(model=MODEL, prompt=second, max_tokens=12, temperature=0)
    assert ids_of(got.choices[0]) == ids_of(want.choices[0])
    assert count("layerline_prefix_lookups_total", small) == 0


def test_metrics_and_log(server, client):
    """The metrics and the request log show what this test sent (a 200, a 400, a 401, a chat with a
    user): on its own or after the file's other tests, in any xdist split."""
    before = server.metric("layerline_generated_tokens_total")  # nan before any request
    before = 0.0 if math.isnan(before) else before
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [3, 1, 4, 1, 5], "max_tokens": 101,
                                          "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 101, r.text
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": -1}).status_code == 400
    assert httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2]},
                      timeout=30).status_code == 401
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   temperature=0, user="u1")
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for want in ('layerline_requests_total{route="/v1/completions",status="200"}',
                 'layerline_requests_total{route="/v1/completions",status="400"}',
                 'layerline_requests_total{route="/v1/completions",status="401"}',
                 "layerline_prompt_tokens_total", "layerline_generated_tokens_total", "layerline_queue_depth",
                 "layerline_running_sequences", "layerline_time_to_first_token_seconds_bucket",
                 "layerline_inter_token_seconds_bucket", 'layerline_stage_step_seconds_count{stage="stage2"}',
                 "layerline_step_hop_seconds_count",
                 "layerline_prefix_lookups_total", "layerline_prefix_hit_ratio", 'layerline_prefix_bytes{host="',
                 'vllm:prefix_cache_hits_total{model_name="tiny-chat"}'):
        assert want in text, want
    assert server.metric("layerline_generated_tokens_total") >= before + 101
    assert server.metric("layerline_step_hop_seconds_count") > 0  # every answered step's links and waits
    lines = server.log.read_text().splitlines()
    assert any(" POST /v1/completions 200 " in ln and "prompt=5 " in ln for ln in lines)
    assert any(" POST /v1/completions 401 " in ln for ln in lines)
    assert any(" POST /v1/chat/completions 200 " in ln and "user='u1'" in ln for ln in lines)


def test_health_is_503_when_a_stage_stops(servers, stages):
    server, small = servers
    procs = stages[0]
    procs[2].terminate()
    procs[2].wait(15)
    r = httpx.get(server.url + "/health", timeout=30)
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["status"] == "unavailable" and [s["ok"] for s in body["stages"]] == [True, True, False]
    assert httpx.get(small.url + "/health", timeout=30).status_code == 503  # the plan's stages, too
    # and the server still answers what needs no stage
    assert httpx.get(server.url + "/v1/models", headers=server.headers, timeout=10).status_code == 200


def test_one_worker_holding_the_model_serves_concurrent_clients_as_alone(ckpt, full, tmp_path):
    """One stage holds the whole model, so it runs ahead (layerline.worker.stage, "Running ahead"):
    sixteen clients joining and ending (eos, max_tokens) keep changing the rows it guessed, and one
    client alone lets it answer from its guesses, several tokens a round trip; every answer equals the
    one-process greedy tokens, and the metrics count every step the stage computed for them."""
    from layerline.driver import control
    from layerline.worker import control_endpoint
    procs, first, tmp, _ = local_stages(str(ckpt), 1, "fp32", threads=1)
    keys = controller_keys(tmp)
    srv = Server(["--first", first, "--first-key", "stage0", "--keys", keys, "--checkpoint", str(ckpt),
                  "--model-name", MODEL], tmp_path)
    try:
        srv.wait()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompts = [[(7 * i + k) % 290 + 6 for k in range(2 + i % 6)] for i in range(16)]
        want = [greedy(full, p, 4 + i % 9) for i, p in enumerate(prompts)]

        def one(i: int) -> list[int]:
            p, n = prompts[i], 4 + i % 9
            if i % 2:
                return ids_of(c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0])
            return [t for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True)
                    for t in ids_of(ch.choices[0])]
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            assert list(ex.map(one, range(16))) == want
        alone = [11, 12, 13]
        steps = lambda: sum(float(line.split()[-1]) for line in httpx.get(srv.url + "/metrics", timeout=10).text  # noqa: E731
                            .splitlines() if line.startswith("layerline_stage_step_seconds_count"))
        before = steps()
        assert ids_of(c.completions.create(model=MODEL, prompt=alone, max_tokens=16, temperature=0).choices[0]) \
            == greedy(full, alone, 16)
        s = control(control_endpoint(first), "stats", keys_dir=keys, peer="stage0")
        assert s["ahead_used"] > 0 and s["errors"] == 0, s
        # its prefill and 15 steps, each counted once whether it came alone or with others (more
        # where a loaded machine made the server replay)
        assert steps() - before >= 16
    finally:
        srv.stop()
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)
