"""A fault in one request stays with that request (issue 37, item 4): a sequence whose logits turn
NaN (here: its prompt holds a token whose embedding row is NaN, a bad weight that only it reads)
fails alone with a 502, greedy or sampled, while the requests batched beside it finish with the
tokens of an undisturbed run. Live: two worker processes and the server, the official client; at
fp32 (torch's kernels pick a greedy row's token) and bf16 (the C++ kernels' `argmax_rows` does)."""
from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path

import openai
import pytest
from safetensors.torch import load_file, save_file

from test_server import Server

from layerline.checkpoint import write_demo_checkpoint
from layerline.cli import local_stages, stop_local
from layerline.local import controller_keys

POISON = 7                                   # the token whose embedding row is NaN
CLEAN = [[5, 6, 8], [11, 12, 13, 14], [21, 22], [31, 32, 33]]
N = 12


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def server(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("faults") / "poisoned"
    write_demo_checkpoint(out, layers=2, hidden=64, vocab=300, dtype="float32", seed=4)
    for f in out.glob("*.safetensors"):
        t = load_file(str(f))
        if "model.embed_tokens.weight" in t:
            t["model.embed_tokens.weight"][POISON] = float("nan")
            save_file(t, str(f), metadata={"format": "pt"})
    procs, first, tmp, _ = local_stages(str(out), 2, request.param, threads=1)
    srv = None
    try:
        srv = Server(["--first", first, "--first-key", "stage0", "--keys", controller_keys(tmp),
                      "--model-name", "m"], Path(tmp)).wait()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        if srv is not None:
            srv.stop()
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def complete(client, prompt: list[int], temperature: float = 0.0):
    try:
        r = client.completions.create(model="m", prompt=prompt, max_tokens=N, temperature=temperature, seed=3,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].token_ids
    except openai.APIStatusError as e:
        return e


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_fail_only_their_request(server, temperature):
    alone = [complete(server, p) for p in CLEAN]
    assert all(isinstance(t, list) and len(t) == N for t in alone), alone
    poisoned = [1, POISON, 9]
    with concurrent.futures.ThreadPoolExecutor(len(CLEAN) + 1) as pool:
        bad = pool.submit(complete, server, poisoned, temperature)
        together = list(pool.map(lambda p: complete(server, p), CLEAN))
    err = bad.result()
    assert isinstance(err, openai.APIStatusError), f"a NaN row answered {err}"
    assert err.status_code == 502 and "not finite" in str(err), err
    assert together == alone  # the rows batched beside it: the tokens of an undisturbed run
