"""What ``inspect --target T`` plans is what ``rewrite --target T`` does, node by node.

``inspect`` prints a plan (targets/plan.py); ``rewrite`` plans again and applies that plan through
the engine's options, stage by stage (api.py). Nothing else checks the two against each other: a
plan built with other options on one side (an allowance, an opset, the input's shapes) or a stage
the rewrite does not apply would print one answer and write another. Here, on the shipped samples
and two real producers' models, for four targets (planning only: no runtime is needed):

- the plan ``rewrite`` made (its report's ``target``) is the one ``inspect --json`` printed;
- every node the plan names is rewritten by the rule it chose, and what that rule created by the
  later stages' rules it lists in ``then``, each at the exactness it names (read from the
  rewrite's own report of what it applied, following each rewrite's created nodes);
- what the target refuses in the written model (checked here, on the file) is what the plan said
  it would still refuse, overall and per node.
"""

from __future__ import annotations

import json

import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import REAL_MODELS, SAMPLES

from onnx_qrewrite.targets import Refused, check_model, load_target

TARGETS = ("tensorrt", "qnn", "tflite", "tract")
MODELS = [
    *sorted(SAMPLES.glob("*.onnx")),
    # several stages, an opset lowering (tensorrt), refusals left (tensorrt, qnn): com.microsoft and Quark
    REAL_MODELS / "ortqdq_ms_cnn_op17_a16u_w16s.onnx",
    REAL_MODELS / "quark_cnn_op17_a16w8_ext.onnx",
]


def _chains(rewrites: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Per node a rewrite replaced: that rewrite, then those of the nodes it created, and so on
    (each in the order met); the rewrites of the nodes a rewrite created are its chain's rest."""
    by_node = {(rw["scope"], rw["node"]): rw for rw in rewrites}
    assert len(by_node) == len(rewrites), "a node rewritten twice"
    chains = {}
    for key, first in by_node.items():
        chain, names = [first], list(first["created_nodes"])
        while names:
            rw = by_node.get((key[0], names.pop(0)))
            if rw is not None:
                chain.append(rw)
                names.extend(rw["created_nodes"])
        chains[key] = chain
    return chains


def _final_nodes(chain: list[dict]) -> list[str]:
    """The nodes a chain of rewrites leaves: what it created that no later rewrite replaced."""
    replaced = {rw["node"] for rw in chain}
    return [name for rw in chain for name in rw["created_nodes"] if name not in replaced]


def _as_words(r: Refused) -> str:
    """A refusal as the plan's ``after`` of a node names it (targets/account.py)."""
    return f"{r.node} ({r.op_key}): {'; '.join(r.reasons)}"


def _model_rule(report: dict) -> str | None:
    """The rule a model-wide verdict names for what the rewrite did to the whole model: the
    default opset lowered (lower-opset), else the IR version lowered (lower-ir)."""
    opsets = [(c["before"], c["after"]) for c in report["opset_changes"] if c["domain"] == ""]
    if any(old is not None and new is not None and new < old for old, new in opsets):
        return "lower-opset"
    ir = report.get("ir_version_change")
    return "lower-ir" if ir is not None and ir["to"] < ir["from"] else None


def _agree(plan: dict, report: dict, written: onnx.ModelProto, target: str) -> None:
    """The assertions of this file's docstring, for one model and target."""
    assert report["target"] == plan, "rewrite planned otherwise than inspect"
    refused = check_model(written, load_target(target))
    key = lambda r: (r["scope"], r["node"], r["op"], r["domain"], tuple(r["reasons"]))  # noqa: E731
    assert sorted((r.scope, r.node, r.op, r.domain, r.reasons) for r in refused) == sorted(map(key, plan["after"]))
    refused_at = {(r.scope, r.node): r for r in refused}
    chains = _chains(report["rewrites"])
    for verdict in plan["nodes"]:
        at = (verdict["scope"], verdict["node"])
        if verdict["node"] == "(model)":
            assert verdict["rule"] == _model_rule(report), verdict
            assert verdict["after"] == (list(refused_at[at].reasons) if at in refused_at else []), verdict
            continue
        chain = chains.get(at, [])
        assert verdict["rule"] == (chain[0]["rule"] if chain else None), (target, verdict["node"])
        assert verdict["then"] == [f"{rw['rule']} ({rw['exactness']}) on {rw['node']}" for rw in chain[1:]], at
        if chain:
            levels = {rw["exactness"] for rw in chain}
            least = next(level for level in ("approximate", "bounded", "exact") if level in levels)
            assert verdict["exactness"] == least, at
            still = [_as_words(refused_at[(at[0], n)]) for n in _final_nodes(chain) if (at[0], n) in refused_at]
        else:
            still = list(refused_at[at].reasons) if at in refused_at else []
        assert verdict["after"] == still, (target, verdict["node"])


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_inspect_target_plans_what_rewrite_target_applies(path, tmp_path):
    for target in TARGETS:
        shown = cli_in_process("inspect", path, "--target", target, "--json")
        assert shown.returncode in (0, 4), shown.stderr
        plan = {k: v for k, v in json.loads(shown.stdout).items() if k != "sources"}
        out, report = tmp_path / f"{target}.onnx", tmp_path / f"{target}.json"
        done = cli_in_process("rewrite", path, "-o", out, "--target", target, "--allow-unlowered", "--report", report)
        assert done.returncode == 0, done.stderr
        _agree(plan, json.loads(report.read_text()), onnx.load(out), target)
