"""Synthetic ternary models with the real architecture of each family, written as i2_s
containers.

No model hub is reachable, so tests, benchmarks and demos run on models made here. ``2b4t``
has exactly the tensors of the official ``microsoft/bitnet-b1.58-2B-4T-gguf`` file (names,
shapes, types and order: 332 tensors, 1,179,449,920 bytes of tensor data); ``tiny`` is the
same architecture shrunk (hidden 256, 2 layers) for tests.

Weights follow the profile measured on the real model (``data/bitnet-2b4t-weight-profile.json``):

* each ternary tensor's zero share, with -1 and +1 equally likely;
* dead (all-zero) rows, and per layer a set of dead FFN neurons n that is zero in ffn_gate row
  n, ffn_up row n and ffn_down column n alike (plus the few extra dead down columns seen);
* per-row density (share of non-zeros) varying around the tensor's mean with the spread of the
  profile's example of the same kind at the nearest layer, the dead rows' own share of that
  spread taken out; the mean is corrected so the tensor's zero share matches its target;
* one bf16 scale per tensor in [1.3, 1.8] (1 + k/128), exact in f16 and f32;
* norm gains near 1 (bf16 values stored as F32), an F16 normal embedding whose values are
  bf16 values (``embedding="bf16"``, the default), as in the official file, which was
  converted from the bf16 master weights: the low 3 mantissa bits of its normal values are
  zero. ``embedding="f16"`` keeps full f16 precision instead.

The other families' presets (:mod:`bitformat.families`) have the tensors, shapes and metadata
of their real checkpoints as bitformat imports them (GGUF names; an untied F16 ``output.weight``
where the model has an ``lm_head``), with weights drawn from the same 2B-4T profile (layer
``i`` of a deeper model uses profile layer ``i mod 30``); ``tiny-<family>`` are test sizes.
Their sizes are the public ``config.json`` values: 1bitLLM/bitnet_b1_58-large and -3B,
HF1BitLLM/Llama3-8B-1.58-100B-tokens (Llama-3-8B), tiiuae/Falcon3-7B-Instruct-1.58bit
(Falcon3-7B) and prism-ml's Ternary Bonsai 8B (Qwen3-8B).

``tiny`` uses layers 0 and 1 of the profile with dead-row counts scaled to its sizes. Every
tensor draws from its own generator, seeded by (seed, tensor name), so files are
byte-identical for a given seed and vocabulary (see :mod:`bitformat.tokenizers.bpe` on the latter).
"""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .constants import GGMLType, ValueType, ggml_nbytes
from .container import output_metadata
from .families import FAMILIES
from .formats import get_format
from .graph import block_shapes
from .io.gguf import GGUFWriter, MetaValue, PlannedTensor
from .ternary import TernaryTensor
from .tokenizers.bpe import llama3_specials, train_bpe

ARCH = "bitnet-b1.58"


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float = 500000.0
    eps: float = 1e-5
    specials: int = 256  # size of the Llama-3 special block at the top of the vocabulary
    embed_std: float = 0.02
    general_name: str = ""
    family: str = "bitnet-2b4t"
    key_length: int = 0  # head size where it is not hidden / heads (Qwen3)
    untied: bool = False  # an output.weight (HF lm_head) next to the embedding

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.head_dim * self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.kv_heads


PRESETS = {
    # embed_std 0.1: logits = norm(h) @ E^T then have a spread of about 1.6 over 512 tokens
    "tiny": Preset("tiny", 256, 2, 4, 2, 512, 512, 256, specials=16, embed_std=0.1,
                   general_name="bitnet-tiny-synth"),
    "2b4t": Preset("2b4t", 2560, 30, 20, 5, 6912, 128256, 4096,
                   general_name="bitnet2b-synth"),
    # name, hidden, layers, heads, kv heads, ffn, vocab, context, rope theta
    "tiny-1bitllm": Preset("tiny-1bitllm", 256, 2, 4, 4, 512, 512, 256, 10000.0, specials=16,
                           embed_std=0.1, general_name="1bitllm-tiny-synth",
                           family="bitnet-1bitllm", untied=True),
    "1bitllm-large": Preset("1bitllm-large", 1536, 24, 16, 16, 4096, 32002, 2048, 10000.0,
                            general_name="bitnet_b1_58-large-synth", family="bitnet-1bitllm",
                            untied=True),
    "1bitllm-3b": Preset("1bitllm-3b", 3200, 26, 32, 32, 8640, 32002, 2048, 10000.0,
                         general_name="bitnet_b1_58-3B-synth", family="bitnet-1bitllm",
                         untied=True),
    "tiny-llama": Preset("tiny-llama", 256, 2, 4, 2, 512, 512, 256, specials=16,
                         embed_std=0.1, general_name="llama-ternary-tiny-synth",
                         family="llama", untied=True),
    "llama3-8b": Preset("llama3-8b", 4096, 32, 32, 8, 14336, 128256, 8192,
                        general_name="Llama3-8B-1.58-synth", family="llama", untied=True),
    "falcon3-7b": Preset("falcon3-7b", 3072, 28, 12, 4, 23040, 131072, 32768, 1000042.0,
                         general_name="Falcon3-7B-1.58bit-synth", family="llama",
                         untied=True),
    "tiny-qwen3": Preset("tiny-qwen3", 256, 2, 4, 2, 512, 512, 256, 1000000.0, 1e-6,
                         specials=16, embed_std=0.1, general_name="qwen3-ternary-tiny-synth",
                         family="qwen3", key_length=128, untied=True),
    "bonsai-8b": Preset("bonsai-8b", 4096, 36, 32, 8, 12288, 151936, 40960, 1000000.0, 1e-6,
                        general_name="Ternary-Bonsai-8B-synth", family="qwen3",
                        key_length=128, untied=True),
}
REAL = PRESETS["2b4t"]  # the sizes the profile was measured on

#: One block's tensors in the official file's order: the HF converter walks the checkpoint
#: in sorted HF-name order (input_layernorm, mlp.down_proj, mlp.ffn_sub_norm, mlp.gate_proj,
#: mlp.up_proj, post_attention_layernorm, self_attn.attn_sub_norm, self_attn.k/o/q/v_proj).
BLOCK_ORDER = ("attn_norm", "ffn_down", "ffn_sub_norm", "ffn_gate", "ffn_up", "ffn_norm",
               "attn_sub_norm", "attn_k_norm", "attn_k", "attn_output", "attn_q_norm", "attn_q",
               "attn_v")
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def _preset(preset: str | Preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}"
                         ) from None


def _block_shapes(p: Preset) -> dict[str, tuple[tuple[int, ...], GGMLType]]:
    every = {n: (s, GGMLType.I2_S if len(s) == 2 else GGMLType.F32) for n, s in block_shapes(
        p.hidden, p.ffn, p.heads, p.kv_heads, p.head_dim).items()}
    have = FAMILIES[p.family].block_tensors()
    return {k: v for k, v in every.items() if k in have}


def plan(preset: str | Preset, embedding: str = "bf16") -> list[PlannedTensor]:
    """Every tensor ``synth`` writes, in file order: name, shape (numpy order), type, bytes.

    >>> t = plan("2b4t")
    >>> len(t), sum(e.nbytes for e in t)
    (332, 1179449920)
    """
    p = _preset(preset)
    shapes = _block_shapes(p)
    et = GGMLType.Q2_0 if embedding == "q2_0" else GGMLType.F16
    out = [("output.weight", (p.vocab, p.hidden), et)] if p.untied else []
    out.append(("token_embd.weight", (p.vocab, p.hidden), et))
    for layer in sorted(range(p.layers), key=str):  # 0, 1, 10, 11, ..., 19, 2, 20, ...
        out += [(f"blk.{layer}.{k}.weight", *shapes[k]) for k in BLOCK_ORDER if k in shapes]
    out.append(("output_norm.weight", (p.hidden,), GGMLType.F32))
    return [PlannedTensor(n, s, t, ggml_nbytes(t, int(np.prod(s)))) for n, s, t in out]


def model_metadata(preset: str | Preset) -> dict[str, MetaValue]:
    """The model's GGUF metadata (architecture keys as in the official file, tokenizer)."""
    p = _preset(preset)
    u32, f32 = ValueType.UINT32, ValueType.FLOAT32
    fam = FAMILIES[p.family]
    arch = fam.arch
    meta = {"general.architecture": MetaValue(ValueType.STRING, arch),
            "general.name": MetaValue(ValueType.STRING, p.general_name)}
    for key, vtype, value in (
            ("vocab_size", u32, p.vocab), ("context_length", u32, p.context),
            ("embedding_length", u32, p.hidden), ("block_count", u32, p.layers),
            ("feed_forward_length", u32, p.ffn), ("rope.dimension_count", u32, p.head_dim),
            ("attention.head_count", u32, p.heads), ("attention.head_count_kv", u32, p.kv_heads),
            ("attention.layer_norm_rms_epsilon", f32, p.eps), ("rope.freq_base", f32,
                                                               p.rope_theta)):
        meta[f"{arch}.{key}"] = MetaValue(vtype, value)
    if p.key_length:
        meta[f"{arch}.attention.key_length"] = MetaValue(u32, p.key_length)
        meta[f"{arch}.attention.value_length"] = MetaValue(u32, p.key_length)
    for key, value in fam.metadata.items():  # what tells it from a family of the same arch
        meta[f"{arch}.{key}"] = MetaValue(ValueType.STRING, value)
    meta["general.quantization_version"] = MetaValue(u32, 2)
    meta.update(train_bpe(p.vocab, llama3_specials(p.specials)).metadata())
    return meta


# -- the weight profile -----------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def load_profile() -> dict:
    """The weight statistics measured on the real 2B-4T model."""
    text = (resources.files("bitformat") / "data" / "bitnet-2b4t-weight-profile.json"
            ).read_text(encoding="utf-8")
    return json.loads(text)


@functools.lru_cache(maxsize=1)
def _live_row_sd() -> dict[tuple[str, int], float]:
    """(kind, layer) -> sd of row density among live rows, from the profile's examples."""
    prof = load_profile()
    out = {}
    for name, ex in prof["row_density_examples"].items():
        layer, kind = _split(name)
        t = prof["tensors"][name]
        rows = _block_shapes(REAL)[kind][0][0]
        f = t["dead_rows"] / rows  # dead rows (density 0) widen the spread: take them out
        m = (1 - t["zero_fraction"]) / (1 - f)
        var = (ex["sd"] ** 2 - f * (1 - f) * m * m) / (1 - f)
        out[(kind, layer)] = float(np.sqrt(max(var, 0.0)))
    return out


def _split(name: str) -> tuple[int, str]:
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a block tensor")
    return int(m.group(1)), m.group(2)


def _rng(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(zlib.crc32(
        key.encode()),)))


@dataclass
class TritSpec:
    """What one ternary tensor is drawn to look like."""

    name: str
    rows: int
    cols: int
    zero_fraction: float  # target share of zeros over the whole tensor (dead parts included)
    row_sd: float  # spread of the density of live rows
    dead_rows: np.ndarray  # sorted row indices that are all zero
    dead_cols: np.ndarray  # sorted column indices that are all zero (ffn_down)
    scale: float  # a bf16 value


def _scaled(count: int, size: int, real_size: int) -> int:
    """A count measured on the real model, for a dimension of ``size`` instead."""
    return round(count * size / real_size)


def dead_neurons(preset: str | Preset, layer: int, seed: int = 0) -> np.ndarray:
    """Sorted FFN neurons of ``layer`` that are dead in gate rows, up rows and down columns."""
    p = _preset(preset)
    k = _scaled(load_profile()["dead_ffn_neurons_by_layer"][str(layer)]["all_three"], p.ffn,
                REAL.ffn)
    return np.sort(_rng(seed, f"blk.{layer}.dead_ffn_neurons").choice(p.ffn, k, replace=False))


def trit_spec(preset: str | Preset, name: str, seed: int = 0) -> TritSpec:
    """The drawn statistics (dead rows and columns, scale, targets) of one ternary tensor."""
    p = _preset(preset)
    layer, kind = _split(name)
    if layer >= p.layers:
        raise ValueError(f"the preset has {p.layers} layers, not {layer + 1}")
    layer = layer % REAL.layers  # deeper models reuse the profile's layers in turn
    prof = load_profile()
    t = prof["tensors"][f"blk.{layer}.{kind}.weight"]
    (rows, cols), _ = _block_shapes(p)[kind]
    real_rows = _block_shapes(REAL)[kind][0][0]
    rng = _rng(seed, name)
    scale = 1.0 + int(rng.integers(39, 103)) / 128  # bf16: 7 mantissa bits, in [1.30, 1.80]
    n_dead = _scaled(t["dead_rows"], rows, real_rows)
    dead_rows = np.zeros(0, dtype=np.int64)
    dead_cols = np.zeros(0, dtype=np.int64)
    if kind in ("ffn_gate", "ffn_up", "ffn_down"):
        neurons = dead_neurons(p, layer, seed)
        dead = prof["dead_ffn_neurons_by_layer"][str(layer)]
        if kind == "ffn_down":
            extra = _scaled(dead["down_cols"] - dead["all_three"], p.ffn, REAL.ffn)
            dead_cols = _with_extra(rng, neurons, extra, p.ffn)
        else:
            dead_rows = neurons
            n_dead -= len(neurons)
    if n_dead > 0:
        dead_rows = _with_extra(rng, dead_rows, n_dead, rows)
    near = min((k for k in _live_row_sd() if k[0] == kind), key=lambda k: abs(k[1] - layer))
    return TritSpec(name, rows, cols, t["zero_fraction"], _live_row_sd()[near], dead_rows,
                    dead_cols, scale)


def _with_extra(rng: np.random.Generator, base: np.ndarray, extra: int, n: int) -> np.ndarray:
    """``base`` plus ``extra`` more distinct indices below ``n``, sorted."""
    if extra <= 0:
        return np.sort(base)
    free = np.setdiff1d(np.arange(n), base)
    return np.sort(np.concatenate([base, rng.choice(free, extra, replace=False)]))


def draw_trits(spec: TritSpec, seed: int = 0) -> np.ndarray:
    """int8 ``[rows, cols]`` trits following ``spec``."""
    rng = _rng(seed, spec.name + "/trits")
    rows, cols = spec.rows, spec.cols
    live = np.setdiff1d(np.arange(rows), spec.dead_rows)
    live_cols = cols - len(spec.dead_cols)
    # Mean density of live cells that leaves the whole tensor with its zero share.
    m = (1 - spec.zero_fraction) * rows * cols / (len(live) * live_cols)
    lo = min(m, max(0.02, 8 / live_cols))  # keep live rows clear of being all zero
    d = m + spec.row_sd * rng.standard_normal(len(live))
    for _ in range(8):  # clipping moves the mean: shift back, clip again
        d = np.clip(d + (m - d.mean()), lo, 1.0)
    density = np.zeros(rows)
    density[live] = d
    # P(u >= T) = density for u uniform on 0..65535; the low bit of u picks the sign.
    thresh = np.minimum(np.round((1 - density) * 65536), 65535).astype(np.uint16)
    u = rng.integers(0, 65536, size=(rows, cols), dtype=np.uint16)
    trits = (u & 1).astype(np.int8)
    trits <<= 1
    trits -= 1
    trits *= u >= thresh[:, None]
    trits[spec.dead_rows] = 0
    trits[:, spec.dead_cols] = 0
    return trits


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (half to even)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & np.uint32(0xFFFF0000)
    return b.view(np.float32)


#: the embedding's precision: bf16 or f16 values stored as F16, or (Ternary Bonsai) q2_0
#: blocks of trits for the embedding and an untied head
EMBEDDINGS = ("bf16", "f16", "q2_0")


def _tensor(p: Preset, t: PlannedTensor, seed: int, embedding: str = "bf16") -> np.ndarray:
    """The stored bytes of one planned tensor."""
    if t.ggml_type == GGMLType.I2_S:
        spec = trit_spec(p, t.name, seed)
        tt = TernaryTensor(draw_trits(spec, seed), np.float32([spec.scale]), 0, t.name)
        return get_format("i2_s").encode(tt)
    rng = _rng(seed, t.name)
    if t.ggml_type == GGMLType.Q2_0:  # a Ternary Bonsai embedding or head: ternary values
        return _q2_0_rows(p, t, rng)
    if t.ggml_type == GGMLType.F32:  # a norm gain
        return _bf16(1.0 + 0.1 * rng.standard_normal(t.shape, dtype=np.float32))
    out = np.empty(t.shape, dtype=np.float16)  # the embedding, in chunks of rows
    step = max(1, (1 << 24) // t.shape[1])
    for r in range(0, t.shape[0], step):
        chunk = rng.standard_normal((min(step, t.shape[0] - r), t.shape[1]), dtype=np.float32)
        chunk *= p.embed_std
        out[r:r + step] = _bf16(chunk) if embedding == "bf16" else chunk
    return out


def _q2_0_rows(p: Preset, t: PlannedTensor, rng: np.random.Generator) -> np.ndarray:
    """q2_0 blocks of uniform trits with an f16 scale per 64 values of about
    ``1.2 * embed_std`` (the spread of the float embedding), d = 0 where a block is all 0."""
    fmt = get_format("q2_0")
    rows, cols = t.shape
    out = []
    step = max(1, (1 << 22) // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        trits = rng.integers(-1, 2, (n, cols), dtype=np.int8)
        d = (np.float32(1.2 * p.embed_std) * rng.uniform(0.5, 1.5, (n, cols // 64))
             ).astype(np.float16).astype(np.float32)
        tt = TernaryTensor(trits, d, 64, t.name)
        d[~tt.block_nonzero()] = 0
        out.append(fmt.encode(tt))
    return np.concatenate(out)


def synth(preset: str | Preset, out: str | os.PathLike, seed: int = 0,
          progress: Callable[[str, int, int], None] | None = None,
          embedding: str = "bf16") -> Path:
    """Write a synthetic model as an i2_s GGUF container at ``out`` and return its path.

    Streams tensor by tensor (the 2b4t embedding, 657 MB, is the largest piece held).
    ``progress(name, index, total)`` is called after each tensor is drawn (index from 0).
    ``embedding``: "bf16" (bf16 values stored as F16, as the official file has them) or
    "f16" (full-precision F16 values) or "q2_0" (ternary q2_0 embedding and untied head, as
    Ternary Bonsai ships them).
    """
    if embedding not in EMBEDDINGS:
        raise ValueError(f"embedding must be one of {', '.join(EMBEDDINGS)}, got "
                         f"{embedding!r:.20}")
    p = _preset(preset)
    fmt = get_format("i2_s")
    entries = plan(p, embedding)
    writer = GGUFWriter(str(out))
    writer.metadata = output_metadata(model_metadata(p), fmt)
    for e in entries:
        writer.add_tensor(e.name, e.shape, e.ggml_type, e.nbytes)

    def blobs():
        for i, e in enumerate(entries):
            data = _tensor(p, e, seed, embedding)
            if progress is not None:
                progress(e.name, i, len(entries))
            yield data
            del data

    writer.write(blobs())
    return Path(out)


__all__ = ["EMBEDDINGS", "PRESETS", "Preset", "TritSpec", "dead_neurons", "draw_trits",
           "load_profile", "model_metadata", "plan", "synth", "trit_spec"]
