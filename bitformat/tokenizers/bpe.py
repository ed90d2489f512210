"""Byte-level BPE tokenizers in GGUF's ``gpt2`` convention (the Llama-3 tokenizer family).

A GGUF file carries its tokenizer as metadata::

    tokenizer.ggml.model             string    "gpt2" (byte-level BPE)
    tokenizer.ggml.pre               string    llama.cpp's pre-tokenizer name: "llama-bpe" (the
                                               Llama-3 split regex), "gpt-2", "qwen2", "falcon3",
                                               ... (:mod:`.pretokenize`)
    tokenizer.ggml.tokens            str[]     token strings, byte-level encoded (" a" -> "Ġa")
    tokenizer.ggml.token_type        i32[]     1 normal, 3 control, 4 user-defined
    tokenizer.ggml.merges            str[]     "left right", in merge-priority order
    tokenizer.ggml.bos_token_id      u32
    tokenizer.ggml.eos_token_id      u32
    tokenizer.ggml.padding_token_id  u32
    tokenizer.ggml.add_bos_token     bool
    tokenizer.chat_template          string    a Jinja template (see :mod:`.chat_template`)

:class:`Tokenizer` runs such a tokenizer with the ``tokenizers`` package; :func:`to_hf_files`
and :func:`from_hf_files` convert it to and from a Hugging Face tokenizer folder. Every token
goes into the BPE model's vocabulary under its GGUF id, and control / user-defined tokens are
registered again as added tokens (``tokenizers`` assigns added tokens the next free id, so a
token missing from the vocabulary would not keep its id).

:func:`train_bpe` makes a real byte-level BPE for synthetic models (no model hub is reachable):
it trains on generated text (see :func:`corpus`) and places Llama-3's special tokens at the top
of the vocabulary. The trained part is capped at 32768 tokens; ids between it and the special
block hold ``<|reserved_special_token_N|>`` fillers. The text is the same on every machine and
Python version, so the vocabulary depends only on the ``tokenizers`` release that trains it.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import ValueType
from ..errors import BitformatError, MetadataError, UnsupportedConversionError
from ..io.gguf import MetaValue
from .chat_template import BITNET_CHAT_TEMPLATE, render_chat

#: The pre-tokenizer regex of Llama 3 (``tokenizer.json``; llama.cpp's ``llama-bpe``).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4  # llama.cpp's llama_token_type

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
MAX_TRAINED = 32768
_RESERVED = "<|reserved_special_token_{}|>"
_KEY = "tokenizer.ggml."


def llama3_specials(n: int = 256) -> list[str]:
    """The first ``n`` tokens of Llama 3's special block (ids 128000.. in Llama 3).

    >>> llama3_specials(10)[::3]
    ['<|begin_of_text|>', '<|reserved_special_token_1|>', '<|start_header_id|>', '<|eot_id|>']
    """
    named = [BOS, EOS] + [_RESERVED.format(i) for i in range(4)] + [
        "<|start_header_id|>", "<|end_header_id|>", _RESERVED.format(4), EOT]
    return (named + [_RESERVED.format(i) for i in range(5, 5 + max(0, n - 10))])[:n]


@dataclass
class BPEData:
    """Everything a ``gpt2`` GGUF tokenizer holds; optional fields are None when absent."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None
    pre: str | None = "llama-bpe"

    #: the GGUF keys this class carries, in the order :meth:`metadata` writes them
    KEYS = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
            "padding_token_id", "add_bos_token", "add_eos_token")

    def metadata(self) -> dict[str, MetaValue]:
        """GGUF metadata with exact types, in canonical order."""
        s, u32, b = ValueType.STRING, ValueType.UINT32, ValueType.BOOL
        out = {_KEY + "model": MetaValue(s, "gpt2")}
        if self.pre is not None:
            out[_KEY + "pre"] = MetaValue(s, self.pre)
        out[_KEY + "tokens"] = MetaValue(ValueType.ARRAY, list(self.tokens), s)
        out[_KEY + "token_type"] = MetaValue(
            ValueType.ARRAY, np.asarray(self.token_types, dtype=np.int32), ValueType.INT32)
        out[_KEY + "merges"] = MetaValue(ValueType.ARRAY, list(self.merges), s)
        out[_KEY + "bos_token_id"] = MetaValue(u32, int(self.bos_id))
        out[_KEY + "eos_token_id"] = MetaValue(u32, int(self.eos_id))
        if self.pad_id is not None:
            out[_KEY + "padding_token_id"] = MetaValue(u32, int(self.pad_id))
        if self.add_bos is not None:
            out[_KEY + "add_bos_token"] = MetaValue(b, bool(self.add_bos))
        if self.add_eos is not None:
            out[_KEY + "add_eos_token"] = MetaValue(b, bool(self.add_eos))
        if self.chat_template is not None:
            out["tokenizer.chat_template"] = MetaValue(s, self.chat_template)
        return out

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> BPEData:
        """Read the tokenizer keys of GGUF metadata (MetaValues or plain values)."""
        m = {k: (v.plain() if isinstance(v, MetaValue) else v) for k, v in meta.items()
             if k.startswith("tokenizer.")}

        def need(key: str) -> Any:
            if _KEY + key not in m:
                raise MetadataError(f"tokenizer metadata lacks {_KEY + key}")
            return m[_KEY + key]

        if need("model") != "gpt2":
            raise UnsupportedConversionError(f"tokenizer model {m[_KEY + 'model']!r} is not "
                                             "a byte-level BPE ('gpt2')")
        tokens = _typed_list(need("tokens"), str, _KEY + "tokens")
        types = _typed_list(m.get(_KEY + "token_type", [TOKEN_NORMAL] * len(tokens)),
                            (int, np.integer), _KEY + "token_type")
        if len(types) != len(tokens):
            raise MetadataError(f"{len(tokens)} tokens but {len(types)} token types")
        ids = [need("bos_token_id"), need("eos_token_id"), m.get(_KEY + "padding_token_id")]
        if any(i is not None and (isinstance(i, bool) or not isinstance(i, (int, np.integer)))
               for i in ids):
            raise MetadataError(f"a special token id in {ids!r:.80} is not an integer")
        if any(i is not None and not 0 <= int(i) < len(tokens) for i in ids):
            raise MetadataError(f"a special token id in {ids} is outside the vocabulary of "
                                f"{len(tokens)}")

        def opt(key: str, conv):
            v = m.get(key)
            if v is not None and not isinstance(v, {int: (int, np.integer)}.get(conv, conv)):
                raise MetadataError(f"metadata {key} is {str(v)[:40]!r}, not a {conv.__name__}")
            return None if v is None else conv(v)

        return cls(tokens, types, _typed_list(m.get(_KEY + "merges", []), str, _KEY + "merges"),
                   int(ids[0]), int(ids[1]), opt(_KEY + "padding_token_id", int),
                   opt(_KEY + "add_bos_token", bool), opt(_KEY + "add_eos_token", bool),
                   opt("tokenizer.chat_template", str), opt(_KEY + "pre", str))

    def uncarried(self, meta: dict[str, Any]) -> list[str]:
        """Tokenizer keys of ``meta`` that this class (and so the HF files) cannot hold."""
        known = {_KEY + k for k in self.KEYS} | {"tokenizer.chat_template"}
        return [k for k in meta if k.startswith("tokenizer.") and k not in known]


def _typed_list(v: Any, kind, key: str) -> list:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple, np.ndarray)) or not all(
            isinstance(x, kind) and not isinstance(x, bool) for x in v):
        raise MetadataError(f"metadata {key} is not an array of "
                            f"{'strings' if kind is str else 'integers'}")
    return [x if kind is str else int(x) for x in v]


# -- training ---------------------------------------------------------------------------------
def corpus(max_bytes: int | None = None) -> list[str]:
    """Training text, the same on every machine: :func:`bitformat.synth_text.training_text`
    (generated prose and code, about ``max_bytes``)."""
    from ..synth_text import training_text

    return training_text(max_bytes)


@functools.lru_cache(maxsize=4)
def _trained(n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens by id, merges) of a byte-level BPE of at most ``n`` tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = _pre_tokenizer("llama-bpe")
    trainer = trainers.BpeTrainer(vocab_size=n, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # About 1 KB of text per trained token saturates the merge list; the cap keeps the tiny
    # preset quick (~0.1 s) while 32k tokens read the whole text (3 MB, ~4 s).
    tok.train_from_iterator(corpus(max(256 << 10, n * 1024)), trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise AssertionError("trained vocabulary ids are not contiguous")
    return tuple(t for t, _ in by_id), tuple(_merge_str(m) for m in model["merges"])


def train_bpe(vocab_size: int, specials: list[str], *, max_trained: int = MAX_TRAINED
              ) -> BPEData:
    """A byte-level BPE of exactly ``vocab_size`` tokens with ``specials`` at the top.

    Ids ``0 .. n-1`` hold the trained tokens (``n = min(max_trained, vocab_size -
    len(specials))``, fewer if the corpus runs out of merges), then
    ``<|reserved_special_token_K|>`` fillers (K continuing after the highest reserved number
    among ``specials``), then ``specials`` in order. With :func:`llama3_specials` (256) and
    128256 tokens this is Llama 3's layout: bos 128000, eos 128001, eot 128009.
    Deterministic for a given ``tokenizers`` release.
    """
    n_free = vocab_size - len(specials)
    if min(n_free, max_trained) < 256:
        raise ValueError(f"{min(n_free, max_trained)} ordinary ids are too few: byte-level "
                         "BPE needs at least 256")
    if BOS not in specials or EOS not in specials:
        raise ValueError(f"specials must contain {BOS} and {EOS}")
    trained, merges = _trained(min(max_trained, n_free))
    taken = set(trained) & set(specials)
    if taken:
        raise ValueError(f"trained tokens collide with specials: {sorted(taken)}")
    reserved = [int(s[len("<|reserved_special_token_"):-2]) for s in specials
                if s.startswith("<|reserved_special_token_")]
    first = max(reserved, default=-1) + 1
    fillers = [_RESERVED.format(first + i) for i in range(n_free - len(trained))]
    tokens = list(trained) + fillers + list(specials)
    types = [TOKEN_NORMAL] * len(trained) + [TOKEN_CONTROL] * (len(fillers) + len(specials))
    eos = tokens.index(EOS)
    return BPEData(tokens, types, list(merges), tokens.index(BOS), eos, pad_id=eos,
                   add_bos=True, chat_template=BITNET_CHAT_TEMPLATE)


# -- running ----------------------------------------------------------------------------------
def _merge_str(m: Any) -> str:
    return m if isinstance(m, str) else f"{m[0]} {m[1]}"


def _pre_tokenizer(pre: str | None):
    from . import pretokenize

    return pretokenize.build(pre if pre is not None else "llama-bpe")


def _ignore_merges(pre: str | None) -> bool:
    from . import pretokenize

    return pretokenize.get(pre if pre is not None else "llama-bpe").ignore_merges


def default_add_bos(pre: str | None) -> bool:
    """llama.cpp's add_bos when the file does not say: true for the Llama 3 family."""
    from . import pretokenize

    return pretokenize.get(pre if pre is not None else "llama-bpe").add_bos


def _build(d: BPEData, with_post_processor: bool):
    """A ``tokenizers.Tokenizer`` giving every token its GGUF id."""
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {t: i for i, t in enumerate(d.tokens)}
    if len(vocab) != len(d.tokens):
        raise MetadataError("the token list holds duplicates")
    pairs = [tuple(m.split(" ")) for m in d.merges]
    if any(len(p) != 2 for p in pairs):
        raise MetadataError("a merge is not two tokens separated by one space")
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs,
                                     ignore_merges=_ignore_merges(d.pre)))
        tok.pre_tokenizer = _pre_tokenizer(d.pre)
        tok.decoder = decoders.ByteLevel()
        # Types other than normal and user-defined (unknown 2, unused 5, byte 6) count as
        # control: never produced from text except by their exact string.
        added = [AddedToken(t, special=ty != TOKEN_USER_DEFINED, normalized=False)
                 for t, ty in zip(d.tokens, d.token_types, strict=True) if ty != TOKEN_NORMAL]
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])
        add_bos = d.add_bos if d.add_bos is not None else default_add_bos(d.pre)
        if with_post_processor and add_bos:
            bos = d.tokens[d.bos_id]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                special_tokens=[(bos, d.bos_id)])
    except BitformatError:
        raise
    except BaseException as exc:  # the tokenizers library's errors, pyo3 panics included
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)) or not isinstance(
                exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        raise MetadataError(f"the tokenizer library refuses this vocabulary: "
                            f"{str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}"
                            ) from None
    return tok


class Tokenizer:
    """Encode and decode with the tokenizer stored in GGUF metadata.

    Examples
    --------
    >>> tok = Tokenizer(train_bpe(512, llama3_specials(16)).metadata())
    >>> ids = tok.encode("Hello, world")
    >>> ids[0] == tok.bos_id, tok.decode(ids[1:])
    (True, 'Hello, world')
    """

    def __init__(self, metadata: dict[str, Any]):
        from . import pretokenize, spm

        model = metadata.get(_KEY + "model")
        if (model.plain() if isinstance(model, MetaValue) else model) == "llama":
            self.data = spm.SPMData.from_metadata(metadata)
            self.pre, self.pre_note = "", ""
            self._tok = spm.build(self.data, with_post_processor=False)
            self.add_bos = self.data.add_bos if self.data.add_bos is not None else True
            self.chat_template = self.data.chat_template or BITNET_CHAT_TEMPLATE
            return
        self.data = BPEData.from_metadata(metadata)
        arch = metadata.get("general.architecture")
        arch = arch.plain() if isinstance(arch, MetaValue) else arch
        #: the pre-tokenizer run, and why when the file does not name one (for inspect)
        self.pre, self.pre_note = pretokenize.resolve(self.data.pre, arch)
        if self.pre_note and self.pre == "default":
            import warnings

            warnings.warn(self.pre_note, stacklevel=2)
        d = self.data
        run = BPEData(d.tokens, d.token_types, d.merges, d.bos_id, d.eos_id, d.pad_id,
                      d.add_bos, d.add_eos, d.chat_template, self.pre)
        self._tok = _build(run, with_post_processor=False)
        self.add_bos = d.add_bos if d.add_bos is not None else default_add_bos(self.pre)
        self.chat_template = d.chat_template or BITNET_CHAT_TEMPLATE

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        from ..io.gguf import GGUFReader

        with GGUFReader(path) as r:
            return cls(r.metadata)

    @property
    def vocab_size(self) -> int:
        return len(self.data.tokens)

    @property
    def bos_id(self) -> int:
        return self.data.bos_id

    @property
    def eos_ids(self) -> list[int]:
        """Ids that end a turn: eos, then ``<|eot_id|>`` where the vocabulary has it."""
        out = [self.data.eos_id]
        eot = self._tok.token_to_id(EOT)
        if eot is not None and eot not in out:
            out.append(eot)
        return out

    def token(self, token_id: int) -> str:
        """The stored (byte-level encoded) string of one id."""
        return self.data.tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens in the text map to their ids.

        ``add_bos`` defaults to the file's ``add_bos_token``. Text rendered by
        :meth:`apply_chat_template` already starts with bos: encode it with ``add_bos=False``.
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, self.data.bos_id)
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True
                            ) -> str:
        """The conversation as prompt text, rendered from the file's chat template."""
        return render_chat(self.chat_template, messages, add_generation_prompt,
                           bos_token=self.data.tokens[self.data.bos_id],
                           eos_token=self.data.tokens[self.data.eos_id],
                           pad_token=None if self.data.pad_id is None else
                           self.data.tokens[self.data.pad_id])


# -- Hugging Face files -----------------------------------------------------------------------
def to_hf_files(metadata: dict[str, Any], out_dir: str | os.PathLike) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    Returns the tokenizer keys of ``metadata`` the files cannot carry (e.g.
    ``tokenizer.ggml.scores``), for the caller to report. Token types other than 1, 3 and 4
    are written as special added tokens, so they read back as control (3).
    """
    model = metadata.get(_KEY + "model")
    if (model.plain() if isinstance(model, MetaValue) else model) == "llama":
        return _spm_to_hf_files(metadata, Path(out_dir))
    d = BPEData.from_metadata(metadata)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build(d, with_post_processor=True)
    tok.save(str(out / "tokenizer.json"))
    names = {"bos_token": d.bos_id, "eos_token": d.eos_id, "pad_token": d.pad_id}
    special = {k: d.tokens[i] for k, i in names.items() if i is not None}
    config: dict[str, Any] = {}
    if d.add_bos is not None:
        config["add_bos_token"] = d.add_bos
    if d.add_eos is not None:
        config["add_eos_token"] = d.add_eos
    config["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": ty != TOKEN_USER_DEFINED}
        for i, (t, ty) in enumerate(zip(d.tokens, d.token_types, strict=True))
        if ty != TOKEN_NORMAL}
    _write_hf_configs(out, config, special, d.chat_template,
                      {"clean_up_tokenization_spaces": True})
    return d.uncarried(metadata)


def _spm_to_hf_files(metadata: dict[str, Any], out: Path) -> list[str]:
    """A SentencePiece vocabulary: ``tokenizer.model`` (exact: pieces, scores, types),
    ``tokenizer.json`` (the same tokenizer for the fast path, bos/eos by a post-processor)
    and the two JSON configs."""
    from . import spm

    d = spm.SPMData.from_metadata(metadata)
    out.mkdir(parents=True, exist_ok=True)
    spm.write_sentencepiece(d, out / "tokenizer.model")
    spm.build(d, with_post_processor=True).save(str(out / "tokenizer.json"))
    names = {"bos_token": d.bos_id, "eos_token": d.eos_id, "unk_token": d.unk_id,
             "pad_token": d.pad_id}
    special = {k: d.tokens[i] for k, i in names.items() if i is not None}
    config: dict[str, Any] = {
        "add_bos_token": d.add_bos if d.add_bos is not None else True,
        "add_eos_token": bool(d.add_eos)}
    if d.add_space_prefix is not None:
        config["add_prefix_space"] = d.add_space_prefix
    config["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, (t, ty) in enumerate(zip(d.tokens, d.token_types, strict=True))
        if ty in (spm.TOKEN_CONTROL, spm.TOKEN_UNKNOWN)}
    _write_hf_configs(out, config, special, d.chat_template,
                      {"clean_up_tokenization_spaces": False, "legacy": True})
    return d.uncarried(metadata)


def _write_hf_configs(out: Path, config: dict[str, Any], special: dict[str, str],
                      chat_template: str | None, extra: dict[str, Any]) -> None:
    """``tokenizer_config.json`` (``config``, the special tokens, the chat template, ``extra``
    and the keys every fast tokenizer has) and ``special_tokens_map.json``."""
    config.update(special)
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update({**extra, "model_input_names": ["input_ids", "attention_mask"],
                   "tokenizer_class": "PreTrainedTokenizerFast"})
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                                encoding="utf-8")


def from_hf_files(hf_dir: str | os.PathLike) -> dict[str, MetaValue]:
    """GGUF tokenizer metadata from a Hugging Face folder (see :func:`_from_hf_files`); a
    field of an unexpected type or structure is a :class:`MetadataError` naming the folder."""
    try:
        return _from_hf_files(hf_dir)
    except BitformatError:
        raise
    except (TypeError, AttributeError, KeyError, ValueError, IndexError) as exc:
        raise MetadataError(f"the tokenizer files have an unexpected structure "
                            f"({type(exc).__name__}: {str(exc)[:100]})", path=str(hf_dir)
                            ) from None


def _from_hf_files(hf_dir: str | os.PathLike) -> dict[str, MetaValue]:
    """GGUF tokenizer metadata from a Hugging Face folder (the inverse of :func:`to_hf_files`).

    Token types: added special tokens are control (3), other added tokens user-defined (4),
    the rest normal (1). ``add_bos_token`` comes from ``tokenizer_config.json`` or, failing
    that, from a post-processor that prepends bos.
    """
    folder = Path(hf_dir)
    path = folder / "tokenizer.json"
    if (folder / "tokenizer.model").is_file() and _is_spm(path):
        return _spm_from_hf_files(folder)
    from ..io.safetensors import read_json

    tj = read_json(path, "tokenizer.json")
    config = _read_json(folder / "tokenizer_config.json")
    smap = _read_json(folder / "special_tokens_map.json")
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedConversionError(f"tokenizer model {model.get('type')!r} is not BPE",
                                         path=str(path))
    by_id: dict[int, tuple[str, int]] = {i: (t, TOKEN_NORMAL) for t, i in model["vocab"].items()}
    for a in tj.get("added_tokens") or []:
        by_id[int(a["id"])] = (a["content"], TOKEN_CONTROL if a.get("special")
                               else TOKEN_USER_DEFINED)
    if sorted(by_id) != list(range(len(by_id))):
        raise MetadataError("token ids are not contiguous from 0", path=str(path))
    tokens = [by_id[i][0] for i in range(len(by_id))]
    ids = {t: i for i, t in enumerate(tokens)}

    def special(name: str) -> int | None:
        v = config.get(name, smap.get(name))
        if isinstance(v, dict):
            v = v.get("content")
        if v is None:
            return None
        if v not in ids:
            raise MetadataError(f"{name} {v!r} is not in the vocabulary", path=str(folder))
        return ids[v]

    bos, eos = special("bos_token"), special("eos_token")
    if bos is None or eos is None:
        raise MetadataError("bos_token and eos_token are required", path=str(folder))
    add_bos = config.get("add_bos_token")
    post = tj.get("post_processor") or {}
    if add_bos is None and post.get("type") == "TemplateProcessing":
        first = (post.get("single") or [{}])[0].get("SpecialToken", {}).get("id")
        add_bos = True if first == tokens[bos] else None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for what, v, kind in (("chat_template", template, str), ("add_bos_token", add_bos, bool),
                          ("add_eos_token", config.get("add_eos_token"), bool)):
        if v is not None and not isinstance(v, kind):
            raise MetadataError(f"{what} is {str(v)[:40]!r}, not a {kind.__name__}",
                                path=str(folder / "tokenizer_config.json"))
    d = BPEData(tokens, [by_id[i][1] for i in range(len(tokens))],
                [_merge_str(m) for m in model.get("merges", [])], bos, eos,
                special("pad_token"), add_bos, config.get("add_eos_token"), template,
                _pre_name(tj.get("pre_tokenizer"), str(path)))
    return d.metadata()


def _is_spm(tokenizer_json: Path) -> bool:
    """A folder whose tokenizer is SentencePiece: tokenizer.model and no byte-level BPE."""
    if not tokenizer_json.is_file():
        return True
    try:
        model = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("model") or {}
    except ValueError:
        return True
    return model.get("type") == "Unigram" or bool(model.get("byte_fallback"))


def _spm_from_hf_files(folder: Path) -> dict[str, MetaValue]:
    """GGUF metadata from ``tokenizer.model``, with add_bos/add_eos, the special tokens and
    the chat template from ``tokenizer_config.json``."""
    from . import spm

    meta = spm.from_sentencepiece(folder / "tokenizer.model")
    d = spm.SPMData.from_metadata(meta)
    config = _read_json(folder / "tokenizer_config.json")
    for key, attr in (("add_bos_token", "add_bos"), ("add_eos_token", "add_eos"),
                      ("add_prefix_space", "add_space_prefix")):
        if isinstance(config.get(key), bool):
            setattr(d, attr, config[key])
    ids = {t: i for i, t in enumerate(d.tokens)}
    for key, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id"), ("pad_token", "pad_id"),
                      ("unk_token", "unk_id")):
        v = config.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str) and v in ids:
            setattr(d, attr, ids[v])
    template = config.get("chat_template")
    if isinstance(template, str):
        d.chat_template = template
    return d.metadata()


def _read_json(path: Path) -> dict[str, Any]:
    from ..io.safetensors import read_json

    if not path.is_file():
        return {}
    return read_json(path, path.name)


def _pre_name(pre: dict | None, path: str) -> str:
    """llama.cpp's pre-tokenizer name for a ``tokenizer.json`` pre_tokenizer."""
    from . import pretokenize

    name = pretokenize.name_of(pre)
    if name is None:
        raise UnsupportedConversionError(
            "pre-tokenizer matches none llama.cpp names (llama-bpe, qwen2, gpt-2, falcon, "
            "starcoder, default)", path=path)
    return name


__all__ = ["BITNET_CHAT_TEMPLATE", "BPEData", "LLAMA3_PATTERN", "Tokenizer", "corpus",
           "from_hf_files", "llama3_specials", "render_chat", "to_hf_files", "train_bpe"]
