"""Every exception bitformat raises, and nothing else.

Each class also inherits the builtin a caller would naturally catch (``ValueError`` for bad
data, ``OSError`` for I/O problems), so library users need not import this module to handle
errors. ``cli/main.py`` is the one place that turns these into messages and exit codes.
"""

from __future__ import annotations


class BitformatError(Exception):
    """Base class of every error bitformat raises on purpose."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        self.path = path
        self.tensor = tensor
        self.problem = message
        where = []
        if path is not None:
            where.append(str(path))
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        prefix = ": ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class FormatError(BitformatError, ValueError):
    """A file does not follow the container format it claims (base of all reader errors)."""


class BadMagicError(FormatError):
    """The file does not start with the GGUF magic bytes."""


class UnsupportedVersionError(FormatError):
    """The GGUF version is not 3 (or 2, read for compatibility)."""


class TruncatedError(FormatError):
    """The file ends before the header or a tensor's data does."""


class CountTooLargeError(FormatError):
    """A count or length in the header is larger than the bytes that remain."""


class TensorLayoutError(FormatError):
    """Tensor data regions overlap, are misaligned or lie outside the file."""


class UnknownTypeError(FormatError):
    """A tensor uses a GGML type, or a metadata value a type, that bitformat does not know."""


class InvalidTritError(FormatError):
    """A ternary tensor holds the code 3 (or another value outside {-1, 0, +1})."""


class InvalidScaleError(FormatError):
    """A scale is NaN, infinite or otherwise unusable."""


class ShapeError(FormatError):
    """A tensor's shape does not fit the encoding (rows not divisible into blocks, ...)."""


class MetadataError(FormatError):
    """Required metadata is missing or has the wrong type."""


class MissingTensorError(MetadataError, KeyError):
    """A tensor the model needs is not in the file (also a ``KeyError``, as a dict lookup)."""

    __str__ = BaseException.__str__


class ScaleLossError(BitformatError, ValueError):
    """The target container cannot hold the source's scales exactly."""


class UnsupportedConversionError(BitformatError, ValueError):
    """A requested conversion or option is not possible for this input."""


class RequestError(BitformatError, ValueError):
    """A request to run a model cannot be served (prompt too long, token id outside the
    vocabulary, unknown backend, bad sampling parameters)."""


class ChatTemplateError(RequestError):
    """A model's chat template is not valid Jinja, fails to render, or refuses the conversation
    (``raise_exception`` in the template, e.g. roles that do not alternate)."""


class UnavailableError(BitformatError, RuntimeError):
    """A request cannot be taken now: the server is busy (its queue is full) or stopping."""


class GpuError(BitformatError, RuntimeError):
    """No usable GPU adapter, or a kernel failed to build or run on it."""


class BitformatIOError(BitformatError, OSError):
    """Reading or writing a file failed at the operating-system level."""


class OutputPathError(BitformatError, ValueError):
    """An output path bitformat will not write to: it is (or holds) the source, or it is a
    folder bitformat did not write."""


class Terminated(BaseException):
    """SIGTERM arrived. Raised by the CLI's signal handler so that writers clean up as they do
    for Ctrl-C (``KeyboardInterrupt``); a ``BaseException`` for the same reason."""
