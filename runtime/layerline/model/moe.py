"""Mixtral's sparse mixture-of-experts block, with experts looked up through an `ExpertStore`.

Routing follows transformers (MixtralTopKRouter): router logits in the stage dtype, softmax in
float32 over all experts, top-k, renormalised over the k chosen (the same as a softmax over the
top-k logits); each chosen expert's SwiGLU output is weighted in float32 and summed in ascending
expert order.

Expert weights are not reached through module attributes but through `store.get(layer, e)`, which
returns the three projections (w1 = gate, w2 = down, w3 = up) as callables x -> y. Two stores:

- `ResidentExperts`: a layer's experts as submodules (`experts.E.w1` ...), loaded with the stage,
  state_dict names equal to the Hugging Face checkpoint's;
- `LRUExpertStore`: one per stage, reads an expert's tensors from the checkpoint when first
  asked (`Checkpoint.tensor`, memory-mapped) and keeps the most recently used ones up to a byte
  budget, counting hits, misses, bytes read and evictions.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import Checkpoint, CheckpointError, CheckpointIndex, open_checkpoint
from .quant import Int4Linear, Int8Linear, int4_fits, make_linear, quant_name

Proj = Callable[[torch.Tensor], torch.Tensor]
EXPERT_PROJS = ("w1", "w2", "w3")


def expert_tensor_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight"


class ExpertStore(Protocol):
    def get(self, layer: int, expert: int) -> tuple[Proj, Proj, Proj]:
        """(w1, w2, w3) of expert `expert` in layer `layer`: gate, down and up projections."""
        ...


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, quant=None):
        super().__init__()
        self.w1 = make_linear(hidden, inter, False, dtype, quant)
        self.w2 = make_linear(inter, hidden, False, dtype, quant)
        self.w3 = make_linear(hidden, inter, False, dtype, quant)


class ResidentExperts(nn.ModuleList):
    """All experts of one layer, held in memory as submodules."""

    def __init__(self, layer: int, n: int, hidden: int, inter: int, dtype: torch.dtype, quant=None):
        super().__init__([Expert(hidden, inter, dtype, quant) for _ in range(n)])
        self.layer = layer

    def get(self, layer: int, expert: int) -> tuple[Proj, Proj, Proj]:
        if layer != self.layer:
            raise KeyError(f"layer {layer}: these resident experts belong to layer {self.layer}")
        e = self[expert]
        return e.w1, e.w2, e.w3


@dataclass
class ExpertStoreStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0  # bytes read from the checkpoint files (their stored dtype)
    evictions: int = 0
    resident_bytes: int = 0  # bytes the cached experts hold now (in the compute precision)
    peak_bytes: int = 0


class LRUExpertStore:
    """Experts read on demand from the checkpoint and cached, least recently used first out.

    `budget_bytes` bounds the cached experts' memory (int8 + scales, or the float dtype); one
    expert bigger than the budget is still served (and dropped at the next miss).
    """

    def __init__(self, ckpt: str | Checkpoint, index: CheckpointIndex, dtype: torch.dtype, quant,
                 budget_bytes: int, device: str | torch.device = "cpu", layers: range | None = None,
                 num_experts: int | None = None):
        if budget_bytes < 0:
            raise ValueError(f"expert cache budget {budget_bytes} bytes: must not be negative")
        self.checkpoint = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt, check=False)
        self.root = self.checkpoint.path
        self.index, self.dtype, self.quant = index, dtype, quant_name(quant)
        self.budget = int(budget_bytes)
        self.device = torch.device(device)
        self.stats = ExpertStoreStats()
        self._cache: OrderedDict[tuple[int, int], tuple[tuple[nn.Module, ...], int]] = OrderedDict()
        self._lock = threading.Lock()
        self.layers, self.num_experts = layers, num_experts
        if layers is not None and num_experts is not None:  # fail at load time, not mid-generation
            for layer in layers:
                for e in range(num_experts):
                    for p in EXPERT_PROJS:
                        self._entry(expert_tensor_name(layer, e, p))

    def _entry(self, name: str):
        entry = self.index.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{self.root}: tensor {name} is missing from the *.safetensors files; "
                                  "the checkpoint is incomplete, re-download it")
        return entry

    def _read(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        path = self.checkpoint.file_path(entry)
        try:
            t = self.checkpoint.tensor(name)
        except (OSError, RuntimeError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: cannot read {name} ({msg}); the file may be truncated, "
                                  "re-download it") from e
        self.stats.bytes_read += entry.nbytes
        return t

    def _build(self, w: torch.Tensor) -> tuple[nn.Module, int]:
        if self.quant == "int4" and int4_fits(w.shape[1], w.shape[0]):
            m = Int4Linear.from_float(w, dtype=self.dtype)
        elif self.quant:
            m = Int8Linear.from_float(w, dtype=self.dtype)
        else:
            with torch.device("meta"):
                m = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=self.dtype)
            m.weight = nn.Parameter(w.to(self.dtype), requires_grad=False)
        m = m.to(self.device)
        return m, sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))

    def get(self, layer: int, expert: int) -> tuple[Proj, Proj, Proj]:
        key = (layer, expert)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return hit[0]  # type: ignore[return-value]
            self.stats.misses += 1
            mods, nbytes = [], 0
            for p in EXPERT_PROJS:
                m, nb = self._build(self._read(expert_tensor_name(layer, expert, p)))
                mods.append(m)
                nbytes += nb
            while self._cache and self.stats.resident_bytes + nbytes > self.budget:
                _, (_, old) = self._cache.popitem(last=False)
                self.stats.resident_bytes -= old
                self.stats.evictions += 1
            projs = tuple(mods)
            self._cache[key] = (projs, nbytes)
            self.stats.resident_bytes += nbytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.resident_bytes)
            return projs  # type: ignore[return-value]

    def cached(self) -> list[tuple[int, int]]:
        """(layer, expert) keys in the cache, least recently used first."""
        return list(self._cache)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.stats.resident_bytes = 0

    def close(self) -> None:
        self.clear()
        self.checkpoint.close()


class SparseMoE(nn.Module):
    """Mixtral's block_sparse_moe: router `gate` [experts, hidden] and top-k SwiGLU experts."""

    def __init__(self, layer: int, hidden: int, inter: int, num_experts: int, top_k: int,
                 dtype: torch.dtype, quant=None, resident: bool = True):
        super().__init__()
        self.layer, self.num_experts, self.top_k = layer, num_experts, top_k
        # the router stays in the compute dtype even at int8: it is tiny and routing is sensitive
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.experts = ResidentExperts(layer, num_experts, hidden, inter, dtype, quant) if resident else None
        self.store: ExpertStore | None = None  # an external store; used instead of `experts` when set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        x2 = x.reshape(-1, h)
        logits = self.gate(x2)
        probs = F.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x2)
        store = self.store if self.store is not None else self.experts
        if store is None:
            raise RuntimeError(f"layer {self.layer}: experts are not loaded and no expert store is attached")
        for e in torch.unique(top_i).tolist():
            tok, slot = torch.where(top_i == e)
            w1, w2, w3 = store.get(self.layer, e)
            xe = x2[tok]
            y = w2(F.silu(w1(xe)) * w3(xe))
            out.index_add_(0, tok, (y * top_w[tok, slot, None]).to(out.dtype))
        return out.view(b, t, h)
