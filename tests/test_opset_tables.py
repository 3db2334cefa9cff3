"""The two tables under rules/opsets/ are read by one loader (rewriter/opset_tables.py); each
reader still refuses a row that cites no ``[[source]]``, in its own words, naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx_qrewrite.errors import InternalError
from onnx_qrewrite.rewriter import opset_tables
from onnx_qrewrite.rewriter.ir_table import ir_additions
from onnx_qrewrite.targets.lower_opset import lowering_steps


def test_each_shipped_table_is_read_with_its_sources():
    for name, kind in (("ir_versions", "ir"), ("lowering", "step")):
        table = opset_tables.opset_table(name)
        assert table.path.name == f"{name}.toml" and table.sources
        assert table.rows(kind) and all(table.cites(row) for row in table.rows(kind))


def test_a_row_citing_no_source_fails_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "ir_versions.toml").write_text(
        '[[source]]\nid = "a"\n\n[[ir]]\nversion = 9\nadded = "x"\ntypes = []\nfields = []\nsource = "b"\n'
    )
    (tmp_path / "lowering.toml").write_text('[[source]]\nid = "a"\n\n[[step]]\nfrom = 22\nto = 21\nsource = "b"\n')
    monkeypatch.setattr(opset_tables, "_opsets_dir", lambda: tmp_path)
    ir_additions.cache_clear()
    lowering_steps.cache_clear()
    try:
        ir_path, lowering_path = tmp_path / "ir_versions.toml", tmp_path / "lowering.toml"
        with pytest.raises(InternalError) as ir_error:
            ir_additions()
        assert str(ir_error.value) == f"{ir_path}: [[ir]] version 9 cites no [[source]]"
        with pytest.raises(InternalError) as step_error:
            lowering_steps()
        assert str(step_error.value) == f"{lowering_path}: step 22 -> 21 cites no [[source]] or skips an opset"
    finally:  # the shipped tables again for the tests after this one
        monkeypatch.undo()
        ir_additions.cache_clear()
        lowering_steps.cache_clear()
