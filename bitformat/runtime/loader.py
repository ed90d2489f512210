"""``load(path, backend)``: an opened container, ready to generate.

>>> m = load("model.gguf", backend="cpu")                          # doctest: +SKIP
>>> for r in m.stream_generate("The capital of France is", max_new_tokens=16):   # doctest: +SKIP
...     print(r.text, end="", flush=True)
>>> m.last_stats.generation_tps                                     # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..constants import DEFAULT_KV_TYPE
from ..container import open_model, require_ternary
from ..errors import BitformatError, MetadataError, RequestError
from ..io.model import Model
from ..validate import model_args, validate_model
from .backend import Backend
from .generate import (
    GenerationResponse,
    GenerationResult,
    GenerationStats,
    collect,
    stream_generate,
)
from .head import HEAD_MODES, Head
from .kvquant import check_kv_type
from .models import ModelArgs, Segment, model_class
from .sampling import Sampler

BACKENDS = ("numpy", "cpu", "wgpu")


def resolve_head(head: str, backend: Backend) -> str:
    """The head mode "auto" stands for on ``backend``: "full" on the wgpu backend with a real
    GPU (its screen sends the hidden state to the host and the integer sums back every step,
    which costs more than the bytes save: 79-126 against 383-404 tokens/s on an NVIDIA H200,
    docs/benchmarks.md), "screened" elsewhere (the cpu backend, and CPU adapters such as
    lavapipe, where the head's bytes dominate). Other modes pass through."""
    if head != "auto":
        return head
    return "full" if backend.name == "wgpu" and not backend.dev.is_cpu else "screened"


class LoadedModel:
    """A model on a backend, with its tokenizer (None if the file has none).

    Attributes: ``args`` (:class:`ModelArgs`), ``net`` (a :class:`~.models.Transformer`),
    ``backend``,
    ``tokenizer``, ``container`` (the format id of its ternary tensors),
    ``weight_bytes_per_token`` and ``last_stats`` (the last generation's timings).
    """

    def __init__(self, container: Model, backend: Backend, args: ModelArgs, tokenizer: Any, *,
                 progress: Callable[[int, int], None] | None = None, head: str = "auto",
                 kv_type: str = DEFAULT_KV_TYPE):
        self.container_model = container
        self.backend = backend
        self.args = args
        self.net = None
        head = resolve_head(head, backend)
        if backend.name == "wgpu" and backend.dev.subgroups:
            # every family's whole step on the device, one command buffer a token (a device
            # without subgroup operations, or a q8_0 cache, runs the shared graph op by op)
            from .wgpu.network import KV_ROUND, WgpuBitNet

            if kv_type in KV_ROUND:
                self.net = WgpuBitNet(args, backend, progress=progress, head=head,
                                      kv_type=kv_type)
        if self.net is None:
            self.net = model_class(args)(args, backend, progress=progress, head=head)
            self.net.kv_type = kv_type
        self.tokenizer = tokenizer
        self.container = container.container
        # A decode step reads every ternary matrix, the norms and the whole LM head once: in
        # the container's bytes, or in what the backend decoded them into at load.
        self.weight_bytes_per_token = backend.weight_bytes_per_token or sum(
            e.plain_nbytes for e in container.entries)
        self.load_seconds = 0.0
        self.last_stats = GenerationStats(weight_bytes_per_token=self.weight_bytes_per_token)

    def encode(self, prompt: str | Sequence[int], *, chat: bool = False,
               system: str | None = None) -> list[int]:
        """Token ids of a prompt (``chat``: as one user turn of the chat template, after the
        ``system`` prompt if given)."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: pass token ids")
        try:
            if chat:
                head = [{"role": "system", "content": system}] if system else []
                text = self.tokenizer.apply_chat_template(
                    head + [{"role": "user", "content": prompt}])
                return self.tokenizer.encode(text, add_bos=False)
            return self.tokenizer.encode(prompt)
        except MetadataError as exc:  # the file's chat template fails: name the file
            if exc.path is not None:
                raise
            raise MetadataError(exc.problem, path=self.container_model.path) from None

    def stream_generate(self, prompt: str | Sequence[int], max_new_tokens: int = 256, *,
                        chat: bool = False, system: str | None = None, **sampling
                        ) -> Iterator[GenerationResponse]:
        """Yield :class:`GenerationResponse` pieces; see :func:`.generate.stream_generate`.
        ``chat``/``system``: wrap the prompt in the chat template (:meth:`encode`).
        ``head_stats()`` then describes what the head read over this generation."""
        ids = self.encode(prompt, chat=chat, system=system)
        self.head.reset_stats()
        for r in stream_generate(self.net, self.tokenizer, ids, max_new_tokens=max_new_tokens,
                                 weight_bytes=self.weight_bytes_per_token, **sampling):
            self.last_stats = r.stats
            yield r

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 256, **kwargs
                 ) -> GenerationResult:
        """The whole answer: text, token ids, finish reason and stats."""
        return collect(self.stream_generate(prompt, max_new_tokens, **kwargs))

    @property
    def head(self) -> Head:
        """The LM head the model chooses tokens with (:class:`.head.Head`)."""
        return self.net.head

    def head_stats(self) -> dict[str, Any]:
        """The head mode and what it did since the last generation started: candidates
        rescored per step (mean, max), fallbacks to the full head (reason -> rows), and the
        bytes a decode step read (``bytes_read_per_token``: the ternary matrices, norms, the
        head's screen and candidate rows, and the last step's KV cache)."""
        d = self.head.stats.as_dict()
        rest = self.weight_bytes_per_token - self.head.full_bytes
        d["bytes_read_per_token"] = int(rest + d["head_bytes_per_step"]
                                        + self.last_stats.kv_bytes_last_token)
        return d

    def prepare_head(self) -> None:
        """Run the head's choice once on a made-up hidden state (the screened head's kernels
        compile on their first call): what a cold start compiles here while a helper process
        compiles the layers (:func:`.warmup.start_helper`)."""
        if self.backend.name == "numpy":
            return
        h = np.random.default_rng(0).standard_normal((1, self.args.dim)).astype(np.float32)
        self.net.head.select(h, [Sampler()])
        self.net.head.reset_stats()

    def warmup(self, parts: Sequence[str] = ("prompt", "step", "long", "batch")) -> float:
        """Run every kind of step once on a throw-away cache and return the seconds it took.

        ``parts``: "prompt", an 18-token prompt (longer than the rans kernels'
        one-token-at-a-time limit and the cpu backend's batch kernels' 16 rows) and a 2-token
        step (a batched decode step's kernels); "step", one decode step, also through the
        device's own argmax where there is one, and the head as a token is chosen; "long",
        the cpu backend's attention shared among threads, for prompts and for steps past 64
        positions (until it is compiled they run a token at a time on one thread, with the
        same bits); "batch", a
        decode step of two requests at once (the server's batched step, in one call on the
        cpu backend: about 18 s to compile on a 2-core AMD EPYC). The first
        run of a kernel compiles it (numba, on the cpu backend, once per machine, then read
        from numba's cache: docs/benchmarks.md, "First run") or builds its pipeline (wgpu).
        Timings taken afterwards measure the model, not the compiler. The numpy backend has
        nothing to prepare.
        """
        t0 = time.perf_counter()
        if self.backend.name == "numpy":
            return 0.0
        prompt = [0] * 18
        cache = self.net.new_cache(len(prompt) + 5)
        if "prompt" in parts:
            self.net.forward(prompt, cache)
            self.net.forward(prompt[:2], cache)
        if "step" in parts:
            self.net.forward(prompt[:1], cache)
            if hasattr(self.net, "forward_argmax"):
                self.net.forward_argmax(prompt[:1], cache)
            # the head as a token is chosen (the screened head's kernels; wgpu: its upload)
            self.net.decode([Segment(prompt[:1], cache)], [Sampler()])
        warm = self.backend.warm_attention
        if "long" in parts and warm is not None:
            warm(self.net.kv_type)
        if "batch" in parts and self.backend.name == "cpu":
            caches = [self.net.new_cache(2) for _ in range(2)]
            self.net.decode([Segment([0], c) for c in caches], [Sampler(), Sampler()])
        return time.perf_counter() - t0

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits ``[T, vocab]`` of every position, recomputed from scratch (no cache reuse)."""
        return self.net.forward(tokens, self.net.new_cache(len(tokens)), all_logits=True)

    def close(self) -> None:
        self.container_model.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(path: str | os.PathLike, backend: str = "cpu", *, dtype: str = "float32",
         threads: int | None = None, i2s_variant: str = "x86", validate: bool = True,
         decode: str = "load", progress: Callable[[int, int], None] | None = None,
         head: str = "auto", kv_cache: str = DEFAULT_KV_TYPE) -> LoadedModel:
    """Open a ternary model (any container, or an HF folder) of any family on ``backend``.

    ``backend``: "cpu" (numba kernels, float32), "numpy" (the reference; ``dtype``
    "float32" or "float64") or "wgpu" (the whole model on a GPU through wgpu: Vulkan, Metal,
    D3D12, or Mesa's lavapipe on a CPU; docs/gpu.md). ``threads`` fixes the cpu backend's
    thread count; by default it switches between one thread and all cores, whichever streams
    faster (see
    :class:`~.cpu.backend.ThreadPicker`). ``validate`` (cpu) reads every ternary
    matrix once with its format's checks; the numpy backend checks on every use anyway.
    ``decode`` (rans containers, cpu and wgpu): "load" decodes the rANS streams once at load
    into 2-bit rows that the fastest kernels read; "fused" decodes them inside every mat-vec
    (fewer bytes held and read, several times slower). A coded LM head is decoded into f16
    at load either way. ``head``: "screened" (the full head's exact tokens from an int8 screen
    of the head and the rows it cannot rule out, docs/exact-head.md), "full" (every logit,
    every step) or "auto" (the default, :func:`resolve_head`: full on a GPU, screened
    elsewhere); on the wgpu backend the screen and the candidate rows run on the device (the
    int8 copy is made and uploaded on the first screened step or warmup).
    ``kv_cache``: the KV cache's type (:mod:`.kvquant`): "f16" (the default, as llama.cpp's:
    keys and values rounded to float16 as they are stored), "f32" (as computed: twice the
    bytes) or "q8_0" (llama.cpp's int8 blocks of 32 with a float16 scale, lossy: 8.5 bits a
    value; on wgpu it runs op by op). Every backend rounds the same way for the same type.
    ``LoadedModel.load_seconds`` says how long loading took.
    ``progress(layer, n_layers)`` is called as each layer's weights are ready (loading the
    2B-4T model takes seconds). Kernels compile on first use: :meth:`LoadedModel.warmup`.
    """
    if head not in ("auto", *HEAD_MODES):
        raise RequestError(f"head must be auto, {' or '.join(HEAD_MODES)}, got {head!r:.20}")
    if decode not in ("load", "fused"):
        raise RequestError(f"decode must be load or fused, got {decode!r:.20}")
    check_kv_type(kv_cache)
    t0 = time.perf_counter()
    if backend not in BACKENDS:
        raise RequestError(f"unknown backend {backend!r}; choose {' or '.join(BACKENDS)}")
    if dtype not in ("float32", "float64") or (backend != "numpy" and dtype != "float32"):
        raise RequestError(f"the {backend} backend does not run in {dtype}")
    container = open_model(path, i2s_variant=i2s_variant)
    try:
        require_ternary(container)  # a float model that is not BitNet: say so, not its shapes
        args: ModelArgs = model_args(container)
        # every tensor the architecture needs, with the shape its config implies, and config
        # values in range: the kernels below only ever see validated shapes
        validate_model(container, args, values="error")
        if backend == "cpu":
            from .cpu.backend import CpuBackend

            be: Backend = CpuBackend(container, i2s_variant=i2s_variant, threads=threads,
                                     validate=validate, decode=decode)
        elif backend == "wgpu":
            from .wgpu.backend import WgpuBackend

            be = WgpuBackend(container, i2s_variant=i2s_variant, validate=validate,
                             decode=decode)
        else:
            from .numpy_backend import NumpyBackend

            be = NumpyBackend(container, dtype=getattr(np, dtype), i2s_variant=i2s_variant)
        tokenizer = None
        if "tokenizer.ggml.tokens" in container.metadata:
            from ..tokenizers.bpe import Tokenizer

            try:
                tokenizer = Tokenizer(container.metadata)
            except BitformatError as exc:
                if exc.path is not None:
                    raise
                raise type(exc)(exc.problem, path=str(path), tensor=exc.tensor) from None
        loaded = LoadedModel(container, be, args, tokenizer, progress=progress, head=head,
                             kv_type=kv_cache)
        loaded.load_seconds = time.perf_counter() - t0
        return loaded
    except BaseException:
        container.close()
        raise
