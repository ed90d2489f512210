"""GPU fixtures: a wgpu device (lavapipe in CI), or a clean skip without an adapter.

``BITFORMAT_REQUIRE_GPU=1`` (CI, which installs lavapipe) turns "no adapter" into a failure,
so the GPU tests cannot silently stop running.
"""

from __future__ import annotations

import pytest

from bitformat.runtime.wgpu.device import ENV_REQUIRE, GpuDevice, request_adapter, require_gpu


@pytest.fixture(scope="session")
def adapter():
    a = request_adapter()
    if a is None:
        if require_gpu():
            pytest.fail(f"{ENV_REQUIRE} is set but wgpu found no adapter")
        pytest.skip("no wgpu adapter (on Linux: apt-get install mesa-vulkan-drivers)")
    return a


@pytest.fixture(scope="session")
def devices(adapter):
    """``get(lanes=1, x_space=None, max_binding=None, fused=True)`` -> a cached
    :class:`GpuDevice`. ``fused=True`` (the default here, a GPU's default) runs the decode
    step's fused kernels on lavapipe too, whose own default is the op-by-op kernels."""
    cache: dict[tuple, GpuDevice] = {}

    def get(lanes: int = 1, x_space: str | None = None, max_binding: int | None = None,
            fused: bool | None = True):
        key = (lanes, x_space, max_binding, fused)
        if key not in cache:
            cache[key] = GpuDevice(adapter, lanes=lanes, x_space=x_space,
                                   max_binding=max_binding, fused=fused)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def gpu(devices):
    return devices()


@pytest.fixture(scope="session")
def tiny_all(tiny_containers):
    """format id -> the tiny synthetic model in that container."""
    return tiny_containers

