"""A model family defined in this one file runs on every backend.

The toy family's layer is one no released model has: ReLU^2 with a sub-norm before down_proj
only, Qwen3's q/k norms and Llama's interleaved q/k rows. It is described once
(:func:`bitformat.graph.decoder_graph`), registered (:func:`bitformat.families.register`),
written by ``synth`` and then read, validated and run by the numpy, cpu and wgpu backends,
which take everything from the graph. A reference written out here, step by step in numpy,
checks that the graph is what runs, and a second toy (a parallel attention + FFN block, which
the fused kernels do not compute) shows what a backend does with a layer it cannot lower.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from backends import runtime_backends

from bitformat.container import open_model
from bitformat.errors import UnsupportedConversionError
from bitformat.families import Family, family_of, register, unregister
from bitformat.graph import Graph, Step, decoder_graph
from bitformat.runtime import load
from bitformat.runtime.backend import quantize_activations, rms_norm, rope
from bitformat.synth import PRESETS, synth

TOY = Family("toy-ternary", "Toy ternary (tests)", ("toy-ternary",),
             decoder_graph("relu2", ffn_sub_norm=True, qk_norm=True, interleaved_qk=True))
#: attention and FFN side by side, both reading one norm of h (GPT-J style)
PARALLEL = Family("toy-parallel", "Toy parallel block (tests)", ("toy-parallel",), Graph((
    Step("norm_quant", ("h",), ("x",), ("attn_norm",)),
    Step("linear", ("x",), ("q", "k", "v"), ("attn_q", "attn_k", "attn_v")),
    Step("attention", ("q", "k", "v"), ("o",)),
    Step("norm_quant", ("o",), ("xo",), ("attn_sub_norm",)),
    Step("linear", ("xo",), ("ya",), ("attn_output",)),
    Step("linear", ("x",), ("gate", "up"), ("ffn_gate", "ffn_up")),
    Step("glu", ("gate", "up"), ("g",), arg="relu2"),
    Step("norm_quant", ("g",), ("xd",), ("ffn_sub_norm",)),
    Step("linear", ("xd",), ("yf",), ("ffn_down",)),
    Step("add", ("h", "ya"), ("h",)),
    Step("add", ("h", "yf"), ("h",)),
)))
PROMPT = [5, 17, 300, 42, 7, 99, 480, 1, 250, 33]


@pytest.fixture(scope="module")
def toy_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy-family")
    paths = {}
    try:
        for fam in (TOY, PARALLEL):
            register(fam)
            # the tiny Qwen3's sizes (a head of 128 beside a hidden size of 256), tied head
            p = replace(PRESETS["tiny-qwen3"], name=fam.id, family=fam.id, untied=False,
                        general_name=f"{fam.id}-synth")
            paths[fam.id] = synth(p, d / f"{fam.id}.gguf", seed=5)
        yield paths
    finally:
        for fam in (TOY, PARALLEL):
            unregister(fam.id)


def _hf_rows(x: np.ndarray) -> np.ndarray:
    """[T, heads, d] from llama.cpp's interleaved rows (GGUF row 2i + p = HF row p d/2 + i)."""
    T, H, d = x.shape
    return x.reshape(T, H, d // 2, 2).swapaxes(-1, -2).reshape(T, H, d)


def reference_logits(path, tokens) -> np.ndarray:
    """The toy family's forward pass written out (float32), from the file's trits."""
    with open_model(path) as m:
        meta = {k: v.plain() for k, v in m.metadata.items()}
        arch = meta["general.architecture"]
        H, KV, d, eps, theta, layers, dim = (meta[f"{arch}.{k}"] for k in (
            "attention.head_count", "attention.head_count_kv", "attention.key_length",
            "attention.layer_norm_rms_epsilon", "rope.freq_base", "block_count",
            "embedding_length"))

        def vec(name):  # a float tensor's values (F32, or F16 for the embedding)
            kind, raw = m.plain(name)
            return np.frombuffer(raw, {"F32": np.float32, "F16": np.float16}[kind.name]
                                 ).astype(np.float32)

        def linear(x, name):  # BitLinear: Q8(x) @ T^T * scale / s
            qa = quantize_activations(x)
            t = m.ternary(name)
            acc = qa.q.astype(np.float32) @ t.trits.astype(np.float32).T  # exact sums
            return acc * np.float32(t.scales[0]) / qa.s[:, None]

        emb = vec("token_embd.weight").reshape(-1, dim)
        h = emb[tokens]
        T = len(tokens)
        inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
        ang = np.arange(T, dtype=np.float32)[:, None] * inv.astype(np.float32)
        cos, sin = np.cos(ang), np.sin(ang)
        causal = np.triu(np.full((T, T), -np.inf, np.float32), 1)
        for i in range(layers):
            p = f"blk.{i}."
            x = rms_norm(h, vec(f"{p}attn_norm.weight"), eps)
            q = _hf_rows(linear(x, f"{p}attn_q.weight").reshape(T, H, d))
            k = _hf_rows(linear(x, f"{p}attn_k.weight").reshape(T, KV, d))
            v = linear(x, f"{p}attn_v.weight").reshape(T, KV, d)
            q = rope(rms_norm(q, vec(f"{p}attn_q_norm.weight"), eps), cos, sin)
            k = rope(rms_norm(k, vec(f"{p}attn_k_norm.weight"), eps), cos, sin)
            o = np.empty((T, H, d), np.float32)
            for hh in range(H):
                kv = hh // (H // KV)
                sc = q[:, hh] @ k[:, kv].T / np.float32(np.sqrt(d)) + causal
                w = np.exp(sc - sc.max(axis=1, keepdims=True))
                o[:, hh] = (w / w.sum(axis=1, keepdims=True)) @ v[:, kv]
            h = h + linear(o.reshape(T, H * d), f"{p}attn_output.weight")  # no sub-norm
            f = rms_norm(h, vec(f"{p}ffn_norm.weight"), eps)
            g = np.maximum(linear(f, f"{p}ffn_gate.weight"), 0) ** 2
            g = rms_norm(g * linear(f, f"{p}ffn_up.weight"), vec(f"{p}ffn_sub_norm.weight"), eps)
            h = h + linear(g, f"{p}ffn_down.weight")
        return rms_norm(h, vec("output_norm.weight"), eps) @ emb.T


def test_the_toy_family_is_read_and_validated_from_its_graph(toy_paths):
    from bitformat.summary import summarize
    from bitformat.validate import check_model, model_args

    with open_model(toy_paths[TOY.id]) as m:
        meta = {k: v.plain() for k, v in m.metadata.items()}
        assert family_of(meta) is TOY
        assert check_model(m, model_args(m)) == []
        names = {e.name for e in m.entries if e.name.startswith("blk.0.")}
    # exactly the tensors the graph's steps read: q/k norms and one sub-norm, no attn_sub_norm
    assert names == {f"blk.0.{t}.weight" for t in TOY.graph.tensors()}
    assert "attn_sub_norm" not in TOY.block_tensors() and TOY.qk_norm and TOY.permuted_qk
    with open_model(toy_paths[TOY.id]) as m:
        assert summarize(m).family["id"] == TOY.id


def test_the_numpy_backend_runs_what_the_graph_describes(toy_paths):
    want = reference_logits(toy_paths[TOY.id], PROMPT)  # its keys and values unrounded
    with load(toy_paths[TOY.id], backend="numpy", kv_cache="f32") as m:
        got = m.logits(PROMPT)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("backend", runtime_backends())
def test_the_toy_family_runs_on_every_backend(toy_paths, backend):
    """The logits of every position and 8 greedy tokens agree with numpy's, and the fast path
    of each backend is the one that runs (the wgpu network, not op by op)."""
    with load(toy_paths[TOY.id], backend="numpy") as ref:
        want = ref.logits(PROMPT)
        tokens = ref.generate(PROMPT, max_new_tokens=8, stop_ids=[]).tokens
    with load(toy_paths[TOY.id], backend=backend) as m:
        if backend == "wgpu":
            from bitformat.runtime.wgpu.network import WgpuBitNet

            assert isinstance(m.net, WgpuBitNet)
        got = m.logits(PROMPT)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
        assert m.generate(PROMPT, max_new_tokens=8, stop_ids=[]).tokens == tokens


def test_a_layer_the_fused_kernels_lack_runs_op_by_op_or_is_refused_by_name(toy_paths):
    """The parallel block runs wherever the graph is interpreted (numpy, cpu op by op, with
    the same logits); the wgpu network refuses it, naming the step it does not compute."""
    path = toy_paths[PARALLEL.id]
    with load(path, backend="numpy") as ref:
        want = ref.logits(PROMPT)
    with load(path, backend="cpu") as m:
        assert m.net._decode_plan() is None  # the one-call step does not compute it
        np.testing.assert_allclose(m.logits(PROMPT), want, rtol=0,
                                   atol=1e-4 * np.abs(want).max())
    if "wgpu" in runtime_backends():
        with pytest.raises(UnsupportedConversionError,
                           match="toy-parallel layer.*step 6: expected add of h, ya, found "
                                 "linear of x"):
            load(path, backend="wgpu")


def test_the_toy_family_converts_losslessly_but_has_no_hf_layout(toy_paths, tmp_path):
    """Every GGUF container takes a registered family's file as it is (the same trits back);
    the Hugging Face export refuses one without a Hugging Face layout, by name, writing
    nothing."""
    from bitformat.container import convert

    src = toy_paths[TOY.id]
    convert(src, tmp_path / "toy.tq1_0.gguf", "tq1_0")
    convert(tmp_path / "toy.tq1_0.gguf", tmp_path / "back.gguf", "i2_s")
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()
    with pytest.raises(UnsupportedConversionError, match="toy-ternary family has no Hugging "
                                                         "Face layout"):
        convert(src, tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists()


def test_a_graph_reads_only_what_it_wrote():
    with pytest.raises(ValueError, match="reads y before"):
        Graph((Step("add", ("h", "y"), ("h",)),))
    with pytest.raises(ValueError, match="unknown step"):
        Step("gelu", ("h",), ("h",))
    with pytest.raises(ValueError, match="glu activation 'gelu'"):
        Step("glu", ("gate", "up"), ("g",), arg="gelu")
