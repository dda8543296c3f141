"""Verification kernels: Triton == the PyTorch reference, and the reference == the
specification (brute force), on random trees and on the edge cases.

The Triton kernels run in the CPU interpreter, which must be switched on before `triton` is first
imported (it decorates its own standard library at import). Other test modules of this pytest
process import triton in compiled mode, so the kernel cases (`@interpreted`) run in ONE
subprocess started with TRITON_INTERPRET=1 (`python tests/infer/test_kernels.py`), and each
case is reported here as its own test. Reference-only tests run in process.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from typing import Callable

import pytest
import torch

from specdec.infer.kernels import (compact_kv, compact_kv_host, compact_kv_reference, compact_kv_triton,
                                   greedy_accept, greedy_accept_host, greedy_accept_reference,
                                   greedy_accept_triton, resolve_impl, stochastic_accept, stochastic_accept_reference,
                                   stochastic_accept_triton)
from specdec.infer.kernels.common import interpreting, triton

INTERPRETED: dict[str, Callable[[], None]] = {}


def interpreted(fn):
    """A case that runs the Triton kernels: executed in the interpreter subprocess."""
    INTERPRETED[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------------------- random trees
SHAPES = ["chain", "star", "random", "binary"]


def random_tree(B: int, N: int, shape: str, gen: torch.Generator, vocab: int = 3,
                distinct_siblings: bool = False, pad: bool = True):
    """tokens/parents/valid [B, N]; rows padded at random (fewer valid nodes, whose parents
    are -1 or 0 and tokens -1)."""
    idx = torch.arange(N)
    shared = {"chain": idx - 1, "star": torch.zeros(N, dtype=torch.long), "binary": (idx - 1) // 2,
              "random": None}[shape]
    if shared is None:  # a different random recursive tree per row
        parents = (torch.rand(B, N, generator=gen) * idx).long()
    else:
        parents = shared.clamp(min=0).expand(B, N).clone()
    parents[:, 0] = -1
    tokens = torch.randint(0, vocab, (B, N), generator=gen)
    if distinct_siblings:  # deterministic top-k children have distinct tokens
        for b in range(B):
            for u in range(N):
                kids = (parents[b] == u).nonzero()[:, 0]
                tokens[b, kids] = torch.randperm(vocab, generator=gen)[: len(kids)]
    valid = torch.ones(B, N, dtype=torch.bool)
    if pad:
        n_valid = torch.randint(1, N + 1, (B,), generator=gen)
        valid = idx[None, :] < n_valid[:, None]
        filler = torch.where(torch.rand(B, 1, generator=gen) < 0.5, -1, 0).expand(B, N)
        parents = torch.where(valid, parents, filler)
        tokens = torch.where(valid, tokens, torch.full_like(tokens, -1))
    return tokens, parents, valid


def brute_force_greedy(tokens, parents, valid, argmax, max_depth):
    """Per row: every accepted node by walking its ancestors; deepest, then lowest index."""
    out = []
    for b in range(tokens.shape[0]):
        best, best_depth = 0, 0
        for i in range(1, tokens.shape[1]):
            node, depth, ok = i, 0, True
            while node > 0:
                par = int(parents[b, node])
                ok &= bool(valid[b, node]) and int(tokens[b, node]) == int(argmax[b, par])
                node, depth = par, depth + 1
            if ok and depth <= max_depth and depth > best_depth:
                best, best_depth = i, depth
        chain = [best]
        while chain[-1] > 0:
            chain.append(int(parents[b, chain[-1]]))
        out.append((best_depth, chain[::-1], int(argmax[b, best])))
    return out


def assert_same(a, b):
    for name, x, y in zip(("n_accepted", "path", "bonus"), a, b):
        assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


def _chain(B, N, gen, eos=None):
    tokens = torch.randint(0, 50, (B, N), generator=gen)
    if eos is not None:
        tokens[:, 2] = eos
    parents = (torch.arange(N) - 1).expand(B, N).clone()
    return tokens, parents, torch.ones(B, N, dtype=torch.bool)


# ----------------------------------------------------------------------------- greedy
def greedy_trees(seed: int):
    """(tokens, parents, valid, argmax, max_depth) over shapes, sizes and depth caps."""
    gen = torch.Generator().manual_seed(seed)
    for shape in SHAPES:
        for B, N in [(1, 1), (3, 5), (6, 17)]:
            tokens, parents, valid = random_tree(B, N, shape, gen)
            argmax = torch.randint(0, 3, (B, N), generator=gen)  # matches 1 time in 3
            for max_depth in (None, 2):
                yield tokens, parents, valid, argmax, max_depth


def test_greedy_reference_matches_brute_force():
    for tokens, parents, valid, argmax, max_depth in greedy_trees(seed=0):
        ref = greedy_accept_reference(tokens, parents, valid, argmax, max_depth=max_depth)
        depth_cap = ref.path.shape[1] - 1
        for b, (n, chain, bonus) in enumerate(brute_force_greedy(tokens, parents, valid, argmax, depth_cap)):
            assert int(ref.n_accepted[b]) == n and int(ref.bonus[b]) == bonus
            assert ref.path[b, : n + 1].tolist() == chain and (ref.path[b, n + 1 :] == -1).all()


def test_greedy_host_matches_reference():
    """The runtime's CPU path (Python lists) is the reference's twin, including its edge cases."""
    for tokens, parents, valid, argmax, max_depth in greedy_trees(seed=3):
        assert_same(greedy_accept_host(tokens, parents, valid, argmax, max_depth=max_depth),
                    greedy_accept_reference(tokens, parents, valid, argmax, max_depth=max_depth))
    check_greedy_edge_cases(greedy_accept_host)
    check_greedy_ties(greedy_accept_host)


@interpreted
def greedy_random_trees():
    for tokens, parents, valid, argmax, max_depth in greedy_trees(seed=0):
        assert_same(greedy_accept_triton(tokens, parents, valid, argmax, max_depth=max_depth),
                    greedy_accept_reference(tokens, parents, valid, argmax, max_depth=max_depth))


def test_greedy_worked_example():
    # tokens [r, 7, 9, 7], parents [-1, 0, 0, 1], argmax [7, 4, 0, 5]: node 1 matches 7, node 3
    # (7) does not match argmax[1] = 4 -> 1 accepted, path [0, 1, -1], bonus 4.
    def t(*v):
        return torch.tensor([v])

    out = greedy_accept(t(5, 7, 9, 7), t(-1, 0, 0, 1), t(True, True, True, True), t(7, 4, 0, 5))
    assert out.n_accepted.tolist() == [1] and out.path.tolist() == [[0, 1, -1]] and out.bonus.tolist() == [4]


def check_greedy_edge_cases(impl):
    gen = torch.Generator().manual_seed(1)
    B, N, eos = 4, 6, 2
    tokens, parents, valid = _chain(B, N, gen, eos=eos)
    agree = torch.cat([tokens[:, 1:], torch.full((B, 1), 7)], dim=1)  # argmax[u] = tokens[u + 1]
    # everything accepted, past the eos at node 2 (the engine truncates, not the kernel)
    out = impl(tokens, parents, valid, agree)
    assert out.n_accepted.tolist() == [N - 1] * B
    assert out.path.tolist() == [list(range(N))] * B and out.bonus.tolist() == [7] * B
    # nothing accepted
    out = impl(tokens, parents, valid, agree + 100)
    assert out.n_accepted.tolist() == [0] * B and (out.path[:, 1:] == -1).all()
    assert torch.equal(out.bonus, agree[:, 0] + 100)
    # an invalid (padding) node is never accepted, nor anything after it
    cut = valid.clone()
    cut[:, 3:] = False
    out = impl(tokens, parents, cut, agree)
    assert out.n_accepted.tolist() == [2] * B and torch.equal(out.bonus, agree[:, 2])
    # max_depth caps the path
    out = impl(tokens, parents, valid, agree, max_depth=3)
    assert out.path.shape == (B, 4) and out.n_accepted.tolist() == [3] * B


def check_greedy_ties(impl):
    # two identical branches 0 -> 1 -> 3 and 0 -> 2 -> 4, both fully accepted: lowest index wins
    tokens = torch.tensor([[0, 5, 5, 6, 6]])
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    out = impl(tokens, parents, torch.ones(1, 5, dtype=torch.bool), torch.tensor([[5, 6, 6, 1, 2]]))
    assert out.path.tolist() == [[0, 1, 3]] and out.bonus.tolist() == [1]


def test_greedy_edge_cases_reference():
    check_greedy_edge_cases(greedy_accept_reference)
    check_greedy_ties(greedy_accept_reference)


@interpreted
def greedy_edge_cases_kernel():
    check_greedy_edge_cases(greedy_accept_triton)
    check_greedy_ties(greedy_accept_triton)


@pytest.mark.parametrize("greedy", [greedy_accept_reference, greedy_accept_host])
def test_greedy_acceptance_rejects_malformed_trees(greedy):
    tokens = torch.zeros(1, 3, dtype=torch.long)
    valid = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="node 2 of row 0 has parent 2"):
        greedy(tokens, torch.tensor([[-1, 0, 2]]), valid, tokens)
    with pytest.raises(ValueError, match="parents\\[:, 0\\] must be -1"):
        greedy(tokens, torch.tensor([[0, 0, 1]]), valid, tokens)
    with pytest.raises(ValueError, match="hangs under invalid node 1"):
        greedy(tokens, torch.tensor([[-1, 0, 1]]), torch.tensor([[True, False, True]]), tokens)
    with pytest.raises(ValueError, match="root\\) must be valid"):
        greedy(tokens, torch.tensor([[-1, 0, 1]]), torch.tensor([[False, True, True]]), tokens)


def test_reference_rejects_malformed_trees():
    tokens = torch.zeros(1, 3, dtype=torch.long)
    valid = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="target_argmax must start with"):
        greedy_accept(tokens, torch.tensor([[-1, 0, 1]]), valid, tokens[:, :2])
    probs = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        stochastic_accept_reference(torch.tensor([[0, 9, 1]]), torch.tensor([[-1, 0, 1]]), valid, probs,
                                    None, torch.rand(1, 3))
    with pytest.raises(ValueError, match="uniforms must"):
        stochastic_accept(torch.tensor([[0, 1, 1]]), torch.tensor([[-1, 0, 1]]), valid, probs,
                          None, torch.rand(1, 4))


# ----------------------------------------------------------------------------- stochastic
def random_probs(B, N, V, gen, tokens, zeros: bool):
    """Target probabilities, peaked at the next node's token half the time (so walks go deep),
    with top-k-like exact zeros when `zeros`."""
    logits = 2.0 * torch.randn(B, N, V, generator=gen)
    boost = torch.rand(B, N, generator=gen) < 0.5
    nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1).clamp(0, V - 1)
    logits.scatter_add_(2, nxt[..., None], 4.0 * boost[..., None].float())
    if zeros:
        kth = logits.topk(V // 2, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, -1)


@interpreted
def stochastic_random_trees():
    V = 16
    for seed, (shape, sampled) in enumerate([(s, q) for s in SHAPES for q in (False, True)]):
        gen = torch.Generator().manual_seed(seed)
        for B, N, dtype, max_depth in [(1, 1, torch.float32, None), (4, 9, torch.float32, None),
                                       (5, 17, torch.bfloat16, 3)]:
            tokens, parents, valid = random_tree(B, N, shape, gen, vocab=V, distinct_siblings=not sampled)
            p = random_probs(B, N, V, gen, tokens, zeros=dtype == torch.bfloat16).to(dtype)
            q = torch.softmax(torch.randn(B, N, V, generator=gen), -1).to(dtype) if sampled else None
            u = torch.rand(B, N, generator=gen)
            ref = stochastic_accept_reference(tokens, parents, valid, p, q, u, max_depth=max_depth)
            assert_same(stochastic_accept_triton(tokens, parents, valid, p, q, u, max_depth=max_depth), ref)
            # the bonus always has positive target probability at the node it is drawn from
            node = ref.path.gather(1, ref.n_accepted[:, None])[:, 0]
            assert (p.float()[torch.arange(B), node, ref.bonus] > 0).all(), (shape, sampled)


def check_stochastic_edge_cases(impl):
    gen = torch.Generator().manual_seed(3)
    B, N, V, eos = 3, 6, 64, 2
    tokens, parents, valid = _chain(B, N, gen, eos=eos)
    nxt = torch.cat([tokens[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1)
    sure = torch.nn.functional.one_hot(nxt, V).float()                       # p(child) = 1
    never = torch.softmax(torch.randn(B, N, V, generator=gen), -1).scatter(2, nxt[..., None], 0.0)
    never = never / never.sum(-1, keepdim=True)                              # p(child) = 0
    u = torch.rand(B, N, generator=gen)
    for q in (None, torch.softmax(torch.randn(B, N, V, generator=gen), -1)):
        out = impl(tokens, parents, valid, sure, q, u)                       # all, past the eos
        assert out.n_accepted.tolist() == [N - 1] * B and out.bonus.tolist() == [0] * B
        out = impl(tokens, parents, valid, never, q, u)                      # none
        assert out.n_accepted.tolist() == [0] * B and (out.bonus != tokens[:, 1]).all()
        cut = valid.clone()
        cut[:, 4:] = False                                                   # padding never accepted
        out = impl(tokens, parents, cut, sure, q, u)
        assert out.n_accepted.tolist() == [3] * B and torch.equal(out.bonus, nxt[:, 3])


def test_stochastic_edge_cases_reference():
    check_stochastic_edge_cases(stochastic_accept_reference)


@interpreted
def stochastic_edge_cases_kernel():
    check_stochastic_edge_cases(stochastic_accept_triton)


def test_stochastic_seeded_generator_is_reproducible():
    gen = torch.Generator().manual_seed(0)
    tokens, parents, valid = random_tree(8, 9, "random", gen, vocab=16, distinct_siblings=True)
    p = random_probs(8, 9, 16, gen, tokens, zeros=False)
    runs = [stochastic_accept(tokens, parents, valid, p, generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert_same(*runs)


# ----------------------------------------------------------------------------- compact_kv
def _caches(gen, dtype):
    """Per-layer tensors of two shapes (a list), and one stacked [layers, ...] tensor."""
    layers = [torch.randn(4, 2, 32, 8, generator=gen).to(dtype) for _ in range(3)]
    layers += [torch.randn(4, 1, 32, 16, generator=gen).to(dtype)]
    stacked = torch.randn(2, 4, 2, 32, 8, generator=gen).to(dtype)
    return layers, stacked


def check_compact_kv_spec(impl):
    """After compaction position base + j holds what base + path[j] held; nothing else moved."""
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([3, 0, 1])
    base_lens = torch.tensor([5, 0, 20])
    path = torch.tensor([[0, 2, 5, 6, -1], [0, 1, 2, 3, 4], [0, -1, -1, -1, -1]])
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        layers, stacked = _caches(gen, dtype)
        before = [t.clone() for t in layers] + [stacked.clone()]
        impl(layers, stacked, slots, base_lens, path)
        for old, new in zip(before, layers + [stacked]):
            old, new = old.view(torch.uint8), new.view(torch.uint8)  # bitwise, fp8 included
            expect = old.clone()
            for b in range(3):
                s, base = int(slots[b]), int(base_lens[b])
                for j in range(1, 5):
                    if path[b, j] >= 0:
                        expect[..., s, :, base + j, :] = old[..., s, :, base + int(path[b, j]), :]
            assert torch.equal(new, expect), dtype


def test_compact_kv_reference_spec():
    check_compact_kv_spec(compact_kv_reference)


def check_compact_kv_random_paths(impl, seed: int, rounds: int, dtype):
    """`impl` moves exactly what the reference moves, on accepted paths of random trees."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        B, P = 3, 6
        tokens, parents, valid = random_tree(B, 12, "random", gen)
        argmax = torch.randint(0, 3, (B, 12), generator=gen)
        path = greedy_accept_reference(tokens, parents, valid, argmax, max_depth=P - 1).path
        slots, base_lens = torch.randperm(4, generator=gen)[:B], torch.randint(0, 16, (B,), generator=gen)
        a, stacked = _caches(gen, dtype)
        b, stacked_b = [t.clone() for t in a], stacked.clone()
        compact_kv_reference(a, stacked, slots, base_lens, path)
        impl(b, stacked_b, slots, base_lens, path)
        assert all(torch.equal(x, y) for x, y in zip(a + [stacked], b + [stacked_b]))


@pytest.mark.parametrize("glue", [True, False])
def test_compact_kv_host_spec_and_random_paths(glue, monkeypatch):
    """The runtime's CPU path (compact_kv's default on CPU tensors) is the reference's twin, with
    the glue kernel's moves and with the index ops that stand in where it cannot be built."""
    from specdec.infer.models import glue_cpu

    if glue and glue_cpu.unavailable_reason() is not None:
        pytest.skip(f"no CPU glue kernel here: {glue_cpu.unavailable_reason()}")
    if not glue:
        monkeypatch.setattr(glue_cpu.KERNEL, "get", lambda: None)
    check_compact_kv_spec(compact_kv_host)
    check_compact_kv_random_paths(compact_kv, seed=2, rounds=10, dtype=torch.bfloat16)


@interpreted
def compact_kv_kernel_spec():
    check_compact_kv_spec(compact_kv_triton)


@interpreted
def compact_kv_kernel_random_paths():
    check_compact_kv_random_paths(lambda *args: compact_kv(*args, impl="triton"), seed=1, rounds=5,
                                  dtype=torch.float16)


def test_compact_kv_rejects_bad_input():
    cache = torch.zeros(2, 1, 8, 4)
    with pytest.raises(ValueError, match="path\\[0, 2\\] = 1 < 2"):
        compact_kv(cache, None, torch.tensor([0]), torch.tensor([0]), torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match="slots must be distinct"):
        compact_kv(cache, None, torch.tensor([1, 1]), torch.tensor([0, 0]), torch.tensor([[0, 1], [0, 1]]))
    with pytest.raises(ValueError, match="do not fit"):
        compact_kv(cache, cache, torch.tensor([0]), torch.tensor([6]), torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="must be \\[B\\]"):
        compact_kv(cache, None, torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([[0, 1]]))


# ----------------------------------------------------------------------------- dispatch
def test_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    assert resolve_impl(cpu) == "reference"
    assert resolve_impl(cpu, host=True) == "host"  # a kernel with a host twin uses it on CPU
    if triton is not None:
        assert resolve_impl(torch.device("cuda")) == "triton"
    monkeypatch.setenv("SPECDEC_KERNELS", "reference")
    assert resolve_impl(torch.device("cuda")) == "reference"
    assert resolve_impl(cpu, host=True) == "reference"  # asked for by name: the reference
    monkeypatch.setenv("SPECDEC_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="CUDA tensors|not installed"):
        greedy_accept(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), -1),
                      torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long))
    monkeypatch.setenv("SPECDEC_KERNELS", "fast")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_impl(cpu)


# ----------------------------------------------------------------------------- real compilation
KERNEL_SIGNATURES = {
    "greedy_accept": ("_greedy_accept_kernel", dict(
        tokens_ptr="*i64", parents_ptr="*i64", valid_ptr="*u8", argmax_ptr="*i64", n_acc_ptr="*i64",
        path_ptr="*i64", bonus_ptr="*i64", N="i32", D="i32", stride_tok="i32", stride_par="i32",
        stride_val="i32", stride_arg="i32", stride_path="i32"), {"BLOCK_N": 64, "BLOCK_D": 8}),
    "stochastic_accept": ("_stochastic_accept_kernel", dict(
        tokens_ptr="*i64", parents_ptr="*i64", valid_ptr="*u8", p_ptr="*bf16", q_ptr="*bf16",
        u_ptr="*fp32", resid_ptr="*fp32", n_acc_ptr="*i64", path_ptr="*i64", bonus_ptr="*i64",
        N="i32", V="i32", D="i32", stride_tok="i32", stride_par="i32", stride_val="i32",
        stride_pb="i64", stride_pn="i32", stride_qb="i64", stride_qn="i32", stride_u="i32",
        stride_r="i32", stride_path="i32"), {"HAS_Q": True, "BLOCK_V": 1024, "BLOCK_D": 8}),
    "compact_kv": ("_compact_kv_kernel", dict(
        table_ptr="*i64", slots_ptr="*i64", base_lens_ptr="*i64", path_ptr="*i64", P="i32", H="i32",
        HEAD_DIM="i32", stride_b="i64", stride_h="i32", stride_t="i32", stride_d="i32",
        stride_path="i32"), {"WORD": "int16", "BLOCK_D": 128}),
}


@pytest.mark.parametrize("module,variant", [(m, v) for m in sorted(KERNEL_SIGNATURES) for v in (0, 1)])
def test_kernels_compile_for_cuda(module, variant):
    """The interpreter is lenient about types; a real compile to sm_90 machine code (ptxas ships
    with triton, no GPU needed) catches what only a CUDA machine would otherwise see."""
    if triton is None or interpreting():
        pytest.skip("needs triton in compiled mode")
    try:
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"this triton cannot compile ahead of time: {e}")
    name, sig, consts = KERNEL_SIGNATURES[module]
    consts = {k: getattr(tl, v) if isinstance(v, str) else v for k, v in consts.items()}
    if variant:  # the other specialisation: no draft_probs / a bigger tree / 32-bit words
        consts.update({"greedy_accept": {"BLOCK_N": 256}, "stochastic_accept": {"HAS_Q": False},
                       "compact_kv": {"WORD": tl.int32, "BLOCK_D": 256}}[module])
    kernel = getattr(importlib.import_module(f"specdec.infer.kernels.{module}"), name)
    src = ASTSource(fn=kernel, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    assert len(out.asm["cubin"]) > 0


# ----------------------------------------------------------------------------- the interpreter run
@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    if triton is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "0"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"interpreter subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", sorted(INTERPRETED))
def test_triton_kernel_in_interpreter(case, interpreter_results):
    assert case in interpreter_results, f"case {case} did not run"
    assert interpreter_results[case] is None, interpreter_results[case]


if __name__ == "__main__":  # the interpreter subprocess: run every case, report one JSON line
    assert interpreting(), "run with TRITON_INTERPRET=1 set before triton is imported"
    torch.set_num_threads(1)
    results = {}
    for case_name, case in INTERPRETED.items():
        try:
            case()
            results[case_name] = None
        except Exception:  # noqa: BLE001 - reported as that case's failure
            results[case_name] = traceback.format_exc()
    print(json.dumps(results))
