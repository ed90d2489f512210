"""Fuzz the commands, not just the parsers: structure-aware mutations of every container and of
hf folders through ``inspect``, ``convert`` and ``run`` (cpu and numpy backends).

    python tools/fuzz_commands.py --cases 10000 [--workers 2] [--json out.json]

Each case mutates a valid tiny model so that it still parses (a GGUF rewritten with a
metadata value, a declared shape, a per-tensor key, a tokenizer field or a tensor's values
changed, or a tensor dropped; in an hf folder config.json, the safetensors header or a
tokenizer file edited), plus some byte-level damage, then runs one command on it in a worker
process whose address space is capped (RLIMIT_AS). A case passes when the command exits 0,
or exits 1 or 2 with a one-line error that is not an "internal error". It fails as a
*traceback* (an exception bitformat did not foresee), a *signal* (the worker died), a
*hang* (no answer within the per-case timeout) or an *over-allocation* (MemoryError under
the address-space cap, or the worker's resident set grown past ``RSS_BOUND_MIB``: the file
made bitformat ask for far more memory than the tiny model it is). One case in
``--subprocess-every`` also runs through a real ``python -m bitformat.cli`` process, to check
what a user sees (exit status, no "Traceback" on stderr).

Cases are numbered; case ``i`` is reproducible from ``i`` alone (``--only i``). Those that
found bugs are kept in tests/fixtures/fuzz/corpus.json and replayed by
tests/test_fuzz_commands.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
#: what the cases mutate. Case numbers below SCHEME_2 use the first seven only (the scheme the
#: corpus and the first 12,000-case figures were recorded in); from SCHEME_2 on, every target.
TARGETS = ("i2_s", "tq2_0", "tq1_0", "stfma", "colpack_u32", "rans", "hf", "q2_0", "iq2_bn",
           "iq1_bn")
SCHEME_1_TARGETS = 7
SCHEME_2 = 1_000_000
COMMANDS = ("inspect", "convert", "run-cpu", "run-numpy")
MEMORY_CAP = 3 << 30  # bytes of address space a worker may map (tiny models need ~1.5 GiB)
RSS_BOUND_MIB = 1024  # resident memory a worker may reach (tiny models: under 200 MiB)
CASE_TIMEOUT = 60.0  # seconds; first cases compile nothing (numba's cache is warm)
FAILURES = ("traceback", "signal", "hang", "over_allocation")
ARCH = "bitnet-b1.58"


# -- base models -------------------------------------------------------------------------------
def build_bases(work: Path) -> dict[str, Path]:
    """The tiny synthetic model in every container and as an hf folder."""
    from bitformat.container import convert
    from bitformat.synth import synth

    bases = {"i2_s": work / "base.i2_s.gguf"}
    synth("tiny", bases["i2_s"], seed=0)
    for t in TARGETS[1:]:
        bases[t] = work / (f"base.{t}.gguf" if t != "hf" else "base-hf")
        convert(bases["i2_s"], bases[t], t)
    return bases


# -- GGUF mutations (the result still parses) -----------------------------------------------
WEIRD = [0, 1, -1, 3, 7, 2**31, 2**32 + 5, 10**9, 2**63, float("nan"), float("inf"), -0.0,
         1e-45, 1e39, -5.5, 0.5, "x", "", ["a"], [1, 2], True]


def _mv(value):
    from bitformat.constants import ValueType
    from bitformat.io.gguf import MetaValue

    if isinstance(value, float):
        return MetaValue(ValueType.FLOAT64 if abs(value) > 3e38 else ValueType.FLOAT32, value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            return MetaValue(ValueType.INT64, value)
        return MetaValue(ValueType.UINT64 if value >= 2**32 else ValueType.UINT32, value)
    return MetaValue.of(value)


def mutate_gguf(src: Path, dst: Path, rng: np.random.Generator) -> str:
    """Rewrite ``src`` into ``dst`` with one structure-aware change; return what it was."""
    from bitformat.constants import GGMLType, ValueType
    from bitformat.io.gguf import GGUFReader, GGUFWriter, MetaValue

    with GGUFReader(src) as r:
        meta = dict(r.metadata)
        infos = list(r.tensors.values())
        blobs = {t.name: np.array(r.raw(t.name)) for t in infos}
    shapes = {t.name: t.shape for t in infos}
    types = {t.name: t.ggml_type for t in infos}
    names = [t.name for t in infos]
    plain = [n for n in names if types[n] in (GGMLType.F32, GGMLType.F16)]
    kind = int(rng.integers(10))
    what = ""
    if kind == 0:  # a hyperparameter: odd value or type, or gone
        keys = [k for k in meta if k.startswith(ARCH + ".")]
        k = keys[rng.integers(len(keys))]
        if rng.random() < 0.2:
            del meta[k]
            what = f"delete {k}"
        else:
            v = WEIRD[rng.integers(len(WEIRD))]
            meta[k] = _mv(v)
            what = f"{k} = {v!r}"
    elif kind == 1:  # a per-tensor key of a bitformat encoding
        keys = [k for k in meta if k.startswith("bitformat.")]
        if not keys:
            kind = 2
        else:
            k = keys[rng.integers(len(keys))]
            choice = rng.integers(4)
            if choice == 0:
                del meta[k]
                what = f"delete {k}"
            elif choice == 1 and k.endswith(".shape"):
                dims = [int(rng.choice([0, 1, 5, 128, 256, 512, 4096, 65536, 2**31]))
                        for _ in range(int(rng.integers(1, 4)))]
                meta[k] = MetaValue(ValueType.ARRAY, np.array(dims, np.uint64), ValueType.UINT64)
                what = f"{k} = {dims}"
            else:
                v = WEIRD[rng.integers(len(WEIRD))]
                meta[k] = _mv(v)
                what = f"{k} = {v!r}"
    if kind == 2:  # drop a tensor
        n = names[rng.integers(len(names))]
        names.remove(n)
        what = f"drop {n}"
    elif kind == 3:  # a plain tensor re-declared with another shape (data cut or padded)
        n = plain[rng.integers(len(plain))]
        old = shapes[n]
        new = tuple(int(d) for d in rng.choice([1, 2, 64, 128, 255, 256, 512, 1024],
                                               size=len(old) if rng.random() < .7 else 1))
        if rng.random() < 0.3:
            new = old[::-1]
        itemsize = 4 if types[n] == GGMLType.F32 else 2
        want = int(np.prod(new)) * itemsize
        b = blobs[n]
        blobs[n] = np.resize(b, want) if want else b[:0]
        shapes[n] = new
        what = f"{n} shape {old} -> {new}"
    elif kind == 4:  # NaN / inf / huge / zero in a float tensor
        n = plain[rng.integers(len(plain))]
        b = blobs[n].copy()
        if types[n] == GGMLType.F32:
            vals = b.view("<f4")
            v = np.float32(rng.choice([np.nan, np.inf, -np.inf, 3e38, 0.0]))
        else:
            vals = b.view("<u2")
            v = np.uint16(rng.choice([0x7E00, 0x7C00, 0xFC00, 0x7BFF, 0]))
        idx = rng.integers(vals.size, size=int(rng.integers(1, 4)))
        if rng.random() < 0.1:
            idx = slice(None)
        vals[idx] = v
        blobs[n] = b
        what = f"{n} values {v} at {idx}"
    elif kind == 5:  # tokenizer metadata
        keys = [k for k in meta if k.startswith("tokenizer.")]
        k = keys[rng.integers(len(keys))]
        mv = meta[k]
        choice = rng.integers(5)
        if choice == 0:
            del meta[k]
            what = f"delete {k}"
        elif mv.vtype == ValueType.ARRAY and mv.item_type == ValueType.STRING and mv.value:
            vals = list(mv.value)
            i = int(rng.integers(len(vals)))
            vals[i] = str(rng.choice(["", " ", "a b c", vals[0], "\u0100zz \u0101q",
                                      "{{ raise }}", "x" * 300]))
            if rng.random() < 0.3:
                vals = vals[: int(rng.integers(len(vals)))]
            meta[k] = MetaValue(ValueType.ARRAY, vals, ValueType.STRING)
            what = f"{k}[{i}] changed, {len(vals)} items"
        elif mv.vtype == ValueType.STRING:
            v = str(rng.choice(["", "{% for %}", "{{ messages[99].content }}", "llama-bpe",
                                "gpt2", "bogus", "{{ 1/0 }}", "{{ range(10**9) | list }}"]))
            meta[k] = MetaValue(ValueType.STRING, v)
            what = f"{k} = {v!r}"
        else:
            v = WEIRD[rng.integers(len(WEIRD))]
            meta[k] = _mv(v)
            what = f"{k} = {v!r}"
    elif kind == 6:  # ternary data damaged (codes 3, CRCs, stream words)
        tern = [n for n in names if n not in plain]
        n = tern[rng.integers(len(tern))]
        b = blobs[n].copy()
        for _ in range(int(rng.integers(1, 9))):
            b[rng.integers(b.size)] = rng.integers(256)
        blobs[n] = b
        what = f"{n} bytes damaged"
    elif kind == 7:  # two tensors swap names (shapes then disagree with the config)
        a, b = rng.choice(names, size=2, replace=False)
        ia, ib = names.index(a), names.index(b)
        names[ia], names[ib] = b, a
        what = f"swap {a} and {b}"
        # data follows the new name
        blobs[a], blobs[b] = blobs[b], blobs[a]
        shapes[a], shapes[b] = shapes[b], shapes[a]
        types[a], types[b] = types[b], types[a]
        for f in ("encoding", "shape", "scale"):
            ka, kb = f"bitformat.tensor.{a}.{f}", f"bitformat.tensor.{b}.{f}"
            va, vb = meta.pop(ka, None), meta.pop(kb, None)
            if vb is not None:
                meta[ka] = vb
            if va is not None:
                meta[kb] = va
    elif kind == 8:  # the architecture itself
        v = str(rng.choice(["bitnet", "bitnet-25", "llama", "", "bitnet-b1.58 "]))
        meta["general.architecture"] = MetaValue(ValueType.STRING, v)
        what = f"general.architecture = {v!r}"
    elif kind == 9:  # an extra tensor
        n = str(rng.choice(["output.weight", "blk.0.attn_q.scale", "blk.99.attn_q.weight",
                            "rope_freqs.weight"]))
        if n not in names:
            names.append(n)
            shapes[n] = (int(rng.choice([1, 256])),)
            types[n] = GGMLType.F32
            blobs[n] = np.frombuffer(np.float32(rng.normal(size=shapes[n][0])).tobytes(),
                                     np.uint8)
        what = f"extra {n}"
    w = GGUFWriter(str(dst), metadata=meta)
    for n in names:
        w.add_tensor(n, shapes[n], types[n], blobs[n].nbytes)
    w.write(iter(blobs[n] for n in names))
    if rng.random() < 0.05:  # and sometimes bytes too
        raw = bytearray(dst.read_bytes())
        for _ in range(int(rng.integers(1, 5))):
            raw[rng.integers(len(raw))] = rng.integers(256)
        dst.write_bytes(bytes(raw))
        what += " + byte damage"
    return what


# -- hf folder mutations ---------------------------------------------------------------------
def _deep(n: int):
    return json.loads("[" * n + "]" * n) if n < 500 else None


def _json_weird(rng):
    return [0, -1, 1.5, 10**9, 2**70, None, True, "x", [], {}, [1, "a"], {"a": 1},
            float("1e308"), "nan"][rng.integers(14)]


def _edit(obj, rng, depth=0):
    """Change one value somewhere in a JSON object (or delete a key)."""
    if isinstance(obj, dict) and obj:
        k = list(obj)[rng.integers(len(obj))]
        if depth < 3 and isinstance(obj[k], (dict, list)) and obj[k] and rng.random() < 0.6:
            return f"{k}." + _edit(obj[k], rng, depth + 1)
        if rng.random() < 0.25:
            del obj[k]
            return f"delete {k}"
        obj[k] = _json_weird(rng)
        return f"{k} = {obj[k]!r}"[:80]
    if isinstance(obj, list) and obj:
        i = int(rng.integers(len(obj)))
        if depth < 3 and isinstance(obj[i], (dict, list)) and obj[i] and rng.random() < 0.6:
            return f"[{i}]." + _edit(obj[i], rng, depth + 1)
        obj[i] = _json_weird(rng)
        return f"[{i}] = {obj[i]!r}"[:80]
    return "nothing"


def mutate_hf(src: Path, dst: Path, rng: np.random.Generator) -> str:
    shutil.copytree(src, dst)
    files = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "safetensors"]
    f = files[rng.integers(len(files))]
    if f == "safetensors":
        st = sorted(dst.glob("*.safetensors"))[0]
        blob = st.read_bytes()
        n = struct.unpack("<Q", blob[:8])[0]
        header = json.loads(blob[8:8 + n])
        choice = rng.integers(4)
        if choice == 0:
            what = _edit(header, rng)
        elif choice == 1:  # a tensor's dtype or shape
            k = [k for k in header if k != "__metadata__"][rng.integers(len(header) - 1)]
            field = str(rng.choice(["dtype", "shape", "data_offsets"]))
            header[k][field] = [["F16", "I8", "U8", "BF16", "F64", "X"][rng.integers(6)],
                                [int(rng.integers(0, 600)), int(rng.integers(0, 600))],
                                [0, int(rng.integers(0, 10**6))]][
                ("dtype", "shape", "data_offsets").index(field)]
            what = f"{k}.{field} = {header[k][field]}"
        elif choice == 2:  # nesting
            header["deep"] = "DEEP"
            what = "deep nesting"
        else:
            k = [k for k in header if k != "__metadata__"][rng.integers(len(header) - 1)]
            header[k + ".renamed" if rng.random() < .5 else "model.layers.0.x.weight"] = \
                header.pop(k)
            what = f"rename {k}"
        text = json.dumps(header).replace('"DEEP"', "[" * 3000 + "]" * 3000)
        text += " " * (-len(text) % 8)
        st.write_bytes(struct.pack("<Q", len(text)) + text.encode() + blob[8 + n:])
        if rng.random() < 0.1:
            st.write_bytes(st.read_bytes()[: int(rng.integers(8, st.stat().st_size))])
            what += " + truncated"
        return f"{st.name}: {what}"
    path = dst / f
    if not path.exists():
        return f"{f}: absent"
    obj = json.loads(path.read_text())
    choice = rng.integers(10)
    if choice == 0:
        path.unlink()
        return f"delete {f}"
    if choice == 1:
        path.write_text("[" * 100_000 + "]" * 100_000)
        return f"{f}: nested 100000 deep"
    if choice == 2:
        path.write_text(path.read_text()[: int(rng.integers(0, 200))])
        return f"{f}: truncated"
    if f == "config.json" and choice < 6:
        k = str(rng.choice(["num_hidden_layers", "hidden_size", "intermediate_size",
                            "num_attention_heads", "num_key_value_heads", "vocab_size",
                            "rms_norm_eps", "rope_theta", "max_position_embeddings",
                            "head_dim", "quantization_config"]))
        obj[k] = _json_weird(rng) if rng.random() < .7 else int(rng.choice([10**9, 2**40, 3]))
        what = f"{k} = {obj[k]!r}"
    else:
        what = _edit(obj, rng)
    path.write_text(json.dumps(obj))
    return f"{f}: {what}"[:160]


# -- one case ----------------------------------------------------------------------------------
def case_plan(i: int) -> tuple[str, str]:
    """The target and command of case ``i`` (its seed picks the mutation)."""
    n = len(TARGETS) if i >= SCHEME_2 else SCHEME_1_TARGETS
    j = i - SCHEME_2 if i >= SCHEME_2 else i
    return TARGETS[j % n], COMMANDS[(j // n) % len(COMMANDS)]


def cli_args(command: str, path: Path, work: Path, rng: np.random.Generator) -> list[str]:
    if command == "inspect":
        return ["inspect", str(path)] + (["--json"] if rng.random() < .3 else [])
    if command == "convert":
        to = TARGETS[rng.integers(len(TARGETS))]
        out = work / ("out-hf" if to == "hf" else "out.gguf")
        return ["convert", str(path), "--to", to, "-o", str(out)]
    backend = command.split("-")[1]
    prompt = ["--prompt", "Hello there"] if rng.random() < .7 else ["--prompt-ids", "1,2,3"]
    return ["run", str(path), *prompt, "-n", "3", "--backend", backend, "--threads", "1"] + (
        ["--chat"] if rng.random() < .2 else [])


def make_case(i: int, bases: dict[str, Path], work: Path) -> tuple[list[str], str]:
    target, command = case_plan(i)
    rng = np.random.default_rng([i, 9])
    for p in work.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if target == "hf":
        path = work / "case-hf"
        what = mutate_hf(bases["hf"], path, rng)
    else:
        path = work / "case.gguf"
        what = mutate_gguf(bases[target], path, rng)
    return cli_args(command, path, work, rng), what


def classify(exit_code: int, output: str, exception: BaseException | None) -> str:
    from bitformat.cli.main import INTERNAL

    if isinstance(exception, MemoryError) or "error: out of memory" in output:
        return "over_allocation"
    if "Traceback" in output or INTERNAL in output:
        return "traceback"
    if exception is not None and not isinstance(exception, SystemExit):
        return "traceback"
    if exit_code == 0:
        return "ok"
    if exit_code in (1, 2) and "rror" in output:
        return "error"
    return "traceback"


def run_in_process(args: list[str]) -> tuple[str, str]:
    from click.testing import CliRunner

    from bitformat.cli import main

    r = CliRunner().invoke(main, args, catch_exceptions=True)
    out = r.output
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        out += f"\n{type(r.exception).__name__}: {r.exception}"
    return classify(r.exit_code, out, r.exception), out.strip().splitlines()[-1][:300] \
        if out.strip() else ""


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_subprocess(args: list[str]) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), BITFORMAT_DEBUG="0")
    try:
        p = subprocess.run([sys.executable, "-m", "bitformat.cli", *args], capture_output=True,
                           text=True, timeout=CASE_TIMEOUT, env=env, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        return "hang", ""
    if p.returncode < 0:
        return "signal", f"signal {-p.returncode}"
    return classify(p.returncode, p.stdout + p.stderr, None), p.stderr.strip()[-300:]


# -- workers -----------------------------------------------------------------------------------
def _peak_rss_mib() -> int:
    """This process's peak resident memory since it started (``VmHWM``). Not ``ru_maxrss``:
    Linux carries that over the exec of a spawned worker, so a worker started by a big parent
    (a pytest process that ran large models) would report the parent's peak as its own."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def worker(conn, base_dir: str, subprocess_every: int) -> None:
    _limit_memory()
    os.environ.pop("BITFORMAT_DEBUG", None)
    work = Path(tempfile.mkdtemp(prefix="fuzzcase-"))
    bases = {t: Path(base_dir) / (f"base.{t}.gguf" if t != "hf" else "base-hf")
             for t in TARGETS}
    try:
        while True:
            i = conn.recv()
            if i is None:
                return
            try:
                args, what = make_case(i, bases, work)
            except Exception as exc:  # noqa: BLE001 - a mutation the writer refuses: skip
                conn.send((i, "skipped", f"{type(exc).__name__}: {exc}"[:200], "", False, 0))
                continue
            via_sub = subprocess_every > 0 and i % subprocess_every == 0
            outcome, line = (run_subprocess if via_sub else run_in_process)(args)
            conn.send((i, outcome, what, f"{' '.join(args[:1])}: {line}", via_sub,
                       _peak_rss_mib()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fuzz(cases: list[int], *, workers: int = 2, subprocess_every: int = 50,
         base_dir: Path | None = None, progress=None) -> dict:
    """Run ``cases``; return figures and every failing case."""
    own = base_dir is None
    base_dir = Path(tempfile.mkdtemp(prefix="fuzzbase-")) if own else base_dir
    if not (base_dir / "base-hf").exists():
        build_bases(base_dir)
    ctx = mp.get_context("spawn")
    counts: Counter = Counter()
    per: Counter = Counter()
    failures: list[dict] = []
    queue = list(reversed(cases))
    t0 = time.time()
    slots: list = []
    peak_rss = 0  # MiB, the largest resident set a worker reached

    def start():
        a, b = ctx.Pipe()
        p = ctx.Process(target=worker, args=(b, str(base_dir), subprocess_every), daemon=True)
        p.start()
        return {"proc": p, "conn": a, "case": None, "since": 0.0}

    def feed(s):
        if queue:
            s["case"] = queue.pop()
            s["since"] = time.time()
            s["conn"].send(s["case"])
        else:
            s["case"] = None

    try:
        slots = [start() for _ in range(max(1, workers))]
        for s in slots:
            feed(s)
        done = 0
        while any(s["case"] is not None for s in slots):
            for k, s in enumerate(slots):
                if s["case"] is None:
                    continue
                i = s["case"]
                result = None
                if s["conn"].poll(0.05):
                    try:
                        result = s["conn"].recv()
                    except EOFError:
                        result = None
                if result is None and not s["proc"].is_alive():
                    code = s["proc"].exitcode
                    result = (i, "signal" if code is not None and code < 0 else "traceback",
                              "", f"worker exit {code}", False, 0)
                if result is None and time.time() - s["since"] > CASE_TIMEOUT:
                    s["proc"].kill()
                    result = (i, "hang", "", "", False, 0)
                if result is None:
                    continue
                _, outcome, what, line, via_sub, rss = result
                peak_rss = max(peak_rss, rss)
                if rss > RSS_BOUND_MIB:  # this case grew the worker past the bound
                    outcome, line = "over_allocation", f"{line} (worker rss {rss} MiB)"
                    s["proc"].kill()
                target, command = case_plan(i)
                counts[outcome] += 1
                per[f"{target} {command}"] += 1
                counts["subprocess"] += bool(via_sub)
                if outcome in FAILURES:
                    failures.append({"case": i, "target": target, "command": command,
                                     "outcome": outcome, "mutation": what, "output": line})
                done += 1
                if progress is not None:
                    progress(done, len(cases), counts)
                if not s["proc"].is_alive() or outcome in ("signal", "hang", "over_allocation"):
                    s["proc"].join(1)
                    slots[k] = s = start()
                feed(s)
    finally:
        for s in slots:
            try:
                s["conn"].send(None)
            except (OSError, BrokenPipeError):
                pass
            s["proc"].join(5)
            if s["proc"].is_alive():
                s["proc"].kill()
        if own:
            shutil.rmtree(base_dir, ignore_errors=True)
    figures = {f: counts[f] for f in ("ok", "error", "skipped", *FAILURES)}
    return {"cases": len(cases), "seconds": round(time.time() - t0, 1), "figures": figures,
            "subprocess_cases": counts["subprocess"], "memory_cap_bytes": MEMORY_CAP,
            "peak_worker_rss_mib": peak_rss,
            "per_target_command": dict(sorted(per.items())), "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--start", type=int, default=SCHEME_2,
                    help="first case number (below 1000000: the older scheme without the "
                         "q2_0/iq2_bn/iq1_bn targets)")
    ap.add_argument("--only", type=int, nargs="*", help="run these case numbers")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--subprocess-every", type=int, default=50)
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    cases = a.only if a.only else list(range(a.start, a.start + a.cases))

    def progress(done, total, counts):
        if done % 100 == 0 or done == total:
            bad = sum(counts[f] for f in FAILURES)
            print(f"{done}/{total} cases, {bad} failures", file=sys.stderr, flush=True)

    res = fuzz(cases, workers=a.workers, subprocess_every=a.subprocess_every, progress=progress)
    text = json.dumps(res, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "failures"}, indent=1))
    for f in res["failures"][:30]:
        print(json.dumps(f))
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
