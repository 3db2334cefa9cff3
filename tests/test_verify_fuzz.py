"""Property-based fuzz over verify's options: whatever a careless user or a script types, the
result is a documented exit code (never 5), one error line at most, no exception escaping, and a
bounded run (huge values are refused before anything is allocated). In-process, so a few hundred
cases fit in seconds; ``--fuzz-examples`` is not needed: raise max_examples locally to dig."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from _verify_helpers import toy_quark_model, toy_rewrite
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx_qrewrite.cli import main

DOCUMENTED = {0, 1, 2, 3, 6}

_numbers = st.one_of(
    st.integers(-5, 5).map(str),
    st.integers(10**5 + 1, 10**40).map(str),
    st.sampled_from(["-1", "nan", "inf", "-inf", "1e400", "0x10", "", " ", "1e-5", "0.5"]),
)
_names = st.sampled_from(["", "x", "y", "yq", "nope", "x:0", "::"])


@st.composite
def _option(draw) -> list[str]:
    kind = draw(
        st.sampled_from(
            [
                "--seed",
                "--samples",
                "--lsb",
                "--atol",
                "--rtol",
                "--threads",
                "--int-range",
                "--val-range",
                "--input-shape",
                "--tolerance-rule",
                "--ort-opt-level",
            ]
        )
    )
    if kind in ("--seed", "--samples", "--threads"):
        return [kind, draw(_numbers)]
    if kind in ("--lsb", "--atol", "--rtol"):
        name = draw(_names)
        return [kind, f"{name}:{draw(_numbers)}" if name else draw(_numbers)]
    if kind == "--int-range":
        return [kind, f"{draw(_numbers)},{draw(_numbers)}"]
    if kind == "--val-range":
        name = draw(_names)
        body = f"[{draw(_numbers)},{draw(_numbers)}]"
        return [kind, f"{name}:{body}" if name else body]
    if kind == "--input-shape":
        dims = ",".join(draw(st.lists(_numbers, max_size=3)))
        return [kind, f"{draw(_names)}:{dims}"]
    if kind == "--tolerance-rule":
        return [kind, draw(st.sampled_from(["numpy", "polygraphy", "fuzzy"]))]
    return [kind, draw(st.sampled_from(["disable", "all", "fast"]))]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("fuzz")
    original = toy_quark_model()
    onnx.save(original, folder / "toy.onnx")
    onnx.save(toy_rewrite(original), folder / "toy.good.onnx")
    return folder / "toy.onnx", folder / "toy.good.onnx"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.lists(_option(), max_size=3))
def test_no_option_combination_is_an_internal_error(toy, options):
    args = ["verify", str(toy[0]), str(toy[1]), "--no-battery", "--no-localize"]
    for option in options:
        args += option
    if not any(o[0] == "--samples" for o in options):
        args += ["--samples", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code in DOCUMENTED, (args, result.output)
    assert "internal error" not in result.output and "Traceback" not in result.output
