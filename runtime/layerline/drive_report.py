"""A drive's result as lines a person reads (deploy.yml's "Show per-stage times", `layerline drive`).

Apart from layerline.driver, which imports torch: the playbook's filter runs in the controller's
Ansible process, where importing torch costs a second a run.
"""
from __future__ import annotations


def drive_report(result) -> str:
    """The drive result as lines a person reads: per-stage times, hops, the reference check."""
    if hasattr(result, "to_dict"):   # a layerline.driver.DriveResult
        result = result.to_dict()
    lines = []
    for t in result.get("stages", []):
        a, b = t["layers"]
        lines.append(f"{t['stage']:<12} layers {a:>3}:{b:<3} {t['s'] * 1e3:9.2f} ms")
    lines.append(f"forward of {result.get('tokens')} tokens: wall {result['wall_s'] * 1e3:.2f} ms, "
                 f"hops and framing {result['hop_s'] * 1e3:.2f} ms")
    gen = result.get("generate")
    if gen:
        per = ", ".join(f"{s * 1e3:.2f}" for s in gen["stage_seconds"])
        n = sum(len(t) for t in gen["new_tokens"])
        lines.append(f"generated {n} tokens for {len(gen['new_tokens'])} sequence(s) in {gen['seconds']:.2f} s: "
                     f"{gen['tokens_per_s']:.1f} tokens/s; per-stage ms per step [{per}]")
        questions = gen.get("questions") or []
        for i, t in enumerate(gen.get("text") or gen["new_tokens"]):
            if i < len(questions):
                lines.append(f"  [{i}] {questions[i]}")
            lines.append(f"  [{i}] {'-> ' if i < len(questions) else ''}"
                         f"{t if isinstance(t, str) else ' '.join(map(str, t))}")
    if "max_abs_diff" in result:
        verdict = "matches" if result["ok"] else "DOES NOT MATCH"
        lines.append(f"max |logits - one-process forward| = {result['max_abs_diff']:.3g} "
                     f"(tolerance {result['tolerance']:.3g} at {result['precision']}): {verdict}")
    return "\n".join(lines)
