"""The byte-level BPE: training, GGUF metadata, encoding, chat template, Hugging Face files."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bitformat.constants import ValueType
from bitformat.errors import UnsupportedConversionError
from bitformat.io.gguf import MetaValue
from bitformat.tokenizers.bpe import (
    BITNET_CHAT_TEMPLATE,
    LLAMA3_PATTERN,
    Tokenizer,
    from_hf_files,
    llama3_specials,
    render_chat,
    to_hf_files,
    train_bpe,
)

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  \n\n\ttabs\r\nCRLF",
    "Ünïcödé façade — naïve café; Straße, ĳ, ǅ",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🎉🚀👩‍👩‍👧 and flags 🇩🇪 ZWJ\u200d",
    "numbers 1234567 3.14159 -0x1F 1e-5 ١٢٣",
    "code: def f(x):\n    return x**2  # comment\n",
    "I'm sure we'll see they've DON'T it's",
    "\x00\x01 control \x7f and lone surrogates are not str-encodable, but U+FFFD \ufffd is",
    "",
]


@pytest.fixture(scope="module")
def tiny_meta():
    return train_bpe(512, llama3_specials(16)).metadata()


@pytest.fixture(scope="module")
def big_meta():
    return train_bpe(128256, llama3_specials()).metadata()


@pytest.fixture(scope="module", params=["tiny", "2b4t"])
def meta(request, tiny_meta, big_meta):
    return tiny_meta if request.param == "tiny" else big_meta


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer(meta)


def _same(a: dict[str, MetaValue], b: dict[str, MetaValue]) -> None:
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        assert (x.vtype, x.item_type) == (y.vtype, y.item_type), k
        if isinstance(x.value, np.ndarray) or isinstance(y.value, np.ndarray):
            assert np.asarray(x.value).dtype == np.asarray(y.value).dtype, k
            assert np.array_equal(x.value, y.value), k
        else:
            assert x.value == y.value, k


def test_llama3_layout(big_meta):
    tokens = big_meta["tokenizer.ggml.tokens"].value
    types = big_meta["tokenizer.ggml.token_type"].value
    assert len(tokens) == 128256 == len(types) == len(set(tokens))
    want = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128002:
            "<|reserved_special_token_0|>", 128006: "<|start_header_id|>", 128007:
            "<|end_header_id|>", 128008: "<|reserved_special_token_4|>", 128009: "<|eot_id|>",
            128010: "<|reserved_special_token_5|>", 128255: "<|reserved_special_token_250|>"}
    assert {i: tokens[i] for i in want} == want
    n = int((types == 1).sum())
    assert 8000 <= n <= 32768 and np.all(types[:n] == 1) and np.all(types[n:] == 3)
    assert tokens[n] == "<|reserved_special_token_251|>"
    assert len(big_meta["tokenizer.ggml.merges"].value) == n - 256
    assert big_meta["tokenizer.ggml.bos_token_id"].value == 128000
    assert big_meta["tokenizer.ggml.eos_token_id"].value == 128001


def test_tiny_layout(tiny_meta):
    tokens = tiny_meta["tokenizer.ggml.tokens"].value
    assert len(tokens) == 512
    # The first 16 of Llama 3's special block sit at 496..511: bos = 496 = 512 - 16.
    assert tokens[496:] == llama3_specials(16)
    assert tokens.index("<|eot_id|>") == 505
    assert len(tiny_meta["tokenizer.ggml.merges"].value) == 240  # 496 = 256 bytes + 240 merges


def test_metadata_types(tiny_meta):
    t = {k: (v.vtype, v.item_type) for k, v in tiny_meta.items()}
    assert list(t) == [
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
    assert t["tokenizer.ggml.token_type"] == (ValueType.ARRAY, ValueType.INT32)
    assert tiny_meta["tokenizer.ggml.token_type"].value.dtype == np.int32
    assert t["tokenizer.ggml.tokens"] == (ValueType.ARRAY, ValueType.STRING)
    assert t["tokenizer.ggml.merges"] == (ValueType.ARRAY, ValueType.STRING)
    for k in ("bos_token_id", "eos_token_id", "padding_token_id"):
        assert t["tokenizer.ggml." + k] == (ValueType.UINT32, None)
    assert t["tokenizer.ggml.add_bos_token"] == (ValueType.BOOL, None)
    assert tiny_meta["tokenizer.ggml.model"].value == "gpt2"
    assert tiny_meta["tokenizer.ggml.pre"].value == "llama-bpe"
    assert tiny_meta["tokenizer.chat_template"].value == BITNET_CHAT_TEMPLATE


def test_training_is_deterministic_across_processes(tiny_meta):
    code = ("import json; from bitformat.tokenizers.bpe import train_bpe, llama3_specials as s; "
            "d = train_bpe(512, s(16)); print(json.dumps([d.tokens, d.merges]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123"})
    tokens, merges = json.loads(out.stdout)
    assert tokens == tiny_meta["tokenizer.ggml.tokens"].value
    assert merges == tiny_meta["tokenizer.ggml.merges"].value


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_bos_default_and_specials(tok):
    assert tok.encode("hi")[0] == tok.bos_id
    assert tok.encode("hi", add_bos=False)[0] != tok.bos_id
    base = tok.vocab_size - (256 if tok.vocab_size > 512 else 16)
    for offset, name in [(0, "<|begin_of_text|>"), (1, "<|end_of_text|>"),
                         (6, "<|start_header_id|>"), (7, "<|end_header_id|>"), (9, "<|eot_id|>")]:
        assert tok.encode(name, add_bos=False) == [base + offset]
        assert tok.token(base + offset) == name
    assert tok.eos_ids == [base + 1, base + 9]
    ids = tok.encode("a<|eot_id|>b", add_bos=False)
    assert base + 9 in ids
    assert tok.decode(ids, skip_special=True) == "ab"


def test_ids_match_an_independent_tokenizer(meta, tok):
    """Our Tokenizer against one built here from the raw vocab and merges."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = meta["tokenizer.ggml.tokens"].value
    types = meta["tokenizer.ggml.token_type"].value
    normal = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"].value]
    ref = HFTokenizer(models.BPE(vocab=normal, merges=merges, ignore_merges=True))
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    ref.decoder = decoders.ByteLevel()
    # Specials after the normal tokens, in id order: tokenizers numbers them consecutively.
    ref.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, t in enumerate(tokens) if types[i] == 3])
    assert ref.get_vocab_size() == len(tokens)
    for text in TEXTS + ["<|begin_of_text|>System: x<|eot_id|>", " ".join(TEXTS) * 3]:
        assert tok.encode(text, add_bos=False) == ref.encode(text,
                                                              add_special_tokens=False).ids


def test_merges_are_used(big_meta):
    tok = Tokenizer(big_meta)
    text = "def __init__(self, name: str) -> None:\n    return self.value"
    assert len(tok.encode(text, add_bos=False)) < len(text.encode()) / 2.5


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "  What is BitNet?\n"}]
    want = ("<|begin_of_text|>System: You are a helpful assistant.<|eot_id|>"
            "User: What is BitNet?<|eot_id|>Assistant: ")
    assert tok.apply_chat_template(msgs) == want
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want[:-len(
        "Assistant: ")]
    ids = tok.encode(want, add_bos=False)
    assert ids[0] == tok.bos_id and ids.count(tok.eos_ids[1]) == 2


def test_chat_template_matches_jinja_when_available():
    jinja2 = pytest.importorskip("jinja2.sandbox")
    msgs = [{"role": "user", "content": "hi "}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}]
    env = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    for gen in (True, False):
        want = env.from_string(BITNET_CHAT_TEMPLATE).render(
            messages=msgs, add_generation_prompt=gen, bos_token="<|begin_of_text|>")
        assert render_chat(BITNET_CHAT_TEMPLATE, msgs, gen) == want


def test_unknown_template_needs_jinja():
    try:
        import jinja2  # noqa: F401
    except ImportError:
        with pytest.raises(UnsupportedConversionError, match="jinja2"):
            render_chat("{{ messages }}", [])
    else:
        assert render_chat("{{ bos_token }}x", []) == "<|begin_of_text|>x"


def test_hf_round_trip(meta, tmp_path):
    assert to_hf_files(meta, tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    _same(from_hf_files(tmp_path), meta)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|begin_of_text|>"
    assert config["eos_token"] == "<|end_of_text|>"
    assert config["chat_template"] == BITNET_CHAT_TEMPLATE
    assert config["add_bos_token"] is True


def test_hf_files_reproduce_ids(meta, tok, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    to_hf_files(meta, tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert hf.encode(text).ids == tok.encode(text)  # the post-processor adds bos


def test_from_hf_llama3_style(tiny_meta, tmp_path):
    """Llama 3's own files keep specials out of the model vocabulary; read those too."""
    to_hf_files(tiny_meta, tmp_path)
    path = tmp_path / "tokenizer.json"
    tj = json.loads(path.read_text())
    specials = {a["content"] for a in tj["added_tokens"]}
    tj["model"]["vocab"] = {t: i for t, i in tj["model"]["vocab"].items() if t not in specials}
    path.write_text(json.dumps(tj))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["add_bos_token"]  # then the bos-adding post-processor decides
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    _same(from_hf_files(tmp_path), tiny_meta)


def test_uncarried_keys_are_reported(tiny_meta, tmp_path):
    meta = dict(tiny_meta)
    meta["tokenizer.ggml.scores"] = MetaValue.of(np.zeros(512, dtype=np.float32))
    assert to_hf_files(meta, tmp_path) == ["tokenizer.ggml.scores"]


def test_transformers_agrees(meta, tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    to_hf_files(meta, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert hf(text)["input_ids"] == tok.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs)


def test_other_token_types_act_as_control(tiny_meta, tmp_path):
    meta = dict(tiny_meta)
    types = meta["tokenizer.ggml.token_type"].value.copy()
    types[-1] = 5  # llama.cpp's "unused"
    meta["tokenizer.ggml.token_type"] = MetaValue.of(types)
    tok = Tokenizer(meta)
    assert tok.encode(tok.token(511), add_bos=False) == [511]
    to_hf_files(meta, tmp_path)
    back = from_hf_files(tmp_path)["tokenizer.ggml.token_type"].value
    assert back[-1] == 3 and np.array_equal(back[:-1], types[:-1])


def test_training_text_is_frozen():
    """The synthetic tokenizer's training text is generated from a fixed seed with integer
    arithmetic only: the same bytes on every Python, OS and numpy (a change here changes every
    `synth` file, so it must be deliberate)."""
    import hashlib

    from bitformat.synth_text import training_text

    text = "".join(training_text(1 << 16))
    assert len(text) >= 1 << 16 and text.isascii()
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "a1d5bcea0bbb9898c895943a179f81ac485302cab1594d5c4a8622fae09f30a5")


# -- pre-tokenizers under llama.cpp's names ----------------------------------------------------
PRE_TEXTS = ["Hello world, it's 2024!  Numbers 1234567 and   spaces\n\n\tTabs; (x+y)^2 <= z",
             "Don't YOU'LL we've: déjà vu ĳ 你好世界 x86_64 $$$ ~~~ |pipe| `code`",
             "  leading and trailing  ", "a\r\nb\rc\n", "1 12 123 1234 12345 3.14159"]


@pytest.mark.parametrize("name", ["llama-bpe", "falcon3", "gpt-2", "qwen2", "falcon",
                                  "starcoder", "default"])
def test_pre_tokenizer_splits_like_llama_cpp_regexes(name):
    """Pieces from the tokenizers-built pre-tokenizer equal a direct sequential split with
    the ``regex`` package (llama.cpp's algorithm: each regex splits every piece, matches
    and gaps kept)."""
    regex = pytest.importorskip("regex")
    from bitformat.tokenizers import pretokenize as tokenizer_pre

    def split(text, patterns):
        pieces = [text]
        for p in patterns:
            out = []
            for piece in pieces:
                pos = 0
                for m in regex.finditer(p, piece):
                    if m.start() > pos:
                        out.append(piece[pos:m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    from tokenizers import pre_tokenizers

    byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pre = tokenizer_pre.build(name)
    for text in PRE_TEXTS:
        got = [p for p, _ in pre.pre_tokenize_str(text)]
        want = [p for s in split(text, tokenizer_pre.get(name).regexes)
                for p, _ in byte.pre_tokenize_str(s)]
        assert got == want, (name, text)


def test_pre_tokenizer_names():
    from bitformat.tokenizers import pretokenize as tokenizer_pre

    with pytest.raises(UnsupportedConversionError, match="'gpt-4o'.*not supported"):
        tokenizer_pre.get("gpt-4o")
    assert tokenizer_pre.get("gpt2") is tokenizer_pre.get("gpt-2")  # bitformat's old name
    assert tokenizer_pre.resolve("gpt2", None) == ("gpt-2", "")
    name, note = tokenizer_pre.resolve(None, "bitnet-b1.58")
    assert name == "llama-bpe" and "assumed" in note
    name, note = tokenizer_pre.resolve(None, "qwen3")
    assert name == "default" and "default" in note


def test_qwen2_and_gpt2_tokenize_like_transformers(tmp_path):
    """A vocabulary exported under each name reads back under the same name, and
    transformers' fast tokenizer on the export gives our ids (BOS included)."""
    transformers = pytest.importorskip("transformers")
    from bitformat.tokenizers.bpe import BPEData, Tokenizer, from_hf_files, to_hf_files

    base = train_bpe(512, llama3_specials(16))
    for pre, add_bos in (("qwen2", False), ("gpt-2", None), ("falcon3", None)):
        d = BPEData(base.tokens, base.token_types, base.merges, base.bos_id, base.eos_id,
                    base.pad_id, add_bos, None, None, pre)
        meta = d.metadata()
        out = tmp_path / pre
        to_hf_files(meta, out)
        back = from_hf_files(out)
        want_pre = "llama-bpe" if pre == "falcon3" else pre  # same regex, llama.cpp's name
        assert back["tokenizer.ggml.pre"].value == want_pre
        ours = Tokenizer(meta)
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
        for text in PRE_TEXTS:
            assert hf(text)["input_ids"] == ours.encode(text), (pre, text)
        assert ours.add_bos == (pre == "falcon3")
