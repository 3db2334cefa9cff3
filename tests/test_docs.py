"""docs/lowerings.md is generated from the catalogue (tools/gen_lowerings.py): the checked-in file
must be what the generator makes now, so a rule, builder or evidence change cannot leave it stale."""

from __future__ import annotations

import importlib.util

from conftest import REPO


def _generator():
    spec = importlib.util.spec_from_file_location("gen_lowerings", REPO / "tools" / "gen_lowerings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_lowerings_is_the_generated_file():
    gen = _generator()
    expected = gen.generate()
    actual = (REPO / "docs" / "lowerings.md").read_text(encoding="utf-8")
    assert actual == expected, "docs/lowerings.md is out of date: run python tools/gen_lowerings.py"


def test_every_shipped_rule_and_builder_appears_in_the_docs():
    from onnx_qrewrite.rewriter.builders import builder_names
    from onnx_qrewrite.rewriter.catalogue import load_catalogue

    text = _generator().generate()
    for rule in load_catalogue():
        assert f"| `{rule.id}` |" in text, rule.id
    for name in builder_names():
        assert f"### `{name}`" in text, name
