"""Option groups shared by subcommands (the rule selection of ``rewrite`` and ``inspect``, the
global ``-v``/``-q`` every subcommand also accepts after its name)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from onnx_qrewrite.errors import UsageError


def configure_logging(verbose: int, quiet: bool) -> None:
    """Log level from ``-v`` (repeatable) and ``-q``: errors only, warnings (default), info, debug."""
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="onnx-qrewrite: %(levelname)s: %(message)s", stream=sys.stderr)
    logging.getLogger().setLevel(level)


def _global_flag(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """Fold a subcommand's -v/-q into the settings the group's own -v/-q made (both count)."""
    if not value:
        return
    state = ctx.ensure_object(dict)
    if param.name == "verbose":
        state["verbose"] = state.get("verbose", 0) + value
    else:
        state["quiet"] = True
    configure_logging(state.get("verbose", 0), bool(state.get("quiet")))


def global_options(func: Callable) -> Callable:
    """``-v``/``-q`` after the subcommand as well as before it (``onnx-qrewrite verify a b -q``),
    as Polygraphy accepts them: users put them wherever their other tools do."""
    func = click.option(
        "-q", "--quiet", is_flag=True, expose_value=False, callback=_global_flag, help="Same as the global -q."
    )(func)
    return click.option(
        "-v", "--verbose", count=True, expose_value=False, callback=_global_flag, help="Same as the global -v."
    )(func)


class MultiValueOption(click.Option):
    """A repeatable option that also takes several values after one flag, as Polygraphy's
    (argparse ``nargs="+"``) options do: ``--atol 1e-5 out0:1e-4`` is ``--atol 1e-5 --atol
    out0:1e-4``. Only the following words that ``looks_like`` accepts are taken, so the
    positional arguments after the option stay positional (model paths never look like values)."""

    def __init__(self, *args: Any, looks_like: Callable[[str], bool], **kwargs: Any) -> None:
        kwargs["multiple"] = True
        super().__init__(*args, **kwargs)
        self.looks_like = looks_like

    def add_to_parser(self, parser: Any, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        looks_like = self.looks_like
        for name in self.opts:
            # click's parser keeps its options in these dicts (click 8.1 to 8.5); were they ever to
            # go, the option still works repeated, one value per flag.
            option = getattr(parser, "_long_opt", {}).get(name) or getattr(parser, "_short_opt", {}).get(name)
            if option is None:
                continue
            process = option.process

            def greedy(value: Any, state: Any, process: Callable[[Any, Any], None] = process) -> None:
                process(value, state)
                while state.rargs and looks_like(state.rargs[0]):
                    process(state.rargs.pop(0), state)

            option.process = greedy


def looks_like_number_value(kind: type) -> Callable[[str], bool]:
    """``[NAME:]NUMBER`` words (``1e-5``, ``out:0:1e-4``), for :class:`MultiValueOption`."""

    def check(text: str) -> bool:
        if text.startswith("-"):
            return False
        try:
            kind(text.rpartition(":")[2])
        except ValueError:
            return False
        return True

    return check


def looks_like_range(text: str) -> bool:
    """``[LO,HI]`` or ``NAME:[LO,HI]`` words, for :class:`MultiValueOption`."""
    return text.endswith("]") and "[" in text and not text.startswith("-")


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
        import tomllib  # only --rule-option needs it: not imported on every start

        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except (tomllib.TOMLDecodeError, RecursionError):
            value = raw
        out.setdefault(rule_id, {})[key] = value
    if dql_semantics:
        out.setdefault("dql-expand", {})["semantics"] = dql_semantics
    return out


def rule_selection(func: Callable) -> Callable:
    """--rules/--only/--skip/--rule-option/--form/--form-option/--dql-semantics, as one reusable group
    (the commands pass --form/--form-option through :func:`expand_forms` first)."""
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
            "--form",
            "forms",
            multiple=True,
            metavar="NAME",
            help="Add a named form (rules/forms/NAME.toml, e.g. weight-only, float-emulation, qdq-to-float): "
            "rewrites the default catalogue does not make; repeatable.",
        ),
        click.option(
            "--form-option",
            "form_options",
            multiple=True,
            metavar="KEY=VALUE",
            help="Set option KEY on every rule of the --form forms that takes it, e.g. weights=float; repeatable.",
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


def plan_options(*, inspecting: bool) -> Callable[[Callable], Callable]:
    """--target-opset/--keep-opset/--allow-approximate, shared by ``rewrite`` and ``inspect`` (which
    plans as if rewriting with them, so its help says so)."""
    helps = {
        "--target-opset": "Raise the default-domain opset to N first (max 26).",
        "--keep-opset": "Never change the opset; use exact decompositions instead.",
        "--allow-approximate": "Also apply approximate rules (they change the model's numerics by design; "
        "tried first).",
    }
    if inspecting:
        helps = {
            "--target-opset": "Plan as if rewriting with --target-opset N.",
            "--keep-opset": "Plan as if rewriting with --keep-opset.",
            "--allow-approximate": "Plan as if rewriting with --allow-approximate.",
        }
    options = [
        click.option("--target-opset", type=int, default=None, help=helps["--target-opset"]),
        click.option("--keep-opset", is_flag=True, help=helps["--keep-opset"]),
        click.option("--allow-approximate", is_flag=True, help=helps["--allow-approximate"]),
    ]

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def target_input_shapes(texts: tuple[str, ...], target: str | None) -> Any:
    """``--input-shape`` for a target (``inspect``/``rewrite --target``): the dimensions to fix before
    planning (onnx_qrewrite.targets.shapes.InputShapes), None when none are given or there is no
    target (then only ``--verify``'s samples take them). A malformed one is a UsageError."""
    if not texts or target is None:
        return None
    from onnx_qrewrite.targets.shapes import parse_input_shapes

    return parse_input_shapes(texts)


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


def expand_forms(
    forms: tuple[str, ...],
    form_options: tuple[str, ...],
    rule_files: tuple[str, ...],
    rule_options: tuple[str, ...],
    *,
    allow_approximate: bool | None = None,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``--form NAME`` and ``--form-option KEY=VALUE`` as what they stand for: the forms' rule files
    added to ``rule_files``, and ``ID.KEY=VALUE`` for every rule of those forms whose builder takes
    KEY added to ``rule_options``. A form whose rules are all approximate needs
    ``allow_approximate`` (when given: commands that rewrite or plan), else it would do nothing."""
    if form_options and not forms:
        raise UsageError("--form-option needs --form (the forms whose rules it sets)")
    if not forms:
        return tuple(rule_files), tuple(rule_options)
    from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

    paths: list[str] = []
    rules: list[Any] = []
    for name in forms:
        try:
            path = named_form(name)
        except UsageError as exc:
            raise UsageError(f"--form {name}: {exc}") from None
        form_rules = list(load_catalogue([path], include_shipped=False))
        if allow_approximate is False and all(r.exactness == "approximate" for r in form_rules):
            raise UsageError(
                f"--form {name}: its rules are approximate (they change the model's numerics by design); "
                "add --allow-approximate to apply them"
            )
        paths.append(str(path))
        rules.extend(form_rules)
    extra: list[str] = []
    for item in form_options:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--form-option {item!r}: expected KEY=VALUE")
        takers = [r for r in rules if key in r.contract.option_names()]
        if not takers:
            from onnx_qrewrite.rewriter.contract import closest

            known = sorted({o for r in rules for o in r.contract.option_names()})
            raise UsageError(
                f"--form-option {item!r}: no rule of {', '.join(forms)} takes option {key!r}"
                f"{closest(key, known)}; options: {', '.join(known) or 'none'}"
            )
        extra.extend(f"{r.id}.{key}={raw}" for r in takers)
    # The forms' options go first: an explicit --rule-option for one rule still wins.
    return (*rule_files, *paths), (*extra, *rule_options)


def load_selected_rules(rule_files, only, skip, rule_options, dql_semantics, float16_semantics=None):
    from onnx_qrewrite.rewriter.catalogue import load_rules  # not through api: that imports the engine

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


def output_file_option(flag: str, dest: str, help: str) -> Callable[[Callable], Callable]:
    """A file the command writes (``--report``, ``--junit``, ``--save-inputs``...): one spelling, so
    every such option is a plain file path checked by :func:`check_report_paths` before any work."""
    return click.option(flag, dest, type=click.Path(dir_okay=False), default=None, help=help)


#: ``-j/--jobs``, the same on every subcommand that runs several models.
jobs_option = click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes for several models.",
)


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
