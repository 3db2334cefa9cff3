"""Errors with the exit codes of the command-line contract.

Every subcommand maps outcomes to the same codes so that CI can tell "the outputs differ" from
"the tool was called wrongly" from "the model is broken":

====  ==========================================================
code  meaning
====  ==========================================================
0     success (for ``verify``: the models agree)
1     verification ran and the models disagree
2     usage error (bad option, unreadable rule file, ...)
3     invalid input model (missing, empty, corrupt, fails the checker)
4     a rule matched a node but could not be applied
5     internal error (a bug in onnx-qrewrite)
6     ``verify`` ran but compared nothing (zero-size outputs, no outputs, or the
      same file given as both models), or compared no element of some value on any
      sample (not verified: set aside as not comparable): not everything was proven
====  ==========================================================

Exit 6 follows pytest's "no tests were collected" (its exit 5, which is taken here): a run that
checked nothing must not look like a pass, and must not look like a disagreement or an error
either. When several models are processed the command exits with the *worst* code, by the
severity order of :data:`SEVERITY` (an empty verification is worse than success, better than
everything else), not the largest number.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "EXIT_CANNOT_LOWER",
    "EXIT_DISAGREE",
    "EXIT_INCONCLUSIVE",
    "EXIT_INTERNAL",
    "EXIT_INVALID_MODEL",
    "EXIT_OK",
    "EXIT_USAGE",
    "SEVERITY",
    "InternalError",
    "InvalidModelError",
    "LoweringError",
    "MissingDependencyError",
    "QRewriteError",
    "UsageError",
    "first_line",
    "worst_exit_code",
]

EXIT_OK = 0
EXIT_DISAGREE = 1
EXIT_USAGE = 2
EXIT_INVALID_MODEL = 3
EXIT_CANNOT_LOWER = 4
EXIT_INTERNAL = 5
EXIT_INCONCLUSIVE = 6

#: Exit codes from least to most severe: the order in which "the worst result" is chosen.
SEVERITY = (EXIT_OK, EXIT_INCONCLUSIVE, EXIT_DISAGREE, EXIT_USAGE, EXIT_INVALID_MODEL, EXIT_CANNOT_LOWER, EXIT_INTERNAL)


def worst_exit_code(codes: Iterable[int]) -> int:
    """The most severe of ``codes`` (0 for none); unknown codes rank as internal errors."""
    rank = {code: i for i, code in enumerate(SEVERITY)}
    return max(codes, key=lambda c: rank.get(c, len(SEVERITY)), default=EXIT_OK)


class QRewriteError(Exception):
    """Base class: the message is one line a user can act on."""

    exit_code: int = EXIT_INTERNAL


class UsageError(QRewriteError):
    """An option, rule file or argument is wrong."""

    exit_code = EXIT_USAGE


class MissingDependencyError(UsageError, ImportError):
    """An optional dependency is not installed (onnxruntime for ``verify``): the message names what
    to install. Also an ImportError, so Python callers can treat it as the missing import it is."""


#: What to install for ``verify``: one of the extras of pyproject.toml.
VERIFY_EXTRA = "pip install 'onnx-qrewrite[verify]'"


class InvalidModelError(QRewriteError):
    """The input model cannot be read or is not a valid ONNX model."""

    exit_code = EXIT_INVALID_MODEL


class LoweringError(QRewriteError):
    """A rule matched a node but cannot rewrite it (unsupported dtype, malformed node, opset)."""

    exit_code = EXIT_CANNOT_LOWER

    def __init__(self, message: str, *, node: str | None = None, rule: str | None = None):
        super().__init__(message)
        self.node = node
        self.rule = rule


class InternalError(QRewriteError):
    """A bug in onnx-qrewrite: the rewrite produced something invalid."""

    exit_code = EXIT_INTERNAL


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (C++ errors from onnx and onnxruntime run to many
    lines), or its type name when it has none: what a one-line error message can quote."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
