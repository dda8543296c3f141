"""Whether the hybrid's head drafts this step: chosen by measured tokens per second.

A trained head costs time every step it drafts (on the 2-core CPU ~9-12 ms next to a ~27 ms
verification); prompt lookup and REST cost ~nothing. When retrieval already offers a long,
trusted copy, or when the head rarely gets a token accepted, the step is faster without it.
Neither is known in advance, so the gate measures: steps fall into *regimes* by what retrieval
offers (its expected accepted length, bucketed), and per regime it keeps decayed sums of
committed tokens and wall seconds for each arm (head on / head off). It plays the arm with more
tokens per second, tries an arm it has too few samples of first, and replays the losing arm
every ``explore``-th step of a regime so a change (longer context, a different prompt) is seen.

A step's sample runs from one ``choose`` to the next (draft + verify + commit + emit), with the
tokens committed in between; a prefill in between (a new request) voids the sample. Losslessness
never depends on the gate: it only changes which candidates are verified.
"""
from __future__ import annotations

import time

# Expected accepted length of retrieval's candidates (sum over depths of the best estimated
# acceptance at that depth): nothing useful / a short or doubtful match / a trusted copy.
REGIME_EDGES = (0.5, 1.5)


def regime_of(expected_len: float) -> int:
    return sum(expected_len >= edge for edge in REGIME_EDGES)


class HeadGate:
    """``choose(regime) -> bool`` each step; ``add_tokens(n)`` on commit; ``interrupt()`` on prefill.

    decay: weight of the past per new sample (0.9: about the last 10 steps of an arm count);
    min_samples: samples of an arm before its rate is trusted; explore: every explore-th decision
    of a regime plays the arm that is behind. clock: injectable for tests.
    """

    def __init__(self, decay: float = 0.9, min_samples: int = 3, explore: int = 8, clock=time.perf_counter):
        self.decay, self.min_samples, self.explore, self.clock = decay, min_samples, explore, clock
        self.tokens: dict[tuple[int, bool], float] = {}
        self.seconds: dict[tuple[int, bool], float] = {}
        self.samples: dict[tuple[int, bool], int] = {}
        self.decisions: dict[int, int] = {}
        self._open: tuple[int, bool, float] | None = None  # (regime, arm, start) of the running step
        self._open_tokens = 0

    def rate(self, regime: int, arm: bool) -> float | None:
        """Decayed tokens per second of an arm in a regime (None before min_samples)."""
        key = (regime, arm)
        if self.samples.get(key, 0) < self.min_samples or self.seconds.get(key, 0.0) <= 0:
            return None
        return self.tokens[key] / self.seconds[key]

    def choose(self, regime: int) -> bool:
        """Close the previous step's sample, then pick this step's arm (True: the head drafts)."""
        now = self.clock()
        self._close(now)
        n = self.decisions[regime] = self.decisions.get(regime, 0) + 1
        on, off = self.rate(regime, True), self.rate(regime, False)
        if on is None:
            arm = True
        elif off is None:
            arm = False
        else:
            arm = on >= off
            if n % self.explore == 0:
                arm = not arm
        self._open, self._open_tokens = (regime, arm, now), 0
        return arm

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
        key = (regime, arm)
        self.tokens[key] = self.decay * self.tokens.get(key, 0.0) + self._open_tokens
        self.seconds[key] = self.decay * self.seconds.get(key, 0.0) + (now - start)
        self.samples[key] = self.samples.get(key, 0) + 1
        self._open = None


__all__ = ["HeadGate", "REGIME_EDGES", "regime_of"]
