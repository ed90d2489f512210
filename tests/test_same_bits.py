"""Lossless means the same bits: one model in every container gives identical logits and
tokens on the numpy and cpu backends (docs/model.md §2, "One arithmetic for every container").

Each kernel computes ``float32(float32(sum_b d_b * isum_b) / s)`` with the block sum exact, so
a per-tensor scale (i2_s, stfma, colpack_u32, rans), the same value repeated in every 256- or
64-value block (TQ2_0, tq1_0, Q2_0) or in every row (iq2_bn, iq1_bn) gives the same float32.
Checked for every family's tiny preset and for one layer at the 2B-4T widths (2,560 and 6,912
columns: 10 and 27 blocks a row), greedy and with a seeded sampler, on each cpu kernel build
this machine runs (vnni, avx2, portable) and both ways of running a rans file.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bitformat.container import convert
from bitformat.formats import FORMAT_IDS
from bitformat.runtime import load
from bitformat.runtime.cpu.backend import lut3_setting
from bitformat.runtime.cpu.kernels import ENV_VAR, KERNEL_BUILDS, builds_here
from bitformat.synth import PRESETS, synth

PROMPT = [5, 17, 300, 42, 7, 99, 480, 1, 250, 33, 64, 128]
FAMILIES = ("tiny", "tiny-1bitllm", "tiny-llama", "tiny-qwen3")
#: one layer of 2B-4T at its real widths (a small vocabulary keeps the head cheap)
WIDE = replace(PRESETS["2b4t"], name="2b4t-one-layer", layers=1, vocab=512, context=64,
               specials=16, embed_std=0.1)


def _containers(preset, tmp_path_factory) -> dict[str, object]:
    d = tmp_path_factory.mktemp(f"same-bits-{getattr(preset, 'name', preset)}")
    paths = {"i2_s": d / "model.i2_s.gguf"}
    synth(preset, paths["i2_s"], seed=3)
    for fid in FORMAT_IDS:
        if fid != "i2_s":
            paths[fid] = d / f"model.{fid}.gguf"
            convert(paths["i2_s"], paths[fid], fid)
    return paths


@pytest.fixture(scope="module", params=FAMILIES)
def family_containers(request, tmp_path_factory):
    return request.param, _containers(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def wide_containers(tmp_path_factory):
    return _containers(WIDE, tmp_path_factory)


def _runs(paths, backend: str) -> dict[tuple, object]:
    """What each container gives: ``(fid, what) -> logits or tokens``. rans runs both ways
    on the cpu backend (decoded at load into 2-bit rows, and decoded inside the kernels), and
    tq1_0 and iq1_bn both as stfma rows and as lut3 tiles (where the CPU has VBMI; else as
    the build holds them)."""
    out = {}
    for fid, path in paths.items():
        variants = [{}]
        if backend == "cpu" and fid == "rans":
            variants = [{"decode": "load"}, {"decode": "fused"}]
        if backend == "cpu" and fid in ("tq1_0", "iq1_bn"):
            variants = [{}, {"lut3": True}]
        for extra in variants:
            key = (fid, *extra.values())
            kw = {k: v for k, v in extra.items() if k != "lut3"}
            with lut3_setting("1" if extra.get("lut3") else "0"), load(
                    path, backend=backend, **kw) as m:
                out[key, "logits"] = m.logits(PROMPT)
                out[key, "greedy"] = m.generate(PROMPT, max_new_tokens=8, stop_ids=[]).tokens
                out[key, "sampled"] = m.generate(PROMPT, max_new_tokens=8, stop_ids=[],
                                                 temperature=0.9, top_k=40, seed=7).tokens
    return out


def _assert_same(runs: dict, what: str) -> None:
    items = [(k[0], v) for k, v in runs.items() if k[1] == what]
    (first, want), rest = items[0], items[1:]
    for key, got in rest:
        if what == "logits":
            np.testing.assert_array_equal(got, want, err_msg=f"{key} vs {first}")
        else:
            assert got == want, f"{what}: {key} gave {got}, {first} gave {want}"


#: numpy, and the cpu backend with each kernel build this CPU runs
BACKENDS = ["numpy", *(f"cpu-{b}" for b in KERNEL_BUILDS)]


def _backend(name: str, monkeypatch) -> str:
    backend, _, build = name.partition("-")
    if build:
        if build not in builds_here():
            pytest.skip(f"this CPU does not run the {build} kernel build")
        monkeypatch.setenv(ENV_VAR, build)
    return backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_container_gives_the_same_bits(family_containers, backend, monkeypatch):
    _, paths = family_containers
    runs = _runs(paths, _backend(backend, monkeypatch))
    for what in ("logits", "greedy", "sampled"):
        _assert_same(runs, what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_bits_at_2b4t_widths(wide_containers, backend, monkeypatch):
    runs = _runs(wide_containers, _backend(backend, monkeypatch))
    for what in ("logits", "greedy", "sampled"):
        _assert_same(runs, what)


def test_bitlinear_same_bits_every_container(wide_containers):
    """One projection, the same int8 input, every container: the same float32 on each
    backend (the per-matrix form of the tests above, with activations that use the whole int8
    range)."""
    from bitformat.container import open_model
    from bitformat.runtime.backend import quantize_activations
    from bitformat.runtime.cpu.backend import CpuBackend
    from bitformat.runtime.numpy_backend import NumpyBackend

    rng = np.random.default_rng(5)
    name = "blk.0.ffn_down.weight"
    outs: dict[tuple[str, str], np.ndarray] = {}
    qa = None
    for fid, path in wide_containers.items():
        with open_model(path) as c:
            cols = c.entry(name).shape[1]
            if qa is None:
                qa = quantize_activations(rng.standard_normal((3, cols)).astype(np.float32))
            bes = [("numpy", NumpyBackend(c))]
            bes += [(f"cpu-{k}", CpuBackend(c, kernel=k, decode="fused")) for k in builds_here()]
            for label, be in bes:
                outs[fid, label] = be.bitlinear(qa, be.weight(name))
    for label in {lab for _, lab in outs}:
        want = outs["i2_s", label]
        for (fid, lab), got in outs.items():
            if lab == label:
                np.testing.assert_array_equal(got, want, err_msg=f"{fid} on {label}")
    np.testing.assert_array_equal(outs["i2_s", "cpu-portable"], outs["i2_s", "numpy"])
