"""Float BitNet weights made ternary, as bitnet.cpp and transformers do it.

bitnet.cpp users start from float files: the bf16 master checkpoint
(``microsoft/bitnet-b1.58-2B-4T-bf16``, read by :mod:`bitformat.formats.hf`) or an f32 / f16 /
bf16 GGUF written by ``convert-hf-to-gguf-bitnet.py`` (bitnet.cpp's ``ggml-model-f32.gguf``) or
by upstream llama.cpp's converter. Every container bitformat writes holds trits, so these
weights are quantized on reading, with one of two rules per tensor:

``absmean`` (raw master weights; transformers' ``WeightQuant`` of online ``AutoBitLinear``
and the ``weight_quant`` of both GGUF converters, all in float32)::

    m = mean(|W|) over the whole tensor          float32 (see below)
    inv = 1 / max(m, 1e-5)                       float32
    t = clamp(round_half_even(W * inv), -1, 1)   the trits
    scale = 1 / inv                              float32: the weight they use is t / inv

``ternary values`` (a tensor holding only 0 and +-a: what those converters write into float
GGUFs, because their ``weight_quant`` returns ``t / inv``): bitnet.cpp's ``quantize_i2_s``
(``llama-quantize ... I2_S``): ``t = sign(v)``, 0 where ``|v| < 1e-6``, ``scale = max |v|``.
It keeps the values in the file exactly. Absmean would give the same trits but the scale
``mean |v|`` (``a`` times the non-zero share), a different model.

Where the implementations differ, and what is followed here:

* the mean: torch sums float32 in float32 (a cascade whose order depends on the CPU's vector
  width and the thread count; ``torch.compile`` reorders it again), so its mean can differ from
  the correctly rounded one in the last bit (6 of 12 bf16 Gaussian tensors of 2B-4T's shapes
  did). Here the mean is the correctly rounded float32 of the exact mean: the scale can then
  differ by 1 ulp from a given torch run, and a trit only where ``|W * inv|`` lies within an ulp
  of 0.5. Where float32 sums are exact (any order), both agree bit for bit (tested).
* the scale's precision: transformers casts ``t / inv`` back to the model dtype (bf16 when
  the checkpoint is loaded as bf16); bitnet.cpp's converter first turns bf16 into float32 and
  keeps ``1 / inv`` in float32. float32 is followed (= transformers with ``dtype=float32``).
* ``quantize_i2_s`` on weights that are not ternary-valued codes them by sign with the scale
  ``max |v|`` (meaningless for raw masters), and the Python ``quantize_to_i2_s`` takes the
  first non-zero ``|v|`` as the scale: on ternary-valued tensors all three agree; on raw
  masters bitformat uses absmean, what the converters' ``weight_quant`` does first.
"""

from __future__ import annotations

import numpy as np

#: GGUF architectures whose float projections are BitNet master weights (bitnet.cpp's two
#: names and upstream llama.cpp's)
MASTER_ARCHITECTURES = ("bitnet-b1.58", "bitnet-25", "bitnet")
EPS = np.float32(1e-5)  # clamp of the mean (transformers, both converters)
ZERO_BELOW = 1e-6  # quantize_i2_s: |v| below this codes 0

#: rule names, as reported to the user
ABSMEAN, TERNARY_VALUES = "absmean", "ternary values"


def absmean(w: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """``(trits int8, scale float32)`` of float weights by transformers' ``WeightQuant``.

    The scale is ``1 / (1 / mean)`` in float32, not always the mean itself (0.4375 here):

    >>> t, s = absmean(np.array([[0.5, -0.25, 0.0, 1.0]], np.float32))
    >>> t.tolist(), str(s)
    ([[1, -1, 0, 1]], '0.43749997')
    """
    w = np.asarray(w, dtype=np.float32)
    m = np.float32(np.abs(w).mean(dtype=np.float64)) if w.size else np.float32(0)
    inv = np.float32(1.0) / max(m, EPS)
    trits = np.clip(np.rint(w * inv), -1, 1).astype(np.int8)
    return trits, np.float32(1.0) / inv


def ternary_values(w: np.ndarray) -> tuple[np.ndarray, np.float32] | None:
    """bitnet.cpp's ``quantize_i2_s`` if ``w`` holds only 0 and +-a (|v| < 1e-6 counts as 0),
    else None.

    >>> t, s = ternary_values(np.array([[0.75, 0.0, -0.75]], np.float32))
    >>> t.tolist(), float(s)
    ([[1, 0, -1]], 0.75)
    >>> ternary_values(np.array([[0.75, 0.5]], np.float32)) is None
    True
    """
    w = np.asarray(w, dtype=np.float32)
    mag = np.abs(w)
    a = np.float32(mag.max()) if w.size else np.float32(0)
    live = mag >= ZERO_BELOW
    if not np.all(mag[live] == a):
        return None
    trits = np.sign(w).astype(np.int8)
    trits[~live] = 0
    return trits, a


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.float32, str]:
    """``(trits, scale, rule)``: :func:`ternary_values` where it applies, else :func:`absmean`."""
    found = ternary_values(w)
    if found is not None:
        return (*found, TERNARY_VALUES)
    return (*absmean(w), ABSMEAN)


__all__ = ["ABSMEAN", "EPS", "MASTER_ARCHITECTURES", "TERNARY_VALUES", "ZERO_BELOW", "absmean",
           "quantize", "ternary_values"]
