"""Generation across real worker processes: several sequences in flight, sampling, lost caches replayed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import local_pipeline

from layerline.checkpoint import read_index
from layerline.driver import Pipeline
from layerline.errors import LayerlineError
from layerline.generate import Sampling, generate
from layerline.model.loader import load_stage
from layerline.model.sampling import sample


@pytest.fixture(scope="module")
def pipeline(small_ckpt):
    with local_pipeline(small_ckpt, 3, "fp32") as pipe:
        yield pipe


@pytest.fixture(scope="module")
def full(small_ckpt):
    return load_stage(str(small_ckpt), 0, read_index(small_ckpt).num_layers, True, True, "fp32")


def in_process(stage, prompt, n, sampling=None, gen=None):
    """Reference decoding in one process with one KV cache."""
    cache = stage.new_cache(1, len(prompt) + n + 1)
    logits = stage(torch.tensor([prompt]), start_pos=0, cache=cache)
    out = []
    for i in range(n):
        s = sampling or Sampling()
        tok = int(sample(logits[:, -1].float(), s.temperature, s.top_p, gen)[0])
        out.append(tok)
        logits = stage(torch.tensor([[tok]]), start_pos=len(prompt) + i, cache=cache)
    return out


PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5], [42], [3, 1, 4, 1, 5, 9, 2, 6]]


def test_several_sequences_in_flight_equal_one_at_a_time(pipeline, full):
    g = generate(pipeline, PROMPTS, 6)
    assert g.tokens == [in_process(full, p, 6) for p in PROMPTS]
    assert g.new_tokens == 6 * len(PROMPTS)
    # every step gives one token per row; decode steps carry rows of several sequences
    assert sum(s.rows for s in g.steps) == 6 * len(PROMPTS)
    assert any(s.rows >= 2 for s in g.steps), "sequences share decode steps (rows micro-batches)"
    # greedy rows: the last stage picked each token; asked for the logits instead, the same tokens
    assert all(s.logits is None and s.argmax is not None for s in g.steps)
    with_logits = generate(pipeline, PROMPTS, 6, pick=False)
    assert with_logits.tokens == g.tokens and all(s.logits is not None for s in with_logits.steps)
    assert len(g.stage_seconds()) == 3 and all(t > 0 for t in g.stage_seconds())


class CountingPipeline(Pipeline):
    """A real Pipeline that counts its rows messages in flight (the engine's micro-batches)."""
    def __post_init__(self):
        super().__post_init__()
        self.rows_out, self.most_rows_out, self.rows_ids = 0, 0, set()

    def submit_rows(self, *a, **kw):
        rid = super().submit_rows(*a, **kw)
        self.rows_ids.add(rid)
        self.rows_out += 1
        self.most_rows_out = max(self.most_rows_out, self.rows_out)
        return rid

    def answers(self, sock):
        out = super().answers(sock)
        for a in out:
            if a.rid in self.rows_ids:
                self.rows_ids.discard(a.rid)
                self.rows_out -= 1
        return out


@pytest.mark.parametrize("depth", [1, 3])
def test_micro_batches_in_flight_follow_the_pipelines_depth(pipeline, full, depth):
    """Stages that share cores (a plan's depth 1) get one micro-batch of every decoding row;
    stages on machines of their own (depth 3) get one each, so none idles."""
    prompts = [[7, 1, 2], [7, 3, 4], [7, 5, 6], [7, 8, 9]]
    with CountingPipeline(pipeline.first, timeout_s=60, depth=depth, keys_dir=pipeline.keys_dir,
                          first_key=pipeline.first_key) as pipe:
        g = generate(pipe, prompts, 8)
    assert g.tokens == [in_process(full, p, 8) for p in prompts]
    assert pipe.most_rows_out == 1 if depth == 1 else 1 < pipe.most_rows_out <= depth
    if depth == 1:  # once every prompt is in, all four rows step together
        assert max(s.rows for s in g.decode) == len(prompts)
    assert g.decode_tokens_per_s() > 0


def test_unbatched_equals_batched(pipeline):
    assert generate(pipeline, PROMPTS[:2], 5, batch=False).tokens == generate(pipeline, PROMPTS[:2], 5).tokens


def test_sampling_is_seeded(pipeline):
    s = Sampling(temperature=0.9, top_p=0.95, seed=7)
    a = generate(pipeline, [PROMPTS[0]], 8, s).tokens
    assert a == generate(pipeline, [PROMPTS[0]], 8, s).tokens
    others = {tuple(generate(pipeline, [PROMPTS[0]], 8, Sampling(0.9, 0.95, seed)).tokens[0]) for seed in range(4)}
    assert len(others) > 1, "different seeds sample different tokens"
    greedy = generate(pipeline, [PROMPTS[0]], 8).tokens
    assert generate(pipeline, [PROMPTS[0]], 8, Sampling(0.9, 1e-9, 3)).tokens == greedy, "tiny top_p is greedy"


def test_eos_stops_a_sequence(pipeline, full):
    want = in_process(full, PROMPTS[0], 6)
    eos = want[2]
    g = generate(pipeline, [PROMPTS[0]], 6, eos=eos)
    assert g.tokens[0] == want[:want.index(eos) + 1]


class LosingPipeline(Pipeline):
    """Every stage drops the sequence's KV cache once, mid-generation (as a restart would)."""
    def __post_init__(self):
        super().__post_init__()
        self.decodes = 0

    def submit(self, input_ids, seq=None, pos=0, cache=False, last_only=False, reserve=None, fork=None, pick=False):
        if pos > 0:
            self.decodes += 1
            if self.decodes == 3:
                self.release(seq)
        return super().submit(input_ids, seq, pos, cache, last_only, reserve, fork, pick)

    def submit_rows(self, rows, input_ids, pick=False, more=0):
        for seq, _ in rows:
            self.decodes += 1
            if self.decodes == 3:
                self.release(seq)
        return super().submit_rows(rows, input_ids, pick, more)


def test_lost_cache_is_rebuilt_by_replaying_the_prefix(small_ckpt, pipeline, full):
    pipe = LosingPipeline(pipeline.first, timeout_s=60, keys_dir=pipeline.keys_dir, first_key=pipeline.first_key)
    try:
        g = generate(pipe, [PROMPTS[4]], 6)
    finally:
        pipe.close()
    assert g.replays == 1
    assert g.tokens[0] == in_process(full, PROMPTS[4], 6), "no generation is lost"


def test_bad_arguments_are_one_line_errors(pipeline):
    with pytest.raises(LayerlineError, match="max-new-tokens"):
        generate(pipeline, [[1]], 0)
    with pytest.raises(LayerlineError, match="prompt"):
        generate(pipeline, [[]], 3)
    with pytest.raises(LayerlineError, match="top-p"):
        Sampling(0.5, 0.0)


def test_cli_generate_json(small_ckpt, full, tmp_path):
    r = subprocess.run([sys.executable, "-m", "layerline.cli", "generate", "--checkpoint", str(small_ckpt),
                        "--local-stages", "2", "--input-ids", "1,2,3,4", "--max-new-tokens", "5",
                        "--precision", "fp32", "--ignore-eos", "--json"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == in_process(full, [1, 2, 3, 4], 5)
    assert len(out["stage_seconds"]) == 2
    assert list(tmp_path.iterdir()) == []  # the local workers' keys and state went with them


def test_cli_bad_flag_is_one_line(small_ckpt):
    r = subprocess.run([sys.executable, "-m", "layerline.cli", "generate", "--checkpoint", str(small_ckpt),
                        "--input-ids", "1,x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--input-ids" in r.stderr


def test_other_stage_errors_are_not_replayed(pipeline):
    """Only a lost cache is replayed; any other error ends the generation with its message."""
    with pytest.raises(LayerlineError, match="token ids must be in"):
        generate(pipeline, [[1, 2, 10**6]], 3)
