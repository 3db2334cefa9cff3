"""External data stays inside the model's folder, on every entry point, and the bytes checked are
the bytes used (issue 9, item 3). Written as an attacker would try it: a secret canary file sits
outside the model's folder and must never reach any output."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from _safety_helpers import CANARY, assert_no_canary, cli, digest, dql_model, one_error_line, set_location
from conftest import assert_bitwise_equal, run

import onnx_qrewrite
from onnx_qrewrite import InvalidModelError

X = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)


@pytest.fixture
def world(tmp_path):
    """tmp/secret.bin (the canary, outside), tmp/m/model.onnx + model.onnx.data, tmp/out/."""
    (tmp_path / "secret.bin").write_bytes(CANARY)
    (tmp_path / "secretdir").mkdir()
    (tmp_path / "secretdir" / "w.bin").write_bytes(CANARY)
    path = dql_model(tmp_path / "m")
    (tmp_path / "out").mkdir()
    return tmp_path, path


@pytest.fixture(autouse=True)
def _no_hang():
    """A FIFO that makes a read block must fail the test, not hang the suite."""
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("hung")))
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _escape(root: Path, model: Path, variant: str) -> str:
    """Make ``model``'s tensor 'w' read the canary through ``variant``; returns the location."""
    m = model.parent
    if variant == "dotdot":
        loc = "../secret.bin"
    elif variant == "deep-dotdot":
        (m / "sub").mkdir()
        loc = "sub/../../secret.bin"
    elif variant == "absolute":
        loc = str(root / "secret.bin")
    elif variant == "symlink-file":
        os.symlink(root / "secret.bin", m / "w.bin")
        loc = "w.bin"
    elif variant == "symlink-relative":
        os.symlink("../secret.bin", m / "w.bin")
        loc = "w.bin"
    elif variant == "symlink-dir":
        os.symlink(root / "secretdir", m / "d")
        loc = "d/w.bin"
    elif variant == "symlink-chain":
        (m / "sub").mkdir()
        os.symlink("..", m / "sub" / "up")
        loc = "sub/up/up/secret.bin"
    elif variant == "fifo":
        os.mkfifo(m / "w.bin")
        loc = "w.bin"
    elif variant == "device":
        os.symlink("/dev/zero", m / "w.bin")
        loc = "w.bin"
    else:
        raise AssertionError(variant)
    set_location(model, "w", loc, offset="0", length=str(len(CANARY)))
    return loc


VARIANTS = [
    "dotdot",
    "deep-dotdot",
    "absolute",
    "symlink-file",
    "symlink-relative",
    "symlink-dir",
    "symlink-chain",
    "fifo",
    "device",
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("entry", ["path", "proto+base_dir", "onnx_ir"])
def test_api_refuses_external_data_outside_the_model_folder(world, variant, entry):
    root, model = world
    _escape(root, model, variant)
    before = digest(root / "m")
    with pytest.raises(InvalidModelError, match="tensor 'w'") as info:
        if entry == "path":
            result = onnx_qrewrite.rewrite(model)
        elif entry == "proto+base_dir":
            result = onnx_qrewrite.rewrite(onnx.load(model, load_external_data=False), base_dir=model.parent)
        else:
            result = onnx_qrewrite.rewrite(ir.load(model))
        result.save(root / "out" / "o.onnx")
    assert "\n" not in str(info.value)
    assert list((root / "out").iterdir()) == []
    assert digest(root / "m") == before
    assert_no_canary(root / "out")


def test_onnx_ir_external_tensor_crafted_in_memory_is_contained(world):
    """An ExternalTensor built by hand (location '../secret.bin', base_dir the model's folder)."""
    root, model = world
    irm = ir.load(model)
    w = irm.graph.initializers["w"]
    w.const_value = ir.ExternalTensor(
        "../secret.bin", 0, len(CANARY), ir.DataType.UINT8, shape=ir.Shape([64, 32]), name="w", base_dir=model.parent
    )
    with pytest.raises(InvalidModelError, match=r"tensor 'w'.*outside"):
        onnx_qrewrite.rewrite(irm).save(root / "out" / "o.onnx")
    w.const_value = ir.ExternalTensor(
        str(root / "secret.bin"), 0, len(CANARY), ir.DataType.UINT8, shape=ir.Shape([64, 32]), name="w", base_dir=""
    )
    with pytest.raises(InvalidModelError, match=r"tensor 'w'.*without a base_dir"):
        onnx_qrewrite.rewrite(irm).save(root / "out" / "o.onnx")
    assert_no_canary(root / "out")


def test_model_proto_with_external_data_needs_its_folder(world):
    root, model = world
    with pytest.raises(InvalidModelError, match="pass base_dir="):
        onnx_qrewrite.rewrite(onnx.load(model, load_external_data=False))
    out = root / "out" / "o.onnx"
    onnx_qrewrite.rewrite(onnx.load(model, load_external_data=False), base_dir=model.parent).save(out)
    assert_bitwise_equal(run(out, {"x": X})["y"], run(model, {"x": X})["y"], "y")


@pytest.mark.parametrize("variant", ["dotdot", "symlink-file", "fifo"])
def test_cli_refuses_escaping_external_data_with_exit_3(world, variant):
    root, model = world
    _escape(root, model, variant)
    proc = cli("rewrite", model, "-o", root / "out" / "o.onnx", timeout=60)
    assert proc.returncode == 3, proc.stderr
    line = one_error_line(proc)
    assert "tensor 'w'" in line and str(model) in line
    assert list((root / "out").iterdir()) == []


def test_verify_refuses_escaping_external_data_and_missing_data_is_exit_3(world):
    root, model = world
    out = root / "out" / "o.onnx"
    onnx_qrewrite.rewrite(model).save(out)
    (root / "out" / "o.onnx.data").unlink()
    proc = cli("verify", model, out, "--samples", "1", "--no-battery")
    assert proc.returncode == 3, proc.stderr
    assert "o.onnx.data" in one_error_line(proc)
    _escape(root, model, "symlink-file")
    proc = cli("verify", model, model, "--samples", "1", "--no-battery")
    assert proc.returncode == 3 and "tensor 'w'" in one_error_line(proc)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"offset": "999999999"}, "past the end"),
        ({"offset": "64", "length": "2048"}, "runs past its end"),
        ({"length": "12"}, "does not match its type and shape"),
        ({"length": "-5"}, "not a non-negative integer"),
        ({"offset": "0x10"}, "not a non-negative integer"),
        ({"length": "9" * 40}, "not a non-negative integer"),
    ],
)
def test_offsets_and_lengths_outside_the_file_are_invalid_models(world, extra, message):
    root, model = world
    set_location(model, "w", "model.onnx.data", **{"offset": "0", **extra})
    with pytest.raises(InvalidModelError, match=message):
        onnx_qrewrite.rewrite(model).save(root / "out" / "o.onnx")
    assert list((root / "out").iterdir()) == []


def test_the_bytes_checked_are_the_bytes_used(world):
    """Swap the data file (and then a symlink to the canary) in after the check: the output still
    carries the original weights, read through the descriptor opened at the check."""
    root, model = world
    original = (model.parent / "model.onnx.data").read_bytes()
    result = onnx_qrewrite.rewrite(model)
    swap = model.parent / "swap"
    swap.write_bytes(CANARY + original[len(CANARY) :])
    os.replace(swap, model.parent / "model.onnx.data")  # a new file under the checked name
    result.save(root / "out" / "a.onnx")
    (model.parent / "model.onnx.data").unlink()
    os.symlink(root / "secret.bin", model.parent / "model.onnx.data")
    result.save(root / "out" / "b.onnx")
    assert_no_canary(root / "out")
    for name in ("a.onnx", "b.onnx"):
        w = onnx.load(root / "out" / name).graph.initializer
        assert next(t for t in w if t.name == "w").raw_data == original[: 64 * 32]


def test_symlinks_and_hard_links_inside_the_folder_are_read(world):
    """Contained links are fine: a symlink to a file in the folder, a hard-linked (deduplicated)
    data file. onnx's own checker refuses both; reading them through the checked descriptor is safe."""
    root, model = world
    m = model.parent
    expected = run(model, {"x": X})["y"]
    os.rename(m / "model.onnx.data", m / "blob")
    os.link(m / "blob", m / "dedup")
    (m / "sub").mkdir()
    os.symlink("../dedup", m / "sub" / "w.data")
    set_location(model, "w", "sub/w.data")
    set_location(model, "w_zp", "blob")
    before = digest(m)
    out = root / "out" / "o.onnx"
    onnx_qrewrite.rewrite(model).save(out)
    assert digest(m) == before
    assert_bitwise_equal(run(out, {"x": X})["y"], expected, "y")


def test_rewrite_from_several_threads_at_once(tmp_path, monkeypatch):
    """The API is thread-safe: no working-directory changes (os.chdir is forbidden here), and
    eight concurrent rewrites of models with external data give the same bytes as one at a time."""

    def no_chdir(*_):
        raise AssertionError("os.chdir called: not thread-safe")

    monkeypatch.setattr(os, "chdir", no_chdir)
    models = [dql_model(tmp_path / f"m{i}", seed=i) for i in range(8)]
    serial = tmp_path / "serial"
    serial.mkdir()
    for i, m in enumerate(models):
        onnx_qrewrite.rewrite(m).save(serial / f"o{i}.onnx")
    parallel = tmp_path / "parallel"
    parallel.mkdir()
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(models))

    def work(i: int, m: Path) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                onnx_qrewrite.rewrite(m, check=True).save(parallel / f"o{i}.onnx")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, m)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert digest(parallel) == digest(serial)
