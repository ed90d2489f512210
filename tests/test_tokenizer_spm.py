"""SentencePiece vocabularies (``tokenizer.ggml.model = llama``) against the sentencepiece
package that trained them, transformers on the HF export, and llama.cpp's tokenizer."""

from __future__ import annotations

import io

import numpy as np
import pytest

from bitformat.tokenizers.bpe import Tokenizer, from_hf_files, to_hf_files
from bitformat.tokenizers.spm import SPMData, from_sentencepiece

spm = pytest.importorskip("sentencepiece")

TEXTS = ["Hello world, it's 2024!", "  two  spaces and a\ttab\nnewline",
         "déjà vu — naïve café ĳ 你好世界 🙂", "x86_64 (a+b)^2 <= c; {json: [1, 2]}",
         "Once upon a time there was a little model.", ""]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    from bitformat.synth_text import training_text

    d = tmp_path_factory.mktemp("spm")
    sp_io = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text(200_000)), model_writer=sp_io, vocab_size=512,
        model_type="bpe", byte_fallback=True, character_coverage=0.9995,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, minloglevel=2)
    path = d / "tokenizer.model"
    path.write_bytes(sp_io.getvalue())
    return path


def test_encode_matches_sentencepiece(spm_model):
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    meta = from_sentencepiece(spm_model)
    tok = Tokenizer(meta)
    assert tok.vocab_size == 512 and tok.add_bos
    for text in TEXTS:
        want = [sp.bos_id()] + sp.encode(text)
        assert tok.encode(text) == want, text
        assert tok.decode(want[1:]) == text


def test_hf_export_round_trip(spm_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    meta = from_sentencepiece(spm_model)
    to_hf_files(meta, tmp_path)
    back = from_hf_files(tmp_path)
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        assert np.array_equal(np.asarray(back[k].value), np.asarray(meta[k].value)), k
    assert back["tokenizer.ggml.add_bos_token"].value is True
    ours = Tokenizer(meta)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text), text


def test_data_round_trip_and_errors(spm_model):
    meta = from_sentencepiece(spm_model)
    d = SPMData.from_metadata(meta)
    assert d.metadata().keys() == meta.keys()
    bad = dict(meta)
    bad["tokenizer.ggml.bos_token_id"] = type(meta["tokenizer.ggml.bos_token_id"])(
        meta["tokenizer.ggml.bos_token_id"].vtype, 9999)
    from bitformat.errors import MetadataError

    with pytest.raises(MetadataError, match="outside the vocabulary"):
        SPMData.from_metadata(bad)


def test_matches_llama_cpp(spm_model, tiny_gguf, tmp_path):
    """A GGUF carrying the vocabulary reads in llama.cpp (vocab only) with the same ids."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from bitformat.container import open_model, write_gguf
    from bitformat.formats import get_format
    from bitformat.io.gguf import MetaValue

    src = open_model(tiny_gguf)
    try:
        meta = {k: v for k, v in src.metadata.items() if not k.startswith("tokenizer.")}
        meta = {("bitnet." + k[len("bitnet-b1.58."):] if k.startswith("bitnet-b1.58.") else k):
                (MetaValue.of("bitnet") if k == "general.architecture" else v)
                for k, v in meta.items()}
        meta.update(from_sentencepiece(spm_model))
        src.metadata = meta
        out = tmp_path / "spm.gguf"
        write_gguf(src, out, get_format("q2_0"))
    finally:
        src.close()
    llm = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    tok = Tokenizer(meta)
    for text in TEXTS:
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), text
