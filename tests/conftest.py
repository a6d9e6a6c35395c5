"""Shared fixtures for the layerline tests."""
from __future__ import annotations

from pathlib import Path

import pytest
# torch._dynamo registers a polyfill for sys.intern when it is first imported, and Ansible's
# module_utils (loaded in-process by some module tests) replaces sys.intern with a patch class
# that dynamo then refuses. Load dynamo first, while sys.intern is still the builtin.
import torch  # noqa: E402
import torch._dynamo  # noqa: F401,E402

# A small Llama-family demo model: fast to write, load and run on a busy CPU.
SMALL_CKPT = dict(layers=4, hidden=128, vocab=500, dtype="float32", seed=0)


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory) -> Path:
    """A deterministic 4-layer demo checkpoint (hidden 128, vocab 500, float32), made once per session.

    Its shape is in `SMALL_CKPT`; read config.json for anything else (heads, head_dim, ...).
    """
    from layerline.checkpoint import write_demo_checkpoint

    out = tmp_path_factory.mktemp("small_ckpt") / "ckpt"
    return Path(write_demo_checkpoint(out, **SMALL_CKPT))


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for the module's tests (small models gain nothing from more)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
