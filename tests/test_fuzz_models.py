"""Fuzzing model bytes and external-data tables (issue 9, item 5): whatever the input, the API
raises a QRewriteError with a usage/invalid-model/cannot-lower code (never exit 5 or a stray
exception), in bounded time, and a secret outside the model's folder never reaches an output.

A few thousand cases run in-process in the normal suite; QRW_FUZZ_EXAMPLES=N runs N per test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import onnx
import pytest
from _safety_helpers import CANARY, dql_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnx_qrewrite
from onnx_qrewrite import QRewriteError
from onnx_qrewrite.errors import EXIT_CANNOT_LOWER, EXIT_INVALID_MODEL, EXIT_USAGE

EXAMPLES = int(os.environ.get("QRW_FUZZ_EXAMPLES", "0"))
#: Seconds one case may take (a 2 KiB model: anything near this is a hang or a blow-up).
CASE_LIMIT = 5.0
RULES = onnx_qrewrite.load_rules()


def _settings(default: int):
    return settings(
        max_examples=EXAMPLES or default,
        deadline=None,  # measured by hand below, against CASE_LIMIT (the machine is shared)
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=not EXAMPLES,
        database=None,
    )


class _World:
    """tmp/secret.bin (canary), tmp/m/model.onnx (+ .data), tmp/out/: rebuilt per case."""

    def __init__(self) -> None:
        # tmpfs when there is one: each case's fsyncs would otherwise dominate its time
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.root = Path(tempfile.mkdtemp(prefix="qrw-fuzz-", dir=shm))
        (self.root / "secret.bin").write_bytes(CANARY)
        self.model = dql_model(self.root / "src")
        self.clean_bytes = self.model.read_bytes()
        self.data = (self.root / "src" / "model.onnx.data").read_bytes()
        self.inline = onnx.load(self.model)  # weights in memory, for mutating a model without data
        self.inline_bytes = self.inline.SerializeToString()

    def case(self, model_bytes: bytes) -> Path:
        m = self.root / "m"
        shutil.rmtree(m, ignore_errors=True)
        shutil.rmtree(self.root / "out", ignore_errors=True)
        m.mkdir()
        (self.root / "out").mkdir()
        (m / "model.onnx.data").write_bytes(self.data)
        (m / "model.onnx").write_bytes(model_bytes)
        return m / "model.onnx"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def world():
    w = _World()
    yield w
    w.close()


def _attempt(world: _World, path: Path) -> None:
    start = time.monotonic()
    try:
        onnx_qrewrite.rewrite(path, rules=RULES).save(world.root / "out" / "o.onnx")
    except QRewriteError as exc:
        assert exc.exit_code in (EXIT_USAGE, EXIT_INVALID_MODEL, EXIT_CANNOT_LOWER), f"exit {exc.exit_code}: {exc}"
        assert "\n" not in str(exc).strip(), str(exc)
        assert not any((world.root / "out").iterdir()), "an error left something written"
    elapsed = time.monotonic() - start
    assert elapsed < CASE_LIMIT, f"{elapsed:.1f} s"
    for p in (world.root / "out").iterdir():
        assert CANARY[:64] not in p.read_bytes()


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 16)),
)


def _mutate(data: bytes, mutations) -> bytes:
    buf = bytearray(data)
    for kind, where, value in mutations:
        if not buf:
            break
        i = where % len(buf)
        if kind == "flip":
            buf[i] ^= value
        elif kind == "truncate":
            del buf[i:]
        elif kind == "insert":
            buf.insert(i, value)
        else:
            del buf[i : i + value]
    return bytes(buf)


@_settings(1500)
@given(mutations=st.lists(_mutation, min_size=1, max_size=4), inline=st.booleans())
def test_mutated_model_bytes_never_crash(world, mutations, inline):
    data = world.inline_bytes if inline else world.clean_bytes
    _attempt(world, world.case(_mutate(data, mutations)))


_locations = st.one_of(
    st.sampled_from(
        [
            "model.onnx.data",
            "../secret.bin",
            "../../secret.bin",
            "./model.onnx.data",
            "sub/../model.onnx.data",
            "model.onnx.data/",
            "/etc/passwd",
            "/dev/zero",
            ".",
            "..",
            "",
            "model.onnx",
            "x\0y",
            "a" * 5000,
            "\udcff",
            "~/secret.bin",
            "model.onnx.data\\..\\..\\secret.bin",
        ]
    ),
    st.text(max_size=30),
)
_numbers = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["", " 1", "1_0", "0x10", "1e3", "+4", "٣", "-0", "00", "99999999999999999999"]),
    st.text(max_size=8),
)


@_settings(1500)
@given(
    tensor=st.sampled_from(["w", "w_zp"]),
    location=_locations,
    offset=_numbers,
    length=_numbers,
    extra_keys=st.lists(
        st.tuples(st.sampled_from(["location", "offset", "checksum", "x"]), st.text(max_size=8)), max_size=2
    ),
)
def test_external_data_tables_never_crash_or_leak(world, tensor, location, offset, length, extra_keys):
    model = onnx.ModelProto()
    model.CopyFrom(onnx.load_model_from_string(world.clean_bytes))
    t = next(x for x in model.graph.initializer if x.name == tensor)
    del t.external_data[:]
    for key, value in [("location", location), ("offset", offset), ("length", length), *extra_keys]:
        if value is not None:
            e = t.external_data.add()
            e.key = key
            try:
                e.value = value
            except (ValueError, UnicodeError, TypeError):
                e.value = "?"
    try:
        data = model.SerializeToString()
    except (ValueError, UnicodeError):  # protobuf refuses to encode some strings: nothing to test
        return
    _attempt(world, world.case(data))
