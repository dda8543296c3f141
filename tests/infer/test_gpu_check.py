"""`python -m specdec.infer.gpu_check`: what can be checked without a GPU."""
from __future__ import annotations

import torch

from specdec.infer import gpu_check
from specdec.infer.kernels import greedy_accept_reference
from specdec.infer.kernels.common import node_depths


def test_without_cuda_it_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_random_trees_are_well_formed():
    gen = torch.Generator().manual_seed(0)
    tokens, parents, valid = gpu_check.random_trees(32, 40, 5, 1000, gen, distinct=True)
    greedy_accept_reference(tokens, parents, valid, tokens)          # validates the tree
    assert int(node_depths(parents, valid).max()) <= 5
    for b in range(32):
        for u in range(40):
            kids = tokens[b][(parents[b] == u) & valid[b]]
            assert kids.unique().numel() == kids.numel()              # distinct siblings


def test_step_timing_runs_through_the_runner_on_cpu():
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=320)
    rows = gpu_check.time_steps(torch.device("cpu"), torch.float32, batch_sizes=(2,), context=8,
                                tree_sizes=(5,), repeat=1, **tiny)
    assert len(rows) == 1 and rows[0]["nodes"] == 5 and rows[0]["spec_step_ms"] > 0
