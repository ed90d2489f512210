"""Shared fixtures: small models built on the fly (no model hub is reachable)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A `synth --preset tiny` model in the i2_s container (built once per test session)."""
    from bitformat.synth import synth

    out = tmp_path_factory.mktemp("tiny") / "tiny-i2_s.gguf"
    synth("tiny", out, seed=0)
    return out
