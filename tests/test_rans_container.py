"""The ``rans`` container: lossless round trips, an independent reader built on constriction,
sizes, and hostile bytes.

The reference reader below is written from docs/formats/rans.md alone: it parses the words
with plain Python and decodes every stream with constriction's own ``AnsCoder``, switching
the model row by row. Our bytes must decode to the same trits there, and constriction's
encoder must reproduce our stream words exactly.
"""

from __future__ import annotations

import zlib

import constriction
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitformat import convert, open_model
from bitformat.codecs import rans_tables as rt
from bitformat.errors import BitformatError, FormatError, MetadataError, ShapeError
from bitformat.formats import FORMAT_IDS, get_format
from bitformat.formats.rans import Rans, describe, section_words
from bitformat.io.gguf import GGUFReader
from bitformat.ternary import TernaryTensor

NAME = "blk.0.attn_q.weight"
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- a reference reader, from the spec ---------------------------------------------------------
def exact_model(units: list[int]):
    f = np.asarray(units, dtype=np.int64) << 12
    return constriction.stream.model.Categorical((f - 1).astype(np.float64), perfect=False)


def ref_parse(raw: np.ndarray) -> dict:
    w = [int(v) for v in np.frombuffer(raw.tobytes(), dtype="<u4")]
    magic, crc, vg, rows, cols, n_live, n_cols, n_tab, k, p, n_streams, n_words = w[:12]
    assert magic == 0x534E4152 and crc == zlib.crc32(raw.tobytes()[8:])
    pos = 12

    def take(n: int) -> list[int]:
        nonlocal pos
        pos += n
        return w[pos - n:pos]

    def bits(words: list[int], n: int, width: int) -> list[int]:
        per = 32 // width
        return [(words[i // per] >> (width * (i % per))) & ((1 << width) - 1) for i in range(n)]

    dead_rows = bits(take(-(-rows // 32)), rows, 1)
    dead_cols = bits(take(-(-cols // 32)), cols, 1)
    tab = take(2 * n_tab)
    units = [[tab[2 * i] & 0xFFFF, tab[2 * i] >> 16, tab[2 * i + 1]] for i in range(n_tab)]
    cls = bits(take(-(-n_live // 8)), n_live, 4) if n_tab > 1 else [0] * n_live
    counts = bits(take(-(-n_streams // 2)), n_streams, 16)
    words = take(n_words)
    assert pos == len(w)
    live_rows = [r for r in range(rows) if not dead_rows[r]]
    live_cols = [c for c in range(cols) if not dead_cols[c]]
    assert (len(live_rows), len(live_cols)) == (n_live, n_cols)
    cuts = [(j * n_cols // p) // 5 * 5 for j in range(p)] + [n_cols]
    off = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return dict(rows=rows, cols=cols, group=(vg >> 8) & 0xFF, units=units, cls=cls, k=k, p=p,
                live_rows=live_rows, live_cols=live_cols, cuts=cuts,
                streams=[np.array(words[off[s]:off[s + 1]], dtype=np.uint32)
                         for s in range(n_streams)])


def digits(symbols: np.ndarray, group: int) -> np.ndarray:
    if group == 1:
        return symbols.astype(np.int8) - 1
    d = (symbols[:, None] // np.array([81, 27, 9, 3, 1])) % 3 - 1  # most significant first
    return d.reshape(-1).astype(np.int8)


def ref_segments(lay: dict, s: int):
    """(live row index, row, columns, model, symbol count) of stream s, in decode order."""
    g, j = divmod(s, lay["p"])
    cols = lay["live_cols"][lay["cuts"][j]:lay["cuts"][j + 1]]
    for i in range(g * lay["k"], min(len(lay["live_rows"]), g * lay["k"] + lay["k"])):
        u = lay["units"][lay["cls"][i]]
        model = exact_model(rt.group5_units(u).tolist() if lay["group"] == 5 else u)
        yield i, lay["live_rows"][i], cols, model, -(-len(cols) // lay["group"])


def ref_decode(raw: np.ndarray) -> np.ndarray:
    lay = ref_parse(raw)
    out = np.zeros((lay["rows"], lay["cols"]), dtype=np.int8)
    for s, words in enumerate(lay["streams"]):
        coder = constriction.stream.stack.AnsCoder(words)
        for _, row, cols, model, n_sym in ref_segments(lay, s):
            trits = digits(coder.decode(model, n_sym), lay["group"])
            assert not trits[len(cols):].any(), "padding is zero trits"
            out[row, cols] = trits[:len(cols)]
        assert coder.pos() == (0, 0), f"stream {s} ends in state 0 with every word read"
    return out


def ref_encode_streams(raw: np.ndarray, trits: np.ndarray) -> list[np.ndarray]:
    """constriction's words for each stream of ``raw``'s layout, from the trits."""
    lay = ref_parse(raw)
    out = []
    for s in range(len(lay["streams"])):
        coder = constriction.stream.stack.AnsCoder()
        for _, row, cols, model, n_sym in reversed(list(ref_segments(lay, s))):
            codes = np.ones(n_sym * lay["group"], dtype=np.int32)
            codes[:len(cols)] = trits[row, cols] + 1
            if lay["group"] == 5:
                codes = codes.reshape(-1, 5) @ np.array([81, 27, 9, 3, 1], dtype=np.int32)
            coder.encode_reverse(codes.astype(np.int32), model)
        out.append(coder.get_compressed())
    return out


# -- helpers -----------------------------------------------------------------------------------
def random_matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Trits with per-row zero shares, some dead rows and columns, sometimes all zero."""
    kind = rng.integers(6)
    if kind == 0:
        return np.zeros((rows, cols), dtype=np.int8)
    p0 = rng.choice([0.05, 0.3, 0.42, 0.7, 0.97], size=(rows, 1))
    u = rng.random((rows, cols))
    t = np.where(u < p0, 0, np.where(rng.random((rows, cols)) < 0.5, -1, 1)).astype(np.int8)
    if kind >= 3:
        t[rng.random(rows) < 0.3] = 0
        t[:, rng.random(cols) < 0.3] = 0
    return t


def roundtrip(fmt: Rans, trits: np.ndarray, scale: float = 1.25) -> np.ndarray:
    raw = fmt.encode(TernaryTensor(trits, np.float32([scale]), 0, NAME))
    back = fmt.decode(raw, *trits.shape, scale=scale, name=NAME)
    assert np.array_equal(back.trits, trits)
    assert back.scales.tolist() == [scale] and back.scale_block == 0
    return raw


def recrc(raw: np.ndarray) -> np.ndarray:
    raw = raw.copy()
    raw[4:8] = np.array([zlib.crc32(raw[8:].tobytes())], dtype="<u4").view(np.uint8)
    return raw


def put_word(raw: np.ndarray, index: int, value: int) -> np.ndarray:
    raw = raw.copy()
    raw[4 * index:4 * index + 4] = np.array([value & 0xFFFFFFFF], dtype="<u4").view(np.uint8)
    return recrc(raw)


# -- round trips -------------------------------------------------------------------------------
@SETTINGS
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), seed=st.integers(0, 2**32 - 1),
       mode=st.sampled_from(["group5", "trit"]), min_stream=st.sampled_from([5, 23, 64, 4096]),
       max_tables=st.sampled_from([1, 4, 16]))
def test_random_shapes_round_trip_and_match_constriction(rows, cols, seed, mode, min_stream,
                                                         max_tables):
    rng = np.random.default_rng(seed)
    trits = random_matrix(rng, rows, cols)
    fmt = Rans(mode, min_stream, max_tables)
    raw = roundtrip(fmt, trits)
    assert np.array_equal(ref_decode(raw), trits)
    lay = ref_parse(raw)
    for s, (ours, theirs) in enumerate(zip(lay["streams"], ref_encode_streams(raw, trits),
                                           strict=True)):
        assert np.array_equal(ours, theirs), f"stream {s}: words differ from constriction's"
    assert np.array_equal(fmt.encode(TernaryTensor(trits, np.float32([1.25]))), raw)


@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (2, 5), (3, 7), (1, 4096), (2, 8194),
                                   (7, 16), (5, 4099)])
def test_remainders_and_geometry(shape):
    rng = np.random.default_rng(sum(shape))
    trits = rng.choice(np.int8([-1, 0, 1]), size=shape, p=[0.3, 0.4, 0.3])
    trits.flat[0] = 1  # at least one live row and column
    raw = roundtrip(get_format("rans"), trits)
    h = describe(raw)
    rows_l, cols_l = h["live_rows"], h["live_cols"]
    if cols_l >= 4096:
        assert h["rows_per_stream"] == 1 and h["pieces"] == cols_l // 4096
    else:
        assert h["pieces"] == 1 and h["rows_per_stream"] == min(rows_l, -(-4096 // cols_l))
    sizes = section_words(*shape, rows_l, h["tables"], h["streams"], h["stream_words"])
    assert raw.size == 4 * sum(sizes.values())


def test_dead_rows_and_columns_cost_nothing():
    rng = np.random.default_rng(1)
    trits = rng.choice(np.int8([-1, 0, 1]), size=(64, 640), p=[0.3, 0.4, 0.3])
    base = roundtrip(get_format("rans"), trits)
    wide = np.zeros((80, 700), dtype=np.int8)
    live_r = np.sort(rng.choice(80, 64, replace=False))
    live_c = np.sort(rng.choice(700, 640, replace=False))
    wide[np.ix_(live_r, live_c)] = trits
    raw = roundtrip(get_format("rans"), wide)
    h = describe(raw)
    assert (h["live_rows"], h["live_cols"]) == (64, 640)
    assert h["stream_words"] == describe(base)["stream_words"]
    zero = roundtrip(get_format("rans"), np.zeros((300, 500), dtype=np.int8))
    assert describe(zero)["streams"] == 0 and zero.size == 4 * (12 + 10 + 16 + 2)


def test_full_size_tensor_beats_its_entropy():
    """A full-size 2B-4T attention matrix drawn like ``synth`` is within 1 % of its order-0
    entropy (row classes and dead rows take it below)."""
    from bitformat.synth import draw_trits, trit_spec

    trits = draw_trits(trit_spec("2b4t", "blk.0.attn_k.weight"))
    raw = roundtrip(get_format("rans"), trits)
    counts = np.bincount(trits.reshape(-1) + 1, minlength=3) / trits.size
    h0 = float(-(counts * np.log2(counts)).sum())
    assert raw.size * 8 / trits.size <= 1.01 * h0


def test_values_that_are_not_trits_are_refused():
    t = np.zeros((3, 9), dtype=np.int8)
    t[2, 4] = 2
    with pytest.raises(FormatError, match="value 2 at row 2, column 4") as e:
        get_format("rans").encode(TernaryTensor(t, np.float32([1.0]), 0, NAME))
    assert NAME in str(e.value)


# -- whole containers --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_rans(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("rans") / "tiny.rans.gguf"
    convert(tiny_gguf, out, "rans")
    return out


@pytest.mark.parametrize("fid", [f for f in FORMAT_IDS if f != "rans"])
def test_every_container_to_rans_and_back(tiny_gguf, tiny_rans, tmp_path, fid):
    src = tmp_path / f"tiny.{fid}.gguf"
    convert(tiny_gguf, src, fid)
    mid = tmp_path / "mid.rans.gguf"
    convert(src, mid, "rans")
    assert mid.read_bytes() == tiny_rans.read_bytes()  # same model, same bytes
    back = tmp_path / f"back.{fid}.gguf"
    convert(mid, back, fid)
    assert back.read_bytes() == src.read_bytes()


def test_rans_container_layout_and_plain_tensors(tiny_gguf, tiny_rans, tmp_path):
    again = tmp_path / "again.gguf"
    convert(tiny_rans, again, "rans")
    assert again.read_bytes() == tiny_rans.read_bytes()
    with open_model(tiny_gguf) as a, open_model(tiny_rans) as b, GGUFReader(tiny_rans) as r:
        assert b.container == "rans" and b.get("bitformat.format") == "rans"
        for e in a.entries:
            f = b.entry(e.name)
            if not e.ternary:
                assert a.plain(e.name)[1].tobytes() == b.plain(e.name)[1].tobytes()
                continue
            info = r.tensors[e.name]
            assert info.ggml_type.name == "I32" and len(info.shape) == 1
            assert f.nbytes == info.nbytes and f.shape == e.shape
            ta, tb = a.ternary(e.name), b.ternary(e.name)
            assert np.array_equal(ta.trits, tb.trits) and ta.tensor_scale() == tb.scales[0]
            assert np.array_equal(ref_decode(r.raw(e.name)), ta.trits)


def test_container_rejects_wrong_storage(tiny_rans, tmp_path):
    from bitformat.io.gguf import GGUFWriter

    with GGUFReader(tiny_rans) as r:
        meta = dict(r.metadata)
        name = next(n for n in r.tensors if n.endswith("attn_q.weight"))
        raw = r.raw(name).copy()
        rows, cols = (int(v) for v in meta[f"bitformat.tensor.{name}.shape"].value)
    from bitformat.constants import GGMLType

    for shape, gtype, msg in (((1, raw.size // 4), GGMLType.I32, "1-D I32"),
                              ((raw.size,), GGMLType.I8, "1-D I32")):
        path = tmp_path / "bad.gguf"
        w = GGUFWriter(str(path), metadata=meta)
        w.add_tensor(name, shape, gtype, raw.size)
        w.write(iter([raw]))
        with pytest.raises(FormatError, match=msg) as e:
            open_model(path)
        assert str(path) in str(e.value) and name in str(e.value)
    meta[f"bitformat.tensor.{name}.shape"].value[:] = [rows + 1, cols]
    path = tmp_path / "shape.gguf"
    w = GGUFWriter(str(path), metadata=meta)
    w.add_tensor(name, (raw.size // 4,), GGMLType.I32, raw.size)
    w.write(iter([raw]))
    with open_model(path) as m, pytest.raises(ShapeError, match=f"{rows}x{cols} matrix"):
        m.ternary(name)


# -- hostile bytes -----------------------------------------------------------------------------
def valid(rows: int = 12, cols: int = 3000, min_stream: int = 2000) -> tuple[np.ndarray, dict]:
    rng = np.random.default_rng(5)
    p0 = np.linspace(0.1, 0.9, rows)[:, None]  # zero shares that want several classes
    trits = np.where(rng.random((rows, cols)) < p0, 0, rng.choice(np.int8([-1, 1]),
                                                                  (rows, cols))).astype(np.int8)
    trits[0, :] = rng.choice(np.int8([-1, 1]), cols)  # every column live
    trits[3] = 0  # one dead row
    raw = roundtrip(Rans("group5", min_stream), trits)
    return raw, describe(raw)


def reject(raw: np.ndarray, rows: int = 12, cols: int = 3000, match: str = "",
           kind: type = FormatError) -> None:
    with pytest.raises(kind, match=match) as e:
        get_format("rans").decode(raw, rows, cols, scale=1.0, path="model.gguf", name=NAME)
    assert "model.gguf" in str(e.value) and NAME in str(e.value)


def test_hostile_header_and_sections():
    raw, h = valid()
    assert h["tables"] > 1 and h["live_rows"] == 11 and h["pieces"] == 1
    bad = raw.copy()
    bad[100] ^= 1
    reject(bad, match="checksum mismatch")
    reject(raw[:-4], kind=ShapeError, match=f"got {raw.size - 4}")
    reject(np.concatenate([raw, raw[:4]]), kind=ShapeError, match=f"got {raw.size + 4}")
    reject(raw[:20], kind=ShapeError, match="got 20")
    reject(put_word(raw, 0, 0x12345678), match="magic")
    reject(put_word(raw, 2, 0x301), match="version/group")
    reject(put_word(raw, 2, 0x10501), match="version/group")
    reject(raw, rows=13, kind=ShapeError, match="12x3000 matrix")
    reject(put_word(raw, 5, 10), match="live rows")  # L
    reject(put_word(raw, 8, 12), match="geometry")  # k beyond the live rows
    reject(put_word(put_word(raw, 8, 2), 9, 2), match="geometry")  # k > 1 and p > 1
    reject(put_word(raw, 8, 3), match="streams, the geometry gives 4")
    reject(put_word(raw, 10, 13), kind=ShapeError, match="got")  # S changes the size
    # Sections: dead-row map, dead-col map, tables, classes, counts.
    rows_at = 12
    reject(put_word(raw, rows_at, (1 << 3) | (1 << 20)), match="bits past the last row")
    reject(put_word(raw, rows_at, 0), match="live rows")
    cols_at = rows_at + 1
    reject(put_word(raw, cols_at, 1), match="live columns")
    tab_at = cols_at + 94
    reject(put_word(raw, tab_at, 0), match="frequency table")
    reject(put_word(raw, tab_at + 1, 4096), match="frequency table")
    cls_at = tab_at + 2 * h["tables"]
    reject(put_word(raw, cls_at, 0xF), match="row class")
    reject(put_word(raw, cls_at + 1, 0x1000), match="class padding")
    cnt_at = cls_at + 2
    first = int(np.frombuffer(raw[4 * cnt_at:4 * cnt_at + 4].tobytes(), "<u4")[0])
    reject(put_word(raw, cnt_at, first + 1), match="word counts")
    swap = ((first & 0xFFFF) + 1) | (((first >> 16) - 1) << 16)  # sum kept, streams moved
    reject(put_word(raw, cnt_at, swap), match="stream 0 of")


def test_flipped_stream_words_never_escape():
    """Every single-bit flip in the stream words (CRC recomputed, so the coder itself is
    tested) gives a clean error or valid trits; the CRC alone catches every flip."""
    raw, h = valid(rows=6, cols=700, min_stream=600)
    start = raw.size - 4 * h["stream_words"]
    rng = np.random.default_rng(0)
    caught = 0
    for bit in rng.choice((raw.size - start) * 8, 300, replace=False):
        bad = raw.copy()
        bad[start + bit // 8] ^= 1 << (bit % 8)
        reject(bad, 6, 700, match="checksum")
        try:
            t = get_format("rans").decode(recrc(bad), 6, 700, scale=1.0, name=NAME)
            assert t.trits.shape == (6, 700) and np.all(np.abs(t.trits) <= 1)
        except FormatError as e:
            assert NAME in str(e) and "corrupt" in str(e)
            caught += 1
    assert caught > 200  # the end check alone misses some; the CRC does not


def test_random_mutations_with_fixed_crc_are_clean():
    raw, h = valid(rows=9, cols=400, min_stream=150)
    rng = np.random.default_rng(3)
    outcomes = {"error": 0, "read": 0}
    for _ in range(400):
        bad = raw.copy()
        for _ in range(rng.integers(1, 4)):
            i = int(rng.integers(8, raw.size))
            bad[i] = rng.integers(256) if rng.random() < 0.5 else bad[i] ^ (1 << rng.integers(8))
        try:
            t = get_format("rans").decode(recrc(bad), 9, 400, scale=1.0, name=NAME)
            assert np.all(np.abs(t.trits) <= 1)
            outcomes["read"] += 1
        except BitformatError as e:
            assert NAME in str(e)
            outcomes["error"] += 1
    assert outcomes["error"] > 300, outcomes


def test_claimed_size_is_capped():
    """All-dead rows and columns cost (rows + cols) bits, so the data cannot bound the matrix
    it claims; the reader caps it instead of allocating."""
    raw, _ = valid()
    reject(raw, rows=1 << 20, cols=1 << 20, kind=ShapeError, match="trits")


def test_scale_is_required():
    raw, _ = valid()
    with pytest.raises(MetadataError, match="per-tensor scale"):
        get_format("rans").decode(raw, 12, 3000, name=NAME)
