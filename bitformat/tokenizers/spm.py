"""SentencePiece vocabularies as GGUF stores them (``tokenizer.ggml.model = "llama"``).

The Llama-2 family (1bitLLM's bitnet_b1_58 models among them) carries::

    tokenizer.ggml.model             string    "llama"
    tokenizer.ggml.tokens            str[]     pieces, "▁" (U+2581) for a space, "<0x0A>" bytes
    tokenizer.ggml.scores            f32[]     piece scores: higher merges first
    tokenizer.ggml.token_type        i32[]     1 normal, 2 unknown, 3 control, 6 byte
    tokenizer.ggml.bos_token_id / eos_token_id / unknown_token_id / padding_token_id  u32
    tokenizer.ggml.add_bos_token / add_eos_token / add_space_prefix                   bool

llama.cpp (``llm_tokenizer_spm``) turns text into pieces by prepending a space (unless
``add_space_prefix`` is false), writing spaces as "▁", splitting into characters and then
merging the adjacent pair whose concatenation is a piece with the highest score, leftmost
first, until none is left; a character that is no piece becomes its UTF-8 bytes' ``<0xNN>``
pieces. The ``tokenizers`` package does the same as a BPE whose merges are every split of
every piece into two pieces, ranked by the merged piece's score (what transformers'
``LlamaConverter`` builds), with byte fallback. :func:`from_sentencepiece` reads a
``tokenizer.model`` (the sentencepiece package) into these keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..constants import ValueType
from ..errors import MetadataError, UnsupportedConversionError
from ..io.gguf import MetaValue

SPACE = "\u2581"
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6)
_KEY = "tokenizer.ggml."


@dataclass
class SPMData:
    """Everything a ``llama`` (SentencePiece) GGUF tokenizer holds."""

    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    bos_id: int
    eos_id: int
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None

    KEYS = ("model", "tokens", "scores", "token_type", "bos_token_id", "eos_token_id",
            "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token",
            "add_space_prefix")

    def metadata(self) -> dict[str, MetaValue]:
        s, u32, b = ValueType.STRING, ValueType.UINT32, ValueType.BOOL
        out = {_KEY + "model": MetaValue(s, "llama"),
               _KEY + "tokens": MetaValue(ValueType.ARRAY, list(self.tokens), s),
               _KEY + "scores": MetaValue(ValueType.ARRAY,
                                          np.asarray(self.scores, dtype=np.float32),
                                          ValueType.FLOAT32),
               _KEY + "token_type": MetaValue(ValueType.ARRAY,
                                              np.asarray(self.token_types, dtype=np.int32),
                                              ValueType.INT32),
               _KEY + "bos_token_id": MetaValue(u32, int(self.bos_id)),
               _KEY + "eos_token_id": MetaValue(u32, int(self.eos_id))}
        for key, v in (("unknown_token_id", self.unk_id), ("padding_token_id", self.pad_id)):
            if v is not None:
                out[_KEY + key] = MetaValue(u32, int(v))
        for key, v in (("add_bos_token", self.add_bos), ("add_eos_token", self.add_eos),
                       ("add_space_prefix", self.add_space_prefix)):
            if v is not None:
                out[_KEY + key] = MetaValue(b, bool(v))
        if self.chat_template is not None:
            out["tokenizer.chat_template"] = MetaValue(s, self.chat_template)
        return out

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> SPMData:
        m = {k: (v.plain() if isinstance(v, MetaValue) else v) for k, v in meta.items()
             if k.startswith("tokenizer.")}
        if m.get(_KEY + "model") != "llama":
            raise UnsupportedConversionError(f"tokenizer model {m.get(_KEY + 'model')!r} is "
                                             "not SentencePiece ('llama')")
        if _KEY + "tokens" not in m:
            raise MetadataError(f"tokenizer metadata lacks {_KEY}tokens")
        tokens = [str(t) for t in m[_KEY + "tokens"]]
        n = len(tokens)
        scores = [float(x) for x in m.get(_KEY + "scores", [0.0] * n)]
        types = [int(x) for x in m.get(_KEY + "token_type", [TOKEN_NORMAL] * n)]
        if len(scores) != n or len(types) != n:
            raise MetadataError(f"{n} tokens but {len(scores)} scores and {len(types)} types")

        def tid(key: str, default: int | None) -> int | None:
            v = m.get(_KEY + key, default)
            if v is not None and not 0 <= int(v) < n:
                raise MetadataError(f"{_KEY}{key} = {v} is outside the vocabulary of {n}")
            return None if v is None else int(v)

        def opt(key: str):
            v = m.get(_KEY + key)
            return None if v is None else bool(v)

        # llama.cpp's defaults for a SentencePiece vocabulary: bos 1, eos 2, unk 0
        return cls(tokens, scores, types, tid("bos_token_id", 1), tid("eos_token_id", 2),
                   tid("unknown_token_id", 0), tid("padding_token_id", None), opt("add_bos_token"),
                   opt("add_eos_token"), opt("add_space_prefix"),
                   m.get("tokenizer.chat_template"))

    def uncarried(self, meta: dict[str, Any]) -> list[str]:
        known = {_KEY + k for k in self.KEYS} | {"tokenizer.chat_template"}
        return [k for k in meta if k.startswith("tokenizer.") and k not in known]


def merges_from_scores(tokens: list[str], scores: list[float], types: list[int]
                       ) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces, the merged piece's score deciding the
    rank (ties by id): the BPE equivalent of llama.cpp's highest-score bigram merging."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED)}
    found = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((-scores[i], i, vocab[left], vocab[right], left, right))
    found.sort()
    return [(f[4], f[5]) for f in found]


def build(d: SPMData, with_post_processor: bool):
    """A ``tokenizers.Tokenizer`` for ``d`` giving every piece its GGUF id."""
    from tokenizers import AddedToken, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {t: i for i, t in enumerate(d.tokens)}
    if len(vocab) != len(d.tokens):
        raise MetadataError("the token list holds duplicates")
    unk = d.tokens[d.unk_id] if d.unk_id is not None else None
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(
        d.tokens, d.scores, d.token_types), unk_token=unk, byte_fallback=True,
        fuse_unk=True))
    space = d.add_space_prefix is not False
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE)] if space else []) + [normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if space else []))
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(d.tokens, d.token_types, strict=True)
                if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    tok.add_special_tokens(specials)
    add_bos = d.add_bos if d.add_bos is not None else True  # llama.cpp: SPM adds bos
    if with_post_processor and (add_bos or d.add_eos):
        bos, eos = d.tokens[d.bos_id], d.tokens[d.eos_id]
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if d.add_eos
                                                                  else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + (
            [f"{eos}:1"] if d.add_eos else [])
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair),
            special_tokens=[(bos, d.bos_id), (eos, d.eos_id)])
    return tok


def from_sentencepiece(model_file: str | os.PathLike) -> dict[str, MetaValue]:
    """GGUF tokenizer metadata from a SentencePiece ``tokenizer.model`` (needs the
    sentencepiece package), as llama.cpp's convert_hf_to_gguf.py writes it."""
    try:
        import sentencepiece as spm
    except ImportError:
        raise UnsupportedConversionError("reading tokenizer.model needs the sentencepiece "
                                         "package") from None
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(TOKEN_UNKNOWN if sp.is_unknown(i) else TOKEN_CONTROL if sp.is_control(i)
                     else TOKEN_UNUSED if sp.is_unused(i) else TOKEN_BYTE if sp.is_byte(i)
                     else TOKEN_NORMAL)
    bos, eos = sp.bos_id(), sp.eos_id()
    return SPMData(tokens, scores, types, bos if bos >= 0 else 1, eos if eos >= 0 else 2,
                   sp.unk_id() if sp.unk_id() >= 0 else None,
                   sp.pad_id() if sp.pad_id() >= 0 else None, add_bos=True,
                   add_eos=False).metadata()


def write_sentencepiece(d: SPMData, path: str | os.PathLike) -> None:
    """``d`` as a SentencePiece BPE ``tokenizer.model`` (the inverse of
    :func:`from_sentencepiece`; needs sentencepiece's protobuf module)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:
        raise UnsupportedConversionError("writing tokenizer.model needs the sentencepiece and "
                                         "protobuf packages") from None
    m = pb.ModelProto()
    for t, s, ty in zip(d.tokens, d.scores, d.token_types, strict=True):
        p = m.pieces.add()
        p.piece, p.score, p.type = t, float(np.float32(s)), int(ty)
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(d.tokens)
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = d.unk_id if d.unk_id is not None else -1
    m.trainer_spec.bos_id, m.trainer_spec.eos_id = d.bos_id, d.eos_id
    m.trainer_spec.pad_id = d.pad_id if d.pad_id is not None else -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = d.add_space_prefix is not False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    with open(path, "wb") as fh:
        fh.write(m.SerializeToString())
