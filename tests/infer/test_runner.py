"""TargetRunner: the lean and generic paths compute what HF computes, tree verification equals
one-token-at-a-time decoding, KV compaction leaves the cache of a plain run, plain greedy equals
HF generate() (all fp32)."""
from __future__ import annotations

import pytest
import torch

from specdec.heads.base import FeatureSpec
from specdec.heads.tree import DraftTree
from specdec.infer.cache import CacheFullError, StepAccess
from specdec.infer.runner import TargetRunner
from specdec.infer.target import Target
from specdec.infer.tiny import tiny_tokenizer

ATOL = 2e-5


def random_tree(gen: torch.Generator, root: int, n: int, vocab: int, max_depth: int = 4) -> DraftTree:
    """One random tree [1, n]: node i hangs under a random earlier node no deeper than max_depth."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        choices = [j for j in range(i) if depth[j] < max_depth]
        p = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        parents.append(p)
        depth.append(depth[p] + 1)
    tokens = torch.randint(vocab, (1, n), generator=gen)
    tokens[0, 0] = root
    return DraftTree(tokens=tokens, parents=torch.tensor([parents]), valid=torch.ones(1, n, dtype=torch.bool))


def root_path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def stack_trees(trees: list[DraftTree]) -> DraftTree:
    """Batch single trees, padding shorter ones with invalid nodes."""
    n = max(t.num_nodes for t in trees)
    tokens = torch.zeros(len(trees), n, dtype=torch.long)
    parents = torch.zeros(len(trees), n, dtype=torch.long)
    valid = torch.zeros(len(trees), n, dtype=torch.bool)
    for b, t in enumerate(trees):
        k = t.num_nodes
        tokens[b, :k], parents[b, :k], valid[b, :k] = t.tokens[0], t.parents[0], t.valid[0]
    return DraftTree(tokens=tokens, parents=parents, valid=valid)


# ---------------------------------------------------------------------------------------------
# Every supported family, in tiny random form, against HF's own forward
# ---------------------------------------------------------------------------------------------
def _arch_target(kind: str) -> Target:
    from transformers import (AutoModelForCausalLM, GemmaConfig, GPT2Config, LlamaConfig, MistralConfig,
                              Qwen2Config, Qwen3Config)

    base = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    configs = {
        "llama3-tied-bias": lambda: LlamaConfig(**base, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                                rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 16,
                                                                 "rope_theta": 10000.0}),
        "qwen2-sliding": lambda: Qwen2Config(**base, use_sliding_window=True, sliding_window=6, max_window_layers=1),
        "qwen3-qknorm": lambda: Qwen3Config(**base, head_dim=32),
        "mistral-sliding": lambda: MistralConfig(**base, sliding_window=6),
        "gemma": lambda: GemmaConfig(**base, head_dim=16),
        "gpt2-generic": lambda: GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                           bos_token_id=0, eos_token_id=0),
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs[kind]()).eval().requires_grad_(False)
    with torch.no_grad():  # opinionated logits, and norm weights away from their init
        for p in model.parameters():
            p.normal_(0.0, 0.15 if p.dim() == 2 else 0.3)
    return Target(name=kind, path=None, model=model, tokenizer=tiny_tokenizer())


@pytest.mark.parametrize("kind", ["llama3-tied-bias", "qwen2-sliding", "qwen3-qknorm", "mistral-sliding",
                                  "gemma", "gpt2-generic"])
def test_runner_matches_hf_forward_on_each_family(kind):
    target = _arch_target(kind)
    n_layers = target.num_layers
    runner = TargetRunner(target, max_batch=1, max_len=64,
                          feature_spec=FeatureSpec(hidden=True, aux_layers=(0, 1, n_layers)))
    assert runner.impl == ("generic" if kind.endswith("generic") else "lean")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(300, (12,), generator=gen)  # longer than the sliding windows (6)
    with torch.no_grad():
        ref = target.model(input_ids=prompt[None], output_hidden_states=True)
    logits, feats = runner.prefill(0, prompt)
    torch.testing.assert_close(logits, ref.logits[0, -1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(feats["hidden"], ref.hidden_states[-1][0], atol=ATOL, rtol=1e-4)
    want_aux = torch.cat([ref.hidden_states[i][0] for i in (0, 1, n_layers)], dim=-1)
    torch.testing.assert_close(feats["aux"], want_aux, atol=ATOL, rtol=1e-4)

    tree = random_tree(gen, root=int(logits.argmax()), n=9, vocab=300)
    tree_logits, tree_feats = runner.verify([0], tree, [12])
    parents = tree.parents[0].tolist()
    for node in range(tree.num_nodes):
        path_tokens = tree.tokens[0, root_path(parents, node)]
        with torch.no_grad():
            full = target.model(input_ids=torch.cat([prompt, path_tokens])[None], output_hidden_states=True)
        torch.testing.assert_close(tree_logits[0, node], full.logits[0, -1], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(tree_feats["hidden"][0, node], full.hidden_states[-1][0, -1], atol=ATOL, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Verification == sequential decoding; compaction == a plain run's cache
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["lean", "generic"])
def test_tree_verification_equals_sequential_decoding(tiny_target, impl):
    runner = TargetRunner(tiny_target, max_batch=3, max_len=64, impl=impl)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(256, (7,), generator=gen), torch.randint(256, (13,), generator=gen)]
    roots, trees = [], []
    for slot, prompt in enumerate(prompts):  # ragged prompts in slots 0 and 1
        logits, _ = runner.prefill(slot, prompt)
        trees.append(random_tree(gen, int(logits.argmax()), n=6 + 5 * slot, vocab=256))
    batch = stack_trees(trees)                                 # widths 6 and 11, padded
    logits, _ = runner.verify([0, 1], batch, [7, 13])          # [2, 11, V]
    for b, (prompt, tree) in enumerate(zip(prompts, trees)):
        parents = tree.parents[0].tolist()
        runner.prefill(2, prompt)  # slot 2: the same sequence, decoded one token at a time
        leaves = [i for i in range(tree.num_nodes) if i not in parents]
        for leaf in leaves:  # every node lies on some leaf's root path
            for j, node in enumerate(root_path(parents, leaf)):
                step_logits, _ = runner.prefill(2, [int(tree.tokens[0, node])], start=len(prompt) + j)
                torch.testing.assert_close(logits[b, node], step_logits, atol=ATOL, rtol=1e-4)
                assert int(logits[b, node].argmax()) == int(step_logits.argmax())


def _bf16_kernels_missing() -> str | None:
    from specdec.infer.models import attention_cpu, glue_cpu
    from specdec.infer.models.linear import NATIVE_BF16_KERNEL

    for kernel in (attention_cpu.KERNEL, glue_cpu.KERNEL, NATIVE_BF16_KERNEL):
        if kernel.unavailable_reason() is not None:
            return f"{kernel.what}: {kernel.unavailable_reason()}"
    return None


@pytest.mark.skipif(_bf16_kernels_missing() is not None,
                    reason=f"needs the AVX512-BF16 CPU kernels ({_bf16_kernels_missing()})")
def test_bf16_tree_verification_equals_sequential_decoding_bit_for_bit():
    """On the CPU kernels each row gets the same bits at any row count and a tree node the bits of
    its token decoded alone, so bf16 speculation is exact. Shown on the embedded SmolLM2 (30
    layers: a sum taken in another order shows in its bf16 logits; the tiny targets round it away)."""
    from specdec.infer.target import load_target

    target = load_target("smollm2-135m", dtype="bfloat16")
    runner = TargetRunner(target, max_batch=2, max_len=160, impl="lean")
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(target.vocab_size, (90,), generator=gen)
    logits, _ = runner.prefill(0, prompt)
    tree = random_tree(gen, int(logits.argmax()), n=13, vocab=target.vocab_size)
    tree_logits, _ = runner.verify([0], tree, [len(prompt)])
    parents, differ = tree.parents[0].tolist(), 0
    for node in range(tree.num_nodes):
        runner.prefill(1, prompt)
        for j, on_path in enumerate(root_path(parents, node)):  # one token at a time
            step_logits, _ = runner.prefill(1, [int(tree.tokens[0, on_path])], start=len(prompt) + j)
        differ += int((tree_logits[0, node] != step_logits).sum())
    assert differ == 0


def test_read_groups_split_the_batch_by_context_length(tiny_target):
    runner = TargetRunner(tiny_target, max_batch=6, max_len=64)
    access = StepAccess(runner.cache, [4, 0, 1, 5], [40, 3, 38, 4], 2)
    groups = access.read_groups()
    assert [(g.rows.tolist(), g.length) for g in groups] == [([0, 2], 42), ([1, 3], 6)]
    assert isinstance(groups[0].slots, torch.Tensor) and groups[0].slots.tolist() == [4, 1]
    assert groups[1].slots.tolist() == [0, 5]
    keys, _ = access.read_group(0, groups[0])
    assert keys.shape[0] == 2 and keys.shape[2] == 42
    even = StepAccess(runner.cache, [2, 3], [30, 29], 3).read_groups()  # similar lengths: one group
    assert len(even) == 1 and even[0].rows is None and even[0].slots == slice(2, 4) and even[0].length == 33
    # Consecutive slots: one view unless the split reads much less (a gathered group is copied first).
    view = StepAccess(runner.cache, [0, 1, 2, 3], [40, 3, 38, 4], 2).read_groups()
    assert len(view) == 1 and view[0].slots == slice(0, 4)
    split = StepAccess(runner.cache, [0, 1, 2, 3, 4], [50, 3, 4, 5, 6], 2).read_groups()
    assert [(g.rows.tolist(), g.slots, g.length) for g in split] == [([0], slice(0, 1), 52),
                                                                     ([1, 2, 3, 4], slice(1, 5), 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_length_grouped_attention_equals_one_row_at_a_time(tiny_target_dir, dtype):
    """A ragged batch in scattered slots (attention split into length groups) scores every tree
    node as the same row verified alone does."""
    from specdec.infer.target import load_target

    target = load_target(str(tiny_target_dir), dtype=dtype)  # its own copy: the shared fixture stays fp32
    runner = TargetRunner(target, max_batch=5, max_len=96, impl="lean")
    alone = TargetRunner(target, max_batch=1, max_len=96, impl="lean")
    gen = torch.Generator().manual_seed(4)
    lengths, slots = [50, 4, 45, 6], [3, 0, 4, 1]
    prompts = [torch.randint(256, (n,), generator=gen) for n in lengths]
    trees = []
    for slot, prompt in zip(slots, prompts):
        logits, _ = runner.prefill(slot, prompt)
        trees.append(random_tree(gen, int(logits.argmax()), n=5, vocab=256))
    access = StepAccess(runner.cache, slots, lengths, 5)
    assert len(access.read_groups()) == 2
    batch_logits, _ = runner.verify(slots, stack_trees(trees), lengths)
    tol = dict(atol=ATOL, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    for b, (prompt, tree) in enumerate(zip(prompts, trees)):
        alone.prefill(0, prompt)
        one, _ = alone.verify([0], tree, [len(prompt)])
        torch.testing.assert_close(batch_logits[b], one[0], **tol)


@pytest.mark.parametrize("impl", ["lean", "generic"])
def test_commit_leaves_the_cache_of_a_plain_run(tiny_target, impl):
    spec = FeatureSpec(hidden=True, aux_layers=(2,))
    runner = TargetRunner(tiny_target, max_batch=2, max_len=64, impl=impl, feature_spec=spec)
    plain = TargetRunner(tiny_target, max_batch=1, max_len=64, impl=impl)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(256, (9,), generator=gen)
    runner.prefill(1, torch.randint(256, (5,), generator=gen))  # a neighbour in slot 0 ...
    logits, _ = runner.prefill(0, prompt)
    other = random_tree(gen, 3, n=5, vocab=256)
    tree = random_tree(gen, int(logits.argmax()), n=12, vocab=256)
    runner.verify([0, 1], stack_trees([tree, other]), [9, 5])
    parents = tree.parents[0].tolist()
    leaf = max(range(tree.num_nodes), key=lambda i: len(root_path(parents, i)))
    nodes = root_path(parents, leaf)                           # root ... deepest node
    path = torch.tensor([nodes + [-1]])                        # padded like greedy_accept's
    runner.commit([0], [9], path, torch.tensor([len(nodes) - 1]))

    plain.prefill(0, torch.cat([prompt, tree.tokens[0, nodes]]))
    end = 9 + len(nodes)
    for layer in range(runner.cache.num_layers):
        torch.testing.assert_close(runner.cache.k[layer][0, :, :end], plain.cache.k[layer][0, :, :end], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(runner.cache.v[layer][0, :, :end], plain.cache.v[layer][0, :, :end], atol=ATOL, rtol=1e-4)
    nxt_a, _ = runner.prefill(0, [7], start=end)               # decoding goes on identically
    nxt_b, _ = plain.prefill(0, [7], start=end)
    torch.testing.assert_close(nxt_a, nxt_b, atol=ATOL, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Plain greedy == HF generate(); prefill variants agree
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["lean", "generic"])
def test_plain_greedy_equals_hf_generate(tiny_target, impl):
    prompt = tiny_target.tokenizer("The quick brown fox")["input_ids"]
    with torch.no_grad():
        ref = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    runner = TargetRunner(tiny_target, max_batch=1, max_len=128, impl=impl)
    logits, _ = runner.prefill(0, prompt)
    out = [int(logits.argmax())]
    while len(out) < 32:
        one = DraftTree(tokens=torch.tensor([[out[-1]]]), parents=torch.tensor([[-1]]),
                        valid=torch.ones(1, 1, dtype=torch.bool))
        logits, _ = runner.verify([0], one, [len(prompt) + len(out) - 1])
        out.append(int(logits[0, 0].argmax()))
    assert out == ref


@pytest.mark.parametrize("impl", ["lean", "generic"])
def test_batched_and_chunked_prefill_match_single(tiny_target, impl):
    spec = FeatureSpec(hidden=True, aux_layers=(0, 3))
    runner = TargetRunner(tiny_target, max_batch=4, max_len=64, feature_spec=spec, impl=impl)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(256, (n,), generator=gen) for n in (3, 17, 9)]
    for t in runner.cache.layers():  # stale entries past a short row's end must not leak into it
        t.normal_(0, 30, generator=gen)
    logits, feats = runner.prefill_batch([0, 1, 2], prompts)
    for b, prompt in enumerate(prompts):
        single, single_feats = runner.prefill(3, prompt)
        torch.testing.assert_close(logits[b], single, atol=ATOL, rtol=1e-4)
        for k in ("hidden", "aux"):
            torch.testing.assert_close(feats[b][k], single_feats[k], atol=ATOL, rtol=1e-4)
    chunks = [prompts[1][:5], prompts[1][5:11], prompts[1][11:]]
    start = 0
    for chunk in chunks:
        chunk_logits, _ = runner.prefill(3, chunk, start=start)
        start += len(chunk)
    torch.testing.assert_close(chunk_logits, logits[1], atol=ATOL, rtol=1e-4)


def test_prefill_in_pieces_matches_one_forward(tiny_target):
    """A backend that bounds a forward's tokens (``prefill_piece``, the bf16 CPU kernel's) gets a
    ragged batch in pieces: logits of each last token, all features and the cache as in one
    forward, a sequence that ends before the last piece included."""
    spec = FeatureSpec(hidden=True, aux_layers=(0, 3))
    whole = TargetRunner(tiny_target, max_batch=3, max_len=64, feature_spec=spec, impl="lean")
    pieces = TargetRunner(tiny_target, max_batch=3, max_len=64, feature_spec=spec, impl="lean")
    pieces.backend.prefill_piece = 8
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(256, (n,), generator=gen) for n in (21, 5, 16)]
    want, want_feats = whole.prefill_batch([0, 1, 2], prompts, [0, 0, 0])
    widths, forward = [], pieces.backend.forward
    pieces.backend.forward = lambda tokens, *a, **k: widths.append(tokens.shape) or forward(tokens, *a, **k)
    got, got_feats = pieces.prefill_batch([0, 1, 2], prompts, [0, 0, 0])
    assert widths == [(3, 8), (2, 8), (1, 5)]  # the 5-token prompt leaves after the first piece
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    for b, n in enumerate((21, 5, 16)):
        for k in ("hidden", "aux"):
            assert got_feats[b][k].shape[0] == n
            torch.testing.assert_close(got_feats[b][k], want_feats[b][k], atol=ATOL, rtol=1e-4)
    for mine, theirs in zip(pieces.cache.layers(), whole.cache.layers()):
        for slot, n in enumerate((21, 5, 16)):
            torch.testing.assert_close(mine[slot, :, :n], theirs[slot, :, :n], atol=ATOL, rtol=1e-4)


def test_runner_errors_are_named(tiny_target):
    runner = TargetRunner(tiny_target, max_batch=1, max_len=16)
    with pytest.raises(CacheFullError, match="max_len=16"):
        runner.prefill(0, list(range(17)))
    with pytest.raises(ValueError, match="slots"):
        runner.prefill(1, [1, 2])
    runner.feature_spec = FeatureSpec(hidden=True, aux_layers=(9,))
    with pytest.raises(ValueError, match="aux_layers"):
        runner.prefill(0, [1, 2])
    with pytest.raises(ValueError, match="dtype"):
        TargetRunner(tiny_target, dtype="float8")
