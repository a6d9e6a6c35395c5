"""The server's parts that need no pipeline: API keys, the text side, detokenizing with stop
strings, the plan's KV budget, flag checks."""
from __future__ import annotations

import argparse
import json

import pytest

from layerline.errors import LayerlineError
from layerline.server import auth, cli
from layerline.server.chat import Detokenizer, TemplateError, TextSide


class Words:
    """A tokenizer stand-in: token i is the word wi, words joined by spaces."""
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)

    def encode(self, text, add_special_tokens=False):
        return type("E", (), {"ids": [int(w[1:]) for w in text.split()]})()


def deltas(stop, ids):
    d = Detokenizer(TextSide(tokenizer=Words()), stop)
    out = [d.add(i) for i in ids]
    return out, d


def test_detokenizer_hands_out_deltas():
    out, d = deltas(None, [1, 2, 3])
    assert out == ["w1", " w2", " w3"] and d.flush() == ""


def test_stop_string_cuts_the_text_and_holds_back_a_possible_start():
    out, d = deltas(["w3 w4"], [1, 2, 3, 4, 5])
    assert "".join(out) == "w1 w2 " and d.stopped
    assert out[2] == " ", "'w3' might begin the stop string: held back"
    out, d = deltas(["w3 w9"], [1, 2, 3])
    assert "".join(out) == "w1 w2 ", "held text waits while it may still become the stop string"
    assert d.add(4) == "w3 w4" and d.flush() == "" and not d.stopped


def test_keys_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n\nsk-one\n  sk-two  \n")
    f.chmod(0o600)
    keys = auth.load_keys(str(f))
    assert keys == [b"sk-one", b"sk-two"]
    assert auth.check(keys, "Bearer sk-two") and auth.check(keys, "bearer sk-one")
    for bad in (None, "", "Bearer", "Bearer sk-three", "Basic sk-one", "sk-one"):
        assert not auth.check(keys, bad)
    f.chmod(0o640)
    with pytest.raises(LayerlineError, match="chmod 600"):
        auth.load_keys(str(f))
    f.chmod(0o600)
    f.write_text("\n# none\n")
    with pytest.raises(LayerlineError, match="no key"):
        auth.load_keys(str(f))
    with pytest.raises(LayerlineError, match="cannot read"):
        auth.load_keys(str(tmp_path / "missing"))


def test_loopback():
    assert all(auth.is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.1.2.3"))
    assert not any(auth.is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "example.com", "::"))


def test_text_side_reads_stop_tokens_and_template(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "max_position_embeddings": 512,
                                                      "vocab_size": 100}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}{% if m.role == 'x' %}"
                         "{{ raise_exception('no x here') }}{% endif %}{{ m.role }}: {{ m.content }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"}))
    side = TextSide.load(str(tmp_path))
    assert side.eos_ids == {2, 7} and side.context == 512 and side.vocab_size == 100
    assert side.render([{"role": "user", "content": "hi"}]) == "<s>user: hi\nassistant:"
    with pytest.raises(TemplateError, match="no x here"):
        side.render([{"role": "x", "content": "hi"}])
    with pytest.raises(TemplateError, match="tokenizer.json"):
        side.encode("hi")
    with pytest.raises(TemplateError, match="no chat template"):
        TextSide().render([{"role": "user", "content": "hi"}])


def test_the_template_is_sandboxed(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(TemplateError):
        TextSide.load(str(tmp_path)).render([{"role": "user", "content": "hi"}])


def test_kv_budget_from_the_plan():
    plan = {"kv": {"context": 4096, "bytes_per_token": 100}, "stages": [
        {"host": "a", "role": "active", "layers": [0, 2], "endpoint": "tcp://10.0.0.1:9100", "kv_bytes": 2 * 100 * 5000},
        {"host": "b", "role": "active", "layers": [2, 3], "endpoint": "tcp://10.0.0.2:9100", "kv_bytes": 100 * 4096},
        {"host": "c", "role": "standby", "layers": [2, 3], "endpoint": "tcp://10.0.0.3:9100", "kv_bytes": 1}]}
    from layerline.server.stages import actives_from_plan, kv_tokens
    assert kv_tokens(plan) == 4096
    st = actives_from_plan(plan)
    assert [s.control for s in st] == ["tcp://10.0.0.1:9101", "tcp://10.0.0.2:9101"]
    assert [s.peer for s in st] == ["a", "b"]


def test_a_standby_promoted_on_another_machine_gives_the_route_its_core_group():
    """The route's depth follows its stages' plan entries: three 1-thread stages on one 2-core
    machine keep 2 micro-batches in flight; a standby on a second machine promoted for the middle
    one adds that machine's group (3). A stage without a plan entry (--first) leaves it unsaid."""
    from layerline.server.route import Route, StageState
    from layerline.server.stages import actives_from_plan

    def stage(host, machine):
        return StageState(host, f"tcp://{machine}:9100", f"tcp://{machine}:9101", planned={
            "host": host, "role": "active", "machine": machine, "device": "cpu", "threads": 1, "cores": 2})
    route = Route([stage("a", "m1"), stage("b", "m1"), stage("c", "m1")])
    assert route.depth() == 2
    route.switch(1, stage("sb", "m2"))
    assert route.depth() == 3 and route.epoch == 1
    route.switch(2, StageState("d", "tcp://m3:9100", "tcp://m3:9101"))
    assert route.depth() is None
    plan = {"stages": [dict(stage("a", "m1").planned, endpoint="tcp://m1:9100", layers=[0, 2])]}
    assert actives_from_plan(plan)[0].planned["machine"] == "m1"


def _args(*argv):
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.mark.parametrize("argv,msg", [
    ([], "--plan"), (["--plan", "p.json", "--first", "tcp://127.0.0.1:1"], "one of them"),
    (["--first", "tcp://127.0.0.1:1", "--host", "0.0.0.0"], "--api-keys"),
    (["--first", "tcp://127.0.0.1:1", "--max-queue", "0"], "--max-queue"),
    (["--first", "tcp://127.0.0.1:1", "--on-stage-lost", "no-such-program {host}"], "no-such-program is not an executable"),
    (["--first", "tcp://127.0.0.1:1", "--on-stage-lost", "'unclosed"], "not a command line"),
])
def test_flag_mistakes_are_one_line(argv, msg, capsys):
    assert cli.run(_args(*argv)) == 2
    err = capsys.readouterr().err
    assert msg in err and err.strip().count("\n") == 0


def test_a_port_in_use_is_one_line(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.run(_args("--first", "tcp://127.0.0.1:1", "--port", str(port))) == 2
    err = capsys.readouterr().err
    assert "cannot listen" in err and "--port" in err and err.strip().count("\n") == 0


def test_importing_the_cli_loads_no_web_stack():
    import subprocess
    import sys
    code = ("import sys, layerline.server.cli; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'torch', 'starlette') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stderr


def test_on_stage_lost_runs_detached_with_the_host(tmp_path):
    """The hook fills in {host}, starts the command without waiting, and writes its output beside the log."""
    run = cli._on_lost(f"sh -c 'echo lost {{host}} > {tmp_path}/out.tmp && mv {tmp_path}/out.tmp {tmp_path}/out.txt'",
                       str(tmp_path / "requests.log"))
    run("w2")
    import time
    deadline = time.time() + 10
    while not (tmp_path / "out.txt").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "out.txt").read_text() == "lost w2\n"
    assert (tmp_path / "on-stage-lost-w2.log").exists()
    assert cli._on_lost(None, None) is None
