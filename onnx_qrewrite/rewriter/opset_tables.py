"""The tables under ``rules/opsets/``, read one way: ``ir_versions.toml`` (what each IR version
added, :mod:`.ir_table`) and ``lowering.toml`` (what changed at each opset step,
``targets/lower_opset.py``). Each cites its evidence in ``[[source]]`` entries that every row must
name; each reader checks its own rows against them, in its own words.

A module of its own, outside :mod:`onnx_qrewrite.targets` and importing nothing of the package:
a plain rewrite reads the IR table through it (``rewriter/ir_table.py`` says why that matters).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from onnx_qrewrite._dataclass import dataclass

__all__ = ["OpsetTable", "opset_table"]


@dataclass(frozen=True)
class OpsetTable:
    """One table as read: where it is (for messages), its rows by table name, its sources' ids."""

    path: Path
    data: dict[str, Any]
    sources: frozenset[str]

    def rows(self, kind: str) -> list[dict[str, Any]]:
        """The ``[[kind]]`` entries, in file order (none: an empty list)."""
        rows: list[dict[str, Any]] = self.data.get(kind, [])
        return rows

    def cites(self, row: dict[str, Any]) -> bool:
        """Whether ``row`` names one of the table's ``[[source]]`` entries."""
        return row.get("source") in self.sources


def _opsets_dir() -> Path:
    from onnx_qrewrite.rewriter.catalogue import shipped_rules_dir

    return shipped_rules_dir() / "opsets"


def opset_table(name: str) -> OpsetTable:
    """``rules/opsets/<name>.toml``, parsed (the callers cache what they build from it)."""
    path = _opsets_dir() / f"{name}.toml"
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return OpsetTable(path, data, frozenset(s["id"] for s in data.get("source", [])))
