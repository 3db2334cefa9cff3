"""Runs of stamps made together (rewriter/stamp_runs.py) give the bytes, report and progress that
stamping each replacement alone gives: names of several lengths (numpy's records and the small
groups' formats), with ``%`` and non-ASCII characters, unnamed nodes, names met twice, a name the
model already has under a stamp's prefix, short runs and spans, each provenance mode."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

import onnx_qrewrite
from onnx_qrewrite.io.encoded import to_bytes
from onnx_qrewrite.rewriter import engine, stamp_runs
from onnx_qrewrite.rewriter.stamp_runs import RunStamper

ROOT = Path(__file__).resolve().parent.parent


def _chain(blocks: int) -> onnx.ModelProto:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from models import _chain_model_bytes

    return onnx.ModelProto.FromString(_chain_model_bytes(blocks))


def _varied(blocks: int) -> onnx.ModelProto:
    """The chain with its quantizers' names shorter than their outputs (so the names are the
    prefixes) in three lengths, some with ``%`` and non-ASCII characters, two unnamed, two alike."""
    model = _chain(blocks)
    dqls = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear"]
    for i, node in enumerate(dqls):
        node.name = f"q{i:02d}" + "%" * (i % 3) + "\u00e9" * (i % 2 and i % 4)
    dqls[5].name = dqls[9].name = ""
    dqls[12].name = dqls[30].name = "dup"
    return model


def _with_clash(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with an unchanged node named as a replacement's created node would be: that
    replacement's family is not free (a name the model has under its prefix)."""
    _, report = engine.run(onnx.ModelProto.FromString(model.SerializeToString()), onnx_qrewrite.load_rules())
    clash = report.rewrites[20].created_nodes[1]
    muls = [n for n in model.graph.node if n.op_type == "Mul"]
    muls[3].name = clash
    return model


def _rewrite(model: onnx.ModelProto, provenance: str, runs: bool, monkeypatch) -> tuple:
    calls: list[tuple] = []
    with monkeypatch.context() as patch:
        if not runs:
            patch.setattr(RunStamper, "usable", staticmethod(lambda *a: False))
        rewritten, report = engine.run(
            onnx.ModelProto.FromString(model.SerializeToString()),
            onnx_qrewrite.load_rules(),
            engine.EngineOptions(provenance=provenance),
            progress=lambda *a: calls.append(a),
        )
    return to_bytes(rewritten), report.to_dict(), calls


@pytest.mark.parametrize("limits", [(1024, 4096, 1024), (7, 12, 2)], ids=["default", "short-runs"])
@pytest.mark.parametrize("provenance", ["compact", "full", "none"])
def test_runs_rewrite_as_stamps_one_at_a_time(limits, provenance, monkeypatch):
    monkeypatch.setattr(stamp_runs, "_RUN", limits[0])
    monkeypatch.setattr(stamp_runs, "_SPAN", limits[1])
    monkeypatch.setattr(stamp_runs, "_GAP", limits[2])
    used = []
    original = RunStamper._segment
    monkeypatch.setattr(RunStamper, "_segment", lambda self, *a: used.append(1) or original(self, *a))
    models = (_varied(66), _with_clash(_varied(66)))
    used.clear()
    for model in models:
        alone = _rewrite(model, provenance, False, monkeypatch)
        assert not used
        together = _rewrite(model, provenance, True, monkeypatch)
        assert used  # (the runs were taken)
        assert together == alone
        used.clear()


def test_a_plain_chain_rewrites_as_stamps_one_at_a_time(monkeypatch):
    model = _chain(40)
    assert _rewrite(model, "compact", True, monkeypatch) == _rewrite(model, "compact", False, monkeypatch)
