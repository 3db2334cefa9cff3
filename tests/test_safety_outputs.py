"""An invocation never writes a file it reads, and a commit is all or nothing (issue 9, items 1-2).

Each scenario is what a careless user (or a hostile folder) does; inputs are hashed before and
after. The kill tests SIGKILL a process that keeps rewriting over one output pair at spread
moments, and check after every kill that the output path holds a consistent pair: the old one
or the new one, never a mix.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from _safety_helpers import INTERRUPTIBLE, PY, cli, digest, dql_model, one_error_line
from conftest import assert_bitwise_equal, run

import onnx_qrewrite
from onnx_qrewrite import UsageError
from onnx_qrewrite.io import outputs

X = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if outputs.TEMP_MARK in p.name)


def _weights(model_path: Path) -> bytes:
    model = onnx.load(model_path)  # loads the external data too: fails on a missing/short file
    return next(t for t in model.graph.initializer if t.name == "w").raw_data


# -- item 1: never write a file the invocation reads ------------------------------------------


def test_rename_then_rewrite_over_the_old_name_keeps_the_inputs_weights(tmp_path):
    """mv m.onnx o.onnx; rewrite o.onnx -o m.onnx: o.onnx still references m.onnx.data."""
    model = dql_model(tmp_path)
    expected = run(model, {"x": X})["y"]
    os.rename(model, tmp_path / "o.onnx")
    before = digest(tmp_path)
    proc = cli("rewrite", tmp_path / "o.onnx", "-o", tmp_path / "model.onnx")
    assert proc.returncode == 0, proc.stderr
    after = digest(tmp_path)
    assert {k: after[k] for k in before} == before  # o.onnx and model.onnx.data untouched
    assert "model.onnx.1.data" in after  # the output's weights went to a name no file had
    assert_bitwise_equal(run(tmp_path / "o.onnx", {"x": X})["y"], expected, "input still runs")
    assert_bitwise_equal(run(tmp_path / "model.onnx", {"x": X})["y"], expected, "output runs")


@pytest.mark.parametrize(
    "target",
    ["data", "data-hardlink", "data-symlink", "model-hardlink", "model-symlink"],
)
def test_output_model_onto_a_file_the_input_reads_is_refused(tmp_path, target):
    model = dql_model(tmp_path / "m")
    m = model.parent
    out = {
        "data": m / "model.onnx.data",
        "data-hardlink": tmp_path / "h.onnx",
        "data-symlink": tmp_path / "s.onnx",
        "model-hardlink": tmp_path / "hm.onnx",
        "model-symlink": tmp_path / "sm.onnx",
    }[target]
    if target == "data-hardlink":
        os.link(m / "model.onnx.data", out)
    elif target == "data-symlink":
        os.symlink(m / "model.onnx.data", out)
    elif target == "model-hardlink":
        os.link(model, out)
    elif target == "model-symlink":
        os.symlink(model, out)
    before = digest(tmp_path)
    proc = cli("rewrite", model, "-o", out)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert str(out) in line and "refusing to overwrite the input" in line
    assert digest(tmp_path) == before


@pytest.mark.parametrize("option", ["--report", "--junit", "--save-inputs"])
@pytest.mark.parametrize("victim", ["input", "input-data", "input-data-hardlink", "output", "output-data"])
def test_reports_onto_models_or_their_data_are_refused(tmp_path, option, victim):
    model = dql_model(tmp_path / "m")
    out = tmp_path / "o.onnx"
    link = tmp_path / "link.json"
    if victim == "input-data-hardlink":
        os.link(model.parent / "model.onnx.data", link)
    path = {
        "input": model,
        "input-data": model.parent / "model.onnx.data",
        "input-data-hardlink": link,
        "output": out,
        "output-data": tmp_path / "o.onnx.data",
    }[victim]
    before = digest(tmp_path)
    # Refused before any work: in this process (tests/_cli_helpers.py), as the real program answers.
    proc = cli_in_process("rewrite", model, "-o", out, "--verify", option, path, "--samples", "1", "--no-battery")
    assert proc.returncode == 2, proc.stderr
    assert option in one_error_line(proc)
    assert digest(tmp_path) == before


def test_verify_reports_onto_its_models_are_refused(tmp_path):
    model = dql_model(tmp_path / "m")
    before = digest(tmp_path)
    for option in ("--report", "--junit", "--save-inputs"):
        proc = cli_in_process("verify", model, model, option, model.parent / "model.onnx.data")
        assert proc.returncode == 2 and "refusing to overwrite the input" in one_error_line(proc)
    proc = cli_in_process("verify", model, model, "--report", tmp_path / "r", "--junit", tmp_path / "r")
    assert proc.returncode == 2 and "is also given to" in one_error_line(proc)
    assert digest(tmp_path) == before


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_outputs_go_only_to_regular_files_or_new_paths(tmp_path, kind):
    model = dql_model(tmp_path / "m")
    target = tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target = Path("/dev/null")
    for args in (["-o", target], ["-o", tmp_path / "o.onnx", "--report", target]):
        proc = cli("rewrite", model, *args, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "regular files or new paths" in one_error_line(proc)
    assert not (tmp_path / "o.onnx").exists()


def test_report_is_not_written_when_the_model_is_refused(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    proc = cli("rewrite", bad, "-o", tmp_path / "o.onnx", "--report", tmp_path / "r.json")
    assert proc.returncode == 3, proc.stderr
    one_error_line(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]


def test_api_save_onto_the_inputs_files_is_refused(tmp_path):
    model = dql_model(tmp_path)
    result = onnx_qrewrite.rewrite(model)
    before = digest(tmp_path)
    os.link(tmp_path / "model.onnx.data", tmp_path / "alias")
    for target in (model, tmp_path / "model.onnx.data", tmp_path / "alias"):
        with pytest.raises(UsageError, match="refusing to overwrite the input"):
            result.save(target)
    (tmp_path / "alias").unlink()
    assert digest(tmp_path) == before


# -- item 2: all or nothing -------------------------------------------------------------------


def test_overwriting_an_output_pair_replaces_it_and_removes_the_old_data(tmp_path):
    a, b = dql_model(tmp_path / "a", seed=1), dql_model(tmp_path / "b", seed=2)
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    names = []
    for src in (a, b, a, b):
        info = onnx_qrewrite.rewrite(src).save(out)
        names.append(info.data_path.name)
        assert _weights(out) == _weights(src)
        assert sorted(p.name for p in out.parent.iterdir()) == sorted(["o.onnx", info.data_path.name])
    assert names == ["o.onnx.data", "o.onnx.1.data", "o.onnx.data", "o.onnx.1.data"]


def test_a_dead_processs_leftovers_are_removed_by_the_next_write(tmp_path):
    model = dql_model(tmp_path / "m")
    out = tmp_path / "o.onnx"
    onnx_qrewrite.rewrite(model).save(out)
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    # What a SIGKILL between renaming the new data and renaming the model leaves: the commit's
    # journal, and a final-named data file that no model references; plus half-written temporaries.
    (tmp_path / f".o.onnx{outputs.TEMP_MARK}{pid}-0badf00d.journal").write_text("new o.onnx.1.data\nold o.onnx.data\n")
    (tmp_path / "o.onnx.1.data").write_bytes(b"x" * 100)
    (tmp_path / f".o.onnx{outputs.TEMP_MARK}{pid}-0badf00e.model").write_bytes(b"half a model")
    (tmp_path / f".o.onnx{outputs.TEMP_MARK}{pid}-0badf00c.data").write_bytes(b"half the weights")
    alive = tmp_path / f".r.json{outputs.TEMP_MARK}{os.getpid()}-0badf00f.part"
    alive.write_bytes(b"a live process's temporary")
    removed = outputs.clean_leftovers(tmp_path)
    assert "o.onnx.1.data" in removed and "o.onnx.data" not in removed  # o.onnx references .data
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m", "o.onnx", "o.onnx.data", alive.name])
    assert _weights(out) == _weights(model)
    alive.unlink()
    onnx_qrewrite.rewrite(model).save(out)  # the next write cleans up the same way, by itself
    assert _temps(tmp_path) == []


_CHILD = r"""
import sys
import onnx_qrewrite
a, b, out = sys.argv[1:4]
results = [onnx_qrewrite.rewrite(a), onnx_qrewrite.rewrite(b)]
print("ready", flush=True)
i = 0
while True:
    results[i % 2].save(out)
    i += 1
    print("saved", flush=True)
"""


def test_sigkill_at_any_moment_leaves_the_old_pair_or_the_new_one(tmp_path):
    """A child keeps saving two different models (4 MiB of weights each) over one output pair; it
    is SIGKILLed at spread moments; after each kill the output loads with one model's weights
    exactly, and the next write removes the dead child's leftovers."""
    a = dql_model(tmp_path / "a", weight_bytes=4 * 2**20, seed=1)
    b = dql_model(tmp_path / "b", weight_bytes=4 * 2**20, seed=2)
    wa, wb = _weights(a), _weights(b)
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    onnx_qrewrite.rewrite(a).save(out)
    rng = random.Random(9)
    kills = int(os.environ.get("QRW_KILLS", "10"))
    seen = {"a": 0, "b": 0}
    leftovers = 0
    for _ in range(kills):
        child = subprocess.Popen([PY, "-c", _CHILD, str(a), str(b), str(out)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        # Wait for one or two completed saves (a, then b) before the random delay: the kill then
        # lands while the other model is being saved, so both can be seen however slow a save is
        # (with a bare delay, a loaded machine killed every child inside its first save).
        for _ in range(rng.randint(1, 2)):
            assert child.stdout.readline().strip() == "saved"
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait()
        w = _weights(out)
        assert w in (wa, wb), "the output pair is a mix"
        seen["a" if w == wa else "b"] += 1
        leftovers += len(_temps(out.parent))
        # Every file besides the temporaries is the model and the data file it references.
        files = {p.name for p in out.parent.iterdir()} - set(_temps(out.parent))
        assert len(files - {"o.onnx"}) <= 2
    outputs.clean_leftovers(out.parent)
    assert _temps(out.parent) == []
    names = {p.name for p in out.parent.iterdir()}
    assert names in ({"o.onnx", "o.onnx.data"}, {"o.onnx", "o.onnx.1.data"}), names
    assert seen["a"] and seen["b"], seen  # the kills did land at different moments
    print(f"kills={kills} seen={seen} leftover temporaries={leftovers}", file=sys.stderr)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_leave_no_temporaries(tmp_path, sig):
    """Signals at growing delays into a CLI rewrite of 48 MiB of weights, until one lands after
    the run finished: exit 143/130 (or death by the signal while still importing, before any
    file exists; or 0 when it came too late), never a temporary left, the output absent or complete.
    Until one signal has landed mid-write, a run whose first temporary appears before its delay is
    over is signalled at that moment, so one always lands while the output is being written,
    however fast start-up is (a fixed step of delays can jump from "still importing" straight to
    "finished" on a quick machine: Python 3.13 did, [-2, -2, 0])."""
    model = dql_model(tmp_path / "m", weight_bytes=48 * 2**20)
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    codes = []
    delay = 0.5
    while not codes or codes[-1] != 0:
        proc = subprocess.Popen(
            [PY, "-m", "onnx_qrewrite", "rewrite", str(model), "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            **INTERRUPTIBLE,
        )
        deadline = time.monotonic() + delay
        early = 128 + sig not in codes  # until one signal has landed mid-write
        while time.monotonic() < deadline and proc.poll() is None and not (early and _temps(out.parent)):
            time.sleep(0.002)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        codes.append(proc.returncode)
        # Python's own start-up, before any code of ours runs: -sig, or for SIGINT while the
        # interpreter imports its site module, "Fatal Python error: init_import_site" and exit 1.
        starting = proc.returncode == -sig or (proc.returncode == 1 and "init_import_site" in err)
        assert proc.returncode in (0, 128 + sig) or starting, err
        if not starting:
            assert "Traceback" not in err
        assert _temps(out.parent) == [], (delay, _temps(out.parent))
        if out.exists():
            assert _weights(out) == _weights(model)
        for p in out.parent.iterdir():
            p.unlink()
        delay += 0.25
        assert len(codes) < 40, codes
    assert 128 + sig in codes, codes


def _cli_with(tmp_path: Path, patch: str, *args: str) -> subprocess.CompletedProcess:
    """The command line in a process of its own (as the console script runs it), with ``patch``
    run first: it sends the process signals at chosen points, so a race is driven, not timed."""
    script = tmp_path / "driven.py"
    script.write_text(f"import os, signal, sys\n{textwrap.dedent(patch)}\nfrom onnx_qrewrite.cli import run\nrun()\n")
    return subprocess.run([PY, str(script), *args], capture_output=True, text=True, timeout=120, **INTERRUPTIBLE)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_as_the_command_line_exits_does_not_change_its_exit(tmp_path, sig):
    """A signal landing as `_main` calls sys.exit with the command's code (what made
    test_sigterm_and_sigint_leave_no_temporaries flaky under load): the outcome is decided, so
    the process ends with that code, one line of output and no traceback. It used to raise there,
    outside every handler (a traceback and exit -2), or, landing after the handlers were given
    back, to kill the process (-15)."""
    done = _cli_with(
        tmp_path,
        f"""
        real_exit = sys.exit
        def exit_signalled(code=None):
            os.kill(os.getpid(), {int(sig)})  # delivered before kill returns: its handler runs here
            real_exit(code)
        sys.exit = exit_signalled
        """,
        "targets",
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and "tensorrt" in done.stdout


def test_a_second_signal_while_the_first_is_handled_is_ignored(tmp_path):
    """SIGINT in the command, then SIGTERM while its temporaries are being removed: exit 130 with
    the one line SIGINT gives, not a traceback out of the handler (each used to raise)."""
    done = _cli_with(
        tmp_path,
        """
        import click
        import onnx_qrewrite.io.outputs as outputs
        real_invoke, real_remove = click.Group.invoke, outputs.remove_registered_temps
        def invoke_interrupted(self, ctx):
            os.kill(os.getpid(), signal.SIGINT)  # lands in the command
            return real_invoke(self, ctx)
        def remove_terminated():
            os.kill(os.getpid(), signal.SIGTERM)  # lands while the interruption is handled
            real_remove()
        click.Group.invoke, outputs.remove_registered_temps = invoke_interrupted, remove_terminated
        """,
        "targets",
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "onnx-qrewrite: interrupted\n" and done.stdout == ""


def test_a_trailing_slash_names_a_new_output_folder(tmp_path):
    """The clash check runs before the output folder is created, and the folder still is."""
    model = dql_model(tmp_path / "m")
    proc = cli("rewrite", model, "-o", f"{tmp_path / 'new'}/")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["model.onnx", "model.onnx.data"]


def _run_beside(script: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with its own folder on the path (the modules it imports are written there)."""
    path = os.pathsep.join(filter(None, [str(script.parent), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [PY, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": path},
        **INTERRUPTIBLE,
    )


def test_an_interrupt_waits_for_the_module_being_imported(tmp_path):
    """SIGINT landing while a module's body runs, or a native module initialises, is held until
    the import is complete (half-made modules broke: exit 5, and a SIGSEGV in onnx's C++ module),
    then raised as usual; outside imports, and once the handlers are given back, it is not held."""
    (tmp_path / "slow_module.py").write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            os.kill(os.getpid(), signal.SIGINT)  # lands while this body runs
            sys.seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
            sys.seen.append("body complete")
            """
        )
    )
    script = tmp_path / "held.py"
    script.write_text(
        textwrap.dedent(
            """
            import importlib, importlib.machinery, os, signal, sys
            from onnx_qrewrite.io import signals

            sys.seen = seen = []
            loader = importlib.machinery.ExtensionFileLoader
            create = loader.create_module

            def create_and_interrupt(self, spec):
                os.kill(os.getpid(), signal.SIGINT)  # lands while the module initialises
                seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
                return create(self, spec)

            loader.create_module = create_and_interrupt
            signals.install()
            native = next(m for m in ("_bz2", "_lzma", "_decimal", "_csv") if m not in sys.modules)
            for name in (native, "slow_module"):
                try:
                    importlib.import_module(name)
                except KeyboardInterrupt:
                    seen.append("interrupted")
                signals.uninstall()  # an interruption is raised once per install: armed again
                signals.install()
            seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
            signals.uninstall()
            seen.append(loader.create_module is create_and_interrupt)
            print(seen)
            """
        )
    )
    proc = _run_beside(script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[True, 'interrupted', True, 'body complete', 'interrupted', False, True]"


def test_a_module_imported_inside_another_is_held_by_the_outer_import_alone(tmp_path):
    """Modules a module's body imports run inside the outer hold: SIGINT landing in the inner body
    waits for the outer body to complete, and only the outermost load blocks and restores the mask
    (two calls of signal.pthread_sigmask for the two modules, not four: every nested load paid two
    system calls and an enum per signal in the masks returned)."""
    package = tmp_path / "outer_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import sys\nfrom outer_pkg import inner\nsys.seen.append('outer complete')\n")
    (package / "inner.py").write_text(
        textwrap.dedent(
            """
            import _signal, os, signal, sys
            os.kill(os.getpid(), signal.SIGINT)  # lands while this body runs
            sys.seen.append(signal.SIGINT in _signal.pthread_sigmask(signal.SIG_BLOCK, []))
            sys.seen.append("inner complete")
            """
        )
    )
    script = tmp_path / "nested.py"
    script.write_text(
        textwrap.dedent(
            """
            import signal, sys
            from onnx_qrewrite.io import signals

            sys.seen = seen = []
            calls = []
            mask = signal.pthread_sigmask

            def counted(how, sigs):
                calls.append(how)
                return mask(how, sigs)

            signals.install()
            signal.pthread_sigmask = counted
            try:
                import outer_pkg
            except KeyboardInterrupt:
                seen.append("interrupted")
            signal.pthread_sigmask = mask
            seen.append(len(calls))
            seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
            signals.uninstall()
            print(seen)
            """
        )
    )
    proc = _run_beside(script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[True, 'inner complete', 'outer complete', 'interrupted', 2, False]"
