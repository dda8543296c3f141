"""Batch-aware adaptive speculation: pick each step's tree budget per request.

The controller sees the running requests before every engine step and returns a
``TreeBudget`` per request (``max_nodes == 0`` = plain decoding for that request);
after the step it reads ``Engine.last_step`` to update the cost model and the
acceptance estimates (``costmodel.py``). Policies (``--spec-policy``):

* ``goodput`` (default): maximise the batch's expected tokens per second,
      goodput = Σ_r E_r(level_r) / t(B, Σ_r (1 + nodes(level_r)))
  over per-request levels of a small budget grid, with hysteresis (a new plan
  must beat the current one by ``margin`` for ``patience`` steps in a row).
  How much to speculate is then settled by measurement, not by the models:
  a ``ThroughputGate`` per batch-size bucket (per request for one decoding
  alone) compares the measured decode
  tokens/s of plain decoding, the models' plan and the full tree for everyone,
  in pairs of adjacent runs, and plays the winner (a short run of the others
  every ``explore``-th step). A wrong
  cost or acceptance estimate cannot make the server slower than the best of
  plain and always-on for long.
* ``always``: one fixed budget for everyone (classic speculative decoding).
* ``threshold``: the fixed budget while the batch is smaller than
  ``--spec-disable-batch-size``, plain above (vLLM / LMDeploy style).
* ``thompson``: a Thompson-sampling bandit over uniform budgets, rewarded by the
  measured goodput of the step, one bandit per batch-size bucket (EESD style).
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specdec.heads.tree import TreeBudget

from specdec.infer.gate import ThroughputGate

from .costmodel import AcceptanceTracker, ConfidenceBlend, CostModel

POLICIES = ("goodput", "always", "threshold", "thompson")
BIG_BUCKET = 2  # batch-size bucket 2 = 4-7 sequences (``ThompsonPolicy.bucket``)
DIP_STEPS = 8  # decisions the goodput policy remembers a batch size for (``GoodputPolicy.choose``)
MODEL_PRIOR_WEIGHT = 2.0  # pairs the models' call is worth where a big batch starts plain (``_seed_behind``)
# Steps in a row that the model arm plays one plan for the same requests before asking the models
# again. Planning is Python on the engine's hot path, ~0.5 ms alone and ~1 ms beside a streaming
# server's event loop: at batch 2, where the model arm led, ~4% of its steps (step logs, session 44).
# Its estimates move over tens of steps, so a plan 3 steps old is as good; hysteresis counts plans.
REPLAN_STEPS = 4
# A batch of 4 or more new to the gate starts speculating (the models' call) only where the nearest
# smaller batch size measured plain decoding at most this fraction of its speculating leader's speed.
SPEC_START_LEAD = 0.8


def budget_grid(nodes=(0, 2, 4, 8, 16, 32), max_depth: int = 6, topk: int = 4) -> list[TreeBudget]:
    """Budget levels, cheapest first: n draft nodes spread over depth min(n, max_depth).

    ``(0, 2, 8)`` with max_depth 6, topk 4 -> nodes/depth/topk (0,0,1) (2,2,1) (8,6,2).
    """
    levels = []
    for n in sorted(set(int(x) for x in nodes)):
        if n < 0:
            raise ValueError(f"speculation budget {n} must be >= 0")
        depth = min(n, max_depth)
        width = 1 if n == 0 else min(topk, math.ceil(n / depth))
        levels.append(TreeBudget(max_nodes=n, max_depth=depth, topk=width))
    if levels[0].max_nodes != 0:  # plain decoding is always an option
        levels.insert(0, TreeBudget(max_nodes=0, max_depth=0, topk=1))
    return levels


@dataclass
class StepObservation:
    """What one engine step tells the controller (read from ``Engine.last_step``)."""

    batch_size: int  # sequences in the verification forward
    tokens: int  # tokens verified in total (roots + draft nodes)
    seconds: float  # wall time of the whole step
    accepted: dict = field(default_factory=dict)  # request id -> accepted draft tokens
    verified: dict = field(default_factory=dict)  # request id -> tree nodes verified, root included
    drafted: dict = field(default_factory=dict)  # request id -> draft depth of the budget used
    prefill_tokens: int = 0  # prompt tokens prefilled in the same step (they cost time too)
    decode_seconds: float = 0.0  # the decode part of ``seconds`` (0: unknown, use ``seconds``)
    groups: int = 0  # distinct non-plain budgets (one drafter call each)
    confidence: dict = field(default_factory=dict)  # request id -> Σ draft tree scores (ConfidenceTap)

    @property
    def goodput(self) -> float:
        """Tokens added per second: every decoding sequence adds its accepted drafts + 1."""
        return (sum(self.accepted.values()) + len(self.accepted)) / max(self.seconds, 1e-6)


class Policy:
    """Chooses a level index (into the grid) per request id."""

    name = "base"

    def choose(self, ctl: "SpeculationController", rids: list) -> dict:
        raise NotImplementedError

    def observe(self, ctl: "SpeculationController", obs: StepObservation) -> None:
        pass

    def arm(self) -> str | None:
        """What the last ``choose`` played, for the step log (None: nothing beyond the levels)."""
        return None


class AlwaysPolicy(Policy):
    name = "always"

    def __init__(self, level: int):
        self.level = level

    def choose(self, ctl, rids):
        return {r: self.level for r in rids}


class ThresholdPolicy(Policy):
    name = "threshold"

    def __init__(self, level: int, disable_batch_size: int):
        self.level, self.disable_batch_size = level, disable_batch_size

    def choose(self, ctl, rids):
        level = self.level if len(rids) < self.disable_batch_size else 0
        return {r: level for r in rids}


class ThompsonPolicy(Policy):
    """Gaussian Thompson sampling over uniform budget levels, per batch-size bucket.

    Each arm keeps discounted sums of reward (goodput, tokens/s); a sample is
    drawn from N(mean, var / n) and the best sample is played. Unplayed arms
    are sampled optimistically so each is tried. Discounting keeps it tracking a
    changing load; bucketing by log2(batch) makes it batch-aware.
    """

    name = "thompson"

    def __init__(self, num_levels: int, discount: float = 0.98, seed: int | None = 0):
        self.num_levels, self.discount = num_levels, discount
        self.rng = random.Random(seed)
        self.stats: dict[int, np.ndarray] = {}  # bucket -> [L, 3] (n, Σr, Σr²)
        self._played: tuple[int, int] | None = None

    @staticmethod
    def bucket(batch: int) -> int:
        return max(batch, 1).bit_length() - 1  # 1 | 2-3 | 4-7 | 8-15 | ...

    def sample_arm(self, bucket: int) -> int:
        s = self.stats.setdefault(bucket, np.zeros((self.num_levels, 3)))
        n, tot, sq = s[:, 0], s[:, 1], s[:, 2]
        played = n > 0.5
        if not played.all():  # try every arm once before trusting any estimate
            return int(self.rng.choice(np.flatnonzero(~played).tolist()))
        mean = tot / n
        var = np.maximum(sq / n - mean ** 2, 0.0)
        # Pooled variance floor: with one sample an arm's own variance is 0.
        floor = max(float(np.mean(var)), 1e-4 * float(np.mean(mean ** 2)), 1e-12)
        draws = [self.rng.gauss(mean[i], math.sqrt((var[i] + floor) / n[i])) for i in range(self.num_levels)]
        return int(np.argmax(draws))

    def choose(self, ctl, rids):
        bucket = self.bucket(len(rids))
        arm = self.sample_arm(bucket)
        self._played = (bucket, arm)
        return {r: arm for r in rids}

    def reward(self, bucket: int, arm: int, value: float) -> None:
        s = self.stats.setdefault(bucket, np.zeros((self.num_levels, 3)))
        s *= self.discount
        s[arm] += (1.0, value, value * value)

    def observe(self, ctl, obs):
        if self._played is not None and obs.accepted:
            self.reward(*self._played, obs.goodput)
        self._played = None

    def arm(self):
        return None if self._played is None else f"level {self._played[1]}"


class GoodputPolicy(Policy):
    """argmax of predicted goodput over per-request levels, with hysteresis; then, per batch-size
    bucket, a ``ThroughputGate`` plays whichever measured fastest in decode tokens/s: plain
    decoding, the models' plan, or the full tree for everyone (``gate=False``: the models alone,
    with one speculative step every ``explore_every`` plain ones to refresh their estimates)."""

    name = "goodput"
    ARMS = ("plain", "model", "full")  # cheapest first
    PRIOR_DECAY = 0.9  # per released request, in what requests decoding alone measured
    PRIOR_MIN = 2.0  # decayed weight of it before it seeds the next one (three requests: 1 + 0.9 + 0.81)

    def __init__(self, margin: float = 0.05, patience: int = 3, explore_every: int = 64, gate: bool = True,
                 gate_explore: int = 32):
        self.margin, self.patience = margin, patience
        self.explore_every = explore_every  # a plain-only plan never learns what speculation costs
        # Explore in runs of 3 (the first step after a switch is not sampled): every 8 steps of a
        # batch-size bucket until each arm has 4 pairs (a 64-token request is ~50 steps), then
        # every 32, the arms behind in turn, one more than 10% slower 4x rarer: ~3-9% of steps.
        # (With 20%, a model plan ~15% behind plain at batch 4-32 was still replayed every 32
        # steps, each replay paying two switches too; goodput ran 6-12% under plain there.)
        self.gate = ThroughputGate(decay=0.95, min_samples=4, explore=gate_explore, run=3, arms=self.ARMS,
                                   clear=0.9, warmup_explore=max(gate_explore // 4, 4)) if gate else None
        self.current: dict = {}
        # Requests decoding alone, measured so far: arm -> decayed [n, Σx] of x = log tokens/s
        # relative to plain decoding, one x per released request (the last ~10 count).
        self.alone_prior: dict = {}
        self._streak = 0
        self._planned_at = -2  # ctl.steps when the models last planned
        self._plain_steps = 0
        self._played: tuple | None = None
        self._sizes: deque = deque(maxlen=DIP_STEPS)  # batch sizes of the last decisions
        self._reused: tuple | None = None  # (requests, ctl.steps, steps played, plan) of the model arm

    def choose(self, ctl, rids):
        if not rids:
            return {}
        # The regime follows the load, not its dips: under closed-loop load a finished request
        # leaves the batch one short for the 1-3 steps until its client's next one is admitted
        # and prefilled. At concurrency 4 those steps at batch 3 played the batch-2-3 leader (a
        # full tree, learnt at concurrency 2, at ~0.7x plain decoding's rate at batch 3),
        # after the drafter caught up on every row's plain steps (the level read 0.86-0.91x plain).
        self._sizes.append(len(rids))
        size = max(self._sizes)
        bucket = ThompsonPolicy.bucket(size)
        allowed = self._arms(bucket) if self.gate is not None else None
        # A request decoding alone is its own regime: at batch 1 whether speculation pays is a
        # property of the request (a copy-heavy one accepts 3-5 tokens a step, an open-ended
        # one 0-1), and one gate for all of them followed whichever came first: a hard first
        # request handed plain decoding the lead for ~950 steps. Offline twin of the server (16
        # Spec-Bench requests one at a time, hybrid, bf16): 0.92x the tokens/s of always-on with
        # one gate, 1.01x with a gate per request.
        regime = ("alone", rids[0]) if size == 1 else bucket
        if (size == 1 and self.gate is not None and regime not in self.gate.leader
                and (prior := self._alone_prior())):
            # ... but a new request starts from what the ones before it measured, not from scratch:
            # learning each request's arms anew explored 3 steps of 8 for most of a 128-token
            # answer (Spec-Bench at concurrency 1, hybrid, bf16, AVX2 CPU: 33.2 tok/s against
            # always-on's 36.8). Its own pairs then overrule the prior where it differs.
            self.gate.seed(regime, *prior)
        if allowed == ("plain",):  # big batches where speculation lost: no models to consult
            self._played = (regime, self.gate.choose(regime, allowed=allowed))
            return dict.fromkeys(rids, 0)
        if len(ctl.nodes) < 2 or self.gate is None:  # plain is the only level, or no gate
            plan = self._model_plan(ctl, rids, ctl.expected_tokens(rids))
            return plan if len(ctl.nodes) < 2 else self._explore_without_gate(plan, rids)
        # The models are consulted only where their answer is used: a bucket's first decision
        # and the model arm's steps. Planning costs ~0.2 ms of Python at batch 4 and ~0.5 at
        # batch 16 (1-2% of a step there), which a plain leader would pay every step for nothing.
        plan = default = None
        if regime not in self.gate.leader:
            big = bucket >= BIG_BUCKET
            plain_below = self._plain_below(bucket, measured=big)
            if big:
                start_plain = plain_below is None or plain_below > SPEC_START_LEAD
            else:
                start_plain = plain_below is not None and plain_below >= 1.0  # plain leads there
            if start_plain:
                # Speculation only gets dearer as batches grow: a new, bigger batch size starts plain
                # where the next smaller one decodes plainly, rather than from the models' guess (their
                # cost model is fitted mostly on smaller batches), and lets the pairs promote
                # speculation. So does a batch of 4 or more where no smaller one measured speculation
                # against plain (a server that starts under heavy load, its small batches seen only for
                # the few steps of the ramp): there a wrong full-tree start costs up to 10x a plain step
                # per step until the pairs demote it (offline twin of a fresh server at concurrency 16:
                # 0.62x plain), a wrong plain start only the gain of the steps until they promote
                # speculation. (Batch 4-7 too: a fresh server's ramp passes it, and the level's tail
                # comes back to it.) And so does one where the smaller batch speculated but
                # measured plain decoding within ``SPEC_START_LEAD`` of it: a small lead there is
                # gone one bucket up (step logs, concurrency 4: the models' plan led batch 2-3 at
                # 1.05x plain, and batch 4-7, started on the full tree, ran it at 0.63x for its
                # first ~35 steps until the pairs demoted it).
                default = "plain"
                plan = self._seed_behind(ctl, rids, regime)
            else:
                # A bucket's first leader, where the models would speculate, is the full tree: at
                # batch 1 their plan picked 3-4 nodes of 12 and the pairs (tokens per step swinging
                # from 1 to 13 with the copies) seldom overturned it. Offline twin of the server, 24
                # requests at concurrency 1 (hybrid, bf16): 0.90-0.97x the tokens/s of always-on;
                # starting from the full tree 1.00-1.08x. At concurrency 4, where plain wins, the
                # pairs still demote it (0.95-1.09x of plain, as before).
                plan, ratio = self._speculating_plan(ctl, rids)
                default = "full" if ratio > 1.0 else "plain"
        arm = self.gate.choose(regime, default=default, allowed=allowed)
        self._played = (regime, arm)
        if arm == "full":
            return dict.fromkeys(rids, len(ctl.nodes) - 1)
        if arm == "plain":
            return dict.fromkeys(rids, 0)
        return self._model_arm(ctl, rids, plan)

    def _model_arm(self, ctl, rids, plan=None) -> dict:
        """The model arm's plan: ``plan`` if the models just made it, else the one played the step
        before for the same requests while it is under ``REPLAN_STEPS`` steps old, else a new one."""
        key, last = tuple(rids), self._reused
        if plan is None and last is not None and last[0] == key and last[1] == ctl.steps - 1 \
                and last[2] < REPLAN_STEPS:
            self._reused = (key, ctl.steps, last[2] + 1, last[3])
            self._planned_at = ctl.steps  # the next plan continues this one's hysteresis
            return last[3]
        plan = plan if plan is not None else self._speculating_plan(ctl, rids)[0]
        self._reused = (key, ctl.steps, 1, plan)
        return plan

    def _alone_prior(self):
        """(arm -> log tokens/s vs plain, weight) to seed a request decoding alone with, from the
        requests before it (None until three have been measured). Worth as many pairs as the gate
        needs to trust an arm, so the new request explores at the slow pace at once."""
        known = {a: s / n for a, (n, s) in self.alone_prior.items() if n >= self.PRIOR_MIN}
        if not known:
            return None
        return {self.ARMS[0]: 0.0, **known}, self.gate.min_samples

    def release(self, rid) -> None:
        """A request ended: what it measured decoding alone joins the prior of the next ones."""
        self.current.pop(rid, None)
        if self.gate is None:
            return
        regime = ("alone", rid)
        lead = self.gate.leader.get(regime)
        own = self.gate.speeds(regime, reference=lead)  # from its own pairs only
        plain = self.ARMS[0]
        if plain in own:
            shift = -own[plain]
        else:  # linked to plain only through the prior: only the challengers it measured count
            n, s = self.alone_prior.get(lead, (0.0, 0.0))
            shift = s / n if n > 0 else None
            own.pop(lead, None)
        if shift is not None:
            d = self.PRIOR_DECAY
            for arm, x in own.items():
                if arm != plain:
                    n, s = self.alone_prior.get(arm, (0.0, 0.0))
                    self.alone_prior[arm] = [d * n + 1.0, d * s + x + shift]
        self.gate.forget(regime)

    def _plain_below(self, bucket: int, measured: bool = False):
        """Plain decoding's tokens/s relative to the leader at the nearest smaller batch-size bucket
        that has one (1.0: plain leads there; None: no such bucket, or plain unrated there);
        measured: only buckets where plain's standing is known count."""
        g = self.gate
        b = next((b for b in range(bucket - 1, -1, -1)
                  if b in g.leader and (not measured or g.relative(b, "plain") is not None)), None)
        return None if b is None else g.relative(b, "plain")

    def _seed_behind(self, ctl, rids, regime) -> dict:
        """Where a big batch starts plain, the speculating arms the models predict slower than
        plain decoding start as if ``MODEL_PRIOR_WEIGHT`` pairs had measured them so: the gate then
        paces their runs by that (``EXPLORE_COST``) instead of trying each every 8th step until 4
        pairs trust it, and their own pairs overrule the guess as they come. A level's tail passes
        batch 13 to 4 in some 100 steps, each batch size new to the gate: offline twin of the server
        at concurrency 16, the tail speculated 3 steps in 11 at 0.2-0.5x plain's rate, and the
        models had put both arms at 0.3-0.5x. Arms predicted faster stay unknown: the models'
        optimism at big batches is what the plain start guards against. -> the model arm's plan."""
        exp = ctl.expected_tokens(rids)
        plain = ctl.predicted_goodput(rids, [0] * len(rids), exp, padded=True)
        full = ctl.predicted_goodput(rids, [len(ctl.nodes) - 1] * len(rids), exp, padded=True) / plain
        plan, model = self._speculating_plan(ctl, rids, exp)
        behind = {arm: math.log(r) for arm, r in (("model", model), ("full", full)) if r < 1.0}
        if behind:
            self.gate.seed(regime, {"plain": 0.0, **behind}, MODEL_PRIOR_WEIGHT)
        return plan

    def _speculating_plan(self, ctl, rids, exp=None) -> tuple[dict, float]:
        """The plan the model arm plays and its predicted tokens/s relative to plain decoding.
        The arm must speculate: the models' plan (hysteresis applied), or the best uniform
        level where that one is plain or, priced as the engine verifies it (every row padded to
        the widest tree), worth less: a mixed plan, one request drafting 12 nodes beside a plain
        one, computes 2 x 13 tokens, while ``best_plan`` charges it 14. ``exp``: the rows'
        ``ctl.expected_tokens``, if the caller has them already."""
        exp = ctl.expected_tokens(rids) if exp is None else exp  # [R, L]
        plan = self._model_plan(ctl, rids, exp)
        levels = [plan[r] for r in rids]
        uniform = [_best_uniform_level(ctl, exp)] * len(rids)
        padded = lambda lv: ctl.predicted_goodput(rids, lv, exp, padded=True)  # noqa: E731
        best, worth = uniform, padded(uniform)
        if any(levels) and (mine := padded(levels)) >= worth:
            best, worth = levels, mine
        return dict(zip(rids, best)), worth / padded([0] * len(rids))

    def _arms(self, bucket: int) -> tuple:
        """A speculating arm is left out of a bucket once a smaller batch measured it slower than
        plain decoding, or clearly (< ``clear`` x) slower than the best arm there: speculation only
        gets dearer as batches grow, and trying it on 8-32 sequences costs several plain steps per
        step (measured: the model arm at 1/3 of plain's rate at batch 16; with only the clearly
        slower arms left out, an offline twin of 8 clients still ran the plan on 9% of its
        batch-8 steps at 0.76x plain's rate, after batch 4 had measured it at 0.86x).
        Plain decoding is always allowed."""
        g, arms = self.gate, self.ARMS
        for smaller in range(bucket):
            speed = {a: g.relative(smaller, a) for a in self.ARMS}  # vs that bucket's leader
            known = [r for r in speed.values() if r is not None]  # an arm left out there has none
            if len(known) > 1:
                floor = max(g.clear * max(known), speed["plain"] or 0.0)
                arms = tuple(a for a in arms if a == "plain" or speed[a] is None or speed[a] >= floor)
        return arms

    def arm(self):
        return None if self._played is None else self._played[1]

    def observe(self, ctl, obs):
        if self._played is not None and obs.accepted:
            seconds = obs.decode_seconds or obs.seconds
            self.gate.record(*self._played, sum(obs.accepted.values()) + len(obs.accepted), seconds)
        self._played = None

    def _model_plan(self, ctl, rids, exp: np.ndarray) -> dict:
        best = best_plan(exp, ctl.used, lambda n, g: ctl.step_time(len(rids), n, g))
        cand = dict(zip(rids, best))
        # Requests that just joined take the new plan's level at once: nothing to flap from;
        # nor has anyone when the models were not asked the step before (another arm played).
        fresh, self._planned_at = self._planned_at != ctl.steps - 1, ctl.steps
        cur = {r: cand[r] if fresh else self.current.get(r, cand[r]) for r in rids}
        g_cur = ctl.predicted_goodput(rids, [cur[r] for r in rids], exp)
        g_new = ctl.predicted_goodput(rids, best, exp)
        self._streak = self._streak + 1 if g_new > g_cur * (1.0 + self.margin) else 0
        if self._streak >= self.patience:
            cur, self._streak = cand, 0
        self.current = cur
        return cur

    def _explore_without_gate(self, cur: dict, rids) -> dict:
        if any(cur.values()):
            self._plain_steps = 0
            return cur
        self._plain_steps += 1
        if self.explore_every and self._plain_steps >= self.explore_every:
            self._plain_steps = 0  # one cheap speculative step to refresh the estimates
            return {r: 1 for r in rids}
        return cur


def _best_uniform_level(ctl, exp: np.ndarray) -> int:
    """The non-plain level whose uniform plan the models rate best (exp [R, L] expected tokens)."""
    R = exp.shape[0]
    rated = [(float(exp[:, l].sum()) / ctl.step_time(R, R * (1 + ctl.used[l]), 1), l)
             for l in range(len(ctl.nodes)) if ctl.nodes[l] > 0]
    return max(rated)[1]


def best_plan(expected: np.ndarray, nodes: list[int], step_time) -> list[int]:
    """Per-request levels maximising Σ expected tokens / step_time(total tokens, draft groups).

    expected [R, L] tokens per step of request r at level l; nodes [L] draft
    nodes per level (tokens verified = 1 + nodes); draft groups = distinct
    non-plain levels in use (one drafter call each). Candidates: every uniform
    plan, and the plans met by a greedy walk that starts everyone plain and
    repeatedly applies the upgrade with the best marginal tokens per extra
    verified token. The greedy walk is exact when each request's E(nodes) is
    concave and the step time depends on total tokens only.
    """
    R, L = expected.shape
    count = [0] * L  # requests per level, for the number of draft groups
    count[0] = R
    groups = lambda: sum(1 for l in range(1, L) if count[l] and nodes[l] > 0)  # noqa: E731
    candidates = []
    for l in range(L):  # uniform plans (one drafter call at most)
        candidates.append((float(expected[:, l].sum()) / step_time(R * (1 + nodes[l]), int(nodes[l] > 0)), [l] * R))
    level = [0] * R
    total_e = float(expected[:, 0].sum())
    total_n = R * (1 + nodes[0])

    def upgrade(r):  # best-ratio move from r's current level, as a heap entry
        l0 = level[r]
        moves = [((expected[r, l] - expected[r, l0]) / (nodes[l] - nodes[l0]), l)
                 for l in range(l0 + 1, L) if nodes[l] > nodes[l0]]
        if not moves:
            return None
        ratio, l = max(moves)
        return (-ratio, r, l0, l) if ratio > 0 else None

    heap = [e for e in (upgrade(r) for r in range(R)) if e]
    heapq.heapify(heap)
    while heap:
        _, r, l0, l = heapq.heappop(heap)
        if level[r] != l0:
            continue
        total_e += expected[r, l] - expected[r, l0]
        total_n += nodes[l] - nodes[l0]
        level[r] = l
        count[l0] -= 1
        count[l] += 1
        candidates.append((total_e / step_time(total_n, groups()), list(level)))
        nxt = upgrade(r)
        if nxt:
            heapq.heappush(heap, nxt)
    return max(candidates, key=lambda c: c[0])[1]


class SpeculationController:
    """Cost model + acceptance tracker + a policy; one per server."""

    def __init__(self, policy: Policy, grid: list[TreeBudget], cost: CostModel | None = None,
                 acceptance_prior: float = 0.6):
        self.policy, self.grid = policy, grid
        self.nodes = [b.max_nodes for b in grid]
        self.depths = [b.max_depth for b in grid]
        # Draft nodes a request really gets verified per level: a drafter that prunes (retrieval
        # with no match, the hybrid's min_score, a short EAGLE tree) fills a 12-node budget with
        # ~3 on this CPU, and the verification cost follows the nodes verified, not the budget.
        self.used = [float(n) for n in self.nodes]
        self.cost = cost or CostModel()
        self.acceptance = AcceptanceTracker(max(max(self.depths), 1), len(grid), prior=acceptance_prior)
        self.confidence = ConfidenceBlend()
        self.last_plan: dict = {}  # request id -> level index of the step in flight
        self.last_arm: str | None = None  # the policy's arm for the step in flight (``Policy.arm``)
        self.steps = 0

    def expected_tokens(self, rids) -> np.ndarray:  # [R, L]
        exp = self.acceptance.expected_tokens(rids, self.depths)
        for i, rid in enumerate(rids):
            exp[i] = self.confidence.adjust(rid, exp[i])
        return exp

    def step_time(self, batch: int, tokens: float, groups: int) -> float:
        return self.cost.predict(batch, tokens, 0, groups)

    def predicted_goodput(self, rids, levels, exp=None, padded: bool = False) -> float:
        """Expected tokens per second of a plan (a level per request). padded: priced as the
        engine verifies it, every row padded to the widest tree (``best_plan`` prices the nodes
        each request drafts, as a packed verification would)."""
        exp = self.expected_tokens(rids) if exp is None else exp
        if padded:
            tokens = len(levels) * (1 + max(self.used[l] for l in levels))
        else:
            tokens = sum(1 + self.used[l] for l in levels)
        groups = len({l for l in levels if self.nodes[l] > 0})
        gain = sum(exp[i, l] for i, l in enumerate(levels))
        return gain / self.step_time(len(rids), tokens, groups)

    def plan(self, rids: list) -> dict:
        """request id -> TreeBudget for the next step (every id gets one)."""
        levels = self.policy.choose(self, list(rids)) if rids else {}
        self.last_plan, self.last_arm = levels, self.policy.arm()
        return {r: self.grid[levels[r]] for r in rids}

    def observe(self, obs: StepObservation) -> None:
        """Feed back what the step measured (call once per step, after ``plan``)."""
        self.steps += 1
        self.cost.observe(obs.batch_size, obs.tokens, obs.seconds, obs.prefill_tokens, obs.groups)
        for rid, acc in obs.accepted.items():
            level = self.last_plan.get(rid, 0)
            if self.nodes[level] == 0:
                continue  # a plain step says nothing about acceptance
            if rid in obs.verified:
                self._learn_used(level, obs.verified[rid] - 1)
            hist = self.acceptance.expected_tokens([rid], [self.depths[level]])[0, 0] - 1.0
            self.confidence.observe(rid, level, acc, hist, obs.confidence.get(rid))
            self.acceptance.observe(rid, level, obs.drafted.get(rid, self.depths[level]), acc)
        self.policy.observe(self, obs)

    def _learn_used(self, level: int, nodes: int, decay: float = 0.95) -> None:
        self.used[level] = decay * self.used[level] + (1 - decay) * min(nodes, self.nodes[level])
        for l in range(len(self.used) - 2, 0, -1):  # a smaller budget never uses more nodes
            self.used[l] = min(self.used[l], self.used[l + 1])

    def release(self, rid) -> None:
        self.acceptance.forget(rid)
        self.confidence.forget(rid)
        self.last_plan.pop(rid, None)
        if isinstance(self.policy, GoodputPolicy):
            self.policy.release(rid)


class ConfidenceTap:
    """Wraps a drafter to record Σ of each proposed tree's non-root scores per slot.

    The engine uses it as the drafter (every other attribute is the wrapped
    drafter's); the scheduler collects the sums after each step for the
    controller's ``ConfidenceBlend``. Drafters without scores record nothing.
    """

    def __init__(self, drafter):
        self._inner = drafter
        self._by_slot: dict[int, float] = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def propose(self, slots, roots, budget):
        tree = self._inner.propose(slots, roots, budget)
        if tree.scores is not None:
            conf = (tree.scores.float() * tree.valid)[:, 1:].clamp(0, 1).sum(1)  # [B] expected accepted drafts
            self._by_slot.update(zip(slots.tolist(), conf.tolist()))
        return tree

    def take(self) -> dict[int, float]:
        """slot -> Σ scores of the trees proposed since the last call."""
        out, self._by_slot = self._by_slot, {}
        return out


def make_controller(policy: str = "goodput", grid: list[TreeBudget] | None = None,
                    cost: CostModel | None = None, fixed_nodes: int | None = None,
                    disable_batch_size: int = 8, seed: int | None = 0, **goodput_opts) -> SpeculationController:
    """Build a controller by policy name; ``fixed_nodes`` picks the budget of always/threshold."""
    grid = grid or budget_grid()
    if policy not in POLICIES:
        raise ValueError(f"unknown speculation policy {policy!r}; choose one of {', '.join(POLICIES)}")
    nodes = [b.max_nodes for b in grid]
    if fixed_nodes is None:
        fixed = len(grid) - 1
    else:  # the grid level closest to the asked budget
        fixed = min(range(len(grid)), key=lambda i: abs(nodes[i] - fixed_nodes))
    pol: Policy
    if policy == "always":
        pol = AlwaysPolicy(fixed)
    elif policy == "threshold":
        pol = ThresholdPolicy(fixed, disable_batch_size)
    elif policy == "thompson":
        pol = ThompsonPolicy(len(grid), seed=seed)
    else:
        pol = GoodputPolicy(**goodput_opts)
    return SpeculationController(pol, grid, cost)
