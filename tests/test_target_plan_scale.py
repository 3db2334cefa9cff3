"""The target plan's account of each refused node (``NodeVerdict.weighed_left``) costs what the
model's size costs, not its square: every node a form's whole-model trial could rewrite names the
refusals that one trial left, and those were put in words again for each node (a 4000-block chain
for tensorrt: 80 million strings, over half an hour). Counted in calls, not timed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import onnx
import pytest

from onnx_qrewrite.api import load_rules
from onnx_qrewrite.targets import account as account_module
from onnx_qrewrite.targets import load_target, plan_for_model


def _make_dql_chain(blocks: int, path: Path) -> onnx.ModelProto:
    """benchmarks/models.py's chain (the model the finding was measured on)."""
    name = "benchmarks_models"
    models = sys.modules.get(name)
    if models is None:
        where = Path(__file__).resolve().parent.parent / "benchmarks" / "models.py"
        spec = importlib.util.spec_from_file_location(name, where)
        assert spec is not None and spec.loader is not None
        models = importlib.util.module_from_spec(spec)
        sys.modules[name] = models
        spec.loader.exec_module(models)
    models.make_dql_chain(blocks, path)
    return onnx.load(path)


def _account(blocks: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list]:
    """Calls of ``_in_words`` while planning the chain for tensorrt, and the plan's verdicts."""
    calls = 0
    words = account_module._in_words

    def counted(refused):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return words(refused)

    model = _make_dql_chain(blocks, tmp_path / f"chain_{blocks}.onnx")
    monkeypatch.setattr(account_module, "_in_words", counted)
    plan = plan_for_model(model, load_rules(), load_target("tensorrt"))
    monkeypatch.setattr(account_module, "_in_words", words)
    return calls, plan.nodes


def test_account_words_grow_with_the_nodes_not_their_square(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small_calls, small = _account(4, tmp_path, monkeypatch)
    big_calls, big = _account(16, tmp_path, monkeypatch)
    # The account still lists every refusal a weighed choice left, for every node.
    left_small = sum(len(v) for n in small for v in n.weighed_left.values())
    left_big = sum(len(v) for n in big for v in n.weighed_left.values())
    assert left_big > 4 * left_small > 0  # the listing itself is quadratic here: all of it is kept
    # Putting it in words is not: 4 times the blocks, at most 4 times the calls (it was 16).
    assert 0 < big_calls <= 4 * small_calls, (small_calls, big_calls)
