"""Option groups shared by subcommands (the rule selection of ``rewrite`` and ``inspect``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from onnx_qrewrite.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _split_ids(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def parse_rule_options(values: tuple[str, ...], dql_semantics: str | None = None) -> dict[str, dict[str, Any]]:
    """``ID.KEY=VALUE`` strings -> ``{id: {key: value}}``; VALUE is read as a TOML value when it
    parses as one (numbers, booleans, quoted strings), else taken as a bare string."""
    out: dict[str, dict[str, Any]] = {}
    for item in values:
        head, sep, raw = item.partition("=")
        rule_id, dot, key = head.rpartition(".")
        if not sep or not dot or not rule_id or not key:
            raise UsageError(f"--rule-option {item!r}: expected RULE_ID.KEY=VALUE")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out.setdefault(rule_id, {})[key] = value
    if dql_semantics:
        out.setdefault("dql-expand", {})["semantics"] = dql_semantics
    return out


def rule_selection(func: Callable) -> Callable:
    """--rules/--only/--skip/--rule-option/--dql-semantics, as one reusable group."""
    options = [
        click.option(
            "--rules",
            "rule_files",
            multiple=True,
            type=click.Path(dir_okay=False),
            help="Add a rule catalogue (TOML); repeatable. Shipped rules come first.",
        ),
        click.option("--only", multiple=True, metavar="ID[,ID...]", help="Apply only these rules."),
        click.option("--skip", multiple=True, metavar="ID[,ID...]", help="Do not apply these rules."),
        click.option(
            "--rule-option",
            "rule_options",
            multiple=True,
            metavar="ID.KEY=VALUE",
            help="Override a rule option, e.g. dql-expand.semantics=spec; repeatable.",
        ),
        click.option(
            "--dql-semantics",
            type=click.Choice(["onnxruntime", "spec"]),
            default=None,
            help="DynamicQuantizeLinear: match onnxruntime's kernel (default) or the ONNX spec body.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


#: Quark float16: its CPU kernel ignores scale and zero point, its documentation applies them.
FLOAT16_SEMANTICS = ("kernel", "documented")


def float16_semantics_option(func: Callable) -> Callable:
    """--float16-semantics: sets option float16_semantics on every rule that has it."""
    return click.option(
        "--float16-semantics",
        type=click.Choice(FLOAT16_SEMANTICS),
        default=None,
        help="Quark float16 Q/DQ whose scale is not 1 or zero point not 0 (the kernel ignores them, "
        "the documentation applies them): reproduce the CPU kernel or the documented formula. "
        "Without it such nodes are an error.",
    )(func)


def load_selected_rules(rule_files, only, skip, rule_options, dql_semantics, float16_semantics=None):
    from onnx_qrewrite.catalogue import load_rules  # not through api: that imports the engine

    catalogue = load_rules(
        rule_files,
        only=_split_ids(only) or None,
        skip=_split_ids(skip) or None,
        options=parse_rule_options(rule_options, dql_semantics) or None,
    )
    if float16_semantics:
        catalogue = catalogue.with_options(
            {r.id: {"float16_semantics": float16_semantics} for r in catalogue if "float16_semantics" in r.options}
        )
    return catalogue


def check_report_paths(**paths: str | None) -> None:
    """Report files (``--report``, ``--junit``, ...) that could not be written are usage errors found
    before any work, so a rewrite is never done and then reported as a failure. Keyword: option
    name with underscores for dashes (``save_inputs`` -> ``--save-inputs``)."""
    for key, path in paths.items():
        if not path:
            continue
        option = "--" + key.replace("_", "-")
        target = Path(path)
        folder = target.parent if str(target.parent) else Path(".")
        if target.is_dir():
            raise UsageError(f"{option} {path}: is a directory; give a file name")
        if not folder.is_dir():
            raise UsageError(f"{option} {path}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"{option} {path}: cannot write to the folder {folder} (permission denied)")
