"""The ``bitformat`` command: click wiring only.

Each command parses its options, calls one library function and renders the result. Heavy
imports happen inside the command that needs them. This module is the one place where
errors become messages and exit codes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import traceback
from pathlib import Path

import click

from .. import __version__
from ..constants import DEFAULT_KV_TYPE, KV_TYPES
from ..errors import BitformatError, Terminated
from ..formats import CONVERT_TARGETS
from .helpers import CompileNotice, check_output, check_threads, quantized_line

PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # matplotlib's savefig picks the format by extension


def _friendly_errors(fn):
    """Turn bitformat's errors into one-line messages (exit 1), Ctrl-C into exit 130 and
    SIGTERM into exit 143, both after the atomic writers removed their unfinished output, at
    any moment, numba's compilation included (:mod:`.interrupts`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .. import interrupts

        previous = interrupts.install()
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # usage errors: click prints them
        except BitformatError as exc:
            _debug_traceback()
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except MemoryError:
            _debug_traceback()
            click.echo("error: out of memory (the model, or what a request asks for, does not "
                       "fit this machine's memory)", err=True)
            sys.exit(1)
        except RecursionError:
            _debug_traceback()
            click.echo("error: an input is nested too deeply to read", err=True)
            sys.exit(1)
        except OSError as exc:
            _debug_traceback()
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"error: {where}{exc.strerror or exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            signalled = interrupts.handled()
            # convert, synth and report (its plot) write their output only once complete
            done = ": nothing was written" if fn.__name__ in ("convert", "synth", "report") else ""
            click.echo(f"interrupted{done}", err=True)
            if signalled:
                interrupts.end_process(130)
            sys.exit(130)
        except Terminated:
            signalled = interrupts.handled()
            click.echo("terminated: no unfinished output was left", err=True)
            if signalled:
                interrupts.end_process(143)
            sys.exit(143)
        except Exception as exc:  # a bug: one line, the traceback only when asked for
            if _debug():
                raise
            click.echo(f"error: {INTERNAL} ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); run with "
                       "--debug or BITFORMAT_DEBUG=1 for the traceback", err=True)
            sys.exit(1)
        finally:
            interrupts.restore(previous)

    return wrapper


#: what an error bitformat did not foresee says (the fuzz test counts these as failures)
INTERNAL = "internal error"


def _debug() -> bool:
    if os.environ.get("BITFORMAT_DEBUG", "") not in ("", "0"):
        return True
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.find_root().params.get("debug"))


def _debug_traceback() -> None:
    if _debug():
        traceback.print_exc()


def _finite(ctx, param, value):
    """A float option that must be a finite number (click's FloatRange lets NaN through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


class ModelSource(click.ParamType):
    """A model: a path, a Hugging Face cache snapshot folder, or ORG/NAME in the local cache
    (:mod:`..io.hf_cache`; never downloaded)."""

    name = "model"

    def convert(self, value, param, ctx):
        if isinstance(value, Path) and value.exists():
            return value
        from ..errors import BitformatError
        from ..io.hf_cache import resolve

        try:
            return resolve(value)
        except BitformatError as e:
            self.fail(e.problem, param, ctx)


MODEL = ModelSource()


class _Progress:
    """A tqdm bar over tensors, weighted by bytes, shown only on a terminal or when asked."""

    def __init__(self, total_bytes: int, desc: str, enabled: bool | None = None):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True,
                        disable=(not sys.stderr.isatty()) if enabled is None else not enabled,
                        leave=False, file=sys.stderr)

    def __call__(self, entry) -> None:
        self.bar.update(entry.nbytes)
        self.bar.set_postfix_str(entry.name, refresh=False)

    def close(self) -> None:
        self.bar.close()


def _show(result, render, as_json: bool, plot: Path | None) -> None:
    """Print a report-like result as JSON or text, mentioning the plot file if one was written."""
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
    else:
        click.echo(render(result))
        if plot is not None:
            click.echo(f"plot written to {plot}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="bitformat")
@click.option("--debug", is_flag=True,
              help="Show the Python traceback of an error (or set BITFORMAT_DEBUG=1).")
def main(debug: bool) -> None:
    """Lossless containers and converters for ternary (BitNet b1.58) weights."""


@main.command()
@click.argument("file", type=MODEL)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--i2s-layout", type=click.Choice(["x86", "arm64"]), default="x86",
              show_default=True, help="i2_s block layout (files do not record it).")
@_friendly_errors
def inspect(file: Path, as_json: bool, i2s_layout: str) -> None:
    """Show the architecture, tokenizer and every tensor of FILE (a container or HF folder)."""
    from ..container import open_model
    from ..summary import render, summarize

    with open_model(file, i2s_variant=i2s_layout) as model:
        total = sum(e.nbytes for e in model.entries)
        bar = _Progress(total, "reading")
        try:
            summary = summarize(model, progress=bar)
        finally:
            bar.close()
    if as_json:
        click.echo(json.dumps(summary.to_json(), indent=1))
    else:
        click.echo(render(summary))


def default_output(src: Path, target: str) -> Path:
    """``model.gguf`` -> ``model.tq2_0.gguf``; an HF export gets a folder ``model-hf``. A
    source in the Hugging Face cache writes to the current folder, named after the repo."""
    from ..io.hf_cache import cache_repo_name

    repo = cache_repo_name(src)
    if repo is not None:
        src = Path.cwd() / repo
    stem = src.name if src.is_dir() or repo is not None else src.stem
    for fid in CONVERT_TARGETS:
        if stem.endswith(f".{fid}"):
            stem = stem[: -len(fid) - 1]
    if target == "hf":
        return src.with_name(f"{stem}-hf")
    return src.with_name(f"{stem}.{target}.gguf")


@main.command()
@click.argument("file", type=MODEL)
@click.option("--to", "target", required=True, type=click.Choice(CONVERT_TARGETS),
              help="Container to write.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Output path (default: next to FILE, named after the target).")
@click.option("--allow-scale-rounding", is_flag=True,
              help="Round scales the target cannot hold exactly, and report the change.")
@click.option("--i2s-layout", type=click.Choice(["x86", "arm64"]), default="x86",
              show_default=True, help="i2_s block layout of FILE (files do not record it).")
@_friendly_errors
def convert(file: Path, target: str, output: Path | None, allow_scale_rounding: bool,
            i2s_layout: str) -> None:
    """Convert FILE into another container, losslessly (or refuse and say why)."""
    from ..container import convert as do_convert
    from ..container import open_model

    out = output or default_output(file, target)
    with open_model(file, i2s_variant=i2s_layout) as model:
        total = sum(e.nbytes for e in model.entries)
    bar = _Progress(total, f"-> {target}")
    try:
        report = do_convert(file, out, target, allow_scale_rounding=allow_scale_rounding,
                            i2s_variant=i2s_layout, progress=bar)
    finally:
        bar.close()
    click.echo(f"wrote {out} ({target}, {report.tensors} tensors, "
               f"{report.ternary_weights:,} ternary weights)")
    if report.quantized:
        click.echo(quantized_line(report.quantized))
    for line in report.warnings:
        click.echo(f"warning: {line}", err=True)
    for name, loss in report.scale_changes.items():
        click.echo(f"  scale of {name} rounded: relative change up to {loss:.3g}")


@main.command()
@click.argument("file", type=MODEL)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw the report at this path (.png, .svg or .pdf, by its extension).")
@click.option("--i2s-layout", type=click.Choice(["x86", "arm64"]), default="x86",
              show_default=True, help="i2_s block layout of FILE (files do not record it).")
@_friendly_errors
def report(file: Path, as_json: bool, plot: Path | None, i2s_layout: str) -> None:
    """Bits per weight of FILE's model in every container, against the entropy floors, and
    the bytes one generated token reads in each (all measured from real encodings)."""
    from ..container import open_model
    from ..report import build_report, render

    check_output(plot, "--plot", PLOT_SUFFIXES)
    with open_model(file, i2s_variant=i2s_layout) as model:
        total = sum(e.nbytes for e in model.entries)
    bar = _Progress(total, "measuring")
    try:
        rep = build_report(file, i2s_variant=i2s_layout, progress=bar)
    finally:
        bar.close()
    if plot is not None:
        from ..report_plot import plot_report

        plot_report(rep, plot)
    _show(rep, render, as_json, plot)


#: bitformat.synth.PRESETS (named here: the CLI imports its modules lazily)
SYNTH_PRESETS = ("tiny", "2b4t", "tiny-1bitllm", "1bitllm-large", "1bitllm-3b", "tiny-llama",
                 "llama3-8b", "falcon3-7b", "tiny-qwen3", "bonsai-8b")


@main.command()
@click.option("--preset", type=click.Choice(SYNTH_PRESETS), default="tiny",
              show_default=True, help="Family and size: tiny (tests) or 2b4t (BitNet 2B-4T); "
              "1bitllm-large/-3b, llama3-8b, falcon3-7b, bonsai-8b (Qwen3) and tiny-<family>.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Draws the weights; the same seed gives the same file on every machine and "
                   "Python version (for one release of the tokenizers package).")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="Where to write the model (an i2_s GGUF container).")
@click.option("--embedding", type=click.Choice(["bf16", "f16", "q2_0"]), default="bf16",
              show_default=True, help="Precision of the F16 embedding's values: bf16 values "
              "(as the official 2B-4T file has them) or full-precision f16; or q2_0: a "
              "ternary embedding and head with per-64 scales (as Ternary Bonsai ships them).")
@_friendly_errors
def synth(preset: str, seed: int, output: Path, embedding: str) -> None:
    """Build a ternary model with a family's real architecture and profile-drawn trits."""
    from tqdm import tqdm

    from ..synth import synth as do_synth

    with tqdm(desc=f"synth {preset}", unit="tensor", disable=not sys.stderr.isatty(),
              leave=False, file=sys.stderr) as bar:
        def progress(name: str, index: int, total: int) -> None:
            bar.total = total
            bar.update(1)
            bar.set_postfix_str(name, refresh=False)

        path = do_synth(preset, output, seed=seed, progress=progress, embedding=embedding)
    click.echo(f"wrote {path} ({preset}, seed {seed})")


def _parse_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of token ids",
                                 param_hint="--prompt-ids") from None


KV_CACHE_OPTION = click.option(
    "--kv-cache", type=click.Choice(KV_TYPES), default=DEFAULT_KV_TYPE, show_default=True,
    help="How the KV cache holds keys and values: f16 rounds them to float16 (as llama.cpp "
         "does by default), f32 keeps them as computed (twice the memory and the bytes a "
         "step reads at long contexts), q8_0 stores llama.cpp's int8 blocks of 32 with a "
         "float16 scale (about half of f16's bytes; lossy: the text can differ from f16's "
         "and f32's; on wgpu it runs op by op). Every backend gives the same tokens for "
         "the same type.")


def _generation_options(fn):
    """The options ``run`` and ``chat`` share: backend, sampling, stop strings, context."""
    for decorator in reversed([
        click.option("--backend", type=click.Choice(["numpy", "cpu", "wgpu"]), default="cpu",
                     show_default=True),
        click.option("--temperature", type=float, callback=_finite, default=0.0, show_default=True,
                     help="0 means greedy."),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 disables."),
        click.option("--top-p", type=float, callback=_finite, default=1.0, show_default=True),
        click.option("--min-p", type=float, callback=_finite, default=0.0, show_default=True,
                     help="Drop tokens less likely than this fraction of the likeliest one "
                          "(0 disables)."),
        click.option("--repetition-penalty", type=float, callback=_finite, default=1.0,
                     show_default=True),
        click.option("--seed", type=int, default=None),
        click.option("--stop", "stop", multiple=True, metavar="TEXT",
                     help="End the answer where this text appears (not shown); repeatable. "
                          "The model's end-of-turn tokens always stop it."),
        click.option("--context", type=click.IntRange(min=1), default=None,
                     help="Tokens of context (prompt + answer; for chat, the whole "
                          "conversation) [default: the model's context length]."),
        click.option("--threads", type=int, default=None, callback=check_threads,
                     help="CPU threads (default: adaptive; at most the cores available)."),
        click.option("--show-special", is_flag=True,
                     help="Show special tokens (<|eot_id|>, ...) in the text; hidden by "
                          "default, as in llama.cpp."),
        click.option("--i2s-layout", type=click.Choice(["x86", "arm64"]), default="x86",
                     show_default=True, help="i2_s block layout of FILE."),
        click.option("--decode", type=click.Choice(["load", "fused"]), default="load",
                     show_default=True, help="rans files: decode the streams once at load into "
                     "2-bit rows (fast), or inside every mat-vec (fused: less memory, slower)."),
        click.option("--head", type=click.Choice(["auto", "screened", "full"]), default="auto",
                     show_default=True, help="LM head: screened reads an int8 copy of the head "
                     "(6 or 7 bits a value where that pays on the model) "
                     "and recomputes only the rows it cannot rule out (the same tokens as full, "
                     "proven in docs/exact-head.md); full computes every logit; auto is full on "
                     "a GPU (wgpu on a real device, where the screen's round trips to the host "
                     "cost more than its bytes save) and screened elsewhere."),
        KV_CACHE_OPTION,
    ]):
        fn = decorator(fn)
    return fn


def _check_context(model, context: int | None) -> None:
    if context is not None and context > model.args.context_length:
        raise click.BadParameter(f"{context} is more than the model's context length of "
                                 f"{model.args.context_length}", param_hint="--context")


@main.command()
@click.argument("file", type=MODEL)
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.File("r", encoding="utf-8"),
              help="Read the prompt text from this file ('-': standard input).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids (instead of text).")
@click.option("-n", "--max-tokens", type=click.IntRange(min=0), default=64, show_default=True,
              help="Tokens to generate at most.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--system", help="System prompt (implies --chat).")
@_generation_options
@click.option("--json", "as_json", is_flag=True,
              help="Print token ids, text and timings as one JSON object at the end.")
@_friendly_errors
def run(file: Path, prompt: str | None, prompt_file, prompt_ids: str | None, max_tokens: int,
        chat: bool, system: str | None, backend: str, temperature: float, top_k: int,
        top_p: float, min_p: float, repetition_penalty: float, seed: int | None,
        stop: tuple[str, ...], context: int | None, threads: int | None, show_special: bool,
        i2s_layout: str, decode: str, head: str, kv_cache: str, as_json: bool) -> None:
    """Generate text from FILE (any container or HF folder), streaming as it goes.

    The first run on a machine compiles the cpu kernels (said on stderr, kept out of the
    reported speeds): on 2 cores the full-size 2B-4T's first token comes 19-25 s after the
    start instead of 4-9 s, and a short run then waits about 30 s while the rest compiles for
    later runs; `bitformat warmup` does it ahead. For a conversation of several
    turns, use `bitformat chat`."""
    from .helpers import ready_model

    ids = _parse_ids(prompt_ids)
    if sum(x is not None for x in (prompt, prompt_file, ids)) != 1:
        raise click.UsageError("give exactly one of --prompt, --file and --prompt-ids")
    if prompt_file is not None:
        prompt = prompt_file.read()
    if system is not None and ids is not None:
        raise click.UsageError("--system needs a text prompt (--prompt or --file)")
    with ready_model(file, backend, i2s_layout, threads, decode, head, kv_cache) as model:
        _check_context(model, context)
        tokens: list[int] = []
        pieces: list[str] = []
        finish = None
        for r in model.stream_generate(prompt if ids is None else ids, max_tokens,
                                       chat=chat or system is not None, system=system,
                                       temperature=temperature, top_k=top_k, top_p=top_p,
                                       min_p=min_p, repetition_penalty=repetition_penalty,
                                       seed=seed, stop=stop, context=context,
                                       skip_special=not show_special):
            if r.token is not None:
                tokens.append(r.token)
            pieces.append(r.text)
            finish = r.finish_reason
            if not as_json:
                click.echo(r.text, nl=False)
        stats = model.last_stats
        hs = model.head_stats()
        if as_json:
            click.echo(json.dumps({
                "tokens": tokens, "text": "".join(pieces), "finish_reason": finish,
                "backend": backend, "container": model.container,
                "decode": decode if model.container == "rans" and backend != "numpy" else None,
                "load_seconds": model.load_seconds,
                "prompt_tokens": stats.prompt_tokens, "prompt_tokens_per_s": stats.prompt_tps,
                "generated_tokens": stats.generated_tokens,
                "generation_tokens_per_s": stats.generation_tps,
                "head": hs["head"],
                "candidates_per_step_mean": hs["candidates_per_step_mean"],
                "candidates_per_step_max": hs["candidates_per_step_max"],
                "rescored_per_step_mean": hs["rescored_per_step_mean"],
                "head_fallbacks": hs["head_fallbacks"],
                # the screen's code width (int8, int7, int6) and the head's switches between them
                "screen_bits": hs.get("screen_bits"),
                "screen_switches": hs.get("screen_switches", []),
                "head_bytes_per_token": hs["head_bytes_per_step"],
                "bytes_read_per_token": hs["bytes_read_per_token"],
                "kv_cache": kv_cache, "kv_cache_bytes_last_token": stats.kv_bytes_last_token,
            }))
            return
        click.echo()
        click.echo(f"[{model.container} on {backend}] loaded in {model.load_seconds:.2f} s, "
                   f"prompt {stats.prompt_tokens} tokens at {stats.prompt_tps:.1f} tok/s, "
                   f"generated {stats.generated_tokens} at {stats.generation_tps:.1f} tok/s, "
                   f"{hs['bytes_read_per_token'] / 1e6:.2f} MB read per token (KV cache "
                   f"{stats.kv_bytes_last_token / 1e6:.3f} MB, {hs['head']} head "
                   f"{hs['head_bytes_per_step'] / 1e6:.2f} MB)", err=True)


@main.command()
@click.argument("file", type=MODEL)
@click.option("--system", help="System prompt (/system changes it during the chat).")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens of one answer at most (default: a quarter of the context, at most "
                   "512).")
@_generation_options
@click.option("--stats", is_flag=True, help="After each answer, show its speed and how much "
              "of the context the conversation holds (on stderr).")
@_friendly_errors
def chat(file: Path, system: str | None, max_tokens: int | None, backend: str,
         temperature: float,
         top_k: int, top_p: float, min_p: float, repetition_penalty: float, seed: int | None,
         stop: tuple[str, ...], context: int | None, threads: int | None, show_special: bool,
         i2s_layout: str, decode: str, head: str, kv_cache: str, stats: bool) -> None:
    """Chat with FILE: a conversation of many turns, answers streamed as they form.

    Prompts are rendered with the model's own chat template (as transformers renders it).
    The KV cache is kept between turns, so each turn runs only its new tokens. Type /help
    for the commands (/reset, /system TEXT, /exit); Ctrl-C stops an answer, Ctrl-D or Ctrl-C
    at the prompt ends the chat. Input need not be a terminal: lines piped in are turns."""
    from ..runtime.chat import ChatSession
    from .chat import chat_loop
    from .helpers import ready_model

    with ready_model(file, backend, i2s_layout, threads, decode, head, kv_cache) as model:
        _check_context(model, context)
        session = ChatSession(model, system=system, context=context, max_new_tokens=max_tokens,
                              stop=stop, skip_special=not show_special, temperature=temperature,
                              top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty, seed=seed)
        interactive = sys.stdin.isatty()
        if interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:  # Windows
                pass
            click.echo(f"chatting with {file.name} ({model.container} on {backend}, context "
                       f"{session.context} tokens); /help lists the commands", err=True)
        chat_loop(session, sys.stdin, sys.stdout, sys.stderr,
                  prompt="> " if interactive else "", stats=stats)


@main.command()
@click.option("--backend", type=click.Choice(["cpu", "wgpu"]), default="cpu",
              show_default=True)
@_friendly_errors
def warmup(backend: str) -> None:
    """Compile every kernel a model can use on this machine, ahead of the first run.

    numba compiles the cpu kernels for the CPU that runs them, on first use, and caches them
    on disk (beside the installed package, or in NUMBA_CACHE_DIR); pip cannot do it at install
    time. This runs a tiny synthetic model through every container once, and a batched step
    as `serve` runs it, in two processes (46-86 s on 2 cores the first time, seconds
    afterwards), so the first `bitformat run` or `serve` starts at once."""
    from tqdm import tqdm

    from ..runtime.warmup import on_compile, warm_up_all

    notice = CompileNotice()
    with tqdm(desc="warmup", unit="model", leave=False, file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        def progress(what: str, index: int, total: int) -> None:
            bar.total = total
            bar.n = index
            bar.set_postfix_str(what)

        try:
            with on_compile(notice, notice.done):
                steps = warm_up_all(backend, progress=progress)
        finally:
            notice.close()
    for s in steps:
        click.echo(f"  {s.what:<24} ready in {s.seconds:6.2f} s")
    compiled = sum(s.compiled for s in steps)  # both processes' (the notice hears this one's)
    click.echo(f"kernels ready: {compiled} compiled now" if compiled else
               "kernels ready: all were already in numba's cache")


@main.command()
@click.argument("file", type=MODEL)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port (0: any free one).")
@click.option("--backend", type=click.Choice(["numpy", "cpu", "wgpu"]), default="cpu",
              show_default=True)
@click.option("--api-key", envvar="BITFORMAT_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or set BITFORMAT_API_KEY).")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded together; more wait in a queue.")
@click.option("--context", type=click.IntRange(min=2), default=None,
              help="Tokens per request, prompt and answer (default: the model's).")
@click.option("--threads", type=int, default=None, help="CPU threads (default: adaptive).")
@click.option("--i2s-layout", type=click.Choice(["x86", "arm64"]), default="x86",
              show_default=True, help="i2_s block layout of FILE.")
@click.option("--quiet", is_flag=True, help="No access log (one line per request on stderr).")
@KV_CACHE_OPTION
@click.option("--cache-memory", default="auto", show_default=True,
              help="Memory all requests' KV caches may take together (e.g. 2GiB): a request "
                   "starts when its prompt and token limit fit, waits otherwise, and is "
                   "refused if it could never fit. auto: 80% of the memory available at "
                   "start, at most --max-batch full contexts. Caches grow as requests do.")
@_friendly_errors
def serve(file: Path, host: str, port: int, backend: str, api_key: str | None, max_batch: int,
          context: int | None, threads: int | None, i2s_layout: str, quiet: bool,
          kv_cache: str, cache_memory: str) -> None:
    """Serve FILE over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/models, /health), batching concurrent requests. Ctrl-C stops it.

    Each request that ends writes a line on stderr: client, method and path, status, prompt
    and answer tokens, milliseconds (--quiet: none). Sampling follows the OpenAI API, whose
    default temperature is 1.0: ask for temperature 0 to get `bitformat run`'s tokens."""
    from ..serve import serve as do_serve

    def ready(info: dict) -> None:
        if info["note"]:
            click.echo(f"note: {info['note']}", err=True)
        pool = "" if info["cache_positions"] is None else (
            f", KV cache {info['kv_cache']}: {info['cache_positions']:,} positions in "
            f"{info['cache_bytes'] / 2**20:,.0f} MiB")
        click.echo(f"serving {info['model']} ({info['backend']}, max batch {info['max_batch']}"
                   f", context {info['context']}{pool}) at {info['url']}/v1")

    def log(line: str) -> None:
        click.echo(line, err=True)

    do_serve(file, host=host, port=port, backend=backend, api_key=api_key, max_batch=max_batch,
             context=context, threads=threads, i2s_variant=i2s_layout, ready=ready,
             access_log=None if quiet else log, kv_cache=kv_cache, cache_memory=cache_memory)
    click.echo("stopped", err=True)


@main.command()
@click.argument("file", type=MODEL)
@click.option("--backend", type=click.Choice(["cpu", "wgpu"]), default="cpu",
              show_default=True)
@click.option("--formats", default="all", show_default=True,
              help="Containers to measure: all, or a comma list of ids.")
@click.option("--tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Decode steps timed (after a fixed 8-token prompt and 1 warm-up step).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw bytes per token against ms per token at this path (.png, .svg or "
                   ".pdf).")
@click.option("--keep-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write the converted containers here and keep them (default: a temporary "
                   "folder, each deleted after its run).")
@click.option("--threads", type=int, default=None, callback=check_threads,
              help="CPU threads (default: adaptive; at most the cores available).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="wgpu: profiled runs per container (the median is kept).")
@click.option("--i2s-layout", type=click.Choice(["x86", "arm64"]), default="x86",
              show_default=True, help="i2_s block layout of FILE.")
@KV_CACHE_OPTION
@_friendly_errors
def bench(file: Path, backend: str, formats: str, tokens: int, as_json: bool,
          plot: Path | None, keep_dir: Path | None, threads: int | None, repeats: int,
          i2s_layout: str, kv_cache: str) -> None:
    """Convert FILE into each container and time decoding on a backend: per kernel class and
    per token the bytes read, the time and the GB/s, and decode tokens/s."""
    from tqdm import tqdm

    from ..bench import parse_formats, render, run_bench

    check_output(plot, "--plot", PLOT_SUFFIXES)
    fids = parse_formats(formats)
    with tqdm(total=len(fids), desc="bench", unit="container", leave=False, file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        def stage(fid: str, what: str) -> None:
            if what == "done":
                bar.update(1)
            else:
                bar.set_postfix_str(f"{fid}: {what}")

        def convert_bar(fid: str, total: int) -> _Progress:
            return _Progress(total, f"-> {fid}")

        result = run_bench(file, backend, fids, tokens, keep_dir=keep_dir, threads=threads,
                           repeats=repeats, i2s_variant=i2s_layout, convert_progress=convert_bar,
                           stage=stage, kv_cache=kv_cache)
    if plot is not None:
        from ..bench_plot import plot_bench

        plot_bench(result, plot)
    _show(result, render, as_json, plot)
    why = result.disagreement()
    if why is not None:  # lossless containers must agree: a bug to report, not a figure
        raise click.ClickException(f"{why}. Lossless containers give the same tokens "
                                   "(docs/model.md §2); please report this with the file.")


if __name__ == "__main__":  # pragma: no cover
    main()
