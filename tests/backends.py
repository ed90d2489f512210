"""The runtime backends a test can run here: numpy and cpu always, wgpu where an adapter exists.

``BITFORMAT_REQUIRE_GPU=1`` (CI, with lavapipe) makes a missing adapter a failure, as the
fixtures in ``tests/gpu/conftest.py`` do, so wgpu cannot silently drop out of a comparison.
"""

from __future__ import annotations

import pytest

from bitformat.runtime.wgpu.device import ENV_REQUIRE, request_adapter, require_gpu


def runtime_backends() -> list[str]:
    if request_adapter() is not None:
        return ["numpy", "cpu", "wgpu"]
    if require_gpu():
        pytest.fail(f"{ENV_REQUIRE} is set but wgpu found no adapter")
    return ["numpy", "cpu"]
