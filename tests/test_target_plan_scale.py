"""The target plan's account of each refused node (``NodeVerdict.weighed_left``) costs what the
model's size costs, not its square: every node a form's whole-model trial could rewrite names the
refusals that one trial left, and those were put in words again for each node (a 4000-block chain
for tensorrt: 80 million strings, over half an hour), and listed again per node in the JSON answer
(43 MB for a 250-block chain), and printed again per node by ``inspect --target -a`` (5 million
lines for a 1000-block chain). Counted in calls, bytes and lines, not timed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import onnx
import pytest

from onnx_qrewrite.api import load_rules
from onnx_qrewrite.cli.target_report import print_plan
from onnx_qrewrite.targets import TargetPlan, load_target, plan_for_model
from onnx_qrewrite.targets import account as account_module
from onnx_qrewrite.targets.verdicts import PLAN_FORMAT


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


def _account(blocks: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, TargetPlan]:
    """Calls of ``_in_words`` while planning the chain for tensorrt, and the plan."""
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
    return calls, plan


def test_account_words_grow_with_the_nodes_not_their_square(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    small_calls, small_plan = _account(4, tmp_path, monkeypatch)
    big_calls, big_plan = _account(16, tmp_path, monkeypatch)
    small, big = small_plan.nodes, big_plan.nodes
    # The account still lists every refusal a weighed choice left, for every node.
    left_small = sum(len(v) for n in small for v in n.weighed_left.values())
    left_big = sum(len(v) for n in big for v in n.weighed_left.values())
    assert left_big > 4 * left_small > 0  # the listing itself is quadratic here: all of it is kept
    # Putting it in words is not: 4 times the blocks, at most 4 times the calls (it was 16).
    assert 0 < big_calls <= 4 * small_calls, (small_calls, big_calls)
    # Nor is the JSON answer (inspect --target --json): each distinct list once, nodes index it
    # (4 times the blocks: 3.8 times the bytes now; 8.3 before, growing with the square).
    small_json, big_json = small_plan.to_dict(), big_plan.to_dict()
    assert len(json.dumps(big_json)) <= 4.2 * len(json.dumps(small_json))
    _assert_lists_as_before(small_plan, small_json)
    _assert_lists_as_before(big_plan, big_json)
    # Nor is the text of inspect --target -a: a list printed in full once, then named (4 times
    # the blocks: 3.8 times the lines now; 9.9 before), and nothing of any node's list is lost.
    lines = []
    for plan in (small_plan, big_plan):
        print_plan(plan, load_target("tensorrt"), all_nodes=True)
        text = capsys.readouterr().out
        _assert_text_lists_as_before(plan, text)
        lines.append(text.count("\n"))
    assert lines[1] <= 4.2 * lines[0], lines


def _assert_lists_as_before(plan: TargetPlan, data: dict) -> None:
    """The plan's JSON (format 2) holds every node's weighed_left list as format 1 did, through
    the index; each distinct list once, so the trial every form node names is listed once."""
    assert data["format"] == PLAN_FORMAT == 2
    lists = data["weighed_left_lists"]
    assert len({tuple(x) for x in lists}) == len(lists)
    for verdict, node in zip(plan.nodes, data["nodes"], strict=True):
        assert set(node["weighed_left"]) == set(verdict.weighed_left)
        for rule_id, at in node["weighed_left"].items():
            assert lists[at] == list(verdict.weighed_left[rule_id])
    shared = [x for x in lists if len(x) == len(plan.nodes) // 2]  # the form trial: every DynamicQuantizeLinear
    assert len(shared) >= 1


def _assert_text_lists_as_before(plan: TargetPlan, text: str) -> None:
    """Every node's weighed_left list is in ``text`` (print_plan with -a): under its ``weighed:``
    line in full, or as one line naming the place above where the same list is printed in full;
    the form trial every form node weighs is printed in full once."""
    full: dict[str, list[str]] = {}  # where -> the list printed in full there
    found: dict[tuple[str, str], list[str]] = {}  # (node, rule) -> its list, references resolved
    node = rule = ""
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and "): " in line:
            node = line.strip().partition(" (")[0]
        elif line.startswith("      weighed: "):
            rule = line.removeprefix("      weighed: ").partition(" (")[0]
            found[node, rule] = []
        elif line.startswith("          left: "):
            said = line.removeprefix("          left: ")
            head, _, where = said.partition(" lines as listed above under ")
            if where:
                assert head == f"the same {len(full[where])}", line
                found[node, rule] = full[where]
            else:
                found[node, rule].append(said)
                full.setdefault(f"{node} (weighed: {rule})", found[node, rule])
    for verdict in plan.nodes:
        for rule_id, words in verdict.weighed_left.items():
            assert found[verdict.node, rule_id] == list(words), (verdict.node, rule_id)
    trial = [x for x in full.values() if len(x) == len(plan.nodes) // 2]  # every DynamicQuantizeLinear
    assert len(trial) == 1 and text.count(trial[0][-1]) == 1
