"""Byte-level BPE pre-tokenizers under the names llama.cpp writes in ``tokenizer.ggml.pre``.

llama.cpp (``src/llama-vocab.cpp``: ``llama_vocab::impl::load`` maps a name to a
``LLAMA_VOCAB_PRE_TYPE_*``, ``llm_tokenizer_bpe`` gives each type its list of regexes) splits
text with each regex in turn, keeping the matches and the text between them as pieces; the
``tokenizers`` package does the same with one ``Split(regex, "isolated")`` per regex. The
Llama 3 family also takes a whole piece that is a token as it is (``ignore_merges``).

An unknown name is an error, never a guess: a wrong split tokenizes most text differently.
A GGUF without ``tokenizer.ggml.pre`` means llama.cpp's ``default`` (with a warning), except
for BitNet files: the official 2B-4T GGUF lacks the key and uses Llama 3's tokenizer, as
bitnet.cpp and ik_llama.cpp read it (:func:`resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedConversionError

_CONTRACTIONS = r"'s|'t|'re|'ve|'m|'ll|'d"
GPT2 = _CONTRACTIONS + r"| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
#: Llama 3's tokenizer.json regex; llama.cpp spells the case-insensitive group out
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Qwen2's: Llama 3's with single digits
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    kind: str  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_* (lower case)
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_TYPES = {
    "llama3": PreTokenizer("llama3", (LLAMA3,), ignore_merges=True, add_bos=True),
    "gpt2": PreTokenizer("gpt2", (GPT2,)),
    "qwen2": PreTokenizer("qwen2", (QWEN2,)),
    "falcon": PreTokenizer("falcon", (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")),
    "starcoder": PreTokenizer("starcoder", (r"\p{N}", GPT2)),
    "default": PreTokenizer("default", (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+",
                                        r"[0-9][0-9][0-9]")),
}

#: llama.cpp's names (``tokenizer.ggml.pre``) -> the type they select.
NAMES = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), "llama3"),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo"), "gpt2"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), "qwen2"),
    "falcon": "falcon",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b"), "starcoder"),
    "default": "default",
}
#: names bitformat wrote before it used llama.cpp's (read, never written)
LEGACY = {"gpt2": "gpt-2"}
#: architectures whose GGUF files may lack tokenizer.ggml.pre and mean Llama 3's
BITNET_ARCHES = ("bitnet-b1.58", "bitnet-25")  # 2B-4T (bitnet.cpp); not 1bitLLM's "bitnet"


def get(name: str) -> PreTokenizer:
    """The pre-tokenizer llama.cpp runs for ``name``; a clear error for names it does not
    know or bitformat does not implement."""
    name = LEGACY.get(name, name)
    if name not in NAMES:
        raise UnsupportedConversionError(
            f"pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; bitformat knows "
            f"{', '.join(sorted(NAMES))}")
    return _TYPES[NAMES[name]]


def resolve(name: str | None, architecture: str | None) -> tuple[str, str]:
    """(the name to run, a note for ``inspect``: "" when the file names its pre-tokenizer)."""
    if name is not None:
        get(name)
        return LEGACY.get(name, name), ""
    if architecture is None or architecture in BITNET_ARCHES:
        return "llama-bpe", ("no tokenizer.ggml.pre: Llama 3's (llama-bpe) assumed, as "
                             "bitnet.cpp reads BitNet files")
    return "default", ("no tokenizer.ggml.pre: llama.cpp's 'default' split, which llama.cpp "
                       "warns degrades generation")


def build(name: str):
    """The ``tokenizers`` pre-tokenizer of ``name`` (then byte-level encoding)."""
    from tokenizers import Regex, pre_tokenizers

    p = get(name)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), "isolated") for r in p.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def name_of(pre: dict | None) -> str | None:
    """llama.cpp's name for a ``tokenizer.json`` pre_tokenizer, or None if none matches."""
    pre = pre or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") != "Sequence":
        return None
    parts = pre.get("pretokenizers", [])
    if not parts or parts[-1].get("type") != "ByteLevel" or parts[-1].get("use_regex", True):
        return None
    regexes = []
    for p in parts[:-1]:
        r = p.get("pattern", {}).get("Regex")
        if p.get("type") != "Split" or r is None or p.get("behavior") not in (
                "Isolated", "isolated"):
            return None
        regexes.append(r)
    for name in ("llama-bpe", "qwen2", "gpt-2", "falcon", "starcoder", "default"):
        if tuple(regexes) == _TYPES[NAMES[name]].regexes:
            return name
    return None
