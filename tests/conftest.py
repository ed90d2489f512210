"""Shared fixtures: small models built on the fly (no model hub is reachable)."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    # CI sets this so that oracle tests cannot silently skip for want of torch/transformers.
    if os.environ.get("BITFORMAT_REQUIRE_ORACLE"):
        import torch  # noqa: F401
        import transformers  # noqa: F401


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A `synth --preset tiny` model in the i2_s container (built once per test session).

    Its embedding holds full-precision f16 values (``embedding="f16"``), as synth drew them
    before its default became bf16 values: tests that compare runs to 1e-9, or expect one
    generated text, were written on these values (bf16 values make exact int8 rounding ties,
    on which two correct computations may round apart). ``tiny_bf16_gguf`` has the default."""
    from bitformat.synth import synth

    out = tmp_path_factory.mktemp("tiny") / "tiny-i2_s.gguf"
    synth("tiny", out, seed=0, embedding="f16")
    return out


@pytest.fixture(scope="session")
def tiny_bf16_gguf(tmp_path_factory):
    """The same model with synth's default embedding: bf16 values stored as F16, as the
    official 2B-4T file has them."""
    from bitformat.synth import synth

    out = tmp_path_factory.mktemp("tiny-bf16") / "tiny-i2_s.gguf"
    synth("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_containers(tiny_gguf, tmp_path_factory):
    """format id -> the tiny model in that container (converted once per test session)."""
    from bitformat.container import convert
    from bitformat.formats import FORMAT_IDS

    d = tmp_path_factory.mktemp("tiny-containers")
    paths = {"i2_s": tiny_gguf}
    for fid in FORMAT_IDS:
        if fid != "i2_s":
            paths[fid] = d / f"tiny.{fid}.gguf"
            convert(tiny_gguf, paths[fid], fid)
    return paths


@pytest.fixture(scope="session")
def lut3_models(tiny_containers):
    """tq1_0 and iq1_bn loaded on the cpu backend as lut3 tiles (BITFORMAT_CPU_LUT3=1; where
    the CPU has VNNI and VBMI, else as the default holds them)."""
    from bitformat.runtime import load
    from bitformat.runtime.cpu.backend import lut3_setting

    with lut3_setting("1"):
        models = {fid: load(tiny_containers[fid], backend="cpu") for fid in ("tq1_0", "iq1_bn")}
    yield models
    for m in models.values():
        m.close()


@pytest.fixture(scope="session")
def cpu_models(tiny_containers):
    """format id -> the tiny model loaded on the cpu backend from that container."""
    from bitformat.runtime import load

    models = {fid: load(p, backend="cpu") for fid, p in tiny_containers.items()}
    yield models
    for m in models.values():
        m.close()
