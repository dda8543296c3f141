"""`python -m specdec.infer.gpu_check` (`make gpu-check`): the checks that need a CUDA GPU.

1. Correctness: every Triton verification kernel against its PyTorch reference (run on CPU
   copies, the reference's exact sequential semantics) on random trees of varied shape, batch
   and depth, at a Llama-3 vocabulary. Greedy acceptance and KV compaction must match exactly;
   stochastic acceptance too, except where float32 sums taken in a different order put a
   uniform within rounding of a threshold (printed; a handful per million rows at most).
2. Kernel timings: Triton vs the reference on CUDA tensors (median of repeated runs).
3. Step timings on a random-weight Llama-3-8B-shaped model (no download) through the runtime's
   `TargetRunner`: a plain decode step (1 token per sequence) against a speculative step
   (verify an N-node tree + acceptance + KV compaction). Their ratio is the mean acceptance
   length at which speculation breaks even (before drafting costs).
Exits 2 with a message when there is no CUDA device, 1 when a kernel disagrees with its reference.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.infer.kernels import (compact_kv, compact_kv_reference, greedy_accept, greedy_accept_reference,
                                   stochastic_accept, stochastic_accept_reference)

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
NO_CUDA = ("gpu-check: no CUDA device visible (torch.cuda.is_available() is False), so nothing was checked.\n"
           "It compares the Triton kernels with their references and times them on a GPU; on CPU the\n"
           "test suite already runs the kernels in the Triton interpreter (make test).")


# ----------------------------------------------------------------------------- random inputs
def random_trees(B: int, N: int, max_depth: int, V: int, gen: torch.Generator, distinct: bool,
                 pad: bool = True):
    """tokens/parents/valid [B, N] on CPU: random recursive trees cut at `max_depth`, rows
    padded to random sizes (unless not `pad`); tokens drawn from 4 values so greedy matches are frequent, or
    distinct among siblings (a random permutation per parent) when `distinct`."""
    parents = torch.full((B, N), -1, dtype=torch.long)
    depth = torch.zeros(B, N, dtype=torch.long)
    for i in range(1, N):
        par = (torch.rand(B, generator=gen) * i).long()
        too_deep = depth.gather(1, par[:, None])[:, 0] >= max_depth
        par = torch.where(too_deep, 0, par)
        parents[:, i] = par
        depth[:, i] = depth.gather(1, par[:, None])[:, 0] + 1
    if distinct:  # sibling rank r gets perm[r] of a per-row permutation offset by the parent
        rank = torch.zeros(B, N, dtype=torch.long)
        for i in range(1, N):
            rank[:, i] = (parents[:, 1:i] == parents[:, i : i + 1]).sum(1)
        tokens = (rank * 7919 + parents * 104729 + torch.randint(0, V, (B, 1), generator=gen)) % V
    else:
        tokens = torch.randint(0, 4, (B, N), generator=gen)
    n_valid = torch.randint(1, N + 1, (B,), generator=gen) if pad else torch.full((B,), N)
    valid = torch.arange(N)[None, :] < n_valid[:, None]
    return tokens, torch.where(valid, parents, 0), valid   # the root (always valid) keeps -1


def peaked_probs(tokens: torch.Tensor, V: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """[B, N, V] target probabilities (on the generator's device) with mass on the next node's
    token half the time, so that walks go deep."""
    B, N = tokens.shape
    dev = gen.device
    logits = torch.randn(B, N, V, generator=gen, device=dev)
    nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1).clamp(0, V - 1).to(dev)
    boost = 12.0 * (torch.rand(B, N, 1, generator=gen, device=dev) < 0.5)
    logits.scatter_add_(2, nxt[..., None], boost)
    return torch.softmax(logits, -1).to(dtype)


def same(a, b) -> int:
    """Rows where two Accepted results differ."""
    n = (a.n_accepted != b.n_accepted) | (a.bonus != b.bonus) | (a.path != b.path).any(1)
    return int(n.sum())


# ----------------------------------------------------------------------------- 1. correctness
def check_kernels(dev: torch.device, seed: int = 0) -> bool:
    gen = torch.Generator().manual_seed(seed)
    ok = True
    print("== kernels vs reference (reference on CPU copies)")
    for B, N, D in [(1, 1, 1), (7, 9, 4), (64, 64, 8), (256, 26, 25)]:
        tokens, parents, valid = random_trees(B, N, D, 4, gen, distinct=False)
        argmax = torch.randint(0, 4, (B, N), generator=gen)
        ref = greedy_accept_reference(tokens, parents, valid, argmax, max_depth=D)
        out = greedy_accept(*(t.to(dev) for t in (tokens, parents, valid, argmax)), max_depth=D, impl="triton")
        bad = same(ref, type(ref)(*(t.cpu() for t in out)))
        ok &= bad == 0
        print(f"  greedy_accept      B={B:<4} N={N:<3} D={D:<3} mismatched rows: {bad}")
    V = 128256
    for B, N, D, dtype in [(1, 1, 1, torch.float32), (8, 17, 6, torch.bfloat16), (32, 64, 8, torch.float32)]:
        for sampled in (False, True):
            tokens, parents, valid = random_trees(B, N, D, V, gen, distinct=not sampled)
            p = peaked_probs(tokens, V, gen, dtype)
            q = torch.softmax(torch.randn(B, N, V, generator=gen), -1).to(dtype) if sampled else None
            u = torch.rand(B, N, generator=gen)
            ref = stochastic_accept_reference(tokens, parents, valid, p, q, u, max_depth=D)
            out = stochastic_accept(*(t.to(dev) for t in (tokens, parents, valid, p)),
                                    None if q is None else q.to(dev), u.to(dev), max_depth=D, impl="triton")
            bad = same(ref, type(ref)(*(t.cpu() for t in out)))
            ok &= bad <= max(1, B // 1000)
            print(f"  stochastic_accept  B={B:<4} N={N:<3} D={D:<3} {'sampled q ' if sampled else 'point mass'} "
                  f"{str(dtype)[6:]:<8} mismatched rows: {bad}")
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        B, P = 16, 9
        tokens, parents, valid = random_trees(B, 40, P - 1, 4, gen, distinct=False)
        path = greedy_accept_reference(tokens, parents, valid, torch.randint(0, 4, (B, 40), generator=gen),
                                       max_depth=P - 1).path
        layers = [torch.randn(B + 3, 8, 512, 128, generator=gen).to(dtype) for _ in range(4)]
        stacked = torch.randn(3, B + 3, 2, 512, 64, generator=gen).to(dtype)
        slots, base = torch.randperm(B + 3, generator=gen)[:B], torch.randint(0, 400, (B,), generator=gen)
        gpu = [t.to(dev) for t in layers], stacked.to(dev)
        compact_kv_reference(layers, stacked, slots, base, path)
        compact_kv(*gpu, slots.to(dev), base.to(dev), path.to(dev), impl="triton")
        equal = all(torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
                    for a, b in zip(layers + [stacked], gpu[0] + [gpu[1]]))
        ok &= equal
        print(f"  compact_kv         B={B:<4} P={P:<3} {str(dtype)[6:]:<13} identical: {equal}")
    return ok


# ----------------------------------------------------------------------------- 2. kernel timings
def timed(fn, dev: torch.device, repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() (synchronised around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_kernels(dev: torch.device, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(dev).manual_seed(seed)   # big tensors are drawn on the device
    V, N, D = 128256, 64, 8
    print(f"== kernel timings (ms, median; N={N} nodes, max depth {D}, V={V}; reference = torch on {dev.type})")
    print(f"  {'kernel':<28}{'B':>5}{'triton':>10}{'reference':>12}")
    for B in (1, 8, 32, 64):
        tokens, parents, valid = (t.to(dev) for t in random_trees(B, N, D, V, gen, distinct=True))
        argmax = torch.randint(0, 4, (B, N), device=dev)
        p = peaked_probs(tokens, V, dgen, torch.bfloat16)
        q = torch.softmax(torch.randn(B, N, V, generator=dgen, device=dev), -1).to(torch.bfloat16)
        u = torch.rand(B, N, generator=dgen, device=dev)
        rows = {
            "greedy_accept": lambda impl: greedy_accept(tokens, parents, valid, argmax, max_depth=D, impl=impl),
            "stochastic_accept point": lambda impl: stochastic_accept(tokens, parents, valid, p, None, u,
                                                                      max_depth=D, impl=impl),
            "stochastic_accept q": lambda impl: stochastic_accept(tokens, parents, valid, p, q, u,
                                                                  max_depth=D, impl=impl),
        }
        for name, fn in rows.items():
            print(f"  {name:<28}{B:>5}{timed(lambda: fn('triton'), dev):>10.3f}"
                  f"{timed(lambda: fn('reference'), dev, repeat=5):>12.3f}")
        cache_k = [torch.zeros(B, 8, 2048, 128, dtype=torch.bfloat16, device=dev) for _ in range(32)]
        cache_v = [torch.zeros_like(t) for t in cache_k]
        path = greedy_accept(tokens, parents, valid, tokens.roll(-1, 1), max_depth=D).path
        slots, base = torch.arange(B, device=dev), torch.full((B,), 1000, device=dev)
        fn = lambda impl: compact_kv(cache_k, cache_v, slots, base, path, impl=impl)  # noqa: E731
        print(f"  {'compact_kv (32 layers K+V)':<28}{B:>5}{timed(lambda: fn('triton'), dev):>10.3f}"
              f"{timed(lambda: fn('reference'), dev, repeat=5):>12.3f}")


# ----------------------------------------------------------------------------- 3. step timings
def random_llama(dev: torch.device, dtype: torch.dtype, **overrides):
    """A random-weight LlamaForCausalLM (Llama-3-8B shape unless overridden) built on `dev`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA3_8B, **overrides})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def random_draft_tree(B: int, N: int, V: int, dev: torch.device, gen: torch.Generator):
    """A full DraftTree of N nodes per row (depth <= 8, distinct sibling tokens)."""
    from specdec.heads.tree import DraftTree

    tokens, parents, _ = random_trees(B, N, 8, V, gen, distinct=True, pad=False)
    parents[:, 0] = -1
    return DraftTree(tokens=tokens.to(dev), parents=parents.to(dev),
                     valid=torch.ones(B, N, dtype=torch.bool, device=dev))


def time_steps(dev: torch.device, dtype: torch.dtype = torch.bfloat16, batch_sizes=(1, 8),
               context: int = 1024, tree_sizes=(16, 32, 64), repeat: int = 10, **model_overrides) -> list[dict]:
    """Plain vs speculative step latency through TargetRunner; returns the table rows."""
    from specdec.infer.runner import TargetRunner
    from specdec.infer.target import Target
    from specdec.infer.verify import verify_tree

    gen = torch.Generator().manual_seed(0)
    model = random_llama(dev, dtype, **model_overrides)
    target = Target(name="random-llama3-8b-shape", path=Path("."), model=model, tokenizer=None)
    V = model.config.vocab_size
    rows = []
    print(f"== step timings (ms, median of {repeat}; {model.config.num_hidden_layers} layers, {dtype}, "
          f"context {context}; accept = sampling at temperature 1; ratio = spec step / plain step)")
    print(f"  {'B':>3}{'nodes':>7}{'plain':>9}{'verify':>9}{'accept':>9}{'commit':>9}"
          f"{'spec step':>11}{'ratio':>7}")
    for B in batch_sizes:
        runner = TargetRunner(target, max_batch=B, max_len=context + max(tree_sizes) + 1, dtype=dtype, device=dev)
        for s in range(B):
            runner.prefill(s, torch.randint(0, V, (context,), generator=gen))
        slots, base = list(range(B)), [context] * B
        root = random_draft_tree(B, 1, V, dev, gen)
        plain = timed(lambda: runner.verify(slots, root, base), dev, repeat)
        for N in tree_sizes:
            tree = random_draft_tree(B, N, V, dev, gen)
            logits, _ = runner.verify(slots, tree, base)
            temp = torch.ones(B, device=dev)
            verify_ms = timed(lambda: runner.verify(slots, tree, base), dev, repeat)
            accept_ms = timed(lambda: verify_tree(tree, logits, temp, max_depth=8), dev, repeat)
            acc = verify_tree(tree, logits, temp, max_depth=8)
            commit_ms = timed(lambda: runner.commit(slots, base, acc.path, acc.n_accepted), dev, repeat)
            step = verify_ms + accept_ms + commit_ms
            rows.append(dict(batch=B, nodes=N, plain_ms=plain, verify_ms=verify_ms, accept_ms=accept_ms,
                             commit_ms=commit_ms, spec_step_ms=step, ratio=step / plain))
            print(f"  {B:>3}{N:>7}{plain:>9.2f}{verify_ms:>9.2f}{accept_ms:>9.2f}{commit_ms:>9.2f}"
                  f"{step:>11.2f}{step / plain:>7.2f}")
        del runner
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.infer.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--skip-model", action="store_true", help="only the kernel checks and timings")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the random model (8B: 32)")
    ap.add_argument("--context", type=int, default=1024, help="committed tokens per sequence")
    ap.add_argument("--batch", default="1,8", help="batch sizes for the step timings")
    ap.add_argument("--nodes", default="16,32,64", help="tree sizes (nodes incl. the root)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    ok = check_kernels(dev, args.seed)
    time_kernels(dev, args.seed)
    if not args.skip_model:
        time_steps(dev, torch.bfloat16, [int(b) for b in args.batch.split(",")], args.context,
                   [int(n) for n in args.nodes.split(",")], num_hidden_layers=args.layers)
    print("gpu-check:", "all kernels match their references" if ok else "MISMATCH (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
