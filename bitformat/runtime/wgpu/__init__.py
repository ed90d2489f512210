"""The ``wgpu`` backend: device plumbing (``device.py``), weights on the device (``backend.py``),
the whole model as one command buffer a token (``network.py``), WGSL kernels (``kernels/``)."""
