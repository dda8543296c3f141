"""Engine: lossless greedy speculation for ANY proposed tree (random trees + an oracle branch),
batch 1 and ragged batch 4, per-sequence stop rules, continuous batching (add / abort mid-run),
chunked prefill, seeded sampling, every registered head type (fp32, tiny target)."""
from __future__ import annotations

import collections

import pytest
import torch

from specdec.heads.base import FeatureSpec
from specdec.heads.tree import DraftTree, TreeBudget
from specdec.infer.cache import padding_groups
from specdec.infer.drafters import DrafterError, available_methods, make_drafter
from specdec.infer.engine import Engine
from specdec.infer.requests import SamplingParams

BUDGET = TreeBudget(max_nodes=10, max_depth=5, topk=3)


class RandomTreeDrafter:
    """A deliberately simple Drafter: random trees, where (with probability p_oracle) one branch
    follows the true greedy continuation from a precomputed plain run.

    sample_q=True: every child is *sampled* from a random q(. | parent) that is returned as
    draft_probs (the contract stochastic verification relies on). Otherwise siblings carry
    distinct tokens (the point-mass rule's precondition).
    """

    feature_spec = FeatureSpec(hidden=True, aux_layers=(0, 2))

    def __init__(self, vocab: int, hidden: int, oracle: list[list[int]] = (), p_oracle: float = 0.7,
                 sample_q: bool = False, seed: int = 0):
        self.vocab, self.hidden, self.oracle = vocab, hidden, [list(s) for s in oracle]
        self.p_oracle, self.sample_q = p_oracle, sample_q
        self.gen = torch.Generator().manual_seed(seed)
        self.hist: dict[int, list[int]] = {}

    def reset(self, max_batch, max_len):
        self.hist = {}

    def _check(self, token_ids, features):
        n = len(token_ids)
        assert features["hidden"].shape == (n, self.hidden)
        assert features["aux"].shape == (n, 2 * self.hidden)

    def prefill(self, slot, token_ids, features):
        self._check(token_ids, features)
        self.hist[slot] = token_ids.tolist()

    def commit(self, slot, token_ids, features):
        self._check(token_ids, features)
        self.hist[slot] += token_ids.tolist()

    def release(self, slot):
        del self.hist[slot]

    def _rand(self, n: int) -> int:
        return int(torch.randint(n, (1,), generator=self.gen))

    def _continuation(self, seq: list[int]) -> list[int]:
        for ref in self.oracle:
            if ref[:len(seq)] == seq:
                return ref[len(seq):]
        return []

    def _one_tree(self, seq: list[int], budget: TreeBudget):
        n = 1 + self._rand(budget.max_nodes + 1)
        tokens, parents, depth, qs = [seq[-1]], [-1], [0], [None]
        q_of: dict[int, torch.Tensor] = {}
        cont = self._continuation(seq) if float(torch.rand(1, generator=self.gen)) < self.p_oracle else []
        oracle_nodes = cont[:min(budget.max_depth, n - 1)]
        for i in range(1, n):
            if i <= len(oracle_nodes) and not self.sample_q:
                parent, tok = i - 1, oracle_nodes[i - 1]
            else:
                parent = [j for j in range(i) if depth[j] < budget.max_depth][self._rand(sum(d < budget.max_depth for d in depth))]
                if self.sample_q:
                    if parent not in q_of:
                        q_of[parent] = torch.softmax(3 * torch.randn(self.vocab, generator=self.gen), -1)
                    tok = int(torch.multinomial(q_of[parent], 1, generator=self.gen))
                else:
                    siblings = {tokens[j] for j in range(i) if parents[j] == parent}
                    tok = self._rand(self.vocab)
                    while tok in siblings:
                        tok = self._rand(self.vocab)
            tokens.append(tok), parents.append(parent), depth.append(depth[parent] + 1)
            qs.append(q_of.get(parent))
        return tokens, parents, qs

    def propose(self, slots, roots, budget):
        rows = [self._one_tree(self.hist[int(s)] + [int(r)], budget) for s, r in zip(slots, roots)]
        B, N = len(rows), max(len(r[0]) for r in rows)
        tokens = torch.zeros(B, N, dtype=torch.long)
        parents = torch.zeros(B, N, dtype=torch.long)
        valid = torch.zeros(B, N, dtype=torch.bool)
        q = torch.zeros(B, N, self.vocab) if self.sample_q else None
        for b, (tok, par, qs) in enumerate(rows):
            tokens[b, :len(tok)], parents[b, :len(tok)], valid[b, :len(tok)] = torch.tensor(tok), torch.tensor(par), True
            if q is not None:
                for i, qi in enumerate(qs[1:], start=1):
                    q[b, i] = qi
        return DraftTree(tokens=tokens, parents=parents, valid=valid, draft_probs=q)


def run(engine: Engine, prompts: dict, params, budget=None) -> dict:
    """Add every prompt, step to the end; -> {id: final RequestOutput}, checking the stream.
    budget: what ``step`` takes, or a function of the step's index returning it."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params)
    final, streamed = {}, collections.defaultdict(str)
    step = 0
    while engine.has_unfinished():
        for out in engine.step(budget(step) if callable(budget) else budget):
            streamed[out.request_id] += out.new_text
            if out.finished:
                final[out.request_id] = out
        step += 1
    for rid, out in final.items():
        assert streamed[rid] == out.text, "streamed deltas must add up to the final text"
    return final


def prompts_of(tokenizer, n: int) -> dict:
    texts = ["Hello there", "The quick brown fox jumps over", "a", "Once upon a time, in a land far away,"]
    return {f"r{i}": tokenizer(texts[i])["input_ids"] for i in range(n)}


@pytest.fixture(scope="module")
def plain_outputs(tiny_target):
    """Plain greedy continuations, each computed alone (batch 1)."""
    outs = {}
    for rid, prompt in prompts_of(tiny_target.tokenizer, 4).items():
        engine = Engine(tiny_target, None, max_batch=1, max_len=256)
        outs[rid] = run(engine, {rid: prompt}, SamplingParams(max_tokens=40, ignore_eos=True))[rid]
    return outs


def oracle_drafter(tiny_target, plain_outputs, **kw):
    prompts = prompts_of(tiny_target.tokenizer, 4)
    oracle = [prompts[rid] + out.token_ids for rid, out in plain_outputs.items()]
    return RandomTreeDrafter(tiny_target.vocab_size, tiny_target.hidden_size, oracle=oracle, **kw)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 4])
def test_random_trees_are_lossless_in_greedy(tiny_target, plain_outputs, batch):
    drafter = oracle_drafter(tiny_target, plain_outputs, seed=batch)
    engine = Engine(tiny_target, drafter, max_batch=batch, max_len=256)
    prompts = prompts_of(tiny_target.tokenizer, 4)  # ragged: 11, 30, 1 and 37 tokens
    # Different budgets in one step, including plain decoding for one request.
    budgets = {"r0": BUDGET, "r1": TreeBudget(4, 2, 2), "r2": TreeBudget(0, 0, 0)}
    final = run(engine, prompts, SamplingParams(max_tokens=40, ignore_eos=True), budget=budgets)
    for rid, out in final.items():
        assert out.token_ids == plain_outputs[rid].token_ids
        assert out.text == plain_outputs[rid].text
        assert out.stats["new_tokens"] == 40
    accepted = [a for out in final.values() for a in out.stats["accepted_per_step"]]
    assert sum(accepted) > 10, "the oracle branch should be accepted often"
    assert final["r2"].stats["accepted_per_step"] == [0] * final["r2"].stats["steps"]
    assert final["r0"].stats["tau"] > 1.0
    assert engine.last_step.tokens_verified >= engine.last_step.batch_size >= 1
    last = engine.last_step  # every row is padded to the widest tree: what the controller prices
    assert last.tokens_computed % last.batch_size == 0 and last.tokens_computed >= last.tokens_verified



def test_plain_steps_reach_the_drafter_before_it_drafts(tiny_target, plain_outputs, monkeypatch):
    """Plain rows are committed to the drafter lazily (one commit for many plain steps), yet it
    always drafts from the full history: with a stale one its oracle branch would never match."""
    import specdec.infer.engine as engine_mod

    monkeypatch.setattr(engine_mod, "MAX_UNFED", 7)  # drafted commits hold <= 6
    drafter = oracle_drafter(tiny_target, plain_outputs, seed=3, p_oracle=1.0)
    prompts = prompts_of(tiny_target.tokenizer, 4)
    refs = [prompts[rid] + out.token_ids for rid, out in plain_outputs.items()]
    commits, proposed = [], []
    commit, propose = drafter.commit, drafter.propose

    def checked_propose(slots, roots, budget):
        for s, r in zip(slots.tolist(), roots.tolist()):
            seq = drafter.hist[s] + [r]
            proposed.append(any(ref[:len(seq)] == seq for ref in refs))
        return propose(slots, roots, budget)

    drafter.commit = lambda slot, ids, feats: commits.append(len(ids)) or commit(slot, ids, feats)
    drafter.propose = checked_propose
    engine = Engine(tiny_target, drafter, max_batch=4, max_len=256)
    # 4 plain steps, then one that drafts; r3 never drafts
    final = run(engine, prompts, SamplingParams(max_tokens=40, ignore_eos=True),
                budget=lambda step: {rid: BUDGET if step % 5 == 4 and rid != "r3" else engine_mod.PLAIN
                                     for rid in prompts})
    for rid, out in final.items():
        assert out.token_ids == plain_outputs[rid].token_ids, rid
    assert proposed and all(proposed), "the drafter drafted from a history without the plain steps"
    assert sum(final["r0"].stats["accepted_per_step"]) > 0
    steps = sum(out.stats["steps"] for out in final.values())
    assert len(commits) < steps / 2, "plain steps should reach the drafter in batches"
    assert max(commits) == 7  # MAX_UNFED bounds what a row holds back (r3 never drafts)


def test_stop_rules_per_sequence(tiny_target, plain_outputs):
    prompts = prompts_of(tiny_target.tokenizer, 4)
    ref = {rid: out.token_ids for rid, out in plain_outputs.items()}
    eos = ref["r0"][12]                        # pretend this token is the end of sequence
    first_eos = {rid: toks.index(eos) if eos in toks else None for rid, toks in ref.items()}
    text1 = plain_outputs["r1"].text
    stop = next(text1[i:i + 2] for i in range(8, len(text1) - 2) if "\ufffd" not in text1[i:i + 2])
    params = {"r0": SamplingParams(max_tokens=40),                   # stops at the eos
              "r1": SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True),
              "r2": SamplingParams(max_tokens=7, ignore_eos=True),
              "r3": SamplingParams(max_tokens=40, ignore_eos=True, stop=["\x00never\x00"])}
    engine = Engine(tiny_target, oracle_drafter(tiny_target, plain_outputs, seed=5), max_batch=4, max_len=256)
    engine.eos_ids = {eos}
    final = run(engine, prompts, params, budget=BUDGET)

    assert final["r0"].token_ids == ref["r0"][:first_eos["r0"] + 1]  # eos kept, nothing after it
    assert final["r0"].finish_reason == "stop"
    cut = text1.index(stop)
    assert final["r1"].text == text1[:cut] and final["r1"].finish_reason == "stop"
    assert ref["r1"][:len(final["r1"].token_ids)] == final["r1"].token_ids
    assert final["r2"].token_ids == ref["r2"][:7] and final["r2"].finish_reason == "length"
    assert final["r3"].token_ids == ref["r3"] and final["r3"].finish_reason == "length"


def test_continuous_batching_add_and_abort(tiny_target, plain_outputs):
    prompts = prompts_of(tiny_target.tokenizer, 4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = Engine(tiny_target, oracle_drafter(tiny_target, plain_outputs, seed=6), max_batch=3, max_len=256)
    final, partial = {}, {}
    engine.add_request("r0", prompts["r0"], params)
    engine.add_request("r1", prompts["r1"], params)
    for step in range(60):
        if step == 2:  # r2 joins; r3 waits for a slot until r1 is aborted
            engine.add_request("r2", prompts["r2"], params)
            engine.add_request("r3", prompts["r3"], params)
        if step == 4:
            assert engine.abort("r1") and not engine.abort("r1")
        for out in engine.step(BUDGET):
            partial[out.request_id] = out
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert "r1" not in final and partial["r1"].token_ids == plain_outputs["r1"].token_ids[:len(partial["r1"].token_ids)]
    for rid in ("r0", "r2", "r3"):
        assert final[rid].token_ids == plain_outputs[rid].token_ids, rid
    assert len(engine.slots) == 3 and not engine.running


def test_chunked_prefill_is_lossless(tiny_target, plain_outputs):
    engine = Engine(tiny_target, oracle_drafter(tiny_target, plain_outputs, seed=7), max_batch=4, max_len=256,
                    prefill_chunk=8)
    final = run(engine, prompts_of(tiny_target.tokenizer, 4), SamplingParams(max_tokens=40, ignore_eos=True),
                budget=BUDGET)
    for rid, out in final.items():
        assert out.token_ids == plain_outputs[rid].token_ids


def record_prefills(engine: Engine) -> list:
    """Wrap the engine's prefill forwards; -> a list that gets, per forward, [(tokens, start)] per row."""
    calls = []
    prefill = engine.runner.prefill_batch
    engine.runner.prefill_batch = lambda slots, ids, starts: calls.append(
        [(len(i), s) for i, s in zip(ids, starts)]) or prefill(slots, ids, starts)
    return calls


def test_a_prompt_that_fits_one_chunk_is_not_split(tiny_target):
    """Under a prefill budget, a prompt that fits one step's budget waits for the next step
    instead of being cut (its rest would need the masked attention path); only a prompt longer
    than the budget is prefilled in pieces."""
    engine = Engine(tiny_target, None, max_batch=4, max_len=256, prefill_chunk=10)
    calls = record_prefills(engine)
    prompts = {"a": list(range(3, 9)), "b": list(range(20, 28)), "c": list(range(40, 63))}  # 6, 8, 23
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    # a (6) alone: b (8) would not fit whole; b, then c (23 > 10) fills the rest and goes on
    assert calls == [[(6, 0)], [(8, 0)], [(2, 0)], [(10, 2)], [(10, 12)], [(1, 22)]]


def test_prefill_groups_keep_padding_small(tiny_target, plain_outputs):
    """New prompts of very different lengths are prefilled in separate forwards (one padded
    forward over 10 + 500 tokens would compute 1,000), and the outputs stay exact."""
    assert padding_groups([500, 10, 480, 12]) == [[0, 2], [3, 1]]
    assert padding_groups([7, 7, 7]) == [[0, 1, 2]]
    groups = padding_groups([300, 5, 120, 90, 4, 100, 1])
    assert sorted(i for g in groups for i in g) == list(range(7))
    lengths = [300, 5, 120, 90, 4, 100, 1]
    for g in groups:
        assert max(lengths[i] for i in g) * len(g) <= 1.25 * sum(lengths[i] for i in g) or len(g) == 1

    engine = Engine(tiny_target, None, max_batch=4, max_len=256)
    calls = record_prefills(engine)
    prompts = prompts_of(tiny_target.tokenizer, 4)
    assert len({len(p) for p in prompts.values()}) > 1
    final = run(engine, prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    for rid, out in final.items():
        assert out.token_ids == plain_outputs[rid].token_ids
    assert sum(len(call) for call in calls) == 4


def test_seeded_sampling_is_reproducible(tiny_target):
    prompts = prompts_of(tiny_target.tokenizer, 3)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, top_p=0.95, seed=11, ignore_eos=True)

    def speculative():
        drafter = RandomTreeDrafter(tiny_target.vocab_size, tiny_target.hidden_size, sample_q=True, seed=3)
        return run(Engine(tiny_target, drafter, max_batch=3, max_len=128), prompts, params, budget=BUDGET)

    first, second = speculative(), speculative()
    assert {k: v.token_ids for k, v in first.items()} == {k: v.token_ids for k, v in second.items()}
    # Plain sampling: a seeded request draws the same tokens alone or in a batch.
    alone = run(Engine(tiny_target, None, max_batch=1, max_len=128), {"r1": prompts["r1"]}, params)
    batched = run(Engine(tiny_target, None, max_batch=3, max_len=128), prompts, params)
    assert alone["r1"].token_ids == batched["r1"].token_ids
    other = run(Engine(tiny_target, None, max_batch=1, max_len=128), {"r1": prompts["r1"]},
                SamplingParams(max_tokens=24, temperature=0.8, seed=12, ignore_eos=True))
    assert other["r1"].token_ids != alone["r1"].token_ids


def test_a_seeded_sample_does_not_depend_on_its_neighbours_trees(tiny_target):
    # PLD drafts from each request's own text, so each row's tree is its own; the batch pads the
    # rows to the widest, and the padding must not draw from a row's random stream
    from specdec.infer.drafters import make_drafter

    tok = tiny_target.tokenizer
    texts = {"a": "abc abc abc abc abc abc", "b": "the cat the cat the cat the cat", "c": "xyz"}
    prompts = {k: tok(v, add_special_tokens=False)["input_ids"] for k, v in texts.items()}
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)

    def engine(batch):
        return Engine(tiny_target, make_drafter("pld", tiny_target), max_batch=batch, max_len=128)

    batched = run(engine(3), prompts, params)
    for k in prompts:
        assert run(engine(1), {k: prompts[k]}, params)[k].token_ids == batched[k].token_ids, k


def test_engine_input_errors(tiny_target):
    engine = Engine(tiny_target, None, max_batch=1, max_len=16)
    engine.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [])
    with pytest.raises(Exception, match="max_len=16"):
        engine.add_request("c", list(range(16)))
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        engine.add_request("d", [1, 10**7])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="whole number"):
        SamplingParams(max_tokens=5.5)
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(temperature=float("nan"))
    # A sequence that fills the cache ends with "length": 13 committed tokens + the last root.
    final = run(engine, {}, None)
    assert final["a"].finish_reason == "length" and len(final["a"].token_ids) == 16 - 3 + 1


def test_llm_generate_queues_all_prompts_or_none(tiny_target):
    from specdec.infer.api import LLM

    llm = LLM(tiny_target, "plain", max_batch=2, max_len=64)
    with pytest.raises(Exception, match="max_len=64"):
        llm.generate(["ok", "hello " * 100], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()            # "ok" was not left queued for the next call
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**7]], SamplingParams(max_tokens=3))
    assert len(llm.generate(["ok"], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_sequence_hitting_max_len_finishes_with_length(tiny_target, plain_outputs):
    prompt = prompts_of(tiny_target.tokenizer, 1)["r0"]
    engine = Engine(tiny_target, oracle_drafter(tiny_target, plain_outputs), max_batch=1, max_len=len(prompt) + 6)
    out = run(engine, {"r0": prompt}, SamplingParams(max_tokens=40, ignore_eos=True), budget=BUDGET)["r0"]
    assert out.finish_reason == "length"
    assert out.token_ids == plain_outputs["r0"].token_ids[:len(out.token_ids)] and len(out.token_ids) == 7


def test_make_drafter_registry(tiny_target):
    assert make_drafter("plain", tiny_target) is None
    with pytest.raises(DrafterError, match="unknown method"):
        make_drafter("telepathy", tiny_target)
    with pytest.raises(DrafterError, match="needs a trained head"):
        make_drafter("eagle3", tiny_target)
    assert {"plain", "medusa", "eagle3", "mlp", "sps"} <= set(available_methods())


# ---------------------------------------------------------------------------------------------
def _head_types():
    try:
        from specdec.heads import head_types
    except ImportError:
        return []
    return list(head_types())


@pytest.mark.parametrize("head_type", _head_types())
@pytest.mark.parametrize("batch", [1, 4])
def test_random_head_drafts_losslessly(tiny_target, plain_outputs, head_type, batch):
    """A randomly initialised head of every registered type, through its own drafter."""
    from specdec.heads import get_head_class

    torch.manual_seed(0)
    head = get_head_class(head_type).from_target(tiny_target).eval()
    engine = Engine(tiny_target, head.new_drafter(tiny_target), max_batch=batch, max_len=256)
    prompts = prompts_of(tiny_target.tokenizer, 2 if batch == 1 else 4)  # ragged either way
    final = run(engine, prompts, SamplingParams(max_tokens=24, ignore_eos=True), budget=TreeBudget(8, 4, 2))
    for rid, out in final.items():
        assert out.token_ids == plain_outputs[rid].token_ids[:24], (head_type, rid)


def test_a_cut_catchup_stays_lossless(tiny_target, plain_outputs):
    """Rows that decode plainly for a while, then draft with an EAGLE-3 drafter whose catch-up is
    cut (catchup_pairs): drafts from a partial context, the same greedy tokens."""
    from specdec.heads import get_head_class
    from specdec.infer.engine import PLAIN

    torch.manual_seed(0)
    head = get_head_class("eagle3").from_target(tiny_target).eval()
    drafter = head.new_drafter(tiny_target, catchup_pairs=8)
    cuts = []
    windowed = drafter._windowed

    def recording(slot, window):
        chunks = windowed(slot, window)
        cuts.append(chunks is not drafter.pending[slot])
        return chunks

    drafter._windowed = recording
    engine = Engine(tiny_target, drafter, max_batch=4, max_len=256)
    prompts = prompts_of(tiny_target.tokenizer, 4)
    final = run(engine, prompts, SamplingParams(max_tokens=40, ignore_eos=True),
                budget=lambda step: {rid: TreeBudget(8, 4, 2) if step % 20 >= 17 else PLAIN for rid in prompts})
    for rid, out in final.items():
        assert out.token_ids == plain_outputs[rid].token_ids, rid
    assert sum(cuts) >= 6, "the backlogs should have been cut"


def test_head_folder_drafts_in_the_targets_dtype(tiny_target, tiny_target_dir, tmp_path):
    """Heads are saved in fp32; loaded beside a bf16 target they must draft in bf16 (an fp32 head
    there measured 2x slower drafting), through the head methods and the hybrid alike."""
    from specdec.heads import get_head_class
    from specdec.infer.target import load_target

    torch.manual_seed(0)
    get_head_class("eagle3").from_target(tiny_target).save_pretrained(tmp_path / "h")
    bf16 = load_target(str(tiny_target_dir), dtype="bfloat16")
    for method in ("eagle3", "hybrid"):
        drafter = make_drafter(method, bf16, head=tmp_path / "h")
        head = drafter.head if method == "eagle3" else drafter.head.head
        assert {p.dtype for p in head.parameters()} == {torch.bfloat16}, method
        assert {b.dtype for b in head.buffers() if b.is_floating_point()} <= {torch.bfloat16}
    with pytest.raises(DrafterError, match="does not exist"):
        make_drafter("hybrid", bf16, head=tmp_path / "missing")


def test_eagle_drafter_logits_follow_the_heads_weights(tiny_target):
    """The drafter's (packed) draft LM head is rebuilt when the head's weight changes in place."""
    from specdec.heads import get_head_class

    torch.manual_seed(0)
    head = get_head_class("eagle3").from_target(tiny_target).eval()
    drafter = head.new_drafter(tiny_target)
    x = torch.randn(2, head.config.hidden_size)
    before = drafter._draft_logits(x)
    with torch.no_grad():
        head.lm_head.weight.mul_(2.0)
    torch.testing.assert_close(drafter._draft_logits(x), 2 * before)


def test_llm_with_a_missing_head_folder_names_the_folder(tiny_target, tmp_path):
    from specdec.infer.api import LLM

    with pytest.raises(DrafterError, match="does not exist"):  # not "method 'plain' takes no head"
        LLM(tiny_target, head=str(tmp_path / "no-such-head"))
    with pytest.raises(Exception, match="not a head folder"):
        LLM(tiny_target, head=str(tmp_path))


def test_llm_generate_prompt_forms_and_mistakes(tiny_target):
    from specdec.infer.api import LLM

    llm = LLM(tiny_target, "plain", max_batch=2, max_len=64)
    sp = SamplingParams(max_tokens=3)
    want = llm.generate([[5, 6, 7]], sp)[0].token_ids
    assert llm.generate(torch.tensor([5, 6, 7]), sp)[0].token_ids == want  # a 1-D tensor is one prompt
    assert [o.token_ids for o in llm.generate(torch.tensor([[5, 6, 7], [5, 6, 7]]), sp)] == [want, want]
    with pytest.raises(ValueError, match=r"^prompt 1: the prompt is empty"):  # its index, not "gen-N"
        llm.generate(["ok", ""], sp)
    with pytest.raises(Exception, match=r"^prompt 0: prompt of \d+ tokens .*max_len=64"):
        llm.generate(["hello " * 20], sp)
    with pytest.raises(TypeError, match="token ids"):  # 1.5 was silently truncated to 1
        llm.generate([1.5, 2], sp)
    with pytest.raises(TypeError, match="prompts"):
        llm.generate(None, sp)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate("ok", {"max_tokens": 3})
    assert not llm.engine.has_unfinished() and llm.generate([[5, 6, 7]], sp)[0].token_ids == want


def test_sampling_params_type_mistakes_are_value_errors():
    assert SamplingParams(stop_token_ids=7).stop_token_ids == [7]  # was TypeError: 'int' is not iterable
    for bad in (dict(temperature="0.7"), dict(top_p="1"), dict(seed="a"), dict(seed=1.5),
                dict(stop_token_ids=["x"])):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(temperature=1, top_p=1, seed=0).seed == 0


def test_llm_generate_budget_is_one_tree_budget(tiny_target):
    from specdec.infer.api import LLM

    llm = LLM(tiny_target, "pld", max_batch=2, max_len=64)
    sp = SamplingParams(max_tokens=4)
    with pytest.raises(TypeError, match="TreeBudget"):  # was AttributeError: no attribute 'max_nodes', mid-step
        llm.generate("abcabc", sp, budget={"gen-0": TreeBudget(4, 4, 1)})
    assert len(llm.generate("abcabc", sp, budget=TreeBudget(4, 4, 1))[0].token_ids) == 4
