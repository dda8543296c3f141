"""A choice between arms by measured tokens per second, per *regime* of the situation: do the
extra work (speculate at all, speculate with the full tree) or not.

The server's goodput policy asks it whether the batch decodes plainly, speculates as its
models plan, or speculates with the full tree (regimes = batch-size buckets). Neither answer is
known in advance, so the gate measures. Per regime one arm *leads* (is played); every
``explore``-th decision a short run of another arm (a *challenger*) is played, and its tokens/s
is compared with the leader's over the steps just before the run: a *pair* of adjacent samples.
A challenger whose pairs say it is faster takes the lead.

Why pairs and not each arm's own running rate: tokens per step swing with the request being
decoded (a copy-heavy prompt accepts 5 drafts a step, an open-ended one 0-1), and an arm that is
explored rarely has its rate from other requests than the leader's. Comparing those let whichever
arm happened to be measured on easy requests win. Simulated batch-1 load (requests of random
difficulty; the full tree 11% faster than the models' plan over all): per-arm rates played the
plan 60% of the steps and reached 0.92x the tokens/s of always playing the full tree, pairs 0.96x.
With the full tree 12% faster on every request (``test_throughput_gate_compares_arms_on_the_same_
requests``), per-arm rates played it 14-97% of the late steps depending on the seed, pairs 94-98%.
Outputs never depend on the gate: it only changes what is drafted and verified.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# A challenger's mean log speed ratio must stand this many standard errors from 0 to be trusted
# before ``min_samples`` pairs (a 3x slower arm need not be tried 4 times).
CONFIDENT = 2.0
MIN_PAIR_STD = 0.25  # floor of a pair's log-ratio std: two pairs never look certain
# Share of a regime's time that the runs of one arm known to be behind may cost: the slower the arm,
# the rarer its runs. A fixed pace (every 4th period) was fine for arms 10-40% behind, but a full tree
# at batch 16 runs at 0.1x of plain decoding on a 2-core CPU, and one 3-step run every 128 decisions
# cost a fifth of the time there (offline twin of the server, a fresh one at concurrency 16: 0.62x plain).
EXPLORE_COST = 0.03
# One pair is enough for an arm doing extra work measured under exp(-FAR_BEHIND) = 0.37x the tokens/s
# of the cheapest arm while that one leads: its steps add at least the tokens the cheapest arm's add
# (a tree that accepts nothing still adds the root), so only its cost makes it that slow, not the
# requests' luck. (A full tree at batch 16 on a 2-core CPU: 0.1x; a second warm-up run costs ~30 steps.)
FAR_BEHIND = 1.0


@dataclass
class _Run:
    """A challenger's exploration run in flight (its samples, to be paired when it ends)."""

    regime: object
    arm: object
    last: int  # the regime's decision number that ends it
    tokens: float = 0.0
    seconds: float = 0.0


class ThroughputGate:
    """``choose(regime) -> arm`` each step, then ``record(regime, arm, tokens, seconds)``.

    arms: the choices, cheapest first (default: False = skip the work, True = do it);
    decay: weight of the past per new pair (0.9: about the last 10 pairs of a challenger count);
    min_samples: pairs of a challenger before its standing is trusted (earlier if clear-cut);
    explore: every explore-th decision of a regime starts a run of ``run`` decisions of a
    challenger (in turn; one clearly, < ``clear`` x, slower only every 4th time or rarer, so that its
    runs cost at most ``EXPLORE_COST`` of the time); warmup_explore:
    the same period while some challenger is not trusted yet (default ``explore``). The first
    step after a switch is not sampled: it pays the switch (a drafter catching up on the tokens it
    skipped), not the arm's steady rate.
    """

    def __init__(self, decay: float = 0.9, min_samples: int = 3, explore: int = 16, run: int = 2,
                 clear: float = 0.8, arms: tuple = (False, True), warmup_explore: int | None = None):
        if len(arms) < 2 or len(set(arms)) != len(arms):
            raise ValueError(f"a gate needs at least two distinct arms, got {arms!r}")
        if run < 2:
            raise ValueError(f"an exploration run needs 2 steps or more (its first is not sampled), got {run}")
        self.decay, self.min_samples = decay, min_samples
        self.explore, self.run, self.clear, self.arms = explore, run, clear, tuple(arms)
        self.warmup_explore = warmup_explore or explore
        self.leader: dict = {}  # regime -> the arm played outside exploration runs
        self.pairs: dict[tuple, list] = {}  # (regime, challenger) -> decayed [n, Σ log ratio, Σ log ratio²]
        self.priors: dict = {}  # regime -> (arm -> log speed, weight) it was seeded with
        self.tokens: dict[tuple, float] = {}  # (regime, arm) -> decayed sums, for rate()
        self.seconds: dict[tuple, float] = {}
        self.samples: dict[tuple, int] = {}
        self.decisions: dict = {}
        self._recent: dict = {}  # regime -> the leader's last ``run`` sampled (tokens, seconds)
        self._trial: _Run | None = None
        self._last_arm = None
        self._skip = False  # the step in flight follows a switch: do not sample it

    # -- what has been measured --------------------------------------------------------------
    def rate(self, regime, arm) -> float | None:
        """Decayed tokens per second of an arm in a regime, from its own steps (None before
        min_samples). For reports: choices use the paired ``relative`` speeds."""
        key = (regime, arm)
        if self.samples.get(key, 0) < self.min_samples or self.seconds.get(key, 0.0) <= 0:
            return None
        return self.tokens[key] / self.seconds[key]

    def standing(self, regime, arm) -> float | None:
        """Mean log(tokens/s of arm / tokens/s of the leader) over its pairs: 0 for the leader,
        None while too few pairs say too little."""
        if arm == self.leader.get(regime):
            return 0.0
        n, s, q = self._pair_stats(regime, arm)
        if n <= 0:
            return None
        mean = s / n
        std = max(math.sqrt(max(q / n - mean * mean, 0.0)), MIN_PAIR_STD)
        if n >= self.min_samples or (n >= 2 and abs(mean) > CONFIDENT * std / math.sqrt(n)):
            return mean
        if mean < -FAR_BEHIND and self.leader.get(regime) == self.arms[0]:
            return mean  # one pair says it (see FAR_BEHIND)
        return None

    def relative(self, regime, arm) -> float | None:
        """An arm's tokens/s as a fraction of the regime's leader (1.0 for it; None: unknown)."""
        s = self.standing(regime, arm)
        return None if s is None else math.exp(s)

    # -- the choice --------------------------------------------------------------------------
    def choose(self, regime, default=None, allowed=None):
        """This step's arm.

        The first leader of a regime is ``default`` (e.g. what a model predicts) if given, else
        the arm doing most work. ``allowed``: a subset of the arms to choose from this time (what
        is known not to pay can be left out)."""
        n = self.decisions[regime] = self.decisions.get(regime, 0) + 1
        if self._trial is not None and (self._trial.regime != regime or n > self._trial.last):
            self._close_trial()
        arms = [a for a in self.arms if allowed is None or a in allowed]
        if len(arms) == 1:  # nothing to choose or explore
            arm = arms[0]
        else:
            lead = self._lead(regime, arms, default)
            standing = {a: self.standing(regime, a) for a in arms}
            others = [a for a in arms if a != lead]
            unknown = [a for a in others if standing[a] is None]
            every = self.warmup_explore if unknown else self.explore
            arm = self._explored(n, every, unknown or others, standing)
            arm = lead if arm is None else arm  # (an arm may be False: no `or`)
            if arm != lead and self._trial is None:  # a run starts: it ends at the period's last decision
                self._trial = _Run(regime, arm, n - n % every + every - 1)
        self._skip = self._last_arm is not None and arm != self._last_arm
        self._last_arm = arm
        return arm

    def _lead(self, regime, arms: list, default):
        """The regime's leader among ``arms``, after promoting a challenger its pairs say is faster."""
        lead = self.leader.get(regime)
        if lead not in arms:  # first decision, or the leader is not allowed now
            known = [a for a in arms if self.standing(regime, a) is not None] if lead is not None else []
            lead = (max(known, key=lambda a: self.standing(regime, a)) if known
                    else default if default in arms else arms[-1])
            self._set_leader(regime, lead)
        standing = {a: self.standing(regime, a) for a in arms}  # the leader's is 0.0
        best = max((a for a in arms if standing[a] is not None), key=standing.get)
        if standing[best] > 0.0:
            self._set_leader(regime, best)
            lead = best
        return lead

    def _explored(self, n: int, every: int, pool: list, standing: dict):
        """The challenger (from ``pool``, in turn) an exploration run plays at decision n, or None
        outside the runs."""
        if n % every < every - self.run:
            return None
        k = n // every
        arm = pool[k % len(pool)]
        if standing[arm] is None or standing[arm] >= math.log(self.clear):
            return arm
        # a run costs (1/r - 1) leader steps per step of it, r the arm's relative speed
        extra = self.run * (math.exp(-standing[arm]) - 1.0)
        period = max(4, math.ceil(extra / (EXPLORE_COST * every)))  # in the arm's turns
        return None if (k // len(pool)) % period else arm

    def _set_leader(self, regime, new) -> None:
        """Re-express every challenger's pairs against the new leader (log ratios subtract)."""
        old = self.leader.get(regime)
        self.leader[regime] = new
        self._recent[regime] = deque(maxlen=self.run)
        if old is None or old == new:
            return
        mine = [k for k in self.pairs if k[0] == regime]
        n1, s1, q1 = self.pairs.pop((regime, new), (0.0, 0.0, 0.0))
        if n1 <= 0:  # nothing links the new leader to the old one
            for k in mine:
                self.pairs.pop(k, None)
            return
        m = s1 / n1
        for k in mine:
            if k in self.pairs:
                n, s, q = self.pairs[k]
                self.pairs[k] = [n, s - n * m, q - 2 * m * s + n * m * m]  # Σ(x - m), Σ(x - m)²
        self.pairs[(regime, old)] = [n1, -s1, q1]

    def speeds(self, regime, reference) -> dict:
        """Each arm's mean log tokens/s relative to ``reference`` from the regime's pairs, however
        few (arms no pair links to ``reference`` are left out; {}: nothing links it)."""
        lead = self.leader.get(regime)
        vs_lead = {lead: 0.0} if lead is not None else {}
        for arm in self.arms:
            n, s, _ = self.pairs.get((regime, arm), (0.0, 0.0, 0.0))
            if arm != lead and n > 0:
                vs_lead[arm] = s / n
        if reference not in vs_lead:
            return {}
        return {a: x - vs_lead[reference] for a, x in vs_lead.items()}

    def seed(self, regime, speeds: dict, weight: float) -> None:
        """Start a new regime from a prior: ``speeds`` (arm -> mean log tokens/s, any common
        reference) count as ``weight`` pairs beside the regime's own pairs, and the fastest of
        them leads. Its own pairs outweigh the prior as they come in."""
        self.priors[regime] = (dict(speeds), float(weight))
        self._set_leader(regime, max(speeds, key=speeds.get))

    def _pair_stats(self, regime, arm) -> tuple:
        """[n, Σ log ratio, Σ log ratio²] of an arm against the leader: its own pairs plus the
        regime's prior, if seeded and it rates both."""
        n, s, q = self.pairs.get((regime, arm), (0.0, 0.0, 0.0))
        speeds, w = self.priors.get(regime, ({}, 0.0))
        lead = self.leader.get(regime)
        if arm in speeds and lead in speeds:
            m = speeds[arm] - speeds[lead]
            n, s, q = n + w, s + w * m, q + w * m * m
        return n, s, q

    def forget(self, regime) -> None:
        """Drop everything measured in a regime (one that will not come back)."""
        for table in (self.pairs, self.tokens, self.seconds, self.samples):
            for key in [k for k in table if k[0] == regime]:
                del table[key]
        for table in (self.leader, self.decisions, self._recent, self.priors):
            table.pop(regime, None)
        if self._trial is not None and self._trial.regime == regime:
            self._trial = None

    # -- what a step measured ----------------------------------------------------------------
    def record(self, regime, arm, tokens: float, seconds: float) -> None:
        """The step's sample: tokens it added in ``seconds`` (not sampled after a switch)."""
        skip, self._skip = self._skip, False
        if skip or tokens <= 0 or seconds <= 0:
            return
        key = (regime, arm)
        self.tokens[key] = self.decay * self.tokens.get(key, 0.0) + tokens
        self.seconds[key] = self.decay * self.seconds.get(key, 0.0) + seconds
        self.samples[key] = self.samples.get(key, 0) + 1
        if arm == self.leader.get(regime):
            self._recent.setdefault(regime, deque(maxlen=self.run)).append((tokens, seconds))
        elif self._trial is not None and (self._trial.regime, self._trial.arm) == (regime, arm):
            self._trial.tokens += tokens
            self._trial.seconds += seconds

    def _close_trial(self) -> None:
        """One pair: the run's tokens/s against the leader's over the steps just before it."""
        run, self._trial = self._trial, None
        regime, arm, tokens, seconds = run.regime, run.arm, run.tokens, run.seconds
        ref = self._recent.get(regime) or ()
        ref_tokens, ref_seconds = sum(t for t, _ in ref), sum(s for _, s in ref)
        if tokens <= 0 or ref_tokens <= 0 or arm == self.leader.get(regime):
            return
        x = math.log((tokens / seconds) / (ref_tokens / ref_seconds))
        n, s, q = self.pairs.get((regime, arm), (0.0, 0.0, 0.0))
        d = self.decay
        self.pairs[(regime, arm)] = [d * n + 1.0, d * s + x, d * q + x * x]


__all__ = ["ThroughputGate"]
