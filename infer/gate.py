"""A two-armed choice by measured tokens per second: do the extra work (draft with the head,
speculate at all) or not, per *regime* of the situation.

Used twice: the hybrid drafter asks whether its trained head drafts this step (a head costs
~9-12 ms per step on the 2-core CPU next to a ~27 ms verification, retrieval ~nothing; regimes =
how much retrieval already offers), and the server's goodput policy asks whether the batch
speculates at all (regimes = batch-size buckets). Neither answer is known in advance, so the gate
measures: per regime it keeps decayed sums of tokens and seconds for each arm, plays the arm
with more tokens per second, tries an arm it has too few samples of first, and replays the
losing arm every ``explore``-th decision of a regime so a change (longer contexts, other
prompts) is seen.

Samples come either from ``record(regime, arm, tokens, seconds)`` (the server: decode time
only) or from the built-in clock: a step then runs from one ``choose`` to the next with the
tokens reported by ``add_tokens`` in between, and ``interrupt`` (a prefill) voids it. Outputs
never depend on the gate: it only changes what is drafted and verified.
"""
from __future__ import annotations

import time


class ThroughputGate:
    """``choose(regime) -> bool`` each step, then either ``record(...)`` or (clock mode)
    ``add_tokens(n)`` on commit and ``interrupt()`` on prefill.

    decay: weight of the past per new sample (0.9: about the last 10 steps of an arm count);
    min_samples: samples of an arm before its rate is trusted; explore: every explore-th decision
    of a regime starts ``run`` decisions of the arm that is behind (4x rarer once it is clearly,
    < ``clear`` x, behind). The first step after a switch is not sampled: it pays the switch
    (a head catching up on the tokens it skipped), not the arm's steady rate. clock: for tests.
    """

    def __init__(self, decay: float = 0.9, min_samples: int = 3, explore: int = 16, run: int = 2,
                 clear: float = 0.8, clock=time.perf_counter):
        self.decay, self.min_samples, self.clock = decay, min_samples, clock
        self.explore, self.run, self.clear = explore, run, clear
        self.tokens: dict[tuple[int, bool], float] = {}
        self.seconds: dict[tuple[int, bool], float] = {}
        self.samples: dict[tuple[int, bool], int] = {}
        self.decisions: dict[int, int] = {}
        self._last_arm: bool | None = None
        self._skip = False  # the step in flight follows a switch: do not sample it
        self._open: tuple[int, bool, float] | None = None  # (regime, arm, start) of the running step
        self._open_tokens = 0

    def rate(self, regime: int, arm: bool) -> float | None:
        """Decayed tokens per second of an arm in a regime (None before min_samples)."""
        key = (regime, arm)
        if self.samples.get(key, 0) < self.min_samples or self.seconds.get(key, 0.0) <= 0:
            return None
        return self.tokens[key] / self.seconds[key]

    def choose(self, regime: int, default: bool | None = None) -> bool:
        """Close the previous clocked step's sample, then pick this step's arm (True: do the work).

        Until both arms have ``min_samples`` here, ``default`` (e.g. what a model predicts) is
        played, the other arm in the exploration runs; with no default, an arm short of samples
        is tried first."""
        now = self.clock()
        self._close(now)
        n = self.decisions[regime] = self.decisions.get(regime, 0) + 1
        on, off = self.rate(regime, True), self.rate(regime, False)
        if on is not None and off is not None:
            arm = on >= off
            every = self.explore * (4 if min(on, off) < self.clear * max(on, off) else 1)
            if n % every >= every - self.run:
                arm = not arm
        elif default is not None:
            arm = default if n % self.explore < self.explore - self.run else not default
        else:
            arm = on is None
        self._skip = self._last_arm is not None and arm != self._last_arm
        self._last_arm = arm
        self._open, self._open_tokens = (regime, arm, now), 0
        return arm

    def record(self, regime: int, arm: bool, tokens: float, seconds: float) -> None:
        """An externally timed sample (the clock is then not used: no ``add_tokens``)."""
        self._open = None
        skip, self._skip = self._skip, False
        if skip or tokens <= 0 or seconds <= 0:
            return
        key = (regime, arm)
        self.tokens[key] = self.decay * self.tokens.get(key, 0.0) + tokens
        self.seconds[key] = self.decay * self.seconds.get(key, 0.0) + seconds
        self.samples[key] = self.samples.get(key, 0) + 1

    def add_tokens(self, n: int) -> None:
        self._open_tokens += n

    def interrupt(self) -> None:
        """Something other than a decode step happened (a prefill): drop the open sample."""
        self._open = None

    def _close(self, now: float) -> None:
        if self._open is None or self._open_tokens == 0:
            self._open = None
            return
        regime, arm, start = self._open
        self.record(regime, arm, self._open_tokens, now - start)


__all__ = ["ThroughputGate"]
