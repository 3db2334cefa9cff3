"""Command-line interface: one module per subcommand under ``commands/``, registered here.

Subcommands load lazily, so ``onnx-qrewrite rules`` does not pay for importing onnxruntime. Every
error becomes one line on stderr and the exit code of the contract in :mod:`onnx_qrewrite.errors`.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from onnx_qrewrite import __version__
from onnx_qrewrite.errors import EXIT_INTERNAL, QRewriteError
from onnx_qrewrite.io import signals

__all__ = ["console", "import_numpy_without_blas_threads", "import_quietly", "main", "run"]

#: name -> "module:attribute" of the click command
SUBCOMMANDS = {
    "rewrite": "onnx_qrewrite.cli.rewrite:rewrite_command",
    "verify": "onnx_qrewrite.cli.verify:verify_command",
    "inspect": "onnx_qrewrite.cli.inspect:inspect_command",
    "rules": "onnx_qrewrite.cli.rules:rules_command",
    "targets": "onnx_qrewrite.cli.targets:targets_command",
}


#: name -> the command's short help, so that ``--help`` lists the subcommands without importing
#: them (each pulls in onnx and numpy: most of the start-up time). tests/test_startup.py checks
#: that this table says what the commands themselves say.
SHORT_HELP = {
    "inspect": "List the quantization ops in MODEL (dtypes, counts, where), the rule that would rewrite each, "
    "and the opset changes a rewrite needs.",
    "rewrite": "Rewrite MODELS with the rules and write them to OUTPUT.",
    "rules": "List the available rules: id, what it matches, what it emits.",
    "targets": "List the targets (rules/targets/*.toml): id, runtime version, how verdicts are proven, "
    "and the `verify --runtime` that runs it here.",
    "verify": "Run ORIGINAL and REWRITTEN in onnxruntime on the same inputs and compare every output.",
}


def _shortened(text: str, limit: int) -> str:
    """``text`` cut at a word to fit ``limit`` characters, with "..." (as click shortens help; its
    own helper for that is deprecated)."""
    if len(text) <= limit:
        return text
    return text[: max(limit - 3, 0)].rsplit(" ", 1)[0] + "..."


#: ``own_process``: :func:`run` started the command in a process of its own (the console script,
#: ``python -m onnx_qrewrite``), not in-process (tests, embedding); see :func:`import_quietly`.
_PROCESS = {"own_process": False}


def import_quietly(module: str) -> Any:
    """``importlib.import_module(module)``; in a process of its own (:func:`run`), with the cyclic
    garbage collector paused, then the loaded objects frozen (``gc.freeze``).

    A subcommand's module imports onnx (and with it numpy and protobuf), and ``verify`` imports
    numpy and onnxruntime: hundreds of thousands of objects that live as long as the process, and
    no garbage, which the collector, triggered by their allocations, would walk again and again
    while they load and at every full collection after: about 12 ms of ``inspect``'s CPU on a small
    model (0.235 s to 0.223 s, runs interleaved with and without it), 11 ms of ``verify``'s (the
    verifier's package, 252 ms to 241 ms at the least of 21 runs each). In-process it is a plain
    import: freezing there would keep the caller's garbage forever, and pausing alone only
    postpones the walk (it cost 10 ms more, measured so)."""
    if not _PROCESS["own_process"] or module in sys.modules:
        return importlib.import_module(module)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(module)
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


#: The variable OpenBLAS, numpy's BLAS in its wheels, reads its thread count from when it loads.
_BLAS_THREADS = "OPENBLAS_NUM_THREADS"


def import_numpy_without_blas_threads() -> None:
    """``import numpy`` (through :func:`import_quietly`) in a command's own process, with OpenBLAS
    told to start no threads of its own, unless the user set their number.

    For a command that does no matrix product (``inspect``: numpy sums and compares small
    constants, and no BLAS routine runs): OpenBLAS starts a thread per core when numpy loads, each
    of which spins waiting for work for a while before it sleeps, 10-20 ms of CPU in an ``inspect``
    of the sample MLP (its thread's time in /proc) for work that never comes. The variable is
    removed once numpy is loaded, so that nothing the command starts inherits it; in-process
    callers (tests, embedding) import numpy as they would."""
    if not _PROCESS["own_process"] or "numpy" in sys.modules or _BLAS_THREADS in os.environ:
        return
    os.environ[_BLAS_THREADS] = "1"
    try:
        import_quietly("numpy")
    finally:
        del os.environ[_BLAS_THREADS]


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's layout, from :data:`SHORT_HELP` instead of the imported commands."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = [(n, _shortened(SHORT_HELP.get(n, ""), limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            command = getattr(import_quietly(module), attr)
        except (ImportError, AttributeError):
            return None
        if not any("--quiet" in p.opts for p in command.params):
            # Every subcommand takes -v/-q after its name too, including ones added later.
            from onnx_qrewrite.cli.options import global_options

            global_options(command)
        return command

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """click's standalone mode turns an interrupt that lands outside a subcommand (while it
        parses the arguments, or after the command returned and before the process exits) into
        "Aborted!" and exit 1, which our exit codes read as "verification disagreed". Run click
        non-standalone and end the process here instead: the same exits as click's for everything
        else, and 130/143 with the one line a subcommand prints for SIGINT/SIGTERM. The SIGTERM
        handlers installed here are given back when the command ends, for in-process callers (in a
        process of its own, :func:`run`, they stay until it exits: given back, a SIGTERM landing
        as it exits would kill it instead of letting it end with its code). They are installed
        before a subcommand's module is imported: that import initialises onnx's native module,
        which an interrupt must not land in (:mod:`onnx_qrewrite.io.signals`)."""
        try:
            return self._main(args, prog_name, complete_var, standalone_mode, **extra)
        finally:
            if not _PROCESS["own_process"]:
                signals.uninstall()

    def _main(
        self,
        args: Sequence[str] | None,
        prog_name: str | None,
        complete_var: str | None,
        standalone_mode: bool,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            signals.install()
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            try:
                signals.install()  # inside the try: a signal landing as soon as it is installed is handled
                code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            finally:
                # The outcome is decided: a signal from here on is ignored (signals.py). One landing
                # before this line raises here and is the outcome (the handlers below); one landing
                # while an interruption unwinds is ignored already: none escapes them.
                signals.settle()
        except click.exceptions.Abort as exc:  # click's wrapper of KeyboardInterrupt and EOFError
            if isinstance(exc.__cause__, KeyboardInterrupt):
                _interrupted(exc.__cause__)
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except KeyboardInterrupt as exc:
            _interrupted(exc)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        # Non-standalone, click returns the command's value on success (ours return None) and the
        # code of a ctx.exit(code).
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
            return result
        except QRewriteError as exc:
            click.echo(f"onnx-qrewrite: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM (signals.Terminated)
            _interrupted(exc)
        except BrokenPipeError:
            # stdout was closed early (``onnx-qrewrite rules | head -1``): stop quietly, as other
            # command-line tools do, with the status of a process ended by SIGPIPE.
            _silence_stdout()
            ctx.exit(128 + 13)
        except Exception as exc:
            logging.getLogger("onnx_qrewrite").debug("internal error", exc_info=True)
            click.echo(
                f"onnx-qrewrite: internal error: {type(exc).__name__}: {exc} "
                "(a bug; run with -v for the traceback and please report it)",
                err=True,
            )
            ctx.exit(EXIT_INTERNAL)


def _interrupted(exc: KeyboardInterrupt) -> NoReturn:
    """SIGINT or SIGTERM (signals.Terminated): remove this run's temporaries, say so in one line,
    exit 128 + the signal number, as shells report it."""
    from onnx_qrewrite.io.outputs import remove_registered_temps

    remove_registered_temps()
    click.echo(f"onnx-qrewrite: {'terminated' if isinstance(exc, signals.Terminated) else 'interrupted'}", err=True)
    sys.exit(signals.interrupt_exit_code(exc))


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="onnx-qrewrite")
@click.option("-v", "--verbose", count=True, help="More log output (repeat for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors; no summary, no progress.")
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """Rewrite quantized ONNX models into portable standard ONNX, and prove it.

    Exit codes: 0 ok, 1 verification disagreed, 2 usage error, 3 invalid input model,
    4 a rule could not be applied, 5 internal error, 6 verify compared nothing.
    -v and -q are also accepted after the subcommand.
    """
    from onnx_qrewrite.cli.options import configure_logging

    configure_logging(verbose, quiet)
    ctx.obj = {"quiet": quiet, "verbose": verbose}


def run() -> None:
    """The command line as the ``onnx-qrewrite`` console script and ``python -m onnx_qrewrite`` run
    it (:func:`console`): :func:`main`, in a process that ends when it returns.

    Before the interpreter exits, every object still alive is moved out of the cyclic garbage
    collector's reach (``gc.freeze``). The interpreter's final collections would otherwise walk
    every object numpy, onnx and onnxruntime created at import, only to free memory the process
    is about to hand back: 40-60 ms of CPU, a sixth to a fifth of ``verify`` on the benchmark's
    tiny BERT and of ``inspect`` of a small model (runs interleaved with and without it; the
    start-up figures are ``python benchmarks/bench.py --cases verify,startup``). What that skips is the
    finalizers of objects left in reference cycles; nothing of ours needs one at exit: atexit
    handlers and ``weakref.finalize`` callbacks (temporary folders, open weight files) still run,
    the standard streams are still flushed, and every output is committed or removed before the
    command returns. In-process callers (tests, embedding) call :func:`main` and keep their
    collector as it was.

    The process being the command's own also lets the modules on ``inspect``'s path take onnx's
    message classes and extension module from onnx's files without ``import onnx``
    (:mod:`onnx_qrewrite._onnx`)."""
    from onnx_qrewrite import _onnx

    _onnx.allow_unpackaged()
    _PROCESS["own_process"] = True
    try:
        main()
    finally:
        gc.freeze()


def console() -> None:
    """The ``onnx-qrewrite`` console script and ``python -m onnx_qrewrite``: :func:`run`, then the
    process ends with the command's exit status (:func:`_end_process`) without the interpreter
    tearing down its modules, which frees numpy's, onnxruntime's and onnx's objects one by one: 26
    ms of CPU after importing the verifier (240 ms against 266 ms, the least of 21 runs each), a
    tenth of the benchmark's bare onnxruntime sessions on the tiny BERT. (:func:`run` returns to
    its caller, for harnesses that run the command line as its own process would, then go on.)"""
    try:
        run()
    except SystemExit as done:
        _end_process(done.code)
        raise


def _end_process(code: object) -> None:
    """End the process now with exit status ``code`` (None: 0), as the interpreter's exit would
    but without freeing every module's objects first: the atexit handlers run (logging's flush,
    ``weakref.finalize`` callbacks: temporary folders, open weight files), the standard streams are
    flushed, then ``os._exit``. What that skips is the modules' teardown: the objects still alive
    are freed by the process ending, and nothing of ours writes in a finalizer (every output is
    committed or removed before the command returns). Returns, for the interpreter's own exit,
    where that could differ: a status that is not a number (printed by the interpreter), a thread
    it would wait for, a stream that cannot be flushed (a closed pipe: the interpreter says so and
    exits 120)."""
    if code is not None and not isinstance(code, int):
        return
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # as the interpreter runs them at exit; they are cleared after
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        return
    os._exit(code or 0)


if __name__ == "__main__":  # pragma: no cover
    console()
