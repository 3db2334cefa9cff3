"""``onnx-qrewrite verify``: run the original and the rewritten model and prove they agree.

The options are one reusable group (:func:`verify_options`), so ``rewrite --verify`` takes the
same ones; :func:`verify_kwargs` turns their values into keyword arguments of
:func:`onnx_qrewrite.verify.verify` (validating them all before any inference runs) and
:func:`emit_report` prints and writes the report.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import click

from onnx_qrewrite.errors import EXIT_DISAGREE

__all__ = ["verify_command", "verify_options", "verify_kwargs", "emit_report"]

logger = logging.getLogger(__name__)

_OPT_LEVELS = ("disable", "basic", "extended", "all")  # checked again by SessionSettings


def verify_options(func: Callable) -> Callable:
    """The verification options, as one group shared by ``verify`` and ``rewrite --verify``."""
    options = [
        click.option("--inputs", "inputs_file", type=click.Path(dir_okay=False), default=None,
                     help="Run on these inputs (.npz keyed by input name) instead of generated ones."),
        click.option("--samples", type=int, default=2, show_default=True,
                     help="Random samples to generate (the quantization battery comes on top)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated inputs."),
        click.option("--int-range", default="0,9", show_default=True, metavar="LO,HI",
                     help="Range of generated integer inputs (ids), inclusive."),
        click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D0,D1,...",
                     help="Shape of an input with symbolic dimensions (default: 1 for each); repeatable."),
        click.option("--battery/--no-battery", default=True, show_default=True,
                     help="Add the quantization battery for float inputs: zeros, a constant, a wide range, negatives."),
        click.option("--atol", multiple=True, metavar="[NAME:]VALUE",
                     help="Absolute tolerance for float outputs; NAME:VALUE for one output. Default by dtype."),
        click.option("--rtol", multiple=True, metavar="[NAME:]VALUE",
                     help="Relative tolerance for float outputs; NAME:VALUE for one output. Default by dtype."),
        click.option("--lsb", multiple=True, metavar="[NAME:]N",
                     help="Allowed difference in units for integer/quantized outputs (default 0: exact)."),
        click.option("--ort-opt-level", type=click.Choice(_OPT_LEVELS), default="disable", show_default=True,
                     help="onnxruntime graph optimisation, the same for both models (it changes QDQ numerics)."),
        click.option("--threads", type=int, default=1, show_default=True,
                     help="onnxruntime intra-op threads for both models (0: onnxruntime's default)."),
        click.option("--custom-op-library", type=click.Path(dir_okay=False), default=None,
                     help="Run the original's vendor ops with this library instead of the reference kernels."),
        click.option("--save-inputs", type=click.Path(dir_okay=False), default=None,
                     help="Write the inputs used to this .npz file."),
        click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None,
                     help="Write the JSON report (schema: onnx_qrewrite/verify/report.schema.json)."),
        click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None,
                     help="Write a JUnit XML report: one test case per output."),
        click.option("--localize/--no-localize", default=True, show_default=True,
                     help="On disagreement, name the first differing node of the rewritten model."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def verify_kwargs(
    *,
    inputs_file: str | None,
    samples: int,
    seed: int,
    int_range: str,
    input_shapes: tuple[str, ...],
    battery: bool,
    atol: tuple[str, ...],
    rtol: tuple[str, ...],
    lsb: tuple[str, ...],
    ort_opt_level: str,
    threads: int,
    custom_op_library: str | None,
    save_inputs: str | None,
    localize: bool,
) -> dict[str, Any]:
    """Option values -> keyword arguments of ``verify``; raises UsageError naming a bad option."""
    from onnx_qrewrite.verify import Tolerances
    from onnx_qrewrite.verify.inputs import parse_input_shape, parse_int_range

    shapes = dict(parse_input_shape(text) for text in input_shapes)
    return {
        "inputs": inputs_file,
        "samples": samples,
        "seed": seed,
        "int_range": parse_int_range(int_range),
        "input_shapes": shapes,
        "battery": battery,
        "tolerances": Tolerances.from_options(atol, rtol, lsb),
        "opt_level": ort_opt_level,
        "threads": threads,
        "custom_op_library": custom_op_library,
        "save_inputs": save_inputs,
        "localize_failures": localize,
    }


def emit_report(report: Any, *, report_path: str | None, junit_path: str | None, quiet: bool) -> None:
    """Write the requested report files and, unless quiet, print the table."""
    if report_path:
        report.write_json(report_path)
    if junit_path:
        report.write_junit(junit_path)
    if not quiet:
        click.echo(report.to_table())


@click.command("verify")
@click.argument("original", type=click.Path(dir_okay=False))
@click.argument("rewritten", type=click.Path(dir_okay=False))
@verify_options
@click.pass_context
def verify_command(ctx: click.Context, original: str, rewritten: str, report_path: str | None,
                   junit_path: str | None, **options: Any) -> None:
    """Run ORIGINAL and REWRITTEN in onnxruntime on the same inputs and compare every output.

    Vendor ops in ORIGINAL run on numpy reference kernels of their measured semantics (or on
    --custom-op-library); REWRITTEN runs in stock onnxruntime. Exit 0 when they agree, 1 when they
    differ (the first differing node is named with its rule), 2+ on errors.
    """
    from onnx_qrewrite.verify import verify

    kwargs = verify_kwargs(**options)
    report = verify(original, rewritten, **kwargs)
    quiet = bool((ctx.obj or {}).get("quiet"))
    emit_report(report, report_path=report_path, junit_path=junit_path, quiet=quiet)
    if not report.passed:
        ctx.exit(EXIT_DISAGREE)
