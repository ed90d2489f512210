"""The text synthetic models' tokenizers are trained on: generated, the same on every machine.

A byte-level BPE needs text with the statistics of text: frequent short words, rarer long ones,
punctuation, digits, indentation. This module writes such text from a fixed seed, with no input
from the machine: English-like prose (a few hundred function words written here, plus invented
words built from syllables, drawn with a Zipf-like law) and Python-like code (keywords,
identifiers made of those words, numbers, indentation, comments, docstrings). The randomness
is SHAKE-256 of a fixed string, read as little-endian integers, and only integer arithmetic
chooses, so the text is byte-identical under every Python version, OS and numpy.

(The vocabulary used to come from the standard library's source, which changes with each
Python release, so ``synth --seed`` gave different files on different interpreters.)
"""

from __future__ import annotations

import hashlib

import numpy as np

SEED = b"bitformat synthetic tokenizer text, version 1"
#: enough text for 32768 merges (3 MB: generated in 0.8 s, a 32k-token BPE trained in 3 s)
MAX_BYTES = 3 << 20

FUNCTION_WORDS = (
    "the of and to a in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we can their has been if more when "
    "will would who so no out up into do any your what some could them other than then now "
    "only its time also two may first like over new these after most such where through back "
    "just how because each those under while both before should between very must being same "
    "made many well here must still every never through since without again against often "
    "always each above below into within upon during among about whether though although yet"
).split()
KEYWORDS = (
    "def return if elif else for while in not and or is None True False class import from as "
    "with try except finally raise pass break continue lambda yield assert global del print "
    "len range self str int float list dict set tuple open isinstance enumerate zip sorted"
).split()
NAMES = (
    "name value data result path item key index size count text line args kwargs node self "
    "other config model file options state buffer start end offset length total parent child "
    "items values keys error message token tokens shape rows cols out x y i j n k fn obj"
).split()
TYPES = "str int float bool bytes None list dict tuple object".split()
DUNDERS = "__init__ __repr__ __len__ __eq__ __iter__ __call__ __enter__ __exit__".split()
ONSETS = ("b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr qu sc sh sk "
          "sl sm sn sp st str sw th tr wh").split()
NUCLEI = "a e i o u a e i o ea ai ou io ee oo ia".split()
CODAS = [""] * 6 + "n r s t l m nd nt st rd ck ng ss rk ld".split()
LEXICON_SIZE = 40000
OPERATORS = ("+", "-", "*", "/", "//", "%", "==", "!=", "<", ">", "<=", ">=")


class _Stream:
    """Integers from SHAKE-256 of the seed, in chunks (little-endian 16-bit words)."""

    CHUNK = 1 << 16

    def __init__(self, seed: bytes):
        self.seed = seed
        self.block = 0
        self.words: list[int] = []
        self.pos = 0

    def next(self, n: int) -> int:
        """A number in 0 .. n-1 (n <= 65536; the small modulo bias does not matter here)."""
        if self.pos == len(self.words):
            h = hashlib.shake_256(self.seed + self.block.to_bytes(8, "little"))
            self.words = np.frombuffer(h.digest(2 * self.CHUNK), dtype="<u2").tolist()
            self.block += 1
            self.pos = 0
        self.pos += 1
        return self.words[self.pos - 1] % n

    def zipf(self, n: int) -> int:
        """A rank in 0 .. n-1 (n <= 65536), about log-uniform: each doubling of the rank as
        likely as the last, as word frequencies go (Zipf's law)."""
        k = self.next(n.bit_length())
        return ((1 << k) - 1 + self.next(1 << k)) % n


class _Lexicon:
    """Invented words by rank, each made from its own SHAKE-256 draw when first needed."""

    def __init__(self, size: int = LEXICON_SIZE):
        self.size = size
        self.words: dict[int, str] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, rank: int) -> str:
        w = self.words.get(rank)
        if w is None:
            d = hashlib.shake_256(SEED + b"/word/" + rank.to_bytes(4, "little")).digest(16)
            syllables = 1 + d[0] % 3 + (d[1] % 4 == 0)
            w = self.words[rank] = "".join(
                ONSETS[d[2 + 3 * i] % len(ONSETS)] + NUCLEI[d[3 + 3 * i] % len(NUCLEI)]
                + CODAS[d[4 + 3 * i] % len(CODAS)] for i in range(syllables))
        return w


def _word(r: _Stream, lex: _Lexicon) -> str:
    if r.next(2):
        return FUNCTION_WORDS[r.zipf(len(FUNCTION_WORDS))]
    return lex[r.zipf(len(lex))]


def _sentence(r: _Stream, lex: _Lexicon) -> str:
    words = []
    for i in range(4 + r.next(16)):
        w = _word(r, lex)
        if r.next(40) == 0:
            w = str(r.zipf(10000))
        words.append(w + ("," if i and r.next(9) == 0 else ""))
    words[0] = words[0].capitalize()
    return " ".join(words).rstrip(",") + ".?!:"[(r.next(16) > 12) * (1 + r.next(3))]


def _ident(r: _Stream, lex: _Lexicon) -> str:
    if r.next(2):
        return NAMES[r.zipf(len(NAMES))]
    parts = [lex[r.zipf(len(lex) // 4)] for _ in range(1 + (r.next(3) == 0) + (r.next(6) == 0))]
    return "_".join(parts)


def _param(r: _Stream, lex: _Lexicon) -> str:
    name = _ident(r, lex)
    return f"{name}: {TYPES[r.zipf(len(TYPES))]}" if r.next(2) else name


def _expr(r: _Stream, lex: _Lexicon) -> str:
    choice = r.next(6)
    if choice == 0:
        return str(r.zipf(1000))
    if choice == 1:
        return f"{_ident(r, lex)}({_ident(r, lex)}, {r.zipf(100)})"
    if choice == 2:
        return f"{_ident(r, lex)} {OPERATORS[r.next(len(OPERATORS))]} {r.zipf(100)}"
    if choice == 3:
        return f"self.{_ident(r, lex)}"
    if choice == 4:
        return f'"{_word(r, lex)} {_word(r, lex)}"'
    return f"{_ident(r, lex)}[{r.zipf(10)}]"


def _code(r: _Stream, lex: _Lexicon) -> str:
    name = DUNDERS[r.next(len(DUNDERS))] if r.next(4) == 0 else _ident(r, lex)
    args = ["self"] * r.next(2) + [_param(r, lex) for _ in range(r.next(4))]
    ret = f" -> {TYPES[r.zipf(len(TYPES))]}" if r.next(2) else ""
    lines = [f"def {name}({', '.join(args)}){ret}:", f'    """{_sentence(r, lex)}"""']
    depth = 1
    for _ in range(2 + r.next(10)):
        pad = "    " * depth
        kind = r.next(8)
        if kind == 0 and depth < 3:
            lines.append(f"{pad}if {_expr(r, lex)}:")
            depth += 1
        elif kind == 1 and depth < 3:
            lines.append(f"{pad}for {_ident(r, lex)} in range({r.zipf(100)}):")
            depth += 1
        elif kind == 2:
            lines.append(f"{pad}# {_sentence(r, lex).lower()}")
        elif kind == 3 and depth > 1:
            lines.append(f"{pad}{KEYWORDS[r.next(len(KEYWORDS))]} {_expr(r, lex)}")
            depth -= 1
        else:
            lines.append(f"{pad}{_ident(r, lex)} = {_expr(r, lex)}")
    lines.append(f"    return {_expr(r, lex)}")
    return "\n".join(lines) + "\n\n"


def training_text(max_bytes: int | None = None) -> list[str]:
    """Chunks of generated prose and code, about ``max_bytes`` in all (at most
    :data:`MAX_BYTES`); always the same for the same ``max_bytes``.

    >>> training_text(2000) == training_text(2000)
    True
    >>> sum(map(len, training_text(10000))) >= 10000
    True
    """
    limit = min(MAX_BYTES, max_bytes or MAX_BYTES)
    r = _Stream(SEED)
    lex = _Lexicon()
    out: list[str] = []
    total = 0
    while total < limit:
        if r.next(5) < 3:
            text = " ".join(_sentence(r, lex) for _ in range(2 + r.next(6))) + "\n\n"
        else:
            text = _code(r, lex)
        out.append(text)
        total += len(text)
    return out


__all__ = ["MAX_BYTES", "training_text"]
