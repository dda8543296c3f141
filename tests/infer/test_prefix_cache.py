"""Automatic prefix caching: a prompt that starts like an earlier one reuses its K/V and features."""
from __future__ import annotations

import pytest
import torch

from specdec.heads.tree import TreeBudget
from specdec.infer.engine import Engine
from specdec.infer.prefix_cache import PrefixCache
from specdec.infer.requests import SamplingParams

from .test_engine import record_prefills, run

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SYSTEM = list(range(40, 90))  # a shared 50-token "system prompt"
PROMPTS = {"a": SYSTEM + [7, 8, 9], "b": SYSTEM + [7, 8, 9], "c": SYSTEM + [7, 8, 9, 10, 11], "d": SYSTEM[:30] + [5] * 9}


def kv(n: int, fill: float = 1.0) -> tuple[list, list]:
    return [torch.full((2, n, 4), fill)], [torch.full((2, n, 4), fill)]


def test_longest_prefix_wins_and_the_last_token_is_always_prefilled():
    cache = PrefixCache(max_bytes=1 << 20, min_tokens=4)
    assert cache.min_tokens == 16  # never below the index key's length
    short, long = list(range(20)), list(range(30))
    cache.store(short, lambda: kv(20, 1.0))
    cache.store(long, lambda: kv(30, 2.0))
    hit = cache.lookup(list(range(25)) + [99])
    assert hit.length == 25 and hit.entry.keys[0][0, 0, 0] == 2.0  # the longer common prefix
    assert cache.lookup(list(range(30))).length == 29  # an identical prompt: all but its last token
    assert cache.lookup(list(range(10)) + [99] * 20) is None  # a common prefix under 16 tokens
    assert cache.lookup([1] + list(range(1, 30))) is None
    assert not cache.store(long, lambda: kv(30))  # already there
    assert not cache.store(list(range(25)), lambda: pytest.fail("copied K/V another entry holds"))
    assert (cache.hits, cache.hit_tokens, cache.lookups) == (2, 54, 4)


def test_least_recently_used_prompts_go_first_to_stay_under_the_budget():
    entry_bytes = 2 * 2 * 20 * 4 * 4  # K and V of 20 tokens, float32
    cache = PrefixCache(max_bytes=2 * entry_bytes)
    first, second, third = ([k] * 20 for k in (1, 2, 3))
    cache.store(first, lambda: kv(20))
    cache.store(second, lambda: kv(20))
    assert cache.lookup(first + [0]).length == 20  # first is now the most recently used
    cache.store(third, lambda: kv(20))
    assert cache.lookup(second + [0]) is None and cache.lookup(first + [0]) is not None
    assert len(cache) == 2 and cache.nbytes == 2 * entry_bytes
    assert not cache.store(list(range(200)), lambda: kv(200))  # larger than the whole cache
    with pytest.raises(ValueError):
        PrefixCache(0)


def test_a_finished_sequence_supersedes_the_entries_of_its_prompt():
    cache = PrefixCache(max_bytes=1 << 20)
    prompt = list(range(30))
    cache.store(prompt, lambda: kv(30))                                   # at its prefill
    cache.store(prompt + [1] * 10, lambda: kv(40, 1.0), reply_from=30)     # its reply
    assert list(cache.entries) == [tuple(prompt + [1] * 10)]
    turn2 = prompt + [1] * 10 + [5] * 10                                   # a chat's next turn ...
    cache.store(turn2 + [6] * 5, lambda: kv(55), reply_from=50)
    cache.store(prompt + [2] * 10, lambda: kv(40, 2.0), reply_from=30)     # ... and the prompt again
    assert set(cache.entries) == {tuple(prompt + [2] * 10), tuple(turn2 + [6] * 5)}
    assert cache.nbytes == sum(e.nbytes for e in cache.entries.values())
    assert cache.lookup(prompt + [2, 2, 0]).length == 32                  # the latest reply
    assert cache.lookup(turn2 + [0]).length == 50                         # the other prompt's stays
    other = list(range(29)) + [99]                                        # shares 29 tokens only
    cache.store(other + [3] * 10, lambda: kv(40), reply_from=30)
    assert len(cache) == 3


def test_an_entry_keeps_the_features_before_where_its_prompt_and_its_reply_end():
    feats = {"aux": torch.arange(80.0)[:, None]}  # token p's feature is p (features of all 100: 20..99 given)
    cache = PrefixCache(max_bytes=1 << 20, feature_tail=8)
    seq = list(range(100))
    cache.store(seq, lambda: kv(100), {"aux": feats["aux"] + 20}, reply_from=60)
    entry = cache.entries[tuple(seq)]
    assert [(s.start, s.end) for s in entry.spans] == [(52, 60), (92, 100)]
    for length, start in ((59, 52), (60, 52), (100, 92), (95, 92)):
        first, got = entry.cached_features(length)
        assert first == start and got["aux"][:, 0].tolist() == list(range(start, length))
    assert entry.cached_features(70) == (70, None) and entry.cached_features(52) == (52, None)
    assert entry.nbytes == 2 * 100 * 2 * 4 * 4 + 16 * 4
    seq2 = list(range(1, 101))
    cache.store(seq2, lambda: kv(100), {"aux": torch.arange(100.0)[:, None]}, reply_from=95)  # they meet
    assert [(s.start, s.end) for s in cache.entries[tuple(seq2)].spans] == [(87, 100)]
    whole = PrefixCache(max_bytes=1 << 20)  # no tail: every feature given
    whole.store(seq, lambda: kv(100), feats, reply_from=60)
    assert [(s.start, s.end) for s in whole.entries[tuple(seq)].spans] == [(20, 100)]
    with pytest.raises(ValueError, match="feature_tail"):
        PrefixCache(1 << 20, feature_tail=0)


@pytest.fixture(scope="module")
def alone(tiny_target):
    """Each prompt decoded on its own engine, no prefix cache: the reference."""
    return {rid: run(Engine(tiny_target, None, max_batch=1, max_len=256), {rid: p}, GREEDY)[rid].token_ids
            for rid, p in PROMPTS.items()}


def test_cached_prefixes_are_lossless_and_skip_their_prefill(tiny_target, alone):
    with pytest.raises(ValueError, match="prefix cache size must be >= 0"):
        Engine(tiny_target, None, max_batch=1, max_len=64, prefix_cache_bytes=-1)
    engine = Engine(tiny_target, None, max_batch=2, max_len=256, prefix_cache_bytes=1 << 24)
    calls = record_prefills(engine)
    outs = {rid: run(engine, {rid: p}, GREEDY)[rid] for rid, p in PROMPTS.items()}  # one after another
    for rid, out in outs.items():
        assert out.token_ids == alone[rid], rid
    cached = {rid: out.stats["cached_prompt_tokens"] for rid, out in outs.items()}
    assert cached == {"a": 0, "b": 52, "c": 53, "d": 30}
    # what was prefilled: all of a; b's last token; c's 2 new tokens; d past the shared 30
    assert [c[0] for c in calls] == [(53, 0), (1, 52), (2, 53), (9, 30)]


def test_a_drafter_gets_the_same_prompt_features_from_the_cache(tiny_target, alone):
    """EAGLE-3 drafts from the target's features of every prompt token: a cached prefix must hand
    over the features its first prefill computed, and drafting stays lossless."""
    from specdec.heads import get_head_class

    torch.manual_seed(0)
    head = get_head_class("eagle3").from_target(tiny_target).eval()

    def serve(cache_bytes):
        drafter = head.new_drafter(tiny_target)
        seen = {}
        prefill = drafter.prefill
        drafter.prefill = lambda slot, ids, feats: seen.update({len(seen): feats}) or prefill(slot, ids, feats)
        engine = Engine(tiny_target, drafter, max_batch=2, max_len=256, prefix_cache_bytes=cache_bytes)
        outs = {rid: run(engine, {rid: p}, GREEDY, budget=TreeBudget(8, 4, 2))[rid] for rid, p in PROMPTS.items()}
        return outs, seen

    cached, seen_cached = serve(1 << 24)
    fresh, seen_fresh = serve(0)
    assert [o.stats["cached_prompt_tokens"] for o in cached.values()] == [0, 52, 53, 30]
    for rid in PROMPTS:
        assert cached[rid].token_ids == fresh[rid].token_ids == alone[rid], rid
    for i in seen_fresh:
        assert seen_cached[i].keys() == seen_fresh[i].keys() and seen_fresh[i]
        for name in seen_fresh[i]:
            torch.testing.assert_close(seen_cached[i][name], seen_fresh[i][name], rtol=1e-4, atol=1e-5)


def test_the_cache_keeps_only_the_features_the_drafter_reads(tiny_target, alone):
    """A drafter that reads a prompt's last ``feature_tail`` features gets those from a cached
    prefix (the fresh ones' tail, also where the entry is a finished sequence whose reply
    follows), the cache holds no more, and the output stays plain greedy's."""
    from specdec.heads import get_head_class

    torch.manual_seed(0)
    head = get_head_class("eagle3").from_target(tiny_target).eval()
    tail = 8

    def serve(cache_bytes):
        drafter = head.new_drafter(tiny_target)
        drafter.feature_tail = tail
        seen = []
        prefill = drafter.prefill
        drafter.prefill = lambda slot, ids, feats: seen.append(feats) or prefill(slot, ids, feats)
        engine = Engine(tiny_target, drafter, max_batch=2, max_len=256, prefix_cache_bytes=cache_bytes)
        outs = {rid: run(engine, {rid: p}, GREEDY, budget=TreeBudget(8, 4, 2))[rid] for rid, p in PROMPTS.items()}
        return outs, seen, engine.prefix_cache

    cached, seen_cached, cache = serve(1 << 24)
    fresh, seen_fresh, _ = serve(0)
    assert [o.stats["cached_prompt_tokens"] for o in cached.values()] == [0, 52, 53, 30]
    for rid in PROMPTS:
        assert cached[rid].token_ids == fresh[rid].token_ids == alone[rid], rid
    lengths = []
    for got, want in zip(seen_cached, seen_fresh):
        m = len(got["aux"])
        lengths.append(m)
        assert min(len(want["aux"]), tail) <= m
        torch.testing.assert_close(got["aux"], want["aux"][-m:], rtol=1e-4, atol=1e-5)
    assert lengths[0] == len(PROMPTS["a"]) and max(lengths[1:]) < len(PROMPTS["b"])  # b, c, d: cut
    for entry in cache.entries.values():  # finished sequences: the last 8 of the prompt and of the reply
        assert sum(len(span.features["aux"]) for span in entry.spans) <= 2 * tail


def test_a_last_hidden_drafter_caches_one_feature_a_prompt(tiny_target, alone):
    """Medusa-like heads read the last hidden state alone: entries keep no other."""
    from specdec.heads import get_head_class

    torch.manual_seed(0)
    head = get_head_class("medusa").from_target(tiny_target).eval()
    engine = Engine(tiny_target, head.new_drafter(tiny_target), max_batch=2, max_len=256, prefix_cache_bytes=1 << 24)
    outs = {rid: run(engine, {rid: p}, GREEDY, budget=TreeBudget(4, 2, 2))[rid] for rid, p in PROMPTS.items()}
    assert {rid: o.token_ids for rid, o in outs.items()} == alone
    assert [o.stats["cached_prompt_tokens"] for o in outs.values()] == [0, 52, 53, 30]
    assert all(sum(len(span.features["hidden"]) for span in e.spans) <= 2 for e in engine.prefix_cache.entries.values())


def test_the_next_turn_reuses_the_whole_previous_turn(tiny_target):
    """A finished sequence is cached as prompt + output with every token's features, plain
    steps and drafted ones alike, so turn 2 (turn 1 + its reply + a new message) prefills only
    the new message and drafts from exactly the features a fresh prefill computes."""
    from specdec.heads import get_head_class

    torch.manual_seed(0)
    head = get_head_class("eagle3").from_target(tiny_target).eval()
    turn1 = SYSTEM + [7, 8, 9]

    def decode(engine, rid, prompt):
        engine.add_request(rid, prompt, GREEDY)
        step, final = 0, None
        while engine.has_unfinished():  # plain and drafting steps in turn: both reach the cache
            for out in engine.step(TreeBudget(8, 4, 2) if step % 2 else TreeBudget(0, 0, 0)):
                final = out if out.finished else final
            step += 1
        return final

    def conversation(cache_bytes):
        drafter = head.new_drafter(tiny_target)
        seen = []
        prefill = drafter.prefill
        drafter.prefill = lambda slot, ids, feats: seen.append(feats) or prefill(slot, ids, feats)
        engine = Engine(tiny_target, drafter, max_batch=1, max_len=256, prefix_cache_bytes=cache_bytes)
        first = decode(engine, "t1", turn1)
        turn2 = turn1 + first.token_ids + [11, 12, 13]
        return first, decode(engine, "t2", turn2), seen, len(engine.prefix_cache or [])

    (first, second, seen, entries), (first0, second0, seen0, _) = conversation(1 << 24), conversation(0)
    assert first.token_ids == first0.token_ids and second.token_ids == second0.token_ids
    assert len(turn1) + 15 <= second.stats["cached_prompt_tokens"] <= len(turn1) + 16
    assert entries == 2  # turn 1 as prompt + reply (its prompt alone dropped), turn 2 the same
    for name in seen0[1]:
        torch.testing.assert_close(seen[1][name], seen0[1][name], rtol=1e-4, atol=1e-5)
