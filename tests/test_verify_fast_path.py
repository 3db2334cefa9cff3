"""``verify``'s fast path (onnxruntime gets the files' bytes; onnx parses the models only when a
check needs their graphs) gives the same reports, verdicts and errors as the path that parses both
models first, on every model the tests ship and on the cases that need the graphs (a disagreement
to localise, bounded rewrites to check, a model onnxruntime refuses)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest

import onnx_qrewrite
from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.io import model_io
from onnx_qrewrite.verify import models as verify_models
from onnx_qrewrite.verify import verify

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted([*ROOT.glob("sample_models/*.onnx"), *ROOT.glob("tests/data/models/*.onnx")])


def _full_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(model: Any, side: str) -> Any:
        raise verify_models.NotFast("test: the full path only")

    monkeypatch.setattr(verify_models, "load_fast", refuse)


def _parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every model onnx parses from here on (the full path's load, the fast path's late parse)."""
    parsed: list[str] = []
    for name in ("open_model", "open_model_bytes"):
        original = getattr(model_io, name)

        def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            parsed.append(str(args[0] if not isinstance(args[0], bytes) else args[2]))
            return _original(*args, **kwargs)

        monkeypatch.setattr(model_io, name, counting)
    return parsed


def _comparable(report: Any) -> dict[str, Any]:
    body = report.to_dict()
    body.pop("duration_seconds", None)
    return body


def _both_ways(original: Path, rewritten: Path, **options: Any) -> tuple[dict, dict, list[str]]:
    with pytest.MonkeyPatch.context() as patch:
        parsed = _parses(patch)
        fast = _comparable(verify(str(original), str(rewritten), **options))
    with pytest.MonkeyPatch.context() as patch:
        _full_path_only(patch)
        full = _comparable(verify(str(original), str(rewritten), **options))
    return fast, full, parsed


def _rewrite(model: Path, out: Path, **options: Any) -> Path | None:
    try:
        onnx_qrewrite.rewrite(str(model), allow_unlowered=True, **options).save(out)
    except onnx_qrewrite.QRewriteError:
        return None
    return out


@pytest.mark.parametrize("model", SHIPPED, ids=lambda p: p.name)
def test_same_report_as_the_full_path(model: Path, tmp_path: Path) -> None:
    rewritten = _rewrite(model, tmp_path / "out.onnx")
    if rewritten is None:
        pytest.skip("the shipped rules do not rewrite this model")  # pragma: no cover - all do today
    fast, full, parsed = _both_ways(model, rewritten)
    assert fast == full
    vendor = any(o.domain not in ("", "ai.onnx", "ai.onnx.ml") for o in onnx.load(str(model)).opset_import)
    bounded = b"onnx_qrewrite.bound" in rewritten.read_bytes()
    if not vendor and not bounded:
        assert parsed == [], "the fast path served this verification without parsing a model"


def test_fast_path_serves_the_sample_models(tmp_path: Path) -> None:
    """The models users start with verify without onnx parsing anything."""
    served = []
    for model in sorted(ROOT.glob("sample_models/*.onnx")):
        rewritten = _rewrite(model, tmp_path / f"{model.stem}.out.onnx")
        assert rewritten is not None
        with pytest.MonkeyPatch.context() as patch:
            parsed = _parses(patch)
            assert verify(str(model), str(rewritten)).passed
        served.append(not parsed)
    assert sum(served) >= 2, served


def test_disagreement_is_localised_alike(tmp_path: Path) -> None:
    """A broken rewrite: the fast path parses the models to localise, and says what the full path says."""
    model = ROOT / "sample_models/dynamic_mlp.onnx"
    rewritten = _rewrite(model, tmp_path / "out.onnx")
    assert rewritten is not None
    broken = onnx.load(str(rewritten))
    for node in broken.graph.node:
        if node.op_type == "Sub":
            node.op_type = "Add"
            break
    else:  # pragma: no cover
        pytest.fail("no Sub to break")
    onnx.save(broken, str(tmp_path / "broken.onnx"))
    fast, full, parsed = _both_ways(model, tmp_path / "broken.onnx")
    assert fast == full
    assert fast["verdict"] != "passed" and fast["localization"] is not None
    assert parsed, "localising needs the graphs"


def test_approximate_and_bounded_rewrites_alike(tmp_path: Path) -> None:
    """Provenance the fast path reads from the bytes: approximate rewrites (drift judged) and
    bounded ones (checked at the node, which parses the graphs)."""
    checked = 0
    for model in SHIPPED:
        rewritten = _rewrite(model, tmp_path / f"{model.stem}.approx.onnx", allow=("exact", "bounded", "approximate"))
        if rewritten is None:
            continue
        fast, full, _ = _both_ways(model, rewritten)
        assert fast == full, model.name
        checked += 1
    assert checked


@pytest.mark.parametrize("damage", ["truncated", "garbage", "no-graph"])
def test_bad_rewritten_file_gives_the_full_path_s_error(tmp_path: Path, damage: str) -> None:
    model = ROOT / "sample_models/dynamic_mlp.onnx"
    data = model.read_bytes()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": b"\x0a\xff\xff\xff", "no-graph": b"\x08\x08"}[damage]
    )
    messages = []
    for full_only in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            if full_only:
                _full_path_only(patch)
            with pytest.raises(InvalidModelError) as caught:
                verify(str(model), str(bad))
            messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_verify_command_does_not_import_onnx(tmp_path: Path) -> None:
    """The start-up cost the fast path removes (benchmarks/bench.py, verify case): checked in a
    fresh interpreter, since this one has onnx imported already."""
    model = ROOT / "sample_models/dynamic_mlp.onnx"
    rewritten = _rewrite(model, tmp_path / "out.onnx")
    code = (
        "import sys\n"
        "from onnx_qrewrite.cli import main\n"
        "try:\n"
        f"    main(['-q', 'verify', {str(model)!r}, {str(rewritten)!r}])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(sorted(m for m in ('onnx', 'onnx_ir', 'onnxscript') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
