"""Training-free drafters (pld, lookahead, rest, hybrid) and the REST datastore.

Proposals are checked directly against the Drafter protocol; losslessness through the engine:
greedy output equals plain greedy on the tiny target, batch 1 and batch 4 with ragged prompts.
"""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from specdec.heads.base import FeatureSpec
from specdec.heads.tree import DraftTree, TreeBudget
from specdec.infer.datastore import (Datastore, DatastoreError, build_datastore, build_suffix_array,
                                     default_datastore)
from specdec.infer.gate import EXPLORE_COST, ThroughputGate
from specdec.infer.drafters.hybrid import (FLOWING, HEAD, TRUSTED_COPY, NodeCost, SourceGate, expected_length,
                                          regime_of)
from specdec.infer.drafters.hybrid import HybridDrafter
from specdec.infer.drafters.lookahead import LookaheadDrafter
from specdec.infer.drafters.pld import (BASE_DRAFT_LEN, CPU_MATCH_FLOOR, CandidateTrie, PLDDrafter, find_matches,
                                        match_acceptance)
from specdec.infer.drafters.rest import RESTDrafter

BUDGET = TreeBudget(max_nodes=12, max_depth=5, topk=4)


class IdTokenizer:
    """Stands in for a tokenizer where only the vocabulary identity matters."""

    def __init__(self, vocab: int = 100, name: str = "ids"):
        self.vocab, self.name_or_path = vocab, name

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.vocab)}


def paths_of(tree: DraftTree, b: int = 0) -> set[tuple[int, ...]]:
    """Every root-to-node token path of row b (root excluded)."""
    toks, par, valid = tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.valid[b].tolist()
    paths: dict[int, tuple] = {0: ()}
    for i in range(1, len(toks)):
        if valid[i]:
            paths[i] = paths[par[i]] + (toks[i],)
    return set(paths.values()) - {()}


def check_tree(tree: DraftTree, roots, budget: TreeBudget) -> None:
    tree.validate()
    assert tree.tokens[:, 0].tolist() == list(roots)
    depth, _ = tree.masks()
    assert (tree.valid.sum(1) - 1 <= budget.max_nodes).all()
    assert int(depth[tree.valid].max()) <= budget.max_depth
    assert tree.draft_probs is None


# ---------------------------------------------------------------------------- PLD


def test_pld_copies_the_continuation_of_the_matching_ngram():
    d = PLDDrafter(max_ngram=3)
    d.reset(2, 64)
    #           the cat sat on the mat . the cat -> root "sat"
    prompt = [10, 11, 12, 13, 10, 14, 15, 10, 11]
    d.prefill(0, torch.tensor(prompt), {})
    tree = d.propose(torch.tensor([0]), torch.tensor([12]), BUDGET)
    check_tree(tree, [12], BUDGET)
    assert tree.top_path(0)[:5] == [12, 13, 10, 14, 15]  # "sat on the mat ." copied


def test_pld_merges_several_matches_most_recent_first():
    # "a b" is followed by c (older) and by d (recent): both children of b, d ranked first.
    seq = np.array([1, 2, 3, 9, 1, 2, 4, 9, 1, 2])
    conts = find_matches(seq, max_ngram=2, min_ngram=1, length=3, max_matches=4)
    assert conts[0] == (2, [4, 9, 1]) and conts[1] == (2, [3, 9, 1])
    d = PLDDrafter(max_ngram=2)
    d.prefill(3, torch.tensor(seq[:-1].tolist()), {})
    tree = d.propose(torch.tensor([3]), torch.tensor([2]), TreeBudget(8, 3, 4))
    check_tree(tree, [2], TreeBudget(8, 3, 4))
    paths = paths_of(tree)
    assert (4, 9, 1) in paths and (3, 9, 1) in paths
    assert tree.top_path(0) == [2, 4, 9, 1]
    # the shared "9 1 ..." tails stay separate branches, the shared root children are deduped
    assert sum(1 for p in paths if len(p) == 1) == len({p[0] for p in paths})


def test_pld_respects_the_budget_and_follows_commits():
    d = PLDDrafter(max_ngram=3, max_matches=8)
    d.reset(1, 128)
    d.prefill(0, torch.arange(20).repeat(3), {})  # strongly periodic
    tight = TreeBudget(max_nodes=3, max_depth=2, topk=2)
    tree = d.propose(torch.tensor([0]), torch.tensor([0]), tight)
    check_tree(tree, [0], tight)
    assert tree.top_path(0) == [0, 1, 2]
    d.commit(0, torch.tensor([0, 1, 2]), {})
    assert d.propose(torch.tensor([0]), torch.tensor([3]), tight).top_path(0) == [3, 4, 5]


def test_pld_drafts_deeper_while_the_copy_flows():
    """A step that accepts the whole best match doubles the next draft's depth (up to the
    budget's); a step that rejects part of it goes back to the base length."""
    d = PLDDrafter(max_ngram=3, max_matches=1, draft_len=3)
    d.reset(1, 256)
    d.prefill(0, torch.arange(40).repeat(2)[:-30], {})  # 0..39 then 0..9: copying 10, 11, ...
    deep = TreeBudget(max_nodes=12, max_depth=8, topk=4)
    assert d.propose(torch.tensor([0]), torch.tensor([10]), deep).top_path(0) == [10, 11, 12, 13]
    d.commit(0, torch.tensor([10, 11, 12, 13]), {})  # all 3 drafts accepted
    assert d.propose(torch.tensor([0]), torch.tensor([14]), deep).top_path(0) == list(range(14, 21))
    d.commit(0, torch.tensor([14, 15, 16, 17, 18, 19, 20]), {})  # all 6 again: 12, capped at 8
    assert d.propose(torch.tensor([0]), torch.tensor([21]), deep).top_path(0) == list(range(21, 30))
    d.commit(0, torch.tensor([21, 22]), {})  # the copy broke after one token
    assert d.propose(torch.tensor([0]), torch.tensor([23]), deep).top_path(0) == [23, 24, 25, 26]
    d.commit(0, torch.tensor([23, 24, 25, 26]), {})  # flowing again ...
    d.commit(0, torch.tensor([27, 28]), {})  # ... then plain steps (nothing drafted): stale
    assert d.propose(torch.tensor([0]), torch.tensor([29]), deep).top_path(0) == [29, 30, 31, 32]
    d.commit(0, torch.tensor([29, 30, 31, 32]), {})
    d.prefill(0, torch.arange(40).repeat(2)[:-30], {})  # a new request starts at the base length
    assert d.propose(torch.tensor([0]), torch.tensor([10]), deep).top_path(0) == [10, 11, 12, 13]


def test_match_acceptance_trusts_longer_ngrams_earlier_ranks_and_shallower_tokens():
    assert match_acceptance(3, 0, 1) > match_acceptance(2, 0, 1) > match_acceptance(1, 0, 1)
    assert match_acceptance(5, 0, 1) == match_acceptance(3, 0, 1)  # longer n-grams count as 3
    for n in (1, 2, 3):
        assert match_acceptance(n, 0, 2) < match_acceptance(n, 0, 1)
        assert match_acceptance(n, 1, 1) < match_acceptance(n, 0, 1)


def test_pld_leaves_out_match_tokens_estimated_under_the_floor():
    """On CPU a 1-gram guess stops after the tokens worth verifying (2 at 0.22, 0.13, then 0.08
    under 0.1), a 3-gram match runs the base length, min_score 0 cuts nothing, and accepting what
    was drafted of a cut match lets the copy flow."""
    one_gram = [7, 20, 21, 22, 23, 24, 25, 26, 8, 9]  # root 7 matches only the 1-gram "7"
    worth = sum(1 for d in range(1, BASE_DRAFT_LEN + 1) if match_acceptance(1, 0, d) >= CPU_MATCH_FLOOR)
    assert 0 < worth < BASE_DRAFT_LEN
    deep = TreeBudget(max_nodes=12, max_depth=12, topk=4)
    cut, uncut = PLDDrafter(max_matches=1), PLDDrafter(max_matches=1, min_score=0.0)
    for d in (cut, uncut):
        d.reset(1, 64)
        d.prefill(0, torch.tensor(one_gram))
    assert cut.floor("cpu") == CPU_MATCH_FLOOR and cut.floor("meta") == 0.0 and uncut.floor("cpu") == 0.0
    assert cut.propose(torch.tensor([0]), torch.tensor([7]), deep).top_path(0) == [7] + one_gram[1:1 + worth]
    assert uncut.propose(torch.tensor([0]), torch.tensor([7]), deep).top_path(0) == [7] + one_gram[1:1 + BASE_DRAFT_LEN]
    cut.commit(0, torch.tensor([7] + one_gram[1:1 + worth]))  # all of the cut match accepted
    assert cut.flowing(0)
    three_gram = PLDDrafter(max_matches=1)
    three_gram.reset(1, 64)
    three_gram.prefill(0, torch.tensor([1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 1, 2]))
    assert three_gram.propose(torch.tensor([0]), torch.tensor([3]), deep).top_path(0) == [3, 40, 41, 42, 43, 44, 45]
    with pytest.raises(ValueError, match="min_score"):
        PLDDrafter(min_score=1.5)


def test_hybrid_pld_only_rows_get_plds_own_cut_tree():
    """With the default floors, a row only PLD drafted for is PLD's tree with its 1-gram guesses cut."""
    prompt = torch.tensor([5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 7, 7, 7, 1, 2, 9, 9])
    budget = TreeBudget(max_nodes=8, max_depth=12, topk=4)
    alone, d = PLDDrafter(max_ngram=2), HybridDrafter(None, PLDDrafter(max_ngram=2), adaptive=False)
    for x in (alone, d):
        x.reset(1, 64)
        x.prefill(0, prompt, {})
    mine, theirs = (x.propose(torch.tensor([0]), torch.tensor([4]), budget) for x in (d, alone))
    assert paths_of(mine) == paths_of(theirs) and len(paths_of(theirs)) < BASE_DRAFT_LEN  # a 1-gram match, cut


def test_empty_prompt_still_proposes_a_valid_tree():
    for d in (PLDDrafter(), LookaheadDrafter()):
        d.reset(1, 32)
        d.prefill(0, torch.zeros(0, dtype=torch.long), {})
        tree = d.propose(torch.tensor([0]), torch.tensor([7]), BUDGET)
        check_tree(tree, [7], BUDGET)
        d.commit(0, torch.tensor([7]), {})
        check_tree(d.propose(torch.tensor([0]), torch.tensor([8]), BUDGET), [8], BUDGET)


# ---------------------------------------------------------------------------- lookahead


def test_lookahead_verification_branch_comes_from_the_ngram_pool():
    d = LookaheadDrafter(window=4, ngram=3, guess_set=3)
    d.reset(1, 64)
    d.prefill(0, torch.tensor([5, 6, 7, 1, 5, 8, 9]), {})
    tree = d.propose(torch.tensor([0]), torch.tensor([5]), BUDGET)
    check_tree(tree, [5], BUDGET)
    paths = paths_of(tree)
    assert (8, 9) in paths and (6, 7) in paths          # both 3-grams that start with 5
    assert tree.top_path(0)[:3] == [5, 8, 9]             # the most recent one first
    # committed tokens add their n-grams: 9 -> (3, 4) becomes available
    d.commit(0, torch.tensor([5, 9, 3, 4]), {})
    assert (3, 4) in paths_of(d.propose(torch.tensor([0]), torch.tensor([9]), BUDGET))


def test_lookahead_window_shifts_by_the_committed_tokens():
    d = LookaheadDrafter(window=4, ngram=2, guess_set=2)
    d.prefill(0, torch.tensor([1, 2]), {})
    d.guesses[0] = [11, 12, 13, 14]
    d.commit(0, torch.tensor([3, 11]), {})              # root + one accepted guess
    assert d.guesses[0][:2] == [13, 14] and len(d.guesses[0]) == 4


# ---------------------------------------------------------------------------- datastore + REST


def test_suffix_array_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.integers(-1, 4, size=int(rng.integers(1, 40)))
        assert build_suffix_array(a).tolist() == sorted(range(len(a)), key=lambda i: a[i:].tolist())
    for _ in range(10):  # long repeats: many doubling rounds, most suffixes settled early
        a = np.tile(rng.integers(0, 3, size=int(rng.integers(1, 9))), int(rng.integers(2, 30)))
        a = np.concatenate([a, rng.integers(-1, 3, size=5)])
        assert build_suffix_array(a).tolist() == sorted(range(len(a)), key=lambda i: a[i:].tolist())


@pytest.fixture
def store(tmp_path):
    docs = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [7, 1, 2, 6], [9]]
    return Datastore.load(build_datastore(docs, tmp_path / "ds", IdTokenizer(), ["docs"]), IdTokenizer())


def test_datastore_round_trip_and_lookup(store):
    assert store.header["num_documents"] == 5 and len(store) == 5 * 1 + 17
    assert isinstance(store.tokens, np.memmap) and isinstance(store.suffix_array, np.memmap)
    m, cont = store.lookup([0, 0, 1, 2, 3], depth=3)       # longest suffix found: [1 2 3]
    assert m == 3
    assert sorted(map(tuple, cont.tolist())) == [(4, -1, -1), (4, -1, -1), (5, -1, -1)]
    m, cont = store.lookup([8, 2], depth=2)                # falls back to the 1-gram [2]
    assert m == 1 and sorted(map(tuple, cont.tolist())) == [(3, 4), (3, 4), (3, 5), (6, -1)]
    assert store.lookup([42], depth=2)[1].shape == (0, 2)  # unknown token: nothing


def test_rest_tree_ranks_continuations_by_frequency(store):
    d = RESTDrafter(store)
    d.reset(1, 32)
    d.prefill(0, torch.tensor([1, 2]), {})
    tree = d.propose(torch.tensor([0]), torch.tensor([3]), BUDGET)
    check_tree(tree, [3], BUDGET)
    assert paths_of(tree) == {(4,), (5,)}
    scores = dict(zip(tree.tokens[0, 1:].tolist(), tree.scores[0, 1:].tolist()))
    assert scores[4] == pytest.approx(2 / 3) and scores[5] == pytest.approx(1 / 3)
    assert tree.top_path(0) == [3, 4]


def test_corrupt_or_foreign_datastore_is_a_clear_error(store, tmp_path):
    with pytest.raises(DatastoreError, match="not a REST datastore"):
        Datastore.load(tmp_path / "nothing")
    with pytest.raises(DatastoreError, match="built with tokenizer"):
        Datastore.load(store.path, IdTokenizer(vocab=99, name="other"))
    header = json.loads((store.path / "header.json").read_text())
    (store.path / "header.json").write_text("{not json")
    with pytest.raises(DatastoreError, match="corrupt header"):
        Datastore.load(store.path)
    (store.path / "header.json").write_text(json.dumps(header))
    sa_file, sa = store.path / "suffix_array.npy", np.array(store.suffix_array)
    raw = sa_file.read_bytes()
    sa_file.write_bytes(raw[:len(raw) - 16])                 # truncated
    with pytest.raises(DatastoreError, match="suffix_array.npy"):
        Datastore.load(store.path)
    np.save(sa_file, sa[::-1].copy())                       # right shape, entries out of order
    with pytest.raises(DatastoreError, match="out of range or out of order"):
        Datastore.load(store.path)


def test_default_datastore_is_built_once_over_the_bundled_prompts(tiny_target, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"question": "2 + 2?", "answer": "It is 4.\n#### 4"}) + "\n")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("specdec.infer.datastore.default_corpus_files", lambda: [corpus])
    first = default_datastore(tiny_target)
    assert first.header["num_documents"] == 1 and str(first.path).startswith(str(tmp_path / "cache"))
    stamp = (first.path / "tokens.npy").stat().st_mtime_ns
    assert default_datastore(tiny_target).path == first.path
    assert (first.path / "tokens.npy").stat().st_mtime_ns == stamp  # cached, not rebuilt


def test_datastore_subcommand(tiny_target_dir, tmp_path, capsys):
    from specdec.train.data_cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello there"}]}) + "\n")
    assert main(["datastore", "--target", str(tiny_target_dir), "--data", str(corpus),
                 "--out", str(tmp_path / "ds")]) == 0
    assert Datastore.load(tmp_path / "ds").header["num_documents"] == 1
    assert main(["datastore", "--target", str(tiny_target_dir), "--data", str(tmp_path / "missing.jsonl"),
                 "--out", str(tmp_path / "ds2")]) == 2
    assert "datastore: tokenise" in capsys.readouterr().err  # progress while a corpus is tokenised
    corpus.write_text(corpus.read_text() + "{not json\n")
    assert main(["datastore", "--target", str(tiny_target_dir), "--data", str(corpus),
                 "--out", str(tmp_path / "ds3")]) == 0
    assert "skipped 1 malformed" in capsys.readouterr().err
    assert main(["datastore", "--target", str(tiny_target_dir), "--data", str(corpus), "--on-error", "fail",
                 "--out", str(tmp_path / "ds4")]) == 2
    assert f"{corpus}:2" in capsys.readouterr().err


def test_datastore_refuses_an_out_folder_that_holds_other_files(tmp_path):
    docs = [[1, 2, 3, 4]]
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    with pytest.raises(DatastoreError, match="holds files but no datastore"):
        build_datastore(docs, keep, IdTokenizer())
    assert (keep / "notes.txt").read_text() == "precious"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DatastoreError, match="is a file"):
        build_datastore(docs, tmp_path / "afile", IdTokenizer())
    built = build_datastore(docs, tmp_path / "ds", IdTokenizer())  # a datastore is rebuilt in place
    assert build_datastore(docs + [[5, 6]], built, IdTokenizer()) == built
    assert Datastore.load(built).header["num_documents"] == 2
    assert not list(tmp_path.glob("*.partial*"))


# ---------------------------------------------------------------------------- hybrid


class FixedHead:
    """A head drafter that always proposes root -> 50 -> 51 and root -> 60, with confidences."""

    feature_spec = FeatureSpec(hidden=True)

    def __init__(self):
        self.commits = []

    def reset(self, max_batch, max_len): pass
    def prefill(self, slot, token_ids, features): pass
    def release(self, slot): pass

    def commit(self, slot, token_ids, features):
        self.commits.append(token_ids.tolist())

    def propose(self, slots, roots, budget):
        B = len(roots)
        tokens = torch.tensor([[0, 50, 51, 60]] * B)
        tokens[:, 0] = roots
        return DraftTree(tokens=tokens, parents=torch.tensor([[-1, 0, 1, 0]] * B),
                         valid=torch.ones(B, 4, dtype=torch.bool),
                         scores=torch.tensor([[1.0, 0.6, 0.5, 0.3]] * B))


def test_hybrid_merges_head_and_retrieval_within_the_budget(store):
    head = FixedHead()  # PLD uncut (min_score 0): its 1-gram match below must be able to run deep
    d = HybridDrafter(head, PLDDrafter(max_ngram=2, min_score=0.0), RESTDrafter(store))
    d.reset(2, 64)
    d.prefill(0, torch.tensor([3, 20, 21, 22, 23, 1, 2]), {"hidden": torch.zeros(7, 4)})
    budget = TreeBudget(max_nodes=6, max_depth=4, topk=4)
    tree = d.propose(torch.tensor([0]), torch.tensor([3]), budget)
    check_tree(tree, [3], budget)
    paths = paths_of(tree)
    assert (50,) in paths and (20,) in paths and (4,) in paths   # head, PLD and REST all present
    assert len(paths) == 6
    # PLD's continuation keeps being committed -> its estimated acceptance rises above the
    # head's confidence and PLD's deeper nodes win the budget.
    before = d.estimate.rate("pld")
    for _ in range(6):
        d.propose(torch.tensor([0]), torch.tensor([3]), budget)
        d.commit(0, torch.tensor([3, 20, 21]), {"hidden": torch.zeros(3, 4)})
        d.prefill(0, torch.tensor([3, 20, 21, 22, 23, 1, 2]), {"hidden": torch.zeros(7, 4)})
    assert d.estimate.rate("pld") > before and d.estimate.rate("head") < 0.5
    tree = d.propose(torch.tensor([0]), torch.tensor([3]), budget)
    assert tree.top_path(0)[:4] == [3, 20, 21, 22]
    assert head.commits and head.commits[0] == [3, 20, 21]      # sub-drafters see every commit


def test_hybrid_keeps_a_flowing_copy_deep_and_learns_its_own_rate():
    """Once PLD's whole chain was accepted, the hybrid tags the deeper chain as the flowing
    source, scores it by its own alpha, and learns that alpha from it."""
    d = HybridDrafter(None, PLDDrafter(max_ngram=3, max_matches=1), adaptive=False, min_score=0.0)
    d.reset(1, 256)
    d.prefill(0, torch.arange(40).repeat(2)[:-30], {})  # 0..39 then 0..9: copying 10, 11, ...
    budget = TreeBudget(max_nodes=12, max_depth=12, topk=4)
    first = d.propose(torch.tensor([0]), torch.tensor([10]), budget)
    assert first.top_path(0) == list(range(10, 17))  # PLD's base depth, 6
    assert d.last_trie[0].sources[1] == {"pld"}
    d.commit(0, torch.tensor(list(range(10, 17))), {})
    deep = d.propose(torch.tensor([0]), torch.tensor([17]), budget)
    assert deep.top_path(0) == list(range(17, 30))  # 12 deep now
    assert all(src == {FLOWING} for src in d.last_trie[0].sources[1:])
    pld_rate, before = d.estimate.rate("pld"), d.estimate.rate(FLOWING)
    d.commit(0, torch.tensor(list(range(17, 30))), {})
    assert d.estimate.rate(FLOWING) > before and d.estimate.rate("pld") == pld_rate


def test_hybrid_rows_only_pld_drafted_for_get_plds_own_tree():
    """Without another source's nodes the hybrid proposes what PLD alone would: the best match
    as deep as PLD drafts it, ranked by PLD, however low alpha ** depth would score it."""
    prompt = torch.tensor([5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 7, 7, 7, 1, 2, 9, 9])
    budget = TreeBudget(max_nodes=8, max_depth=12, topk=4)
    alone = PLDDrafter(max_ngram=2, min_score=0.0)  # uncut: the chain runs the base length
    alone.reset(1, 64)
    alone.prefill(0, prompt)
    d = HybridDrafter(None, PLDDrafter(max_ngram=2, min_score=0.0), adaptive=False, min_score=0.2)
    d.reset(1, 64)
    d.prefill(0, prompt, {})
    mine, theirs = (x.propose(torch.tensor([0]), torch.tensor([1]), budget) for x in (d, alone))
    assert paths_of(mine) == paths_of(theirs)
    assert max(len(p) for p in paths_of(mine)) == BASE_DRAFT_LEN  # 0.5 ** 3 < 0.2 would cut it at 2


def test_hybrid_rates_learn_from_the_merged_cut_not_from_plds_deeper_tree():
    """PLD's rate weighs it against the head's confidences, so it is learnt from the nodes the
    merged cut keeps (2 here), not from the deeper chain verified when PLD drafts alone: learnt
    from that, accepted long copies would inflate it."""
    d = HybridDrafter(None, PLDDrafter(max_ngram=3, max_matches=1), adaptive=False, min_score=0.2)
    d.reset(1, 256)
    d.prefill(0, torch.arange(40).repeat(2)[:-30], {})  # 0..39 then 0..9: copying 10, 11, ...
    tree = d.propose(torch.tensor([0]), torch.tensor([10]), TreeBudget(max_nodes=12, max_depth=12, topk=4))
    assert tree.top_path(0) == list(range(10, 17))
    d.commit(0, torch.tensor(list(range(10, 17))), {})
    assert d.estimate.trials["pld"] == 2 and d.estimate.hits["pld"] == 2


def test_hybrid_copy_flows_on_the_part_of_the_match_it_kept():
    """A copy cut short next to the head's nodes by the hybrid's node price (0.5 ** depth below
    0.1 after 3 tokens) and accepted whole flows on: PLD drafts it deeper next step, as it would uncut."""
    d = HybridDrafter(FixedHead(), PLDDrafter(max_ngram=3, max_matches=1), adaptive=False, min_score=0.1)
    d.reset(1, 256)
    prompt = torch.arange(40).repeat(2)[:-30]  # 0..39 then 0..9: copying 10, 11, ...
    d.prefill(0, prompt, {"hidden": torch.zeros(len(prompt), 4)})
    budget = TreeBudget(max_nodes=12, max_depth=12, topk=4)
    tree = d.propose(torch.tensor([0]), torch.tensor([10]), budget)
    assert max(paths_of(tree), key=len) == (11, 12, 13)  # 6 drafted, 3 kept
    assert (50, 51) in paths_of(tree)
    d.commit(0, torch.tensor([10, 11, 12, 13]), {"hidden": torch.zeros(4, 4)})
    assert d.pld.flowing(0)
    d.propose(torch.tensor([0]), torch.tensor([14]), budget)
    assert d.last_trie[0].sources[1] == {FLOWING}


def test_hybrid_asks_the_head_only_outside_a_trusted_copy():
    """Once PLD's copy is trusted (its expected length >= 1.5 tokens) the merged tree is the
    copy's: the head is not run there, so it pays neither its drafting nor a gate's exploration."""
    head = FixedHead()
    d = HybridDrafter(head, PLDDrafter(max_ngram=3, max_matches=1), adaptive=False, min_score=0.0)
    d.reset(1, 512)
    prompt = torch.cat([torch.arange(100, 300), torch.arange(100, 110)])  # copying 110, 111, ...
    d.prefill(0, prompt, {"hidden": torch.zeros(len(prompt), 4)})
    budget = TreeBudget(max_nodes=12, max_depth=12, topk=4)
    root, regimes, asked = 110, [], []
    for _ in range(8):
        before = d.head_steps
        tree = d.propose(torch.tensor([0]), torch.tensor([root]), budget)
        regimes.append(regime_of(expected_length(d.last_trie[0])))
        asked.append(d.head_steps > before)
        truth = tuple(range(root + 1, root + 40))  # the text goes on copying: accept the copy
        path = [root, *max((p for p in paths_of(tree) if truth[:len(p)] == p), key=len)]
        d.commit(0, torch.tensor(path), {"hidden": torch.zeros(len(path), 4)})
        root = path[-1] + 1
    assert regimes[0] < TRUSTED_COPY and regimes[-1] == TRUSTED_COPY  # PLD's alpha was learnt
    assert asked == [r < TRUSTED_COPY for r in regimes]
    assert len(head.commits) == 8  # the head still sees every commit
    d.propose(torch.tensor([0]), torch.tensor([7]), budget)  # no match for 7: the head again
    assert d.head_steps == asked.count(True) + 1


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_throughput_gate_plays_the_faster_arm_and_keeps_exploring():
    gate = ThroughputGate(decay=0.9, min_samples=2, explore=6, run=2, clear=0.1)
    arms = []
    for _ in range(60):
        arm = gate.choose(regime=0)
        arms.append(arm)
        # The extra work takes 3x as long for 2x the tokens: it does not pay.
        gate.record(0, arm, tokens=2 if arm else 1, seconds=3.0 if arm else 1.0)
    # No default: the arm doing more work leads first; runs of the other (2 steps, every 6th)
    # are compared with the steps just before them, and 2 pairs this clear hand over the lead.
    assert arms[:3] == [True] * 3 and arms[3:5] == [False, False]
    assert gate.leader[0] is False and gate.relative(0, True) == pytest.approx(2 / 3)
    assert gate.rate(0, False) > gate.rate(0, True)
    # From then on the extra work runs only in the exploration runs: decisions n = 4, 5 (mod 6).
    assert [n for n in range(21, 61) if arms[n - 1]] == [n for n in range(21, 61) if n % 6 >= 4]
    assert gate.rate(1, False) is None and gate.relative(1, True) is None  # regimes are measured apart


def test_throughput_gate_follows_a_default_until_it_has_measured_both_arms():
    gate = ThroughputGate(min_samples=2, explore=8, run=3)
    arms = []
    for _ in range(8):
        arms.append(gate.choose(0, default=False))
        gate.record(0, arms[-1], tokens=1, seconds=1)
    assert arms == [False] * 4 + [True] * 3 + [False]   # the default, an exploration run, back
    # The first step of the run (a switch) was not sampled: 2 samples of the explored arm, one
    # pair (as fast as the leader's last 3 steps), too few to say more.
    assert gate.samples == {(0, False): 4, (0, True): 2}
    assert gate.pairs[(0, True)] == [1.0, 0.0, 0.0] and gate.standing(0, True) is None


def test_throughput_gate_compares_arms_on_the_same_requests():
    """Speculation's tokens per step swing with the request (each runs 20-60 steps and accepts
    1.2-3 tokens a step), plain decoding's do not; the full tree is 12% faster than the models'
    plan on every request. Compared in adjacent pairs, the full tree takes the lead from the
    default and keeps it. (Each arm's own running rate, the easy requests of one against the hard
    ones of another, played it 14-97% of the late steps across seeds.) Over 60 seeds, 1-2 runs fall
    to 82-89% when the noise lifts the models' plan within 2% of the full tree for a while."""
    late_full = []
    for seed in range(5):
        rng = random.Random(seed)
        gate = ThroughputGate(decay=0.95, min_samples=4, explore=32, run=3, clear=0.9, warmup_explore=8,
                              arms=("plain", "model", "full"))
        arms, left = [], 0
        for _ in range(2000):
            if left == 0:
                left, level = rng.randint(20, 60), rng.uniform(1.2, 3.0)
            left -= 1
            arm = gate.choose(0, default="model")
            arms.append(arm)
            tokens = 1.0 if arm == "plain" else level * (1.12 if arm == "full" else 1.0) * rng.uniform(0.6, 1.4)
            gate.record(0, arm, tokens=tokens, seconds=0.03)
        assert gate.leader[0] == "full" and gate.relative(0, "model") < 1.0 and gate.relative(0, "plain") < 1.0
        late_full.append(arms[-1000:].count("full"))
    assert min(late_full) >= 800 and sum(late_full) >= 4500  # the rest: exploration runs


@pytest.mark.parametrize("slow", [0.8, 0.1])
def test_throughput_gate_explores_an_arm_the_rarer_the_slower_it_is(slow):
    """An arm known to be behind is still explored, but its runs never cost more than
    ``EXPLORE_COST`` of the time: at 0.8x the leader's speed every 4th period (as for any arm
    clearly behind), at 0.1x (a full tree at batch 16 on this CPU) ~7x rarer still."""
    gate = ThroughputGate(decay=0.95, min_samples=4, explore=32, run=3, clear=0.9, warmup_explore=8)
    seconds = {False: 1.0, True: 1.0 / slow}  # one token a step either way
    spent = {False: 0.0, True: 0.0}
    runs, prev = 0, False
    for n in range(8000):
        arm = gate.choose(0, default=False)
        runs += arm and n >= 2000 and not prev
        prev = arm
        gate.record(0, arm, tokens=1.0, seconds=seconds[arm])
        if n >= 2000:
            spent[arm] += seconds[arm]
    assert gate.leader[0] is False and gate.relative(0, True) == pytest.approx(slow)
    share = spent[True] / (spent[True] + spent[False])
    assert runs >= 3 and share <= EXPLORE_COST
    if slow == 0.8:
        assert runs == pytest.approx(6000 / (4 * 32), abs=2)  # every 4th period of 32 decisions


def test_throughput_gate_seeded_regime_trusts_its_prior_until_its_own_pairs_disagree():
    """A regime seeded with a prior leads with its fastest arm and trusts the others' standing at
    once (no warm-up exploration); ``speeds`` reports the regime's own pairs only; a challenger
    its own pairs measure faster takes the lead."""
    gate = ThroughputGate(decay=0.95, min_samples=4, explore=32, run=3, clear=0.9, warmup_explore=8,
                          arms=("plain", "model", "full"))
    gate.seed("r", {"plain": 0.0, "model": 0.1, "full": 0.2}, weight=4)
    assert gate.leader["r"] == "full"
    assert gate.relative("r", "plain") == pytest.approx(np.exp(-0.2))
    assert gate.relative("r", "model") == pytest.approx(np.exp(-0.1))
    assert gate.speeds("r", "plain") == {}  # nothing of its own links plain to the leader yet
    first = [gate.choose("r") for _ in range(32)]
    assert first.count("full") >= 29  # the slow pace from the start
    gate.pairs[("r", "plain")] = [8.0, 8 * 0.5, 8 * 0.25]  # its own pairs: plain 1.65x the full tree
    assert gate.speeds("r", "plain") == pytest.approx({"full": -0.5, "plain": 0.0})
    assert gate.choose("r") == "plain" and gate.leader["r"] == "plain"


@pytest.mark.parametrize("head_pays", [False, True])
def test_hybrid_head_gate_learns_from_paired_steps(head_pays):
    """A head costing 10 time units a step whose drafts are never accepted is switched off after
    its first paired samples; a head costing 1 whose two drafts are always accepted (retrieval
    proposes nothing here) stays on: 3 tokens in 3 units beat 1 token in 2."""
    clock = FakeClock()

    class TimedHead(FixedHead):
        def propose(self, slots, roots, budget):
            clock.now += 1.0 if head_pays else 10.0
            return super().propose(slots, roots, budget)

    d = HybridDrafter(TimedHead(), min_score=0.0, clock=clock)  # the head as the only source
    d.reset(1, 256)
    d.prefill(0, torch.tensor([3, 20, 21, 22, 23, 1, 2]), {"hidden": torch.zeros(7, 4)})
    budget = TreeBudget(max_nodes=6, max_depth=4, topk=4)
    for _ in range(60):
        d.propose(torch.tensor([0]), torch.tensor([3]), budget)
        clock.now += 2.0  # verification
        committed = [3, 50, 51] if head_pays else [3]
        d.commit(0, torch.tensor(committed), {"hidden": torch.zeros(len(committed), 4)})
    on, off = d.gates[HEAD].rates(regime_of(0.0))
    assert d.steps == 60 and (on > off) == head_pays
    if head_pays:
        assert d.head_steps == 60
    else:
        assert d.head_steps < 15  # its first samples, then a short run every 24 steps
    with pytest.raises(ValueError, match="head_depth"):
        HybridDrafter(TimedHead(), PLDDrafter(), head_depth=0)


@pytest.mark.parametrize("rest_pays", [False, True])
def test_hybrid_rest_gate_learns_from_paired_steps(rest_pays):
    """REST is gated like the head: a lookup costing 3 time units whose continuation is never
    accepted is switched off after its first paired samples; one costing 0.5 whose two tokens are
    always accepted stays on (3 tokens in 2.5 units beat 1 in 2)."""
    clock = FakeClock()

    class TimedREST(PLDDrafter):  # a "datastore" that always continues with 70, 71
        def trie(self, slot, root, budget, source="rest"):
            clock.now += 0.5 if rest_pays else 3.0
            trie = CandidateTrie(root)
            trie.add([70, 71], 0.9, source=source)
            return trie

    d = HybridDrafter(None, None, TimedREST(), min_score=0.0, clock=clock)  # the datastore alone
    d.reset(1, 256)
    d.prefill(0, torch.tensor([3, 20, 21, 22, 23, 1, 2]), {})
    budget = TreeBudget(max_nodes=6, max_depth=4, topk=4)
    for _ in range(60):
        d.propose(torch.tensor([0]), torch.tensor([3]), budget)
        clock.now += 2.0  # verification
        committed = [3, 70, 71] if rest_pays else [3]
        d.commit(0, torch.tensor(committed), {})
    on, off = d.gates["rest"].rates(regime_of(0.0))
    assert (on > off) == rest_pays and set(d.gates) == {"rest"}
    assert d.rest_steps == 60 if rest_pays else d.rest_steps < 15


def test_node_cost_fits_the_seconds_a_verified_node_adds():
    cost = NodeCost(prior=0.0005)
    rng = np.random.default_rng(0)
    for _ in range(6):
        cost.add(7, 0.04)
    assert cost.seconds == 0.0005  # too few steps: the prior
    for _ in range(30):
        cost.add(7, 0.04)
    assert cost.seconds == 0.0005  # every step the same size: no slope to fit
    for _ in range(200):  # float32-like: 30 ms a step plus 2.5 ms a node, with noise
        n = int(rng.integers(1, 14))
        cost.add(n, 0.030 + 0.0025 * n + float(rng.normal(0, 0.002)))
    assert cost.seconds == pytest.approx(0.0025, rel=0.15)


def test_source_gate_pairs_tokens_and_time_of_one_step():
    gate = SourceGate(decay=1.0, min_samples=2, explore=10, run=2, node_seconds=0.5)
    gate.record(0, ran=True, tokens_on=3, tokens_off=1, seconds=4.0, source_seconds=1.0, only_nodes=2)
    assert gate.rates(0) == (None, None)  # the first step after the source was off is not sampled
    for _ in range(2):
        gate.record(0, ran=True, tokens_on=3, tokens_off=1, seconds=4.0, source_seconds=1.0, only_nodes=2)
    on, off = gate.rates(0)
    assert on == pytest.approx(3 / 4.0) and off == pytest.approx(1 / (4.0 - 1.0 - 2 * 0.5))
    assert gate.pays(0)  # 0.75 vs 0.5 tokens per unit of time
    gate.record(1, ran=False, tokens_on=1, tokens_off=1, seconds=1.0, source_seconds=0.0, only_nodes=0)
    assert 1 not in gate.sums  # a step without the head teaches nothing


def test_trie_select_leaves_out_nodes_below_min_score():
    trie = CandidateTrie(0)
    trie.add([1, 2, 3], [0.9, 0.2, 0.01])
    trie.add([4], 0.04)
    assert [trie.tokens[i] for i in trie.select(8)] == [0, 1, 2, 3, 4]
    assert [trie.tokens[i] for i in trie.select(8, min_score=0.05)] == [0, 1, 2]


# ---------------------------------------------------------------------------- lossless


PROMPTS = ["abcabcabc abcabc", "hello world hello world hello", "", "x" * 40 + " The quick brown fox"]


@pytest.fixture(scope="module")
def plain_outputs(tiny_target):
    from specdec.infer.api import LLM, SamplingParams

    llm = LLM(tiny_target, "plain", max_batch=4, max_len=256)
    return llm.generate(PROMPTS, SamplingParams(max_tokens=48), chat=True)


@pytest.fixture(scope="module")
def echo_datastore(tiny_target, plain_outputs, tmp_path_factory):
    """A datastore of the target's own answers: REST's drafts then get accepted often."""
    tok = tiny_target.tokenizer
    docs = [tok(o.text, add_special_tokens=False)["input_ids"] for o in plain_outputs]
    docs += [o.token_ids for o in plain_outputs]
    return build_datastore(docs, tmp_path_factory.mktemp("echo") / "ds", tok)


@pytest.fixture(scope="module")
def random_eagle3(tiny_target, tmp_path_factory):
    from specdec.heads import get_head_class

    return get_head_class("eagle3").from_target(tiny_target).save_pretrained(tmp_path_factory.mktemp("e3") / "head")


@pytest.mark.parametrize("method", ["pld", "lookahead", "rest", "hybrid", "hybrid+eagle3"])
def test_greedy_output_equals_plain_decoding(method, tiny_target, plain_outputs, echo_datastore, random_eagle3):
    from specdec.infer.api import LLM, SamplingParams

    opts = {"rest": {"datastore": str(echo_datastore)}, "hybrid": {"datastore": str(echo_datastore)},
            "hybrid+eagle3": {"datastore": str(echo_datastore), "draft_head": str(random_eagle3)}}
    name = method.split("+")[0]
    llm = LLM(tiny_target, name, max_batch=4, max_len=256, **opts.get(method, {}))
    params = SamplingParams(max_tokens=48)
    batch = llm.generate(PROMPTS, params, chat=True)                  # batch 4, ragged prompts
    assert [o.token_ids for o in batch] == [o.token_ids for o in plain_outputs]
    single = llm.generate([PROMPTS[0]], params, chat=True)[0]         # batch 1
    assert single.token_ids == plain_outputs[0].token_ids
    if name in ("rest", "hybrid"):  # the datastore holds these very answers: drafts get accepted
        assert sum(sum(o.stats["accepted_per_step"]) for o in batch) > 0


def test_pld_default_budget_is_deeper_on_cpu_only(tiny_target):
    """PLD's own default tree (cheap, long copies) applies on CPU; elsewhere the device's default."""
    from specdec.heads.tree import CPU_TREE_BUDGET
    from specdec.infer.drafters.pld import CPU_LOOKUP_BUDGET, PLDDrafter
    from specdec.infer.engine import Engine

    pld = PLDDrafter(tiny_target)
    assert pld.default_budget("cuda") is None
    assert Engine(tiny_target, pld, max_batch=1, max_len=64).default_budget == CPU_LOOKUP_BUDGET
    assert CPU_LOOKUP_BUDGET.max_depth > CPU_TREE_BUDGET.max_depth


def test_throughput_gate_trusts_one_pair_that_finds_extra_work_far_slower():
    """While the cheapest arm leads, one pair at 0.2x settles a challenger doing extra work (its
    tokens per step cannot fall below the leader's, only its cost makes it that slow); one pair
    at 0.5x does not, nor does one pair that finds the cheapest arm slow while extra work leads."""
    gate = ThroughputGate(decay=0.95, min_samples=4, explore=32, run=3, arms=("plain", "model", "full"))
    gate.leader[0] = "plain"
    for arm, ratio in (("full", 0.2), ("model", 0.5)):
        gate.pairs[(0, arm)] = [1.0, math.log(ratio), math.log(ratio) ** 2]
    assert gate.relative(0, "full") == pytest.approx(0.2) and gate.standing(0, "model") is None
    gate.leader[1] = "full"
    gate.pairs[(1, "plain")] = [1.0, math.log(0.2), math.log(0.2) ** 2]
    assert gate.standing(1, "plain") is None
