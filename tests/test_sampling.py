"""Sampling (runtime/sampling.py): the filters against a direct transcription of their
definitions, Gumbel-max against the softmax it must draw from, the noise as a pure function of
(seed, step), and bad parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bitformat.errors import RequestError
from bitformat.runtime.sampling import Sampler, SamplingParams, keep_mask, make_sampler


def reference_keep(z: np.ndarray, p: SamplingParams) -> set[int]:
    """The filters written out with Python sorting, one step at a time."""
    rows = [(float(v), i) for i, v in enumerate(z)]
    if p.top_k:
        ranked = sorted(rows, key=lambda r: (-r[0], r[1]))
        kth = ranked[min(p.top_k, len(ranked)) - 1][0]
        rows = [r for r in rows if r[0] >= kth]
    if p.top_p < 1.0:
        ranked = sorted(rows, key=lambda r: (-r[0], r[1]))
        top = ranked[0][0]
        w = [math.exp(v - top) for v, _ in ranked]
        total, cum, kept = sum(w), 0.0, []
        for (v, i), wi in zip(ranked, w, strict=True):
            kept.append((v, i))
            cum += wi / total
            if cum >= p.top_p:
                break
        rows = kept
    if p.min_p > 0:
        top = max(v for v, _ in rows)
        rows = [r for r in rows if r[0] >= top + math.log(p.min_p)]
    return {i for _, i in rows}


@pytest.mark.parametrize("seed", range(40))
def test_filters_match_their_definition(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    z = np.round(rng.standard_normal(n) * 3, int(rng.integers(0, 3)))  # rounding makes ties
    p = SamplingParams(temperature=1.0, top_k=int(rng.integers(0, n + 2)),
                       top_p=float(rng.choice([1.0, 0.5, 0.9, 0.99, 1e-6])),
                       min_p=float(rng.choice([0.0, 0.05, 0.5])))
    assert set(np.flatnonzero(keep_mask(z, p))) == reference_keep(z, p)


def test_gumbel_max_draws_from_the_softmax():
    z = np.array([1.0, 0.0, 2.0, -1.0, 1.5], np.float32)
    temperature, n = 0.7, 20000
    s = Sampler(SamplingParams(temperature=temperature, seed=11))
    counts = np.zeros(z.size)
    for _ in range(n):
        t = s.pick(z)
        s.accept(t)
        counts[t] += 1
    p = np.exp(z / temperature) / np.exp(z / temperature).sum()
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p < 0.0004 of failing by chance


def test_noise_is_a_function_of_seed_and_step():
    a = Sampler(SamplingParams(temperature=1.0, seed=5))
    b = Sampler(SamplingParams(temperature=1.0, seed=5), history=[1, 2, 3])
    np.testing.assert_array_equal(a.noise(1000), b.noise(1000))
    first = a.noise(1000)
    np.testing.assert_array_equal(a.noise(10), first[:10])  # a prefix of the same stream
    a.accept(0)
    assert not np.array_equal(a.noise(1000), first)
    c = Sampler(SamplingParams(temperature=1.0, seed=6))
    assert not np.array_equal(c.noise(1000), first)
    assert np.corrcoef(first[:-1], a.noise(1000)[1:])[0, 1] < 0.1  # no shifted copy


def test_greedy_ties_nan_and_penalty():
    assert make_sampler()(np.array([1.0, 3.0, 3.0])) == 1  # ties: the lowest id
    assert make_sampler()(np.array([np.nan, 0.0, -1.0])) == 1  # NaN is never chosen
    assert make_sampler(0.5, seed=1)(np.array([np.nan, -np.inf, 0.0])) == 2
    s = Sampler(SamplingParams(repetition_penalty=2.0), history=[1])
    z = np.array([0.0, 3.0, 1.6], np.float32)
    assert s.pick(z) == 2  # 3.0 / 2 < 1.6
    np.testing.assert_array_equal(s.penalize(z), np.float32([0.0, 1.5, 1.6]))
    np.testing.assert_array_equal(s.penalize(np.array([-1.0, -1.0], np.float32)),
                                  [-1.0, -2.0])
    # bounds of selected rows map through the same monotone function
    np.testing.assert_array_equal(s.penalize(z[[1, 2]], ids=np.array([1, 2])),
                                  np.float32([1.5, 1.6]))


@pytest.mark.parametrize("bad", [
    {"temperature": float("nan")}, {"temperature": -1}, {"temperature": float("inf")},
    {"top_k": -1}, {"top_k": 1.5}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -0.1},
    {"repetition_penalty": 0.0}, {"repetition_penalty": float("nan")}, {"seed": -1},
    {"seed": 2**64}, {"seed": "x"}, {"temperature": True},
])
def test_bad_parameters_are_request_errors(bad):
    with pytest.raises(RequestError, match="bad sampling parameters"):
        SamplingParams(**bad)


def test_needs_all_logits():
    assert SamplingParams(temperature=1.0, top_p=0.9).needs_all_logits
    assert not SamplingParams(temperature=1.0, top_p=0.9, top_k=40).needs_all_logits
    assert not SamplingParams(top_p=0.9).needs_all_logits  # greedy
