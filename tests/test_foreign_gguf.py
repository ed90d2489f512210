"""A GGUF that is not ternary (llama.cpp's quantized types): listed by ``inspect``, refused by
the other commands in one line that says what the file is and what to do instead."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from bitformat.cli import main
from bitformat.errors import UnknownTypeError
from bitformat.io.gguf import GGUFReader

PROJ = {"attn_q": (64, 64), "attn_k": (64, 64), "attn_v": (64, 64), "attn_output": (64, 64),
        "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory):
    """A one-layer llama GGUF as llama.cpp quantizes one: Q4_1 projections, a Q8_0 embedding,
    written by gguf-py (llama.cpp's own package)."""
    import gguf
    from gguf import quants

    T = gguf.GGMLQuantizationType
    path = tmp_path_factory.mktemp("q4_1") / "llama-q4_1.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(32)
    rng = np.random.default_rng(0)

    def add(name, shape, t):
        x = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(name, quants.quantize(x, t), raw_dtype=t)

    add("token_embd.weight", (32, 64), T.Q8_0)
    for n, shape in PROJ.items():
        add(f"blk.0.{n}.weight", shape, T.Q4_1)
    for n in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{n}.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_reader_lists_llama_cpp_types(q4_1):
    with GGUFReader(q4_1) as r:
        t = r.tensors["blk.0.ffn_down.weight"]
        assert t.ggml_type.name == "Q4_1" and t.shape == (64, 128)
        assert t.nbytes == 64 * 128 // 32 * 20  # Q4_1: 20 bytes a block of 32
        assert r.tensors["token_embd.weight"].ggml_type.name == "Q8_0"


def test_inspect_lists_it_and_says_what_it_is(q4_1):
    r = CliRunner().invoke(main, ["inspect", str(q4_1)])
    assert r.exit_code == 0, r.output
    assert "Q4_1" in r.output and "Q8_0" in r.output and "llama" in r.output
    errors = [ln for ln in r.output.splitlines() if "error" in ln]
    assert len(errors) == 1 and "not a ternary model" in errors[0], errors
    r = CliRunner().invoke(main, ["inspect", str(q4_1), "--json"])
    s = json.loads(r.output)
    assert {t["encoding"] for t in s["tensors"]} == {"Q8_0", "Q4_1", "F32"}
    assert s["family"]["id"] is None


@pytest.mark.parametrize("args", [["run", "{f}", "-p", "hi"], ["convert", "--to", "tq2_0", "{f}",
                                  "-o", "{out}"], ["report", "{f}"], ["chat", "{f}"]],
                         ids=["run", "convert", "report", "chat"])
def test_the_other_commands_refuse_it_in_one_line(q4_1, tmp_path, args):
    out = tmp_path / "out.gguf"
    r = CliRunner().invoke(main, [a.format(f=q4_1, out=out) for a in args], input="hi\n")
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    msg = lines[0]
    assert "not a ternary model" in msg and "'llama'" in msg and "Q4_1 x 7" in msg
    assert "Q8_0 x 1" in msg and "llama.cpp" in msg
    assert not out.exists()


def test_a_type_nobody_knows_is_refused_by_number(q4_1, tmp_path):
    raw = bytearray(q4_1.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = raw.index(name) + len(name) + 4 + 2 * 8  # n_dims, two dims: the type follows
    raw[at: at + 4] = (200).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(UnknownTypeError, match="GGML type 200, which neither"):
        GGUFReader(bad)
