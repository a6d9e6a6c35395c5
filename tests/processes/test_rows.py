"""A batched step over rows of different sequences (continuous batching), each at its own position.

In process: Stage.forward_rows equals per-sequence one-token steps (llama, a sliding window
shorter than the prompts, Qwen2's biases, Mixtral's experts). Through real workers (three stages,
fp32, the small demo checkpoint): a `rows` message steps several sequences at once with the
tokens and logits each gets stepped alone; a row whose sequence a stage lacks or holds fewer
tokens of fails the whole message with code seq_unknown and the offending ids, nothing applied,
while a step behind what a stage holds rewinds it there (the logits of computing that position
fresh); a forward of an older wire epoch than a stage has seen for its sequence is dropped
unanswered and counted; every malformed rows message gets an error reply and the worker lives
on; release and the KV budget's evictions show up as seq_unknown.
"""
from __future__ import annotations

import pytest
import torch

from layerline import wire
from layerline.checkpoint import read_index, write_demo_checkpoint
from layerline.errors import LayerlineError
from layerline.model.loader import load_stage
from stage_procs import control, start_workers

KV = 64
VOCAB = 500
HIDDEN = 128
ATOL = 1e-5


# --- in process ---------------------------------------------------------------------------------

def _model(tmp_path, arch):
    kw = {"sliding_window": 4} if arch == "mistral" else {}
    ck = write_demo_checkpoint(tmp_path / arch, arch=arch, layers=3, hidden=64, vocab=300, dtype="float32",
                               seed=7, **kw)
    return str(ck), read_index(ck).num_layers


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "mixtral"])
def test_forward_rows_equals_one_step_per_sequence(tmp_path, arch, one_thread):
    """Three sequences at positions 3, 7 and 5 (past Mistral's window of 4) stepped together give
    each one's own step; the first and a later stage (hidden in, hidden out; logits out)."""
    ck, n = _model(tmp_path, arch)
    g = torch.Generator().manual_seed(1)
    lens = [3, 7, 5]
    for first, last, lo, hi in ((True, False, 0, 2), (False, True, 2, n)):
        stage = load_stage(ck, lo, hi, first, last, "fp32")

        def inp(t, first=first, stage=stage):
            return (torch.randint(0, 300, (1, t), generator=g) if first
                    else torch.randn(1, t, stage.args.hidden_size, generator=g))
        prompts = [inp(t) for t in lens]
        alone = [stage.new_cache(1, 16) for _ in lens]
        rows = [stage.new_cache(1, 16) for _ in lens]
        for p, a, r in zip(prompts, alone, rows):
            stage(p, 0, a)
            stage(p, 0, r)
        pos = list(lens)
        for _ in range(3):
            x = torch.cat([inp(1) for _ in lens])
            want = torch.cat([stage(x[i:i + 1], pos[i], alone[i]) for i in range(len(lens))])
            got = stage.forward_rows(x, pos, rows)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            pos = [p + 1 for p in pos]
            assert [c.length for c in rows] == pos


def test_forward_rows_checks_everything_before_writing(small_ckpt, one_thread):
    stage = load_stage(str(small_ckpt), 0, 4, True, True, "fp32")
    a, b = stage.new_cache(1, 8), stage.new_cache(1, 8)
    stage(torch.tensor([[1, 2, 3]]), 0, a)
    stage(torch.tensor([[4, 5]]), 0, b)
    before = [c.layers[0].k.clone() for c in (a, b)]
    x = torch.tensor([[7], [8]])
    for positions, caches, text in (([3, 3], [a, b], "rows\\[1\\]: position 3"),
                                    ([3, 2], [a, a], "appears twice"),
                                    ([3], [a], "1 positions"),
                                    ([3, 0], [a, stage.new_cache(2, 8)], "2 rows")):
        with pytest.raises(LayerlineError, match=text):
            stage.forward_rows(x, positions, caches)
    full = stage.new_cache(1, 3)
    stage(torch.tensor([[1, 2, 3]]), 0, full)
    with pytest.raises(LayerlineError, match="KV cache full"):
        stage.forward_rows(x, [3, 2], [full, b])
    assert (a.length, b.length) == (3, 2)
    for c, k in zip((a, b), before):
        assert torch.equal(c.layers[0].k, k)


def _attention(dtype, nh=8, nkv=2, hd=16):
    from layerline.model.llama import Attention, ModelArgs
    return Attention(ModelArgs(vocab_size=10, hidden_size=nh * hd, intermediate_size=8, num_layers=1,
                               num_heads=nh, num_kv_heads=nkv, head_dim=hd, rms_norm_eps=1e-5,
                               rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                               attention_bias=False, tie_word_embeddings=False), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_equals_the_textbook_formula(dtype):
    """The attention every path shares (`Attention._attend`, torch's SDPA) against softmax(q k^T /
    sqrt(d)) v in float64, query head h reading kv head h // g (HF's repeat_kv): one token over
    every key, and a causal prefill."""
    torch.manual_seed(3)
    nh, nkv, hd = 8, 2, 16
    attn = _attention(dtype, nh, nkv, hd)

    def textbook(q, k, v, mask):
        q, k, v = q.double(), k.double().repeat_interleave(nh // nkv, 1), v.double().repeat_interleave(nh // nkv, 1)
        s = q @ k.transpose(2, 3) / hd ** 0.5
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        out = s.softmax(-1) @ v  # [b, nh, t, hd]
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], nh * hd)

    for t, s, mask in ((1, 9, None), (6, 6, torch.arange(6)[None, :] <= torch.arange(6)[:, None])):
        q, k, v = torch.randn(1, nh, t, hd, dtype=dtype), *torch.randn(2, 1, nkv, s, hd, dtype=dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(attn._attend(q, k, v, mask).double(), textbook(q, k, v, mask), rtol=tol, atol=tol)


def test_a_row_attends_exactly_as_its_sequence_alone_at_bf16():
    """Rows of sequences of different lengths, stepped together: each row's attention output and
    cache write are bit for bit those of its sequence stepped alone, so at bf16 a greedy stream's
    tokens do not depend on what else the server batched with it."""
    from layerline.model.llama import _views
    torch.manual_seed(4)
    attn, nh, nkv, hd = _attention(torch.bfloat16), 8, 2, 16
    lens = [5, 130, 37]
    caches = [tuple(torch.randn(2, 1, nkv, 160, hd, dtype=torch.bfloat16)) for _ in lens]
    alone = [(kb.clone(), vb.clone()) for kb, vb in caches]
    q, k, v = torch.randn(3, nh, 1, hd, dtype=torch.bfloat16), *torch.randn(2, 3, nkv, 1, hd, dtype=torch.bfloat16)
    pos = [torch.tensor([n]) for n in lens]
    views = _views(lens, 1, (None,), "cpu")[None]
    got = attn._attend_rows(q, k, v, pos, caches, views)
    for i in range(3):
        want = attn._attend_one(q[i:i + 1], k[i:i + 1], v[i:i + 1], pos[i], alone[i], views[i])
        assert torch.equal(got[i:i + 1], want), i
        assert torch.equal(caches[i][0], alone[i][0]) and torch.equal(caches[i][1], alone[i][1])


# --- real workers -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipeline(small_ckpt, request):
    """Three workers of the 4-layer small checkpoint: 0:2 (first), 2:3, 3:4 (last), each with
    KV room for every sequence these tests keep (the default budget holds one full context)."""
    w = start_workers(str(small_ckpt), [(0, 2), (2, 3), (3, 4)], kv_context=KV, extra=["--kv-bytes", str(2**26)])
    request.addfinalizer(lambda: w.stop())
    return w


@pytest.fixture(scope="module")
def client(pipeline, request):
    c = pipeline.client()
    request.addfinalizer(c.close)
    return c


@pytest.fixture(scope="module")
def reference(small_ckpt):
    return load_stage(str(small_ckpt), 0, 4, True, True, "fp32")


def ok(h, t):
    assert h["op"] == "result", h.get("error")
    return t["logits"]


def prefill(client, seq: str, prompt: list[int], chunks: int = 1) -> torch.Tensor:
    """The ordinary per-sequence messages, in `chunks` pieces; the last logits row."""
    bounds = [round(i * len(prompt) / chunks) for i in range(chunks + 1)]
    for a, b in zip(bounds, bounds[1:]):
        h, t = client.call({"seq": seq, "pos": a, "cache": True, "reserve": 24, "logits": "last"},
                           {"input_ids": torch.tensor([prompt[a:b]])})
        logits = ok(h, t)
    return logits[0, -1]


def step_alone(client, seq: str, pos: int, tok: int) -> torch.Tensor:
    h, t = client.call({"seq": seq, "pos": pos, "cache": True, "logits": "last"}, {"input_ids": torch.tensor([[tok]])})
    return ok(h, t)[0, -1]


def step_rows(client, rows: list[tuple[str, int, int]]):
    """rows: (seq, pos, token) -> the reply header and tensors."""
    return client.call({"rows": [[s, p] for s, p, _ in rows], "cache": True, "logits": "last"},
                       {"input_ids": torch.tensor([[tok] for _, _, tok in rows])})


def seq_lengths(pipeline) -> list[int]:
    return [control(c, "stats")["sequences"] for c in pipeline.control]


PROMPTS = {"a": [3, 17, 42, 99, 7], "b": [250, 1], "c": [8, 8, 9, 1, 2, 3, 4, 5, 6, 7, 11], "d": [400]}


def test_rows_step_many_sequences_as_each_alone(client, reference):
    """Four sequences at positions 5, 2, 11 and 1, stepped together for six greedy steps (in
    varying order and subsets), give the tokens and logits each gets stepped alone."""
    n = 6
    alone = {}
    for s, p in PROMPTS.items():  # alone: the ordinary per-sequence messages
        logits = prefill(client, f"alone-{s}", p)
        toks, steps = [int(logits.argmax())], [logits]
        for i in range(n - 1):
            steps.append(step_alone(client, f"alone-{s}", len(p) + i, toks[-1]))
            toks.append(int(steps[-1].argmax()))
        alone[s] = (toks, steps)
        client.release(f"alone-{s}")
    got = {s: ([], []) for s in PROMPTS}
    for s, p in PROMPTS.items():
        logits = prefill(client, f"rows-{s}", p, chunks=2 if len(p) > 3 else 1)
        got[s][0].append(int(logits.argmax()))
        got[s][1].append(logits)
    orders = [list("abcd"), list("dcba"), list("ca"), list("bd"), list("abcd"), list("bacd"), list("db"), list("ca")]
    for order in orders:
        live = [s for s in order if len(got[s][0]) < n]
        if not live:
            continue
        h, t = step_rows(client, [(f"rows-{s}", len(PROMPTS[s]) + len(got[s][0]) - 1, got[s][0][-1]) for s in live])
        logits = ok(h, t)
        assert logits.shape == (len(live), 1, VOCAB) and logits.dtype == torch.float32
        assert h["rows"] == [[f"rows-{s}", len(PROMPTS[s]) + len(got[s][0]) - 1] for s in live]
        assert [e["stage"] for e in h["timings"]] == ["stage0", "stage1", "stage2"]
        for i, s in enumerate(live):
            got[s][1].append(logits[i, -1])
            got[s][0].append(int(logits[i, -1].argmax()))
    for s, p in PROMPTS.items():
        assert got[s][0] == alone[s][0], s
        for a, b in zip(got[s][1], alone[s][1]):
            assert torch.allclose(a, b, rtol=0, atol=ATOL), (s, float((a - b).abs().max()))
        # and the whole-model reference, recomputed without a cache
        full = reference(torch.tensor([p + got[s][0][:-1]]))
        assert torch.allclose(got[s][1][-1], full[0, -1], rtol=0, atol=1e-4)
        client.release(f"rows-{s}")


def test_argmax_replies_carry_each_rows_greedy_token(client):
    """`logits: "argmax"` (a step whose rows are all plain greedy): the last stage answers each row's
    first largest logit and whether its logits were finite, the same step asked again for its logits
    (a step at a position a sequence holds rewinds it there) agreeing token for token."""
    for s, p in PROMPTS.items():
        prefill(client, f"pick-{s}", p)
    rows = [(f"pick-{s}", len(p), 7 + i) for i, (s, p) in enumerate(PROMPTS.items())]
    h, t = client.call({"rows": [[s, q] for s, q, _ in rows], "cache": True, "logits": "argmax"},
                       {"input_ids": torch.tensor([[tok] for _, _, tok in rows])})
    assert h["op"] == "result" and set(t) == {"argmax", "finite"}, h.get("error")
    assert t["argmax"].dtype == torch.int64 and t["argmax"].shape == (len(rows),)
    assert t["finite"].dtype == torch.uint8 and t["finite"].tolist() == [1] * len(rows)
    logits = ok(*step_rows(client, rows))
    assert t["argmax"].tolist() == logits[:, -1].max(-1).indices.tolist()
    # a one-sequence message too: its last position's token
    h, t = client.call({"seq": "pick-a", "pos": 2, "cache": True, "logits": "argmax"},
                       {"input_ids": torch.tensor([PROMPTS["a"][2:]])})
    assert h["op"] == "result" and t["argmax"].shape == (1,)
    assert int(t["argmax"][0]) == int(prefill(client, "pick-a2", PROMPTS["a"]).argmax())
    for s in list(PROMPTS) + ["a2"]:
        client.release(f"pick-{s}")


def test_unknown_or_stale_rows_fail_the_whole_message_and_apply_nothing(client, pipeline):
    prefill(client, "x1", [1, 2, 3])
    prefill(client, "x2", [4, 5])
    h, _ = step_rows(client, [("x1", 3, 9), ("ghost", 4, 9), ("x2", 5, 9)])
    assert h["op"] == "error" and h["code"] == "seq_unknown" and h["stage"] == "stage0"
    assert h["seqs"] == ["ghost", "x2"]
    assert "ghost (unknown)" in h["error"] and "x2 (holds 2 tokens, row pos 5)" in h["error"]
    # nothing was applied: x1 still holds 3 tokens, so the same step (with x2 right) goes through
    h, t = step_rows(client, [("x1", 3, 9), ("x2", 2, 9)])
    assert ok(h, t).shape == (2, 1, VOCAB)
    for s in ("x1", "x2"):
        client.release(s)


def test_a_later_stage_that_lost_a_row_names_it_at_reply_to(client, pipeline):
    """stage1 alone forgets y2: stage0 steps both rows, stage1 refuses, the sender hears which."""
    import zmq
    prefill(client, "y1", [5, 6, 7])
    prefill(client, "y2", [8, 9])
    s = pipeline.dealer(1)
    s.setsockopt(zmq.LINGER, 1000)
    s.send_multipart(wire.encode({"op": "release", "seq": "y2"}))  # frees y2 on stage1 and stage2
    s.close()
    import time
    deadline = time.time() + 5
    while seq_lengths(pipeline)[1:] != [1, 1]:
        assert time.time() < deadline, seq_lengths(pipeline)
        time.sleep(0.05)
    h, _ = step_rows(client, [("y1", 3, 1), ("y2", 2, 1)])
    assert h["op"] == "error" and h["code"] == "seq_unknown" and h["stage"] == "stage1" and h["seqs"] == ["y2"]
    for q in ("y1", "y2"):
        client.release(q)


def test_release_frees_a_row_sequence(client, pipeline):
    import time
    # counted once z1's prefill is back: every stage then holds it and has handled every release sent before
    # it (the earlier tests' releases travel stage to stage after them, so a count taken before may be mid-way)
    prefill(client, "z1", [1, 2])
    held = seq_lengths(pipeline)
    assert all(n >= 1 for n in held), held
    client.release("z1")
    deadline = time.time() + 5
    while seq_lengths(pipeline) != [n - 1 for n in held]:
        assert time.time() < deadline, (seq_lengths(pipeline), held)
        time.sleep(0.05)
    h, _ = step_rows(client, [("z1", 2, 3)])
    assert h["code"] == "seq_unknown" and h["seqs"] == ["z1"]


def bad_rows() -> dict:
    """case -> (header fields, input_ids, text the error must contain)."""
    one = torch.tensor([[1]])
    two = torch.tensor([[1], [2]])
    return {
        "rows not a list": ({"rows": "b1"}, one, "header.rows"),
        "empty rows": ({"rows": []}, one, "header.rows"),
        "row not a pair": ({"rows": [["b1"]]}, one, "header.rows[0]"),
        "pos 0": ({"rows": [["b1", 0]]}, one, "header.rows[0]"),
        "pos not an int": ({"rows": [["b1", "2"]]}, one, "header.rows[0]"),
        "pos a bool": ({"rows": [["b1", True]]}, one, "header.rows[0]"),
        "pos beyond kv context": ({"rows": [["b1", KV]]}, one, "header.rows[0]"),
        "bad seq id": ({"rows": [["b/1", 2]]}, one, "header.rows[0]"),
        "duplicate seq": ({"rows": [["b1", 2], ["b1", 2]]}, two, "header.rows[1]: seq b1 appears twice"),
        "more rows than the batch": ({"rows": [["b1", 2], ["b2", 2]]}, one, "header.rows: 2 rows but the tensor's batch is 1"),
        "fewer rows than the batch": ({"rows": [["b1", 2]]}, two, "header.rows: 1 rows but the tensor's batch is 2"),
        "over MAX_BATCH": ({"rows": [[f"s{i}", 1] for i in range(wire.MAX_BATCH + 1)]},
                           torch.zeros(wire.MAX_BATCH + 1, 1, dtype=torch.int64), "header.rows"),
        "top-level seq": ({"rows": [["b1", 2]], "seq": "b1"}, one, "drop header.seq"),
        "top-level pos": ({"rows": [["b1", 2]], "pos": 2}, one, "drop header.pos"),
        "without cache": ({"rows": [["b1", 2]], "cache": False}, one, "header.cache"),
        "two tokens per row": ({"rows": [["b1", 2]]}, torch.tensor([[1, 2]]), "one new token per row"),
        "bad reserve": ({"rows": [["b1", 2]], "reserve": 0}, one, "header.reserve"),
        "bad logits": ({"rows": [["b1", 2]], "logits": "first"}, one, "header.logits"),
        "token id out of range": ({"rows": [["b1", 2]]}, torch.tensor([[VOCAB]]), "input_ids"),
        "negative epoch": ({"rows": [["b1", 2]], "epoch": -1}, one, "header.epoch"),
        "epoch a bool": ({"rows": [["b1", 2]], "epoch": True}, one, "header.epoch"),
        "epoch a string": ({"rows": [["b1", 2]], "epoch": "3"}, one, "header.epoch"),
    }


def test_bad_rows_messages_get_errors_and_never_kill_a_worker(client, pipeline):
    prefill(client, "b1", [1, 2])
    before = control(pipeline.control[0], "stats")
    for case, (fields, ids, text) in bad_rows().items():
        h, _ = client.call({"cache": True, **fields}, {"input_ids": ids})
        assert h["op"] == "error" and h["stage"] == "stage0", case
        assert text in h["error"], f"{case}: {h['error']!r} lacks {text!r}"
        assert all(p.poll() is None for p in pipeline.procs), f"{case} killed a worker"
    after = control(pipeline.control[0], "stats")
    assert after["rejected"] - before["rejected"] == len(bad_rows())
    # a batch-2 sequence cannot be a row
    h, t = client.call({"seq": "wide", "pos": 0, "cache": True, "logits": "last"}, {"input_ids": torch.tensor([[1], [2]])})
    ok(h, t)
    h, _ = step_rows(client, [("wide", 1, 3)])
    assert h["op"] == "error" and "seq wide has batch 2" in h["error"]
    # b1 was never touched: it still steps from position 2
    h, t = step_rows(client, [("b1", 2, 3)])
    assert ok(h, t).shape == (1, 1, VOCAB)
    for s in ("b1", "wide"):
        client.release(s)


def test_the_kv_budget_evicts_the_oldest_and_rows_then_name_it(small_ckpt):
    """A stage whose --kv-bytes holds two sequences of 16 tokens: a third evicts the oldest."""
    cfg = read_index(small_ckpt).config
    per_token = 2 * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 4 * 4
    w = start_workers(str(small_ckpt), [(0, 4)], kv_context=KV, extra=["--kv-bytes", str(2 * 16 * per_token)])
    c = w.client()
    try:
        for s in ("e1", "e2", "e3"):
            h, t = c.call({"seq": s, "pos": 0, "cache": True, "reserve": 16, "logits": "last"},
                          {"input_ids": torch.tensor([[1, 2, 3]])})
            ok(h, t)
        assert control(w.control[0], "stats")["sequences"] == 2
        h, _ = step_rows(c, [("e3", 3, 1), ("e1", 3, 1), ("e2", 3, 1)])
        assert h["code"] == "seq_unknown" and h["seqs"] == ["e1"]
        h, t = step_rows(c, [("e3", 3, 1), ("e2", 3, 1)])
        assert ok(h, t).shape == (2, 1, VOCAB)
    finally:
        c.close()
        assert w.stop() == [0]


def test_a_per_sequence_step_of_an_unknown_sequence_names_it_too(client):
    h, _ = client.call({"seq": "nope", "pos": 3, "cache": True}, {"input_ids": torch.tensor([[1]])})
    assert h["op"] == "error" and h["code"] == "seq_unknown" and h["seqs"] == ["nope"]


def test_a_step_behind_what_a_stage_holds_rewinds_it(client, reference):
    """After a failover the engine resends each sequence from what every stage confirmed, which a
    stage may hold more of: it rewinds there and computes what a fresh computation would."""
    prompt = [3, 17, 42, 99, 7]
    prefill(client, "rw", prompt)
    t1, t2 = 11, 12
    first = step_alone(client, "rw", 5, t1)
    second = step_alone(client, "rw", 6, t2)          # every stage holds 7 tokens now
    assert torch.allclose(step_alone(client, "rw", 5, t1), first, rtol=0, atol=ATOL)   # one sequence, back to 5
    h, t = step_rows(client, [("rw", 6, t2)])
    assert torch.allclose(ok(h, t)[0, -1], second, rtol=0, atol=ATOL)
    h, t = step_rows(client, [("rw", 5, t1)])          # a row, back from 7 to 5
    assert torch.allclose(ok(h, t)[0, -1], first, rtol=0, atol=ATOL)
    fresh = reference(torch.tensor([prompt + [t1]]))[0, -1]   # the whole model, no cache
    assert torch.allclose(ok(h, t)[0, -1], fresh, rtol=0, atol=1e-4)
    h, t = client.call({"seq": "rw", "pos": 2, "cache": True, "logits": "last"},
                       {"input_ids": torch.tensor([prompt[2:] + [t1]])})   # the middle of the prompt
    assert torch.allclose(ok(h, t)[0, -1], fresh, rtol=0, atol=1e-4)
    h, _ = step_rows(client, [("rw", 8, t2)])          # past what it holds (6): still seq_unknown
    assert h["code"] == "seq_unknown" and h["seqs"] == ["rw"] and "holds 6 tokens, row pos 8" in h["error"]
    client.release("rw")


def test_a_forward_of_an_older_epoch_is_answered_and_not_computed(client, pipeline):
    """A stage that has seen epoch 1 for a sequence does not compute an epoch-0 forward of it (it could
    rewind what the newer one wrote) and answers it as seq_unknown naming that sequence, so a sender
    that still waits for it fails just that sequence instead of stalling (one that failed over forgot
    the request and drops the answer); forwards without an epoch are served; the epoch travels with
    the message to the last stage."""
    before = [control(c, "stats") for c in pipeline.control]
    h, t = client.call({"seq": "ep", "pos": 0, "cache": True, "reserve": 24, "logits": "last", "epoch": 1},
                       {"input_ids": torch.tensor([[1, 2, 3]])})
    assert ok(h, t).shape == (1, 1, VOCAB) and h["epoch"] == 1
    stale = [client.send({"seq": "ep", "pos": 3, "cache": True, "logits": "last", "epoch": 0},
                         {"input_ids": torch.tensor([[4]])}),
             client.send({"rows": [["ep", 3]], "cache": True, "logits": "last", "epoch": 0},
                         {"input_ids": torch.tensor([[4]])}),
             client.send({"seq": "ep", "pos": 0, "cache": True, "logits": "last", "epoch": 0},   # would restart it
                         {"input_ids": torch.tensor([[9]])})]
    rid = client.send({"rows": [["ep", 3]], "cache": True, "logits": "last", "epoch": 2},
                      {"input_ids": torch.tensor([[4]])})
    answers = {}
    for _ in range(4):
        got, h, t = client.recv()
        answers[got] = (h, t)
    for r in stale:   # refused at stage0, not computed: nothing went on to the later stages
        h, _ = answers[r]
        assert h["op"] == "error" and h["code"] == "seq_unknown" and h["seqs"] == ["ep"] and h["stage"] == "stage0"
        assert "epoch 0 is older than the one that last wrote ep (epoch 1)" in h["error"], h
    h, t = answers[rid]   # the pos-0 one did not restart it: the epoch-2 row continues at 3
    assert h["epoch"] == 2 and ok(h, t).shape == (1, 1, VOCAB)
    step_alone(client, "ep", 4, 5)   # no epoch: never stale
    after = [control(c, "stats") for c in pipeline.control]
    assert [a["stale_dropped"] - b["stale_dropped"] for a, b in zip(after, before)] == [3, 0, 0]
    assert after[0]["requests"] - before[0]["requests"] == 6 and after[1]["requests"] - before[1]["requests"] == 3
    client.release("ep")


# --- the prefix cache (layerline.prefix): keep, fork, and a stage that lacks the entry -----------------

def _stats(pipeline, key: str) -> list:
    return [control(c, "stats")[key] for c in pipeline.control]


def _wait_for(pred, what: str) -> None:
    import time
    deadline = time.time() + 5
    while not pred():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_a_fork_copies_a_kept_prefix_at_every_stage(client, pipeline):
    """A sequence released with keep leaves its first tokens as a prefix entry at every stage; a new
    sequence forked from it (pos N, fork {from, len: N}) gives exactly the logits of computing the
    whole prompt from 0 in the same chunks; a stage that lacks the entry answers seq_unknown naming
    the new sequence; a fork needs cache."""
    p1 = [3, 17, 42, 99, 7, 5, 6, 8, 9, 10, 11, 12]
    p2 = p1 + [40, 41, 42, 43]
    before = _stats(pipeline, "prefix_entries")
    for a, b in ((0, 8), (8, 12)):
        ok(*client.call({"seq": "pk", "pos": a, "cache": True, "reserve": 24, "logits": "last"},
                        {"input_ids": torch.tensor([p1[a:b]])}))
    client.out.send_multipart(wire.encode({"op": "release", "seq": "pk", "keep": "pe1", "len": 12}))
    _wait_for(lambda: _stats(pipeline, "prefix_entries") == [n + 1 for n in before], "the entry at every stage")
    h, t = client.call({"seq": "pf", "pos": 12, "cache": True, "reserve": 24, "logits": "last",
                        "fork": {"from": "pe1", "len": 12}}, {"input_ids": torch.tensor([p2[12:]])})
    forked = ok(h, t)[0, -1]
    assert h["fork"] == {"from": "pe1", "len": 12}
    for a, b in ((0, 8), (8, 12), (12, 16)):
        whole = ok(*client.call({"seq": "pw", "pos": a, "cache": True, "reserve": 24, "logits": "last"},
                                {"input_ids": torch.tensor([p2[a:b]])}))[0, -1]
    assert torch.equal(forked, whole)
    h, t = step_rows(client, [("pf", 16, 5), ("pw", 16, 5)])   # a forked sequence steps as any other
    assert torch.equal(ok(h, t)[0, -1], ok(h, t)[1, -1])
    # stage2 alone loses the entry: stage0 and stage1 fork, stage2 names the new sequence
    s = pipeline.dealer(2)
    s.send_multipart(wire.encode({"op": "release", "seq": "pe1"}))
    _wait_for(lambda: _stats(pipeline, "prefix_entries")[2] == before[2], "stage2 dropped the entry")
    s.close()
    h, _ = client.call({"seq": "pg", "pos": 12, "cache": True, "reserve": 24, "logits": "last",
                        "fork": {"from": "pe1", "len": 12}}, {"input_ids": torch.tensor([p2[12:]])})
    assert h["op"] == "error" and h["code"] == "seq_unknown" and h["seqs"] == ["pg"] and h["stage"] == "stage2"
    assert "forks from prefix entry pe1, which is not held here" in h["error"]
    h, _ = client.call({"seq": "ph", "pos": 12, "cache": False, "fork": {"from": "pe1", "len": 12}},
                       {"input_ids": torch.tensor([p2[12:]])})
    assert h["op"] == "error" and "header.fork" in h["error"]
    for bad, text in (({"fork": {"from": "pe1", "len": 11}}, "header.fork.len: 11 must equal header.pos 12"),
                      ({"fork": {"from": "pe1", "len": 12}, "input": torch.tensor([[1], [2]])}, "one row"),
                      ({"fork": ["pe1", 12]}, "header.fork: must be")):
        ids = bad.pop("input", torch.tensor([p2[12:]]))
        h, _ = client.call({"seq": "pi", "pos": 12, "cache": True, "logits": "last", **bad}, {"input_ids": ids})
        assert h["op"] == "error" and text in h["error"], (bad, h["error"])
    for bad in ({"keep": "p/1", "len": 3}, {"keep": "pz", "len": 0}, {"len": 3}):   # the worker lives on
        client.out.send_multipart(wire.encode({"op": "release", "seq": "pw", **bad}))
    assert all(p.poll() is None for p in pipeline.procs)
    for q in ("pf", "pw", "pg", "pe1"):
        client.release(q)
    _wait_for(lambda: _stats(pipeline, "prefix_entries") == before, "release frees the entry")


def _engine_run(pipe, prompt: list[int], bounds: list[int] | None = None, prefix: bool = True):
    """One greedy sequence with logprobs through its own Engine; (sequence, engine, [(token, logprobs)])."""
    from layerline.engine import Engine, Sequence
    got = []
    s = Sequence(wire.new_id("pt"), list(prompt), 6, bounds=list(bounds or []), logprobs=3,
                 sink=lambda kind, v: got.append(v) if kind == "logprobs" else None)
    eng = Engine(pipe, chunk=8, rows=True, prefix=prefix, raise_errors=True)
    eng.add(s)
    eng.run()
    return s, eng, got


def test_the_engine_reuses_a_prefix_and_a_stage_that_lost_it_recomputes(pipeline):
    """Through the Engine: a prompt that extends an ended one starts at that one's last chunk bound
    (a hit) and its greedy tokens and logprobs equal the run without the cache at the same bounds;
    when stage2 alone lost the entry, the hit replays from 0 and still gives exactly those."""
    from layerline.engine import Engine, Sequence
    first = list(range(100, 120))                       # 20 tokens: chunks end at 8, 16, 20
    second = first + list(range(200, 210))              # + 10: the hit starts at 20
    third = second + [7, 7, 7]
    with pipeline.pipeline() as pipe, pipeline.pipeline() as off:
        eng = Engine(pipe, chunk=8, rows=True, prefix=True, raise_errors=True)
        for p in (first, second):
            got = []
            s = Sequence(wire.new_id("pt"), list(p), 6, logprobs=3,
                         sink=lambda kind, v, got=got: got.append(v) if kind == "logprobs" else None)
            eng.add(s)
            eng.run()
        assert (eng.prefix.lookups, eng.prefix.hits, eng.prefix.reused) == (2, 1, 20)
        assert s.bounds == [8, 16, 20, 28, 30] and s.finish == "length"
        ref, _, ref_got = _engine_run(off, second, [8, 16, 20], prefix=False)
        assert s.generated == ref.generated and got == ref_got
        # the second entry replaced the first (it extends it); stage2 alone drops it
        [entry] = eng.prefix.ids()
        _wait_for(lambda: _stats(pipeline, "prefix_entries") == [1, 1, 1], "one entry at every stage")
        d = pipeline.dealer(2)
        d.send_multipart(wire.encode({"op": "release", "seq": entry}))
        _wait_for(lambda: _stats(pipeline, "prefix_entries")[2] == 0, "stage2 dropped the entry")
        d.close()
        got = []
        s = Sequence(wire.new_id("pt"), list(third), 6, logprobs=3,
                     sink=lambda kind, v: got.append(v) if kind == "logprobs" else None)
        eng.add(s)
        eng.run()
        assert (eng.prefix.hits, eng.prefix.lost, s.finish) == (2, 1, "length")
        assert s.bounds == [8, 16, 20, 28, 30, 33]
        ref, _, ref_got = _engine_run(off, third, [8, 16, 20, 28, 30], prefix=False)
        assert s.generated == ref.generated and got == ref_got
        eng.close()
    _wait_for(lambda: _stats(pipeline, "prefix_entries") == [0, 0, 0], "close drops every entry")
