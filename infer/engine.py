"""The speculative decoding engine: schedule -> draft -> verify -> commit, with continuous batching.

Each call of ``step`` does, for the requests it holds (each in its own KV slot):
  schedule  admit waiting requests into free slots; run (a chunk of) prefill for new ones and
            sample their first token (the *root*: known, not yet run through the target)
  draft     ``drafter.propose`` a tree under each request's TreeBudget (max_nodes 0: root only)
  verify    one target forward over all trees (padded to the widest), then the acceptance rule:
            ``greedy_accept`` at temperature 0, ``stochastic_accept`` otherwise
  commit    keep the accepted path's K/V in place, hand the committed tokens and their features
            to the drafter (a plain row's when it next drafts: ``_feed``), emit accepted drafts +
            the bonus token, apply the stop rules
The maths lives elsewhere (runner, verify.py, sampling.py, heads.tree); this file only routes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.heads.tree import DraftTree, TreeBudget, default_budget
from specdec.infer import sampling, verify
from specdec.infer.cache import CacheFullError, SlotAllocator, padding_groups
from specdec.infer.prefix_cache import PrefixCache
from specdec.infer.requests import Request, RequestOutput, SamplingParams
from specdec.infer.runner import TargetRunner

PLAIN = TreeBudget(max_nodes=0, max_depth=0, topk=0)
# Prompts prefilled in one forward may pad to at most 10% more tokens than they hold: padding
# costs linear and attention compute (32 Spec-Bench prompts, 39-1,334 tokens: 25% -> 870-900
# tok/s, 10% -> 1,100; one prompt per forward: 990-1,060, short prompts use the GEMMs poorly).
PREFILL_WASTE = 0.1
# Plain steps a row may hold back from its drafter (Engine._feed): bounds the features kept.
MAX_UNFED = 64

__all__ = ["Engine", "PLAIN", "RequestOutput", "SamplingParams", "StepStats"]


@dataclass
class StepStats:
    """What the last ``step`` did (read by the server's controller)."""

    batch_size: int = 0          # sequences verified (decode rows)
    tokens_verified: int = 0     # valid tree nodes scored by the target, roots included
    tokens_computed: int = 0     # rows x the widest row's nodes: every row is padded to it
    prefill_tokens: int = 0      # prompt tokens run this step
    cached_tokens: int = 0       # prompt tokens copied from the prefix cache instead
    seconds: float = 0.0
    decode_seconds: float = 0.0  # of which drafting + verification + commit (no prefill)
    accepted: dict = field(default_factory=dict)  # request id -> accepted draft tokens
    budgets: dict = field(default_factory=dict)   # request id -> TreeBudget used
    verified: dict = field(default_factory=dict)  # request id -> tree nodes verified (root included)


DEFAULT_MAX_LEN = 2048  # tokens per sequence (prompt + output) when the caller names none


def position_limit(target) -> int | None:
    """The positions the target was trained for (``max_position_embeddings``), if it says."""
    return getattr(getattr(target.model, "config", None), "max_position_embeddings", None)


def context_length(target, max_len: int | None) -> int:
    """The KV length per sequence: ``max_len``, or DEFAULT_MAX_LEN within the target's positions.
    A ``max_len`` past the positions the target was trained for (``max_position_embeddings``)
    is refused, as vLLM refuses such a ``max_model_len``: its output there is not to be trusted."""
    limit = position_limit(target)
    if max_len is None:
        return min(DEFAULT_MAX_LEN, limit or DEFAULT_MAX_LEN)
    if limit and max_len > limit:
        raise ValueError(f"max_len={max_len} is past the {limit} positions target {target.name!r} "
                         "was trained for (its max_position_embeddings)")
    return max_len


class Engine:
    """``Engine(target, drafter=None, max_batch, max_len, dtype, device, prefill_chunk)``.

    prefill_chunk: at most this many prompt tokens are prefilled per step (None: whole prompts),
    so a long new prompt does not stall the running sequences.
    prefix_cache_bytes: keep prefilled prompts' K/V up to this size and reuse the longest common
    prefix for later prompts (``infer/prefix_cache.py``; 0: off).
    """

    def __init__(self, target, drafter=None, max_batch: int = 8, max_len: int | None = None, dtype=None,
                 device=None, prefill_chunk: int | None = None, impl: str = "auto", prefix_cache_bytes: int = 0):
        self.target, self.drafter = target, drafter
        max_len = context_length(target, max_len)
        spec = drafter.feature_spec if drafter is not None else None
        self.runner = TargetRunner(target, max_batch, max_len, dtype, device, feature_spec=spec, impl=impl)
        self.device, self.max_len = self.runner.device, max_len
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 or None, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 (0: off), got {prefix_cache_bytes} bytes")
        # the drafter's own bound on the prompt features it reads (None: all; see PrefixCache)
        tail = getattr(drafter, "feature_tail", None)
        self.prefix_cache = PrefixCache(prefix_cache_bytes, feature_tail=tail) if prefix_cache_bytes > 0 else None
        self.slots = SlotAllocator(max_batch)
        self.eos_ids = set(target.eos_token_ids)
        self.vocab_size = target.vocab_size
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.last_step = StepStats()
        if drafter is not None:
            drafter.reset(max_batch, max_len)
            own = getattr(drafter, "default_budget", None)  # a TreeBudget, or a method of the device
            own = own(self.device) if callable(own) else own
            self.default_budget = own or default_budget(self.device)
        else:
            self.default_budget = PLAIN

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id, prompt_ids, params: SamplingParams | None = None) -> None:
        """Queue a request; it gets a KV slot at the next step with one free."""
        if request_id in self.running or any(r.id == request_id for r in self.waiting):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:  # an embedding lookup would fail mid-step, for the whole batch
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} are outside the target's "
                             f"vocabulary (0..{self.vocab_size - 1})")
        if len(prompt) >= self.max_len:
            raise CacheFullError(f"request {request_id!r}: prompt of {len(prompt)} tokens leaves no "
                                 f"room under max_len={self.max_len}")
        params = params or SamplingParams()
        self.waiting.append(Request(request_id, prompt, params, self.target.tokenizer, self.device))

    def abort(self, request_id) -> bool:
        """Drop a request (waiting or running); True if it existed."""
        for r in self.waiting:
            if r.id == request_id:
                self.waiting.remove(r)
                return True
        if request_id in self.running:
            self._release(self.running.pop(request_id))
            return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self, budget: TreeBudget | dict | None = None) -> list[RequestOutput]:
        """One engine iteration; returns one output (a delta) per request that advanced."""
        t0 = time.perf_counter()
        stats = StepStats()
        self._admit(stats)
        decoding = [r for r in self.running.values() if r.root is not None]
        prefilling = [r for r in self.running.values() if r.root is None]
        outputs = self._prefill(prefilling, stats) if prefilling else []
        if decoding:
            t1 = time.perf_counter()
            outputs += self._decode(sorted(decoding, key=lambda r: r.slot), budget, stats)
            stats.decode_seconds = time.perf_counter() - t1
        stats.seconds = time.perf_counter() - t0
        self.last_step = stats
        return outputs

    def _admit(self, stats: StepStats) -> None:
        while self.waiting and len(self.slots):
            r = self.waiting.pop(0)
            r.slot, r.t_start = self.slots.allocate(), time.perf_counter()
            self.running[r.id] = r
            if self.prefix_cache is not None:
                stats.cached_tokens += self._reuse_prefix(r)

    def _reuse_prefix(self, r: Request) -> int:
        """Copy the longest cached prefix of r's prompt into its slot. -> tokens reused."""
        hit = self.prefix_cache.lookup(r.prompt)
        if hit is None:
            return 0
        entry, n = hit.entry, hit.length
        self.runner.cache.copy_in(r.slot, entry.keys, entry.values, n)
        if self.drafter is not None:
            r.feature_start, features = entry.cached_features(n)
            if features is not None:
                r.prompt_features.append(features)
        r.prefilled = r.cached = n
        return n

    def _remember_prompt(self, r: Request, features: dict | None) -> None:
        """Copy a just-prefilled prompt's K/V (and its features) into the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(r.prompt, lambda: self.runner.cache.copy_out(r.slot, len(r.prompt)), features)

    def _remember_sequence(self, r: Request) -> None:
        """Cache a finished sequence (prompt + the output whose K/V is in its slot) in place of its
        prompt's entries (PrefixCache.store): the next turn of a chat re-sends both."""
        cache = self.prefix_cache
        n = min(r.kv_len, len(r.prompt) + len(r.out))  # tokens past eos or a stop were never emitted
        if cache is None or n <= len(r.prompt):
            return
        features = None
        if self.drafter is not None:  # the prompt's, each commit's, then the plain steps not yet fed
            if r.kept_features is None:
                return
            parts = r.kept_features + ([_unfed_features(r)] if r.unfed else [])
            m = n - r.feature_start  # the kept features start where the prompt's did
            features = {k: torch.cat([p[k] for p in parts])[:m] for k in parts[0]}
            if any(len(v) < m for v in features.values()):
                return
        cache.store((r.prompt + r.out)[:n], lambda: self.runner.cache.copy_out(r.slot, n), features,
                    reply_from=len(r.prompt))

    def _prefill(self, reqs: list[Request], stats: StepStats) -> list[RequestOutput]:
        """Prefill (a chunk of) each new prompt; a finished prefill samples the first token."""
        budget = self.prefill_chunk or sum(len(r.prompt) for r in reqs)
        chunks, left = [], budget
        for r in reqs:
            todo = len(r.prompt) - r.prefilled
            n = min(todo, left)
            # A prompt that fits in one step's budget waits for the next step rather than being
            # split: its rest would start past position 0 and need the masked attention path
            # (~1.7x the causal kernel's time on a 1,000-token chunk).
            if n <= 0 or (chunks and n < todo <= budget):
                break
            chunks.append((r, r.prompt[r.prefilled:r.prefilled + n]))
            left -= n
        logits, feats = [None] * len(chunks), [None] * len(chunks)
        for group in padding_groups([len(c) for _, c in chunks], PREFILL_WASTE):
            lg, ft = self.runner.prefill_batch([chunks[i][0].slot for i in group], [chunks[i][1] for i in group],
                                               [chunks[i][0].prefilled for i in group])
            for j, i in enumerate(group):
                logits[i], feats[i] = lg[j], ft[j]
        outputs = []
        for b, (r, chunk) in enumerate(chunks):
            r.prefilled += len(chunk)
            stats.prefill_tokens += len(chunk)
            if self.drafter is not None:
                r.prompt_features.append(feats[b])
            if r.prefilled < len(r.prompt):
                continue
            joined = None
            if self.drafter is not None:
                joined = {k: torch.cat([f[k] for f in r.prompt_features]) for k in r.prompt_features[0]}
                self.drafter.prefill(r.slot, torch.tensor(r.prompt, device=self.device), joined)
                r.prompt_features = []
                if self.prefix_cache is not None:  # the finished sequence is cached with its features
                    r.kept_features = [joined]
            self._remember_prompt(r, joined)
            r.kv_len = len(r.prompt)
            r.root = self._first_token(r, logits[b])
            outputs.append(self._emit(r, [r.root]))
        return outputs

    def _first_token(self, r: Request, logits: torch.Tensor) -> int:
        if r.params.greedy:
            return int(sampling.greedy_tokens(logits))
        temperature, top_k, top_p = sampling.sampling_tensors([r.params], self.device)
        probs = sampling.process_logits(logits[None], temperature, top_k, top_p)  # [1, V]
        return int(sampling.sample(probs, r.uniforms(1)))

    def _decode(self, reqs: list[Request], budget, stats: StepStats) -> list[RequestOutput]:
        outputs, live = [], []
        for r in reqs:  # a sequence whose root no longer fits in the cache ends here
            if r.kv_len >= self.max_len:
                outputs.append(self._emit(r, [], reason="length"))
            else:
                live.append(r)
        if not live:
            return outputs
        budgets = [self._budget_for(r, budget) for r in live]
        tree, sampled_q = self._draft(live, budgets)
        slots, base_lens = [r.slot for r in live], [r.kv_len for r in live]
        logits, feats = self.runner.verify(slots, tree, base_lens)              # [B, N, V]
        n_acc, path, bonus = self._accept(live, tree, logits, sampled_q)
        n_list, bonus_list = n_acc.tolist(), bonus.tolist()
        if max(n_list) > 0:  # roots already sit at base_len: only accepted drafts move
            self.runner.commit(slots, base_lens, path, n_acc)
        stats.batch_size, stats.tokens_verified = len(live), int(tree.valid.sum())
        stats.tokens_computed = len(live) * tree.num_nodes
        row_nodes = tree.valid.sum(1).tolist()
        plain_feats = None  # plain rows' features, kept for the drafter's deferred commit (_feed)
        if self.drafter is not None and any(bud.max_nodes == 0 for bud in budgets):
            # a copy when the step was wider: a view would keep every tree node's features alive
            plain_feats = {k: v[:, 0] if v.shape[1] == 1 else v[:, 0].clone() for k, v in feats.items()}
        for b, r in enumerate(live):
            drafts = []  # a plain row (or no drafter) commits its root alone
            if self.drafter is not None and budgets[b].max_nodes == 0:
                r.unfed.append((plain_feats, b, r.root))
                if len(r.unfed) >= MAX_UNFED:
                    self._feed(r)
            elif self.drafter is not None:
                nodes = path[b, :n_list[b] + 1]                                  # [n+1] root first
                committed = tree.tokens[b, nodes]  # _draft fed the row's plain steps before it drafted
                row_feats = {k: v[b, nodes] for k, v in feats.items()}
                self.drafter.commit(r.slot, committed, row_feats)
                if r.kept_features is not None:
                    r.kept_features.append(row_feats)
                drafts = committed[1:].tolist()
            r.kv_len += n_list[b] + 1
            r.root = bonus_list[b]
            r.accepted.append(n_list[b])
            stats.accepted[r.id], stats.budgets[r.id] = n_list[b], budgets[b]
            stats.verified[r.id] = int(row_nodes[b])
            outputs.append(self._emit(r, drafts + [r.root]))
        return outputs

    def _feed(self, r: Request) -> None:
        """Give the drafter the plain steps it has not seen, as one commit (a drafter takes
        commits of any length). Deferred because plain rows fill big batches, where committing
        every row every step (the hybrid's histories, the head's pending features) cost 1.3-1.5 ms
        of a ~60 ms step at batch 8 and 4.3 of ~180 at batch 32 (offline serve twin, bf16), for
        nothing until the row drafts again."""
        if not r.unfed:
            return
        tokens = torch.tensor([tok for _, _, tok in r.unfed], device=self.device)
        feats = _unfed_features(r)
        r.unfed.clear()
        self.drafter.commit(r.slot, tokens, feats)
        if r.kept_features is not None:
            r.kept_features.append(feats)

    def _budget_for(self, r: Request, budget) -> TreeBudget:
        chosen = budget.get(r.id) if isinstance(budget, dict) else budget
        chosen = chosen or self.default_budget
        if self.drafter is None or chosen.max_nodes == 0:
            return PLAIN
        room = self.max_len - r.kv_len - 1  # draft nodes that fit after the root
        if room <= 0:
            return PLAIN
        if chosen.max_nodes > room:
            chosen = TreeBudget(room, min(chosen.max_depth, room), chosen.topk)
        return chosen

    def _draft(self, reqs: list[Request], budgets: list[TreeBudget]):
        """Propose per distinct budget, then pad all rows into one tree batch. -> (tree, whether
        each row's draft tokens were sampled from draft_probs)."""
        roots = torch.tensor([r.root for r in reqs], device=self.device)     # [B]
        rows: list[tuple] = [None] * len(reqs)
        groups: dict[TreeBudget, list[int]] = {}
        for b, bud in enumerate(budgets):
            groups.setdefault(bud, []).append(b)
        for bud, members in groups.items():
            if bud.max_nodes == 0:
                for b in members:
                    rows[b] = (roots[b:b + 1], torch.full((1,), -1, device=self.device),
                               torch.ones(1, dtype=torch.bool, device=self.device), None)
                continue
            for b in members:
                self._feed(reqs[b])
            slots = torch.tensor([reqs[b].slot for b in members], device=self.device)
            t = self.drafter.propose(slots, roots[members], bud)
            for j, b in enumerate(members):
                q = None if t.draft_probs is None else t.draft_probs[j]
                rows[b] = (t.tokens[j].to(self.device), t.parents[j].to(self.device),
                           t.valid[j].to(self.device), q)
        return _pad_trees(rows), [row[3] is not None for row in rows]

    def _accept(self, reqs: list[Request], tree: DraftTree, logits: torch.Tensor, sampled_q: list[bool]):
        """Acceptance per kind of row: greedy, sampled with draft_probs, sampled point-mass.
        -> n_accepted [B], path [B, N] (-1 padded), bonus [B]."""
        B = len(reqs)
        n_acc = torch.zeros(B, dtype=torch.long, device=self.device)
        if all(r.params.greedy for r in reqs):
            if tree.num_nodes == 1:  # plain greedy decoding
                root_only = torch.zeros(B, 1, dtype=torch.long, device=self.device)
                return n_acc, root_only, sampling.greedy_tokens(logits[:, 0])
            res = verify.verify_tree(tree, logits)  # one call for the batch: no per-kind split
            return res.n_accepted, res.path, res.bonus
        bonus = torch.zeros(B, dtype=torch.long, device=self.device)
        path = torch.full((B, tree.num_nodes), -1, dtype=torch.long, device=self.device)
        kinds: dict[tuple, list[int]] = {}
        for b, r in enumerate(reqs):
            kinds.setdefault((r.params.greedy, sampled_q[b]), []).append(b)
        for (greedy, has_q), members in kinds.items():
            idx = torch.tensor(members, device=self.device)
            sub = DraftTree(tokens=tree.tokens[idx], parents=tree.parents[idx], valid=tree.valid[idx],
                            draft_probs=tree.draft_probs[idx] if has_q else None)
            temperature, top_k, top_p = sampling.sampling_tensors([reqs[b].params for b in members], self.device)
            uniforms = None
            if not greedy:
                # Each row draws as many uniforms as its own tree has nodes: up to its last valid
                # one, not the width the batch (or its drafter's group) padded it to, so a seeded
                # request samples the same tokens in any batch.
                uniforms = torch.full((len(members), tree.num_nodes), 0.5, device=self.device)
                for j, (b, width) in enumerate(zip(members, _own_widths(sub.valid))):
                    uniforms[j, :width] = reqs[b].uniforms(width)
            res = verify.verify_tree(sub, logits[idx], temperature, top_k, top_p, uniforms=uniforms)
            n_acc[idx], bonus[idx] = res.n_accepted, res.bonus
            path[idx, :res.path.shape[1]] = res.path
        return n_acc, path, bonus

    # ------------------------------------------------------------------ outputs and stop rules
    def _emit(self, r: Request, new_tokens: list[int], reason: str | None = None) -> RequestOutput:
        out = r.append(new_tokens, self.eos_ids, reason)
        if r.finished:
            self.running.pop(r.id, None)
            self._remember_sequence(r)
            self._release(r)
        return out

    def _release(self, r: Request) -> None:
        if r.slot is None:
            return
        if self.drafter is not None:
            self.drafter.release(r.slot)
        r.unfed.clear()
        self.slots.release(r.slot)
        r.slot = None


def _own_widths(valid: torch.Tensor) -> list[int]:
    """[B, N] valid -> each row's nodes up to its last valid one (the root, node 0, always is);
    one host sync for the batch."""
    index = torch.arange(valid.shape[1], device=valid.device)
    return (torch.where(valid, index, 0).amax(1) + 1).tolist()


def _pad_trees(rows: list[tuple]) -> DraftTree:
    """Per-row (tokens [n], parents [n], valid [n], draft_probs [n, V] | None) -> one DraftTree
    padded to the widest row; padding nodes are invalid children of the root."""
    B, N = len(rows), max(row[0].shape[0] for row in rows)
    dev = rows[0][0].device
    tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
    parents = torch.zeros(B, N, dtype=torch.long, device=dev)
    valid = torch.zeros(B, N, dtype=torch.bool, device=dev)
    qs = [row[3] for row in rows if row[3] is not None]
    draft_probs = None
    if qs:
        draft_probs = torch.zeros(B, N, qs[0].shape[-1], dtype=qs[0].dtype, device=dev)
    for b, (tok, par, val, q) in enumerate(rows):
        n = tok.shape[0]
        tokens[b, :n], parents[b, :n], valid[b, :n] = tok, par, val
        if q is not None:
            draft_probs[b, :n] = q
    parents[:, 0] = -1
    return DraftTree(tokens=tokens, parents=parents, valid=valid, draft_probs=draft_probs)


def _unfed_features(r: Request) -> dict[str, torch.Tensor]:
    """The features of a row's plain steps not yet fed to the drafter, stacked {name: [n, ...]}."""
    return {k: torch.stack([f[k][b] for f, b, _ in r.unfed]) for k in r.unfed[0][0]}
