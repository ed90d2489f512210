"""The runtime against transformers' ``BitNetForCausalLM``, the reference implementation.

The tiny synthetic model is written in every container and exported with
``bitformat convert --to hf`` (the CLI itself; the F16 embedding gives a float32 folder, so
transformers computes in float32). For 24 random prompts (fixed seed, lengths 1 to 40), every
container on both backends must give the logits of transformers (torch 2.13.0, CPU) to a
relative error ``max|ours - theirs| / max|theirs|`` of at most 1e-4 per prompt, and, where no
int8 flip happened, the same 8 greedy tokens.

Int8 flips. Every BitLinear quantizes its input per token, ``q = round(x * 127 / max|x|)``.
Two float32 implementations differ in their last bits, and where ``x * s`` lies near a ``.5``
they round it to neighbouring integers; one int8 step there moves the logits by up to a few
1e-2. On this random model the float noise is largest after attention (its scores are large:
the o_proj input differs by up to 0.035 int8 steps between torch and numpy, every other
projection input by at most 3e-4; a float64 run shows both sides off by that much, torch the
more), so half of these prompts hit at least one flip, about 2 int8 values in 1e5. The 1e-4
tolerance is not loosened for them. A prompt over it counts as an int8 flip only if all of
this holds, and otherwise fails:

(a) re-running our model with transformers' quantized activations injected (``q`` and ``s``
    of every quantization, in call order) brings it within 1e-4;
(b) our ``x * s`` and transformers' agree to float noise (at most 2e-3 int8 steps; 0.1 for
    the attention output) and every ``q`` that differs is exactly one step away, with the
    ``.5`` between the two ``x * s`` (the float products that were rounded; two equal ones
    rounded apart would be a rounding-rule bug), i.e. both lie within that noise of a tie.
    (b) is checked on every call of the re-run, where each input was computed from the same
    int8 values upstream, and on the free run's first call whose ``q`` differs (its own
    upstream was identical too): after a flip, later calls of a free run may differ anywhere,
    and a near-tie value can land on transformers' side in the re-run only.

Transformers' side is captured with forward hooks on its AutoBitLinear modules (q/k/v share
one input, gate/up another: four quantizations per layer, as the runtime does) and quantized
with its own formula in torch; ours through :data:`bitformat.runtime.models.base.activation_hook`,
which the network calls with every RMSNorm output it quantizes. A tie exact on both sides (where
only the rounding rule decides) does not occur in these runs, so a separate test holds the
rule itself against transformers' ``ActQuant``.
The assertion messages say how many prompts and int8 values flipped, and a test keeps flips
a minority of the prompts and under 1e-3 of the int8 values of those prompts.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch: the BitNet helpers compile

from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from bitformat.cli import main as cli  # noqa: E402
from bitformat.formats import FORMAT_IDS  # noqa: E402
from bitformat.runtime import load  # noqa: E402
from bitformat.runtime.backend import QuantizedActivations, quantize_activations  # noqa: E402
from bitformat.runtime.models import base as model_mod  # noqa: E402

pytestmark = pytest.mark.oracle

BOUND = 1e-4  # relative logits error, per prompt
BACKENDS = ("numpy", "cpu")
N_PROMPTS, MAX_LEN, GREEDY = 24, 40, 8
#: float noise allowed between the two sides' ``x * s`` (int8 steps) before a flip is believed:
#: the attention output (call 1 of each layer's 4) is the ill-conditioned one.
NOISE, NOISE_ATTN = 2e-3, 0.1
_rng = np.random.default_rng(20240607)
PROMPTS = [_rng.integers(0, 512, int(_rng.integers(1, MAX_LEN + 1))).tolist()
           for _ in range(N_PROMPTS)]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# -- transformers' side ----------------------------------------------------------------------------
@dataclass
class Quant:
    """One quantization as transformers did it: int8 ``q``, scales ``s`` [T], products ``x*s``."""

    q: np.ndarray
    s: np.ndarray
    xs: np.ndarray


@dataclass
class HFRun:
    logits: np.ndarray  # float64 copy of transformers' logits [T, vocab]
    quant: list[Quant]  # 4 per layer: attn_norm, attn_sub_norm, ffn_norm, ffn_sub_norm outputs
    greedy: list[int] = field(default_factory=list)


def hf_quant(x: torch.Tensor) -> Quant:
    """transformers' ActQuant, in torch on the captured input (its dtype)."""
    s = 127 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)
    xs = x * s
    q = xs.round().clamp(-128, 127)
    return Quant(q.numpy().astype(np.int8), s[:, 0].numpy().copy(), xs.numpy().copy())


def hf_runs(model, prompts, greedy: int) -> list[HFRun]:
    """Logits, quantized projection inputs and greedy continuations of every prompt."""
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [mod.register_forward_hook(
        lambda mod, args, out, name=name: seen.append((name, args[0][0].detach().clone())))
        for name, mod in model.named_modules()
        if type(mod).__name__ in ("AutoBitLinear", "BitLinear")]
    n_layers = model.config.num_hidden_layers
    assert len(hooks) == 7 * n_layers
    runs = []
    try:
        with torch.no_grad():
            for p in prompts:
                seen.clear()
                logits = model(torch.tensor([p])).logits[0].double().numpy()
                by = dict(seen)
                assert len(by) == len(seen) == 7 * n_layers
                quant = []
                for i in range(n_layers):
                    at, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
                    assert torch.equal(by[at + "q_proj"], by[at + "k_proj"])
                    assert torch.equal(by[at + "q_proj"], by[at + "v_proj"])
                    assert torch.equal(by[mlp + "gate_proj"], by[mlp + "up_proj"])
                    quant += [hf_quant(by[n]) for n in (at + "q_proj", at + "o_proj",
                                                        mlp + "gate_proj", mlp + "down_proj")]
                runs.append(HFRun(logits, quant))
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():  # greedy: argmax of a full recompute at every step
        for p, run in zip(prompts, runs, strict=True):
            ids = list(p)
            for _ in range(greedy):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            run.greedy = ids[len(p):]
    return runs


# -- our side --------------------------------------------------------------------------------------
class Quantizer:
    """Stands in for ``quantize_activations``: records ``(x, ours)``; with ``inject`` it
    returns transformers' ``q`` and ``s`` of the same call instead of its own."""

    def __init__(self, inject: list[Quant] | None = None):
        self.calls: list[tuple[np.ndarray, QuantizedActivations]] = []
        self.inject = inject

    def __call__(self, x: np.ndarray) -> QuantizedActivations:
        qa = quantize_activations(x)
        i = len(self.calls)
        self.calls.append((x.copy(), qa))
        if self.inject is None or i >= len(self.inject):
            return qa
        return QuantizedActivations(self.inject[i].q.copy(), self.inject[i].s.astype(x.dtype))


def run_ours(lm, tokens, inject=None) -> tuple[np.ndarray, Quantizer]:
    quantizer = Quantizer(inject)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_mod, "activation_hook", quantizer)
        logits = lm.logits(tokens)
    return logits, quantizer


@dataclass
class Verdict:
    err: float  # free run
    flips: int = 0  # int8 values found differing (0: within BOUND without injection)
    values: int = 0  # int8 values quantized in one forward
    problems: list[str] = field(default_factory=list)  # non-empty: a real discrepancy


def judge(lm, tokens, run: HFRun) -> Verdict:
    """Compare one prompt; explain an excess as int8 flips or list what is wrong."""
    logits, free = run_ours(lm, tokens)
    v = Verdict(rel_err(logits, run.logits), values=sum(x.size for x, _ in free.calls))
    if v.err <= BOUND:
        return v
    if len(free.calls) != len(run.quant):
        v.problems.append(f"{len(free.calls)} quantizations, transformers did {len(run.quant)}")
        return v
    logits, rerun = run_ours(lm, tokens, inject=run.quant)
    flipped: set[tuple[int, int]] = set()  # (call, flat index)
    # The free run up to its first differing call (everything before it had the same int8
    # inputs), then every call of the re-run: a near-tie value may land on transformers'
    # side in the re-run (injected scales move it by float noise) and on the other side freely.
    first = next((i for i, ((_, qa), t) in enumerate(zip(free.calls, run.quant, strict=True))
                  if not np.array_equal(qa.q, t.q)), None)
    if first is None:
        v.problems.append(f"{v.err:.3g} without any int8 value differing")
    checks = [] if first is None else [("free run", first, *free.calls[first])]
    checks += [("re-run", i, x, qa) for i, (x, qa) in enumerate(rerun.calls)]
    for where, i, x, qa in checks:
        theirs = run.quant[i]
        mine = (x * qa.s[:, None]).astype(np.float64)  # the products ours rounded
        other = theirs.xs.astype(np.float64)
        gap, noise = float(np.abs(mine - other).max()), NOISE_ATTN if i % 4 == 1 else NOISE
        if gap > noise:
            v.problems.append(f"{where} call {i}: x*s differs by {gap:.3g} int8 steps "
                              f"(> {noise})")
        diff = qa.q != theirs.q
        if diff.any():
            half = np.minimum(qa.q, theirs.q)[diff] + 0.5
            tie = ((np.abs(qa.q[diff].astype(int) - theirs.q[diff]) == 1)
                   & ((mine[diff] - half) * (other[diff] - half) <= 0)
                   & (mine[diff] != other[diff]))  # equal products: a rounding-rule bug
            if not tie.all():
                v.problems.append(f"{where} call {i}: int8 values differ away from a .5 tie: "
                                  f"x*s {mine[diff][~tie][:4]} vs {other[diff][~tie][:4]}")
            flipped.update((i, int(j)) for j in np.flatnonzero(diff))
    v.flips = len(flipped)
    err = rel_err(logits, run.logits)
    if err > BOUND:
        v.problems.append(f"still {err:.3g} with transformers' int8 activations injected")
    return v


def describe(verdicts: dict[int, Verdict]) -> str:
    flipped = {i: v for i, v in verdicts.items() if v.flips}
    ok = max((v.err for v in verdicts.values() if not v.flips), default=0.0)
    return (f"{len(flipped)} of {len(verdicts)} prompts had int8 flips "
            f"({sum(v.flips for v in flipped.values())} values of "
            f"{sum(v.values for v in flipped.values())}: prompts {sorted(flipped)}); "
            f"worst error of the others {ok:.2g}")


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paths(tiny_gguf, tiny_containers, tmp_path_factory):
    """format id -> the tiny model in that container, and "hf" -> its CLI export."""
    d = tmp_path_factory.mktemp("oracle-runtime")
    out = dict(tiny_containers)
    out["hf"] = d / "tiny-hf"
    res = CliRunner().invoke(cli, ["convert", str(tiny_gguf), "--to", "hf", "-o", str(out["hf"])])
    assert res.exit_code == 0, res.output
    assert '"torch_dtype": "float32"' in (out["hf"] / "config.json").read_text()
    return out


@pytest.fixture(scope="module")
def tf_model(paths):
    import torch._dynamo

    transformers.logging.set_verbosity_error()
    with torch._dynamo.config.patch(disable=True):
        model = transformers.BitNetForCausalLM.from_pretrained(str(paths["hf"]),
                                                               dtype=torch.float32).eval()
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        yield model


@pytest.fixture(scope="module")
def hf32(tf_model):
    return hf_runs(tf_model, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def ours(paths):
    # transformers keeps its KV cache in float32; ours does too here, not the f16 default
    models = {}
    yield lambda fid, backend: models.setdefault(
        (fid, backend), load(paths[fid], backend=backend, kv_cache="f32"))
    for m in models.values():
        m.close()


@pytest.fixture(scope="module")
def verdicts(ours, hf32):
    cache = {}

    def get(fid, backend):
        if (fid, backend) not in cache:
            lm = ours(fid, backend)
            cache[(fid, backend)] = {i: judge(lm, p, run)
                                     for i, (p, run) in enumerate(zip(PROMPTS, hf32, strict=True))}
        return cache[(fid, backend)]

    return get


# -- tests -----------------------------------------------------------------------------------------
def test_prompts_cover_lengths():
    lengths = [len(p) for p in PROMPTS]
    assert min(lengths) <= 3 and max(lengths) >= 35 and len(set(map(tuple, PROMPTS))) == N_PROMPTS


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantizer_is_transformers_actquant(dtype):
    """Exact .5 ties (rounded to even), a row of zeros, clamping and random rows: the rounding
    rule itself, which the model runs above never put to the test (no tie exact on both sides)."""
    from transformers.integrations.bitnet import ActQuant

    ties = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, -126.5, 127.0, 3.0]  # max 127: s = 1
    rng = np.random.default_rng(5)
    x = np.vstack([ties, np.zeros(10), [1e-7] * 9 + [-2e-6], rng.standard_normal((5, 10)),
                   rng.standard_normal((5, 10)) * 1e3]).astype(dtype)
    qa = quantize_activations(x)
    assert qa.q[0].tolist() == [0, 2, 2, 0, -2, -2, 126, -126, 127, 3]
    want = ActQuant.apply(torch.from_numpy(x)).numpy()  # round(x s).clamp() / s, in torch
    np.testing.assert_array_equal(np.rint(want * qa.s[:, None]), qa.q)  # the same integers
    np.testing.assert_allclose(qa.q / qa.s[:, None], want, rtol=1e-6, atol=0)  # and scales


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fid", FORMAT_IDS)
def test_logits_match_transformers(verdicts, fid, backend):
    v = verdicts(fid, backend)
    bad = {i: (f"{x.err:.3g}", x.problems) for i, x in v.items() if x.problems}
    assert not bad, f"{fid}/{backend}: real discrepancies {bad}; {describe(v)}"
    flipped = [i for i, x in v.items() if x.flips]
    # Flips explained, but they must stay the exception, else this test proves little
    # (measured: 12 of the 24 prompts, 19 int8 values of 8e5 in those prompts).
    assert len(flipped) <= 2 * N_PROMPTS // 3, f"{fid}/{backend}: {describe(v)}"
    assert sum(v[i].flips for i in flipped) <= 1e-3 * sum(v[i].values for i in flipped), \
        f"{fid}/{backend}: {describe(v)}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fid", FORMAT_IDS)
def test_greedy_matches_transformers(ours, verdicts, hf32, fid, backend):
    v, lm = verdicts(fid, backend), ours(fid, backend)
    clean = [i for i, x in v.items() if not x.flips and not x.problems]
    assert len(clean) >= N_PROMPTS // 3, f"{fid}/{backend}: {describe(v)}"
    wrong = {}
    for i in clean:
        got = lm.generate(PROMPTS[i], max_new_tokens=GREEDY, temperature=0, stop_ids=[]).tokens
        if got != hf32[i].greedy:
            wrong[i] = (got, hf32[i].greedy)
    assert not wrong, f"{fid}/{backend}: greedy differs (ours, transformers') {wrong}"


def test_float64_numpy_matches_transformers_float64(paths, tf_model):  # tf_model: dynamo off
    """The float64 numpy backend against transformers' model in float64.

    ``from_pretrained(dtype=float64)`` keeps the folder's float32 embedding and norms (and
    fails at the first matmul with transformers 5), so the float32 model is converted with
    ``.to(float64)``. transformers still computes RMSNorm, RoPE and the softmax in float32, so
    this side is no more exact than float32 after attention: the same flip rule applies.
    """
    try:
        model = transformers.BitNetForCausalLM.from_pretrained(str(paths["hf"]),
                                                               dtype=torch.float64).eval()
        if {p.dtype for p in model.parameters()} != {torch.float64}:
            raise TypeError("mixed dtypes")
        with torch.no_grad():
            model(torch.tensor([[1, 2]]))
    except Exception:  # any failure: fall back to converting the float32 model
        try:
            model = transformers.BitNetForCausalLM.from_pretrained(
                str(paths["hf"]), dtype=torch.float32).eval().to(torch.float64)
            with torch.no_grad():
                model(torch.tensor([[1, 2]]))
        except Exception as e:
            pytest.skip(f"transformers cannot run this model in float64: {e}")
    prompts = PROMPTS
    runs = hf_runs(model, prompts, 0)
    assert runs[0].logits.dtype == np.float64 and runs[0].quant[0].s.dtype == np.float64
    with load(paths["i2_s"], backend="numpy", dtype="float64", kv_cache="f32") as lm:
        v = {i: judge(lm, p, run) for i, (p, run) in enumerate(zip(prompts, runs, strict=True))}
    bad = {i: (f"{x.err:.3g}", x.problems) for i, x in v.items() if x.problems}
    assert not bad, f"float64: real discrepancies {bad}; {describe(v)}"
    assert sum(1 for x in v.values() if not x.flips) >= len(prompts) // 3, describe(v)
