"""rans on the cpu backend: decoded once at load into stfma rows (``decode="load"``) or inside
every mat-vec (``decode="fused"``). The decoder against the stfma writer on random matrices,
the model against i2_s, corrupt streams, and what a token reads."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from click.testing import CliRunner

from bitformat import load, open_model
from bitformat.cli import main
from bitformat.codecs import rans_decode as RD
from bitformat.codecs import rans_rows as RR
from bitformat.errors import FormatError, RequestError
from bitformat.formats import get_format
from bitformat.formats.rans import Rans
from bitformat.io.gguf import GGUFReader, GGUFWriter
from bitformat.ternary import TernaryTensor

PROMPT = [5, 17, 300, 42, 7, 99, 480, 1]


def stfma_rows(trits: np.ndarray) -> np.ndarray:
    t = TernaryTensor(trits, np.float32([1.5]), 0, "x")
    return get_format("stfma").encode(t).view(np.uint8).reshape(trits.shape[0], -1)


def decode_rows(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    w = RD.rans_weight(raw, *shape, 1.5, "x", {}, check_crc=True)
    out = np.full((shape[0], RR.stfma_row_bytes(shape[1])), 0xAA, np.uint8)  # not the answer
    return out, RR.decode_to_rows(w, out)


@pytest.mark.parametrize("seed", range(40))
def test_decode_to_rows_is_the_stfma_layout(seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 70))
    cols = int(rng.choice([1, 3, 16, 17, 250, 2560, int(rng.integers(4000, 9000))]))
    trits = rng.choice(np.int8([-1, 0, 1]), size=(rows, cols), p=[0.3, 0.4, 0.3])
    if seed % 2:  # dead rows and columns
        trits[rng.random(rows) < 0.3] = 0
        trits[:, rng.random(cols) < 0.2] = 0
    if seed % 7 == 0:
        trits[:] = 0
    fmt = Rans("trit" if seed % 5 == 0 else "group5", int(rng.choice([5, 64, 4096])),
               int(rng.choice([1, 16])))
    raw = fmt.encode(TernaryTensor(trits, np.float32([1.5]), 0, "x"))
    out, status = decode_rows(raw, trits.shape)
    assert not status.any()
    want = stfma_rows(trits)
    if not np.array_equal(out, want):
        r, b = (int(v) for v in np.argwhere(out != want)[0])
        raise AssertionError(f"row {r}, byte {b} (columns {4 * b}..{4 * b + 3}): "
                             f"{out[r, b]:#04x}, wanted {want[r, b]:#04x}")


def test_decode_to_rows_flags_corrupt_streams():
    rng = np.random.default_rng(7)
    trits = rng.choice(np.int8([-1, 0, 1]), size=(64, 2560), p=[0.3, 0.4, 0.3])
    trits[:, rng.random(2560) < 0.05] = 0  # dead columns: the run-copying path
    raw = get_format("rans").encode(TernaryTensor(trits, np.float32([1.5]), 0, "x"))
    n_words = int(np.frombuffer(raw[44:48].tobytes(), "<u4")[0])
    start = raw.size - 4 * n_words
    flagged = 0
    for bit in rng.choice(4 * n_words * 8, 60, replace=False):
        bad = raw.copy()
        bad[start + bit // 8] ^= 1 << (bit % 8)
        bad[4:8] = np.array([zlib.crc32(bad[8:].tobytes())], "<u4").view(np.uint8)
        try:  # the format's own reader decides what is corrupt
            get_format("rans").decode(bad, 64, 2560, scale=1.5, name="x")
            corrupt = False
        except FormatError:
            corrupt = True
        _, status = decode_rows(bad, (64, 2560))
        assert bool(status.any()) == corrupt
        flagged += corrupt
    assert flagged > 40


# -- the model -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_containers):
    out = {"i2_s": load(tiny_containers["i2_s"], backend="cpu"),
           "load": load(tiny_containers["rans"], backend="cpu", decode="load"),
           "fused": load(tiny_containers["rans"], backend="cpu", decode="fused")}
    yield out
    for m in out.values():
        m.close()


def test_decoded_at_load_runs_the_2bit_kernels_stacked(models):
    blk = models["load"].net.blocks[0]
    assert all(w.encoding == "stfma" for w in blk.proj.values())
    assert set(blk.stacked) == {("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")}
    assert all(w.encoding == "rans" for w in models["fused"].net.blocks[0].proj.values())
    assert models["fused"].net.blocks[0].stacked == {}


def test_logits_equal_i2s_in_both_modes(models):
    want = models["i2_s"].logits(PROMPT)
    for mode in ("load", "fused"):
        got = models[mode].logits(PROMPT)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max(),
                                   err_msg=mode)
    np.testing.assert_array_equal(models["load"].logits(PROMPT), want)  # the same kernels
    tokens = {k: m.generate(PROMPT, max_new_tokens=10, stop_ids=[]).tokens
              for k, m in models.items()}
    assert tokens["load"] == tokens["fused"] == tokens["i2_s"]


def test_bytes_a_token_reads(models, tiny_containers):
    with open_model(tiny_containers["rans"]) as m:
        emb = m.entry("token_embd.weight")
        ternary = [e for e in m.entries if e.ternary]
        other = sum(e.nbytes for e in m.entries if not e.ternary and e is not emb)
        head = 2 * emb.shape[0] * emb.shape[1]  # decoded into f16 at load either way
        assert emb.coding == "rans_float" and emb.nbytes < head
        rows = sum(e.shape[0] * -(-e.shape[1] // 16) * 4 for e in ternary)
        words = sum(e.nbytes for e in ternary)
    assert models["load"].weight_bytes_per_token == rows + head + other
    assert models["fused"].weight_bytes_per_token == words + head + other
    assert models["load"].load_seconds > 0


def corrupt_copy(src, dst, name: str) -> None:
    """``src`` with one stream word of ``name`` changed and its CRC-32 recomputed."""
    with GGUFReader(src) as r:
        meta = dict(r.metadata)
        tensors = [(n, i.shape, i.ggml_type, r.raw(n).copy()) for n, i in r.tensors.items()]
    for n, _, _, raw in tensors:
        if n == name:
            n_words = int(np.frombuffer(raw[44:48].tobytes(), "<u4")[0])
            raw[raw.size - 4 * n_words + 5] ^= 0x10
            raw[4:8] = np.array([zlib.crc32(raw[8:].tobytes())], "<u4").view(np.uint8)
    w = GGUFWriter(str(dst), metadata=meta)
    for n, shape, gtype, raw in tensors:
        w.add_tensor(n, shape, gtype, raw.nbytes)
    w.write(iter(raw for *_, raw in tensors))


@pytest.mark.parametrize("validate", [True, False])
def test_corrupt_stream_fails_at_load(tiny_containers, tmp_path, validate):
    """Decoding at load checks every stream as it decodes it, validating or not."""
    name = "blk.1.ffn_up.weight"
    path = tmp_path / "bad.rans.gguf"
    corrupt_copy(tiny_containers["rans"], path, name)
    with open_model(path) as m, pytest.raises(FormatError):
        m.ternary(name)  # the format's reader agrees that it is corrupt
    with pytest.raises(FormatError, match="corrupt") as e:
        load(path, backend="cpu", decode="load", validate=validate)
    assert name in str(e.value) and str(path) in str(e.value)


def test_decode_option_is_checked(tiny_containers):
    with pytest.raises(RequestError, match="load or fused"):
        load(tiny_containers["rans"], backend="cpu", decode="lazy")


def test_run_cli_decode_and_load_time(tiny_containers):
    for mode in ("load", "fused"):
        r = CliRunner().invoke(main, ["run", str(tiny_containers["rans"]), "--prompt-ids",
                                      "1,2,3", "-n", "4", "--json", "--decode", mode],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["decode"] == mode and out["container"] == "rans" and out["load_seconds"] > 0
    r = CliRunner().invoke(main, ["run", str(tiny_containers["i2_s"]), "--prompt-ids", "1,2",
                                  "-n", "2", "--json"], catch_exceptions=False)
    assert json.loads(r.stdout)["decode"] is None
