"""Choosing the next token: one definition of sampling that every head and backend follows.

A request's :class:`SamplingParams` turn the logits ``l`` of a step into a token id in this order
(llama.cpp's default chain; all filters see the logits before the temperature):

1. **repetition penalty** (CTRL, as transformers and llama.cpp): each token id in the last
   ``repetition_context`` ids of the history gets ``l / penalty`` if ``l > 0`` else
   ``l * penalty``, in float32. It is monotone in ``l``, so bounds on ``l`` map to bounds on it.
2. **greedy** (``temperature == 0``): the largest penalized logit; ties go to the lowest id.
3. **top-k** (``k > 0``): the rows whose value is at least the k-th largest (ties at the k-th
   value all stay).
4. **top-p** (``p < 1``): over what is left, softmax at temperature 1, sorted by value (then id),
   the shortest prefix whose probability reaches ``p`` (llama.cpp's ``top_p``).
5. **min-p** (``m > 0``): keep ``l_i >= max(l) + ln(m)``, i.e. ``p_i >= m * p_max``.
6. **temperature**, then **Gumbel-max**: the token is ``argmax_i (l_i / T + g_i)`` over what is
   left, where ``g_i`` is the Gumbel noise of row ``i`` at this step (ties: the lowest id).

Gumbel-max draws exactly from ``softmax(l / T)`` restricted to the kept rows, and it needs no
normalisation: a head that knows every logit only to within a bound can still find the winner
for the same noise (docs/exact-head.md). The noise of step ``n`` is a pure function of
``(seed, n)`` (:meth:`Sampler.noise`), so two computations of the same step agree whatever else
they do. NaN logits are never chosen (they count as ``-inf``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (module docstring). Defaults are greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    repetition_context: int = 64  # how many of the latest ids the penalty sees (0: all)
    seed: int | None = None  # None: a fresh random seed per request

    def __post_init__(self) -> None:
        def bad(what: str) -> RequestError:
            return RequestError(f"bad sampling parameters: {what}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
        for name in ("top_k", "repetition_context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise bad(f"{name} must be a whole number >= 0, got {v!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, (int, np.integer))
                                      or not 0 <= self.seed < 2**64):
            raise bad(f"seed must be a whole number in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_all_logits(self) -> bool:
        """Whether choosing needs the whole distribution (top-p over all rows): a screened
        head cannot bound that set and must compute every logit."""
        return not self.greedy and self.top_p < 1.0 and self.top_k == 0


@dataclass
class Sampler:
    """One request's sampling state: its parameters, the token history the penalty reads, and
    the step counter that indexes its Gumbel noise. ``pick`` chooses from full logits;
    ``accept`` records the chosen token and moves to the next step."""

    params: SamplingParams = field(default_factory=SamplingParams)
    history: list[int] = field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        seed = self.params.seed
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self.history = [int(t) for t in self.history]

    # -- the pieces a head needs ----------------------------------------------------------------
    def penalized_ids(self) -> np.ndarray:
        """The distinct token ids the repetition penalty applies to at this step (int64)."""
        p = self.params
        if p.repetition_penalty == 1.0 or not self.history:
            return np.zeros(0, np.int64)
        window = self.history[-p.repetition_context:] if p.repetition_context else self.history
        return np.unique(np.asarray(window, dtype=np.int64))

    def penalize(self, values: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        """``values`` (float32, the logits of rows ``ids``, or of every row) after the penalty.

        Monotone non-decreasing in each value, so a head may apply it to bounds."""
        pen = self.penalized_ids()
        values = np.asarray(values, dtype=np.float32)
        if pen.size == 0:
            return values
        out = values.copy()
        rows = pen[pen < values.size] if ids is None else np.flatnonzero(np.isin(ids, pen))
        seen = out[rows]
        r = np.float32(self.params.repetition_penalty)
        out[rows] = np.where(seen > 0, seen / r, seen * r)
        return out

    def noise(self, n: int) -> np.ndarray:
        """Gumbel noise ``g[0:n]`` (float64) of this step: a pure function of (seed, step)."""
        # SeedSequence mixes (seed, step) into independent streams; SFC64 uniforms and two logs
        # take 0.5 ms for a 128k vocabulary (numpy's own gumbel() 2 ms)
        seq = np.random.SeedSequence([self.seed & 0xFFFFFFFF, self.seed >> 32, self.step])
        u = np.random.Generator(np.random.SFC64(seq)).random(n)  # [0, 1)
        with np.errstate(divide="ignore"):
            return -np.log(-np.log(u))  # u = 0 gives -inf: that row never wins

    # -- choosing from full logits ----------------------------------------------------------------
    def pick(self, logits: np.ndarray) -> int:
        """The token for full logits ``[vocab]`` at this step (module docstring)."""
        z = self.penalize(np.asarray(logits, dtype=np.float32).reshape(-1)).astype(np.float64)
        z[np.isnan(z)] = -np.inf
        if self.params.greedy:
            return int(np.argmax(z))
        keep = keep_mask(z, self.params)
        z = np.where(keep, z / self.params.temperature + self.noise(z.size), -np.inf)
        return int(np.argmax(z))

    def accept(self, token: int) -> None:
        self.history.append(int(token))
        self.step += 1


def keep_mask(z: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Rows that survive top-k, top-p and min-p for penalized logits ``z`` (float64, no NaN)."""
    keep = np.isfinite(z) | (z == np.inf)
    if not keep.any():
        return np.ones(z.shape, bool)  # every row -inf: Gumbel-max among them all
    if 0 < p.top_k < int(keep.sum()):
        kth = np.partition(z[keep], -p.top_k)[-p.top_k]
        keep &= z >= kth
    if p.top_p < 1.0:
        idx = np.flatnonzero(keep)
        order = idx[np.lexsort((idx, -z[idx]))]  # by value, then id
        v = z[order]
        if v[0] == np.inf:
            v = np.where(v == np.inf, 0.0, -np.inf)  # +inf rows share all the probability
        prob = np.exp(v - v[0])
        cum = np.cumsum(prob / prob.sum())
        n = int(np.searchsorted(cum, p.top_p)) + 1  # first prefix reaching p
        keep = np.zeros(z.shape, bool)
        keep[order[: min(n, order.size)]] = True
    if p.min_p > 0.0:
        keep &= z >= z[keep].max() + math.log(p.min_p)
    return keep


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, *, min_p: float = 0.0):
    """``logits [vocab] -> token id``, one step further on each call (a :class:`Sampler` with no
    history and no penalty). Kept for callers that hold logits themselves."""
    s = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                               seed=seed))

    def sample(logits: np.ndarray) -> int:
        token = s.pick(logits)
        s.accept(token)
        return token

    sample.greedy = s.params.greedy
    return sample


def pick_tokens(logits: np.ndarray, samplers: Sequence[Sampler]) -> list[int]:
    """Row ``r`` of ``logits [n, vocab]`` chosen by ``samplers[r]`` (the full head's choice)."""
    return [s.pick(logits[r]) for r, s in enumerate(samplers)]
