"""What a newcomer sees: the synthetic-model note, special tokens, the compile notice, option and
output-path checks (through click's CliRunner), and the kernel warm-up."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from bitformat.cli import main
from bitformat.cli.helpers import CompileNotice, cores


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_run_says_a_synthetic_model_is_meaningless(tiny_gguf):
    r = invoke("run", tiny_gguf, "-p", "def f(x):", "-n", 4)
    assert r.exit_code == 0, r.output
    assert "synthetic model" in r.output and "meaningless" in r.output
    assert "microsoft/bitnet-b1.58-2B-4T-gguf" in r.output


def test_real_model_gets_no_synthetic_note(tiny_gguf, tmp_path):
    from bitformat.io.gguf import GGUFReader, GGUFWriter, MetaValue

    out = tmp_path / "named.gguf"
    with GGUFReader(tiny_gguf) as rd:
        w = GGUFWriter(str(out))
        w.metadata = dict(rd.metadata)
        w.metadata["general.name"] = MetaValue.of("bitnet2b")
        for name, info in rd.tensors.items():
            w.add_tensor(name, info.shape, info.ggml_type, info.nbytes)
        w.write(rd.raw(n) for n in rd.tensors)
    r = invoke("run", out, "-p", "def f(x):", "-n", 2)
    assert r.exit_code == 0, r.output
    assert "synthetic" not in r.output


def test_special_tokens_hidden_unless_asked(tiny_gguf):
    """Greedy decoding of the tiny model after this prompt makes control tokens (id >= 496;
    with the default f16 KV cache)."""
    from bitformat.tokenizers.bpe import Tokenizer

    args = ("run", tiny_gguf, "-p", "import os", "-n", 40, "--json")
    hidden, shown = (json.loads(invoke(*a).stdout) for a in (args, (*args, "--show-special")))
    assert hidden["tokens"] == shown["tokens"]
    tok = Tokenizer.from_gguf(tiny_gguf)
    names = {tok.token(t) for t in hidden["tokens"] if t >= 496}
    assert names and all(n.startswith("<|") for n in names)
    assert all(n in shown["text"] for n in names)
    assert not any(n in hidden["text"] for n in names)
    assert hidden["text"] == tok.decode(hidden["tokens"], skip_special=True)
    assert shown["text"] == tok.decode(shown["tokens"])


def test_threads_checked(tiny_gguf):
    r = CliRunner().invoke(main, ["run", str(tiny_gguf), "-p", "x", "--threads", "0"])
    assert r.exit_code == 2 and "at least 1" in r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--threads", "-3"])
    assert r.exit_code == 2 and "at least 1" in r.output
    many = cores() + 5
    r = invoke("run", tiny_gguf, "-p", "x", "-n", 2, "--threads", many)
    assert r.exit_code == 0
    assert f"--threads {many} is more than the {cores()} cores" in r.output


def test_plot_path_checked_before_any_work(tiny_gguf, tmp_path, monkeypatch):
    import bitformat.report

    def boom(*a, **k):
        raise AssertionError("the report ran before the plot path was checked")

    monkeypatch.setattr(bitformat.report, "build_report", boom)
    for plot, why in ((tmp_path / "missing" / "r.png", "does not exist"),
                      (tmp_path / "r.jpg", "use one of .png, .svg, .pdf"),
                      (tmp_path, "is a directory")):
        r = CliRunner().invoke(main, ["report", str(tiny_gguf), "--plot", str(plot)])
        assert r.exit_code == 2 and why in r.output, r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--plot", str(tmp_path / "b.gif")])
    assert r.exit_code == 2 and ".png, .svg, .pdf" in r.output


@pytest.mark.parametrize("suffix,magic", [(".svg", b"<?xml"), (".pdf", b"%PDF"),
                                          (".png", b"\x89PNG")])
def test_plot_format_follows_the_extension(tiny_gguf, tmp_path, suffix, magic):
    r = invoke("report", tiny_gguf, "--plot", tmp_path / f"r{suffix}")
    assert r.exit_code == 0, r.output
    assert (tmp_path / f"r{suffix}").read_bytes().startswith(magic)
    assert [p.name for p in tmp_path.iterdir()] == [f"r{suffix}"]  # no temporary left


def test_interrupted_run_says_nothing_false(tiny_gguf, monkeypatch):
    from bitformat.runtime.loader import LoadedModel

    def stop(*a, **k):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(LoadedModel, "stream_generate", stop)
    r = CliRunner().invoke(main, ["run", str(tiny_gguf), "-p", "x"])
    assert r.exit_code == 130 and "interrupted" in r.output
    assert "nothing was written" not in r.output


def test_compile_notice(capsys):
    n = CompileNotice(" (after)")
    n.close()
    assert capsys.readouterr().err == ""  # nothing compiled: nothing said
    n = CompileNotice(" (after)")
    n("kernels.mm2_vnni")
    n("ops.norm_quant")
    n.close()
    err = capsys.readouterr().err
    assert "compiling kernels for this machine (first run only" in err
    assert "compiled 2 kernels in" in err and err.rstrip().endswith("(after)")


def test_on_compile_hears_numba_compile_not_cache():
    import numba

    from bitformat.runtime.warmup import on_compile

    heard = []

    @numba.njit(cache=False)
    def add_one(x):
        return x + 1

    with on_compile(heard.append):
        assert add_one(1) == 2
        assert add_one(2) == 3  # compiled once
    assert heard == [f"{__name__.rsplit('.', 1)[-1]}.{add_one.py_func.__qualname__}"]


def test_warmup_prepares_before_timing(tiny_gguf):
    """After warmup() nothing compiles while generating (cpu), so the speed is the model's."""
    import bitformat
    from bitformat.runtime.models.base import Segment
    from bitformat.runtime.sampling import Sampler
    from bitformat.runtime.warmup import on_compile

    heard = []
    with bitformat.load(tiny_gguf, backend="cpu") as m:
        assert m.warmup() >= 0
        with on_compile(heard.append):
            m.generate("def f(x):", 6)
            m.generate(list(range(1, 9)), 3)
            m.generate(list(range(1, 80)), 3)  # attention past one run of positions
            caches = [m.net.new_cache(4) for _ in range(3)]  # the server's batched step
            m.net.decode([Segment([t], c) for t, c in zip((1, 2, 3), caches, strict=True)],
                         [Sampler() for _ in caches])
        assert heard == []
        assert m.last_stats.generated_tokens == 3


def test_bf16_embedding_copy(tiny_gguf, tmp_path):
    from bitformat import open_model
    from bitformat.constants import GGMLType
    from bitformat.runtime.warmup import _bf16_embedding_copy

    _bf16_embedding_copy(tiny_gguf, tmp_path / "b.gguf")
    with open_model(tiny_gguf) as a, open_model(tmp_path / "b.gguf") as b:
        gtype, raw = b.plain("token_embd.weight")
        assert gtype == GGMLType.BF16
        f16 = a.plain("token_embd.weight")[1].view("<f2").astype(np.float32)
        bf = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        assert np.allclose(bf, f16, rtol=2 ** -8, atol=0)
        assert [e.name for e in a.entries] == [e.name for e in b.entries]


def test_readme_shows_the_real_model_commands():
    """The README's "Real models" and the hints `run` prints come from one text (guide.py)."""
    from pathlib import Path

    from bitformat.guide import REAL_MODELS, synthetic_note

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    commands = [line.strip() for line in REAL_MODELS.splitlines() if line.startswith("  ")]
    assert len(commands) == 8 and all(c in readme for c in commands)
    for line in synthetic_note("x.gguf").splitlines()[1:3]:
        assert line.strip() in readme


def test_warmup_runs_every_variant_in_two_processes():
    """`bitformat warmup` splits the variants over two processes and reports them all, in order,
    with both processes' compile counts; a second run finds everything in numba's cache."""
    from bitformat.runtime.warmup import SECOND, _variants, warm_up_all

    steps = warm_up_all("cpu", processes=2)
    assert [s.what for s in steps] == [w for _, w in _variants()]
    assert {v for v, _ in _variants()} >= set(SECOND)
    again = warm_up_all("cpu", processes=2)
    assert [s.compiled for s in again] == [0] * len(again)
    r = CliRunner().invoke(main, ["warmup"])
    assert r.exit_code == 0, r.output
    assert "kernels ready: all were already in numba's cache" in r.output
    assert "rans (fused decode)" in r.output and "Traceback" not in r.output


def test_waiting_for_the_helpers_layers_does_not_wait_for_the_rest():
    """wait_for_layers returns at the helper's line while the helper goes on, at its end if
    it never says it (a failed helper: this process compiles the rest), and at the timeout."""
    import subprocess
    import sys
    import time

    from bitformat.runtime.warmup import LAYERS_READY, wait_for_layers

    def helper(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)

    says = helper("import sys, time; sys.stdout.write('compiling\\n'); sys.stdout.flush(); "
                  f"time.sleep(0.3); sys.stdout.write({LAYERS_READY.decode()!r} + '\\n'); "
                  "sys.stdout.flush(); time.sleep(30)")
    t0 = time.monotonic()
    wait_for_layers(says, timeout=20)
    assert time.monotonic() - t0 < 10 and says.poll() is None  # returned, helper still going
    says.kill()
    says.wait()
    fails = helper("import sys; sys.exit(3)")
    wait_for_layers(fails, timeout=20)
    assert fails.wait(5) == 3
    silent = helper("import time; time.sleep(30)")
    t0 = time.monotonic()
    wait_for_layers(silent, timeout=0.5)
    assert time.monotonic() - t0 < 5 and silent.poll() is None
    silent.kill()
    silent.wait()


def test_steps_run_op_by_op_until_the_one_call_step_is_compiled(tiny_gguf):
    """A first run on an empty kernel cache generates op by op while the helper compiles the
    one-call step (``step_compiled``), switches to it once the helper says so, and gives the
    tokens a run with the one-call step from the start gives (the same arithmetic)."""
    from bitformat.runtime import load
    from bitformat.runtime.cpu.kernels import kernel_mode

    with load(tiny_gguf, backend="cpu") as m:
        want = m.generate([1, 2, 3], 12, temperature=0).tokens
        has_plan = m.net._plan not in (False, None)
    assert has_plan == (kernel_mode() == "vnni")  # where the one-call step exists at all
    with load(tiny_gguf, backend="cpu") as m:
        ready = [False]
        asked = []
        m.backend.step_compiled = lambda: asked.append(1) or ready[0]
        first = m.generate([1, 2, 3], 12, temperature=0).tokens
        assert m.net._plan is False and len(asked) >= 11  # asked each step, never planned
        ready[0] = True
        again = m.generate([1, 2, 3], 12, temperature=0).tokens
        assert m.backend.step_compiled is None  # asked once more, then never again
        assert (m.net._plan not in (False, None)) == has_plan
    assert first == want and again == want


def test_a_first_run_says_when_it_waits_for_the_compile_helper(tiny_gguf, monkeypatch):
    """On an empty kernel cache `run` ends by waiting for the helper that fills the cache for
    later runs: it says so on stderr after the speeds, with the seconds it waited, and the
    helper has ended when the command has (a helper already done: no such line)."""
    import subprocess
    import sys

    from bitformat.runtime import warmup

    procs = []

    def fake_helper(code, ended=False):
        def start(*_a, **_k):
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE))
            if ended:  # (its line stays in the pipe)
                procs[-1].wait()
            return procs[-1]
        return start

    slow = ("import sys, time; sys.stdout.write('layers compiled\\n'); sys.stdout.flush(); "
            "time.sleep(12)")  # longer than the run takes
    monkeypatch.setattr(warmup, "start_helper", fake_helper(slow))
    r = CliRunner().invoke(main, ["run", str(tiny_gguf), "-p", "hi", "-n", 3])
    assert r.exit_code == 0, r.output
    err = r.stderr
    assert "finishing the kernel cache for later runs" in err
    assert err.index("generated 3 at") < err.index("finishing the kernel cache")
    waited = float(err.split("next run)...")[1].split()[0])
    assert waited > 0 and procs[-1].poll() is not None
    done = "import sys; sys.stdout.write('layers compiled\\n'); sys.stdout.flush()"
    monkeypatch.setattr(warmup, "start_helper", fake_helper(done, ended=True))
    r = CliRunner().invoke(main, ["run", str(tiny_gguf), "-p", "hi", "-n", 3, "--json"])
    assert r.exit_code == 0, r.output
    assert "finishing the kernel cache" not in r.stderr
    assert json.loads(r.stdout)["generated_tokens"] == 3
