"""Start-up: importing the package, ``--help`` and ``rules`` load neither onnx nor numpy (the
catalogue is validated against the builders' declared contracts, builders/contracts.py, without
importing their code), and the help text the command line prints without importing the
subcommands is the one they carry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from onnx_qrewrite import cli

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


def _modules_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.strip().splitlines()[-1].split())


def test_importing_the_package_loads_no_onnx_or_numpy():
    loaded = _modules_after("import onnx_qrewrite")
    assert "onnx" not in loaded and "numpy" not in loaded and "onnxruntime" not in loaded


def test_help_loads_no_subcommand_and_no_onnx():
    loaded = _modules_after(
        "from onnx_qrewrite.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    )
    assert "onnx" not in loaded and "numpy" not in loaded
    assert not any(m.startswith("onnx_qrewrite.cli.") for m in loaded)


def test_rules_loads_no_onnx_numpy_or_builder_code():
    loaded = _modules_after(
        "from onnx_qrewrite.cli import main\n"
        "for args in (['rules'], ['rules', '--long']):\n"
        "    try:\n        main(args)\n    except SystemExit:\n        pass"
    )
    assert "onnx_qrewrite.rewriter.catalogue" in loaded  # it did list the rules
    assert "onnx" not in loaded and "numpy" not in loaded
    assert "difflib" not in loaded  # only a bad rule file needs its suggestions
    builder_code = {m for m in loaded if m.startswith("onnx_qrewrite.rewriter.builders.")}
    assert builder_code == {"onnx_qrewrite.rewriter.builders.contracts"}


def _console_modules(tmp_path, *args: str) -> set[str]:
    """The modules loaded once the console script's :func:`cli.console` ran ``args`` (exit 0),
    listed by an atexit handler: it ends the process itself (``cli._end_process``)."""
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(' '.join(sorted(sys.modules))))\n"
        f"sys.argv = ['onnx-qrewrite', *{list(args)!r}]\n"
        "from onnx_qrewrite.cli import console\n"
        "console()"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.strip().splitlines()[-1].split())


def test_console_inspect_and_verify_of_a_plain_model_import_no_onnx(tmp_path):
    """``inspect`` reads the model with onnx's message classes and checker, loaded without
    ``import onnx`` (onnx_qrewrite/_onnx.py), and ``verify`` needs neither: ``import onnx`` would
    be a quarter of ``polygraphy --help`` on top of either (benchmarks/bench.py --cases startup)."""
    from onnx_qrewrite.cli import main

    model = SAMPLES / "dynamic_mlp.onnx"
    loaded = _console_modules(tmp_path, "inspect", str(model))
    assert "onnx" not in loaded and "ml_dtypes" not in loaded
    assert "onnx.onnx_cpp2py_export" in loaded  # onnx's checker did run
    rewritten = tmp_path / "out.onnx"
    try:
        main(["-q", "rewrite", str(model), "-o", str(rewritten)])
    except SystemExit as exc:
        assert not exc.code
    inputs = str(SAMPLES / "dynamic_mlp.inputs.npz")
    loaded = _console_modules(tmp_path, "verify", str(model), str(rewritten), "--inputs", inputs)
    assert "onnxruntime" in loaded and "onnx" not in loaded and "onnx.onnx_cpp2py_export" not in loaded


def test_a_plain_rewrite_loads_no_target_machinery(tmp_path):
    """Without ``--target`` a rewrite needs of the targets' code only the IR table (the IR its
    provenance needs, rewriter/ir_table.py): importing anything under onnx_qrewrite.targets would
    load its profiles, planner and shape inference (~30 ms of CPU) on every rewrite."""
    model = SAMPLES / "dynamic_mlp.onnx"
    loaded = _console_modules(tmp_path, "-q", "rewrite", str(model), "-o", str(tmp_path / "out.onnx"))
    assert "onnx_qrewrite.rewriter.ir_table" in loaded  # the provenance's IR was asked for
    assert not any(m == "onnx_qrewrite.targets" or m.startswith("onnx_qrewrite.targets.") for m in loaded)


def test_a_builder_module_is_imported_when_its_rule_is_applied():
    loaded = _modules_after(
        "from onnx_qrewrite.rewriter import builders\n"
        "assert builders.contract_of('qoperator_to_qdq') is not None\n"
        "import sys\n"
        "assert 'onnx_qrewrite.rewriter.builders.qoperator' not in sys.modules\n"
        "assert builders.get_builder('qoperator_to_qdq').contract is builders.contract_of('qoperator_to_qdq')"
    )
    assert "onnx_qrewrite.rewriter.builders.qoperator" in loaded
    assert "onnx_qrewrite.rewriter.builders.matmul_nbits" not in loaded


def test_the_lazy_api_is_the_api():
    import onnx_qrewrite
    from onnx_qrewrite import api

    assert onnx_qrewrite.rewrite is api.rewrite and onnx_qrewrite.RewriteResult is api.RewriteResult
    assert "rewrite" in dir(onnx_qrewrite)


def test_short_help_table_matches_the_commands():
    ctx = click.Context(cli.main)
    assert set(cli.SHORT_HELP) == set(cli.SUBCOMMANDS)
    for name in cli.SUBCOMMANDS:
        command = cli.main.get_command(ctx, name)
        assert command is not None
        assert command.get_short_help_str(limit=1000) == cli.SHORT_HELP[name], name


def test_the_precomputed_varint_table_is_the_encoding():
    """_wire builds its table of short length prefixes cheaply at import; it must be exactly what
    the encoder computes."""
    from onnx_qrewrite.io._wire import SMALL_VARINTS, varint

    assert [varint(n) for n in range(1 << 14)] == SMALL_VARINTS


def test_verifying_one_pair_starts_no_worker_machinery(tmp_path):
    """``verify A B`` does not import the worker pool (multiprocessing) that ``--rewritten-dir``
    with ``-j`` uses."""
    from pathlib import Path

    import onnx_qrewrite

    model = Path(__file__).resolve().parent.parent / "sample_models" / "dynamic_mlp.onnx"
    out = tmp_path / "mlp.portable.onnx"
    onnx_qrewrite.rewrite(str(model)).save(str(out))
    loaded = _modules_after(
        "from onnx_qrewrite.cli import main\n"
        f"try:\n    main(['-q', 'verify', {str(model)!r}, {str(out)!r}])\n"
        "except SystemExit as exit:\n    assert not exit.code, exit.code"
    )
    assert "onnx_qrewrite.verify" in loaded and "onnxruntime" in loaded  # it did verify
    assert "onnx_qrewrite.cli.batch" not in loaded and "multiprocessing" not in loaded


def test_inspect_and_rewrite_start_no_process(tmp_path):
    """Neither command runs a helper program: giving memory back to the system looks
    ``malloc_trim`` up in the loaded symbols, where ``ctypes.util.find_library`` would run
    ``ldconfig`` in a subprocess on every start."""
    from pathlib import Path

    model = Path(__file__).resolve().parent.parent / "sample_models" / "dynamic_mlp.onnx"
    out = tmp_path / "mlp.portable.onnx"
    code = (
        "import sys\n"
        "spawned = []\n"
        "sys.addaudithook(lambda event, args: spawned.append(event) if event in "
        "('subprocess.Popen', 'os.posix_spawn', 'os.fork', 'os.exec') else None)\n"
        "from onnx_qrewrite.cli import main\n"
        f"for args in (['inspect', {str(model)!r}], ['-q', 'rewrite', {str(model)!r}, '-o', {str(out)!r}]):\n"
        "    try:\n        main(args)\n    except SystemExit as exit:\n        assert not exit.code, exit.code\n"
        "assert not spawned, spawned\n"
        "print('engine ran:', 'onnx_qrewrite.rewriter.engine' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("engine ran: True")
    assert out.exists()


def test_verify_reads_the_models_for_the_clash_check_only_when_it_writes(tmp_path, monkeypatch):
    """The clash check finds the external data the models reference by reading every model file
    once more; a ``verify`` that writes nothing skips it (it could refuse nothing), one that writes
    a report still makes it."""
    from pathlib import Path

    import pytest

    import onnx_qrewrite
    from onnx_qrewrite.cli import verify as verify_cli

    model = Path(__file__).resolve().parent.parent / "sample_models" / "dynamic_mlp.onnx"
    out = tmp_path / "mlp.portable.onnx"
    onnx_qrewrite.rewrite(str(model)).save(str(out))
    scanned: list[str] = []
    real = verify_cli.model_reads

    def spy(path):
        scanned.append(str(path))
        return real(path)

    monkeypatch.setattr(verify_cli, "model_reads", spy)
    with pytest.raises(SystemExit) as exit:
        cli.main(["-q", "verify", str(model), str(out)])
    assert exit.value.code == 0 and scanned == []
    with pytest.raises(SystemExit) as exit:
        cli.main(["-q", "verify", str(model), str(out), "--report", str(tmp_path / "report.json")])
    assert exit.value.code == 0 and scanned == [str(model), str(out)]
    with pytest.raises(SystemExit) as exit:
        cli.main(["-q", "verify", str(model), str(out), "--report", str(model)])
    assert exit.value.code == 2


def _gc_state_after(code: str) -> str:
    """The last line ``code`` prints, run in a fresh interpreter (asserting it exits 0)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_command_in_its_own_process_leaves_the_final_collection_nothing_to_walk():
    """``python -m onnx_qrewrite`` (and the console script, ``cli.run``) freezes what is alive
    when the command ends: the interpreter's final collections then skip onnx's and numpy's
    objects. The command's output is the same."""
    from pathlib import Path

    model = Path(__file__).resolve().parent.parent / "sample_models" / "dynamic_mlp.onnx"
    code = (
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
        f"sys.argv = ['onnx-qrewrite', 'inspect', {str(model)!r}]\n"
        "runpy.run_module('onnx_qrewrite', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "quantization ops: 6 nodes" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "frozen at exit: True"


def test_in_process_callers_keep_their_garbage_collector():
    """``main`` called in-process (a test, a notebook) freezes nothing, so the caller's garbage is
    still collected, and leaves the collector on or off as the caller had it."""
    from pathlib import Path

    model = Path(__file__).resolve().parent.parent / "sample_models" / "dynamic_mlp.onnx"
    code = (
        "import gc\n"
        "from onnx_qrewrite.cli import main\n"
        f"try:\n    main(['inspect', {str(model)!r}])\n"
        "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
        "print(gc.get_freeze_count(), gc.isenabled())"
    )
    assert _gc_state_after(code) == "0 True"
    paused = "import gc\ngc.disable()\n" + code
    assert _gc_state_after(paused) == "0 False"  # a caller's own setting is kept


def test_the_verifiers_package_loads_without_collections_in_the_commands_own_process():
    """``verify`` loads numpy, onnxruntime and the verifier's package with the collector paused,
    then frozen (``cli.import_quietly``), in the command's own process: no collection walks those
    objects while they load. In-process callers import it as usual (collections run), and keep
    their collector on."""
    code = (
        "import gc, sys\n"
        "from onnx_qrewrite import cli\n"
        "cli._PROCESS['own_process'] = OWN\n"
        "runs = []\n"
        "gc.callbacks.append(lambda phase, info: runs.append(phase) if phase == 'start' else None)\n"
        "cli.import_quietly('onnx_qrewrite.verify')\n"
        "print(len(runs), gc.get_freeze_count() > 0, gc.isenabled(), 'onnxruntime' in sys.modules)"
    )
    own = _gc_state_after(code.replace("OWN", "True")).split()
    assert own == ["0", "True", "True", "True"], own
    in_process = _gc_state_after(code.replace("OWN", "False")).split()
    assert int(in_process[0]) > 0 and in_process[1:] == ["False", "True", "True"], in_process


def test_the_console_script_ends_with_the_commands_status_without_tearing_down_modules(tmp_path):
    """``cli.console`` (the console script, ``python -m onnx_qrewrite``) ends the process with the
    command's exit status once the atexit handlers ran
    and the standard streams are flushed, skipping the interpreter's teardown of every module
    (a module's object whose finalizer would print at teardown prints nothing); an error keeps
    its exit code and its one line."""
    model = SAMPLES / "dynamic_mlp.onnx"
    code = (
        "import atexit, sys\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        print('torn down')\n"
        "kept = Finalized()\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "sys.argv = ['onnx-qrewrite', *sys.argv[1:]]\n"
        "from onnx_qrewrite.cli import console\n"
        "console()"
    )
    done = subprocess.run([sys.executable, "-c", code, "rules"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "dql-expand" in done.stdout and done.stdout.rstrip().endswith("atexit ran"), done.stdout[-200:]
    assert "torn down" not in done.stdout
    bad = subprocess.run(
        [sys.executable, "-c", code, "verify", str(model), str(tmp_path / "missing.onnx")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 3, bad.stderr
    assert "missing.onnx" in bad.stderr and bad.stdout.strip() == "atexit ran", (bad.stdout, bad.stderr)
    # In-process, main returns to its caller and the interpreter's own exit tears the modules down;
    # cli.run returns too (harnesses that run the command as its process would, then go on).
    plain = code.replace("import console\nconsole()", "import main\nmain()")
    done = subprocess.run([sys.executable, "-c", plain, "rules"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "torn down" in done.stdout, done.stdout[-200:]
    returning = code.replace(
        "import console\nconsole()", "import run\ntry:\n    run()\nexcept SystemExit:\n    print('returned')"
    )
    done = subprocess.run([sys.executable, "-c", returning, "rules"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "returned\natexit ran" in done.stdout, done.stdout[-200:]


def test_inspect_loads_numpy_protobuf_and_the_engine_without_collections_in_its_own_process():
    """``inspect`` imports the catalogue, the model reader and the engine (and with them numpy,
    protobuf and onnx's message classes) through ``cli.import_quietly`` once its options are read:
    in the console script's process no collection runs while any of those modules loads (they
    did: 60-odd collections of the sample MLP's ``inspect`` ran inside them; a builder's module,
    loaded when its rule applies, is not among them). The output is unchanged."""
    model = SAMPLES / "dynamic_mlp.onnx"
    code = (
        "import gc, sys\n"
        "from onnx_qrewrite import cli\n"
        "loading = []\n"
        "def note(phase, info):\n"
        "    frame = sys._getframe(1) if phase == 'start' else None\n"
        "    while frame is not None:\n"
        "        if frame.f_code.co_name == '<module>':\n"
        "            loading.append(frame.f_code.co_filename)\n"
        "        frame = frame.f_back\n"
        "gc.callbacks.append(note)\n"
        f"sys.argv = ['onnx-qrewrite', 'inspect', {str(model)!r}]\n"
        "try:\n    cli.run()\nexcept SystemExit as exit:\n    assert not exit.code, exit.code\n"
        "print(repr(sorted(set(loading))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "quantization ops: 6 nodes" in done.stdout
    loading = eval(done.stdout.strip().splitlines()[-1])  # a list of file names, printed by repr
    heavy = ("numpy", "protobuf", "onnx_ml_pb2", "rewriter", "io")
    builders = f"{os.sep}builders{os.sep}"  # each loads when its rule applies, in the engine's run
    during = [n for n in loading if any(f"{os.sep}{part}" in n for part in heavy) and builders not in n]
    assert during == [], during


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_inspect_starts_no_blas_threads_unless_the_user_asks_for_them():
    """In the console script's process ``inspect`` loads numpy with OpenBLAS told to start no
    threads (it multiplies no matrices; the pool's threads spin for work that never comes), and
    leaves the variable unset afterwards; a user's own OPENBLAS_NUM_THREADS wins."""
    model = SAMPLES / "dynamic_mlp.onnx"
    code = (
        "import os, sys\n"
        "from onnx_qrewrite import cli\n"
        f"sys.argv = ['onnx-qrewrite', 'inspect', {str(model)!r}]\n"
        "try:\n    cli.run()\nexcept SystemExit as exit:\n    assert not exit.code, exit.code\n"
        "print(len(os.listdir('/proc/self/task')), os.environ.get('OPENBLAS_NUM_THREADS'))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    for given, expected in ((None, "1 None"), ("2", "2 2")):
        run_env = env if given is None else {**env, "OPENBLAS_NUM_THREADS": given}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, env=run_env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == expected
