"""``onnx-qrewrite verify``: run the original and the rewritten model and prove they agree.

The options are one reusable group (:func:`verify_options`), so ``rewrite --verify`` takes the
same ones; :func:`verify_kwargs` turns their values into keyword arguments of
:func:`onnx_qrewrite.verify.verify` (validating them all before any inference runs) and
:func:`emit_report` prints and writes the report.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from onnx_qrewrite.cli.options import (
    MultiValueOption,
    check_report_paths,
    global_options,
    jobs_option,
    looks_like_number_value,
    looks_like_range,
    output_file_option,
)
from onnx_qrewrite.errors import UsageError, worst_exit_code
from onnx_qrewrite.io.clash import check_writes, model_reads
from onnx_qrewrite.io.outputs import write_report_file

if TYPE_CHECKING:
    from onnx_qrewrite.cli.batch import Outcome

__all__ = ["combined_junit", "emit_report", "verify_command", "verify_kwargs", "verify_options"]

logger = logging.getLogger(__name__)

_OPT_LEVELS = ("disable", "basic", "extended", "all")  # checked again by SessionSettings


def _per_output_option(
    flag: str, kind: type, help: str, metavar: str = "[NAME:]VALUE"
) -> Callable[[Callable], Callable]:
    """A number for every output or for one (``NAME:VALUE``), several after one flag or repeated:
    the one spelling of every tolerance and drift threshold, as Polygraphy spells ``--atol``."""
    return click.option(
        flag, cls=MultiValueOption, looks_like=looks_like_number_value(kind), metavar=metavar, help=help
    )


def verify_options(
    *, report: bool = True, junit: bool = True, runtime_default: str | None = "onnxruntime"
) -> Callable[[Callable], Callable]:
    """The verification options, as one group shared by ``verify`` and ``rewrite --verify``
    (which has its own ``--report`` and ``--junit``, hence the switches). ``rewrite`` leaves
    ``--runtime`` unset by default (None), so that with ``--target`` an explicit
    ``--runtime onnxruntime`` can be told apart from no choice (then the target's runtime)."""
    options: list[Callable[[Callable], Callable]] = [
        *_input_options(),
        *_tolerance_options(),
        *_drift_options(),
        *_session_options(runtime_default),
    ]
    if report:
        options.append(
            output_file_option(
                "--report", "report_path", "Write the JSON report (schema: onnx_qrewrite/verify/report.schema.json)."
            )
        )
    if junit:
        options.append(
            output_file_option(
                "--junit", "junit_path", "Write a JUnit XML report: one test suite per model, one case per output."
            )
        )

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def _input_options() -> list[Callable[[Callable], Callable]]:
    """Where the inputs come from: a file, or generated (how many, seeded, in which ranges and shapes)."""
    return [
        click.option(
            "--inputs",
            "inputs_file",
            type=click.Path(dir_okay=False),
            default=None,
            help="Run on these inputs (.npz keyed by input name) instead of generated ones.",
        ),
        click.option(
            "--samples",
            type=int,
            default=2,
            show_default=True,
            help="Random samples to generate, at most 100000 (the quantization battery comes on top).",
        ),
        click.option(
            "--seed", type=int, default=0, show_default=True, help="Seed of the generated inputs (0 to 2**64-1)."
        ),
        click.option(
            "--int-range",
            default=None,
            metavar="LO,HI",
            help="Range of every generated integer input, inclusive. Default: Gather indices within the "
            "table, other integers {0, 1}.",
        ),
        click.option(
            "--val-range",
            "val_ranges",
            cls=MultiValueOption,
            looks_like=looks_like_range,
            metavar="[NAME:][LO,HI]",
            help="Range of generated values, as Polygraphy spells it: NAME:[LO,HI] for one input, "
            "[LO,HI] for every input; several after one flag, or repeated.",
        ),
        click.option(
            "--input-shape",
            "input_shapes",
            multiple=True,
            metavar="NAME:D0,D1,... | DIM=N",
            help="Shape of an input with symbolic dimensions, or DIM=N: the symbolic dimension named DIM in "
            "every input (default: 1 for each); repeatable. rewrite --target also fixes them in the model "
            "before planning.",
        ),
        click.option(
            "--battery/--no-battery",
            default=True,
            show_default=True,
            help="Add the quantization battery for float inputs: zeros, a constant, a wide range, negatives.",
        ),
    ]


def _tolerance_options() -> list[Callable[[Callable], Callable]]:
    """How outputs are compared element by element."""
    return [
        _per_output_option(
            "--atol",
            float,
            "Absolute tolerance for float outputs; NAME:VALUE for one output; several after one "
            "flag (--atol 1e-5 out0:1e-4) or repeated. Default by dtype.",
        ),
        _per_output_option(
            "--rtol", float, "Relative tolerance for float outputs, in the same forms as --atol. Default by dtype."
        ),
        _per_output_option(
            "--lsb",
            int,
            "Allowed difference in units for integer/quantized outputs (default 0: exact).",
            metavar="[NAME:]N",
        ),
        click.option(
            "--tolerance-rule",
            type=click.Choice(["numpy", "polygraphy"]),
            default="numpy",
            show_default=True,
            help="Float elements pass when |diff| <= atol + rtol*|original| (numpy), or when |diff| <= atol "
            "OR |diff|/|rewritten| <= rtol (polygraphy: its default elemwise check).",
        ),
    ]


def _drift_options() -> list[Callable[[Callable], Callable]]:
    """When and how outputs are judged by their drift instead (approximate rewrites)."""
    return [
        click.option(
            "--drift",
            "drift_mode",
            type=click.Choice(["auto", "always", "never"]),
            default="auto",
            show_default=True,
            help="Judge the outputs by their drift (relative L2, cosine, argmax agreement) instead of element "
            "by element: auto when the rewrite carries approximate rules (its provenance says so).",
        ),
        _per_output_option(
            "--drift-rel-l2",
            float,
            "Drift: largest relative L2 error ||rewritten - original|| / ||original|| on any sample "
            "(default 0.05), in the forms of --atol.",
        ),
        _per_output_option("--drift-cosine", float, "Drift: smallest cosine similarity on any sample (default 0.999)."),
        _per_output_option(
            "--drift-argmax",
            float,
            "Drift: smallest fraction of rows whose argmax agrees, for classifier-shaped outputs "
            "(float, last dimension > 1; default 0.8).",
        ),
        _per_output_option(
            "--drift-atol",
            float,
            "Drift: largest absolute error (default: reported, not judged: its scale is the output's).",
        ),
    ]


def _session_options(runtime_default: str | None) -> list[Callable[[Callable], Callable]]:
    """How the models run: onnxruntime settings, files of inputs and outputs kept, the runtime, localisation."""
    runtime_help = (
        "Run the rewritten model on this runtime (the original stays in onnxruntime); each is an "
        "extra: pip install 'onnx-qrewrite[openvino]' (or tract, qnn); tflite runs in a Python 3.12+ environment "
        "of its own, named by $ONNX_QREWRITE_TFLITE_PYTHON."
    )
    if runtime_default is None:
        runtime_help += " Default: --target's runtime when installed, else onnxruntime."
    return [
        click.option(
            "--ort-opt-level",
            type=click.Choice(_OPT_LEVELS),
            default="disable",
            show_default=True,
            help="onnxruntime graph optimisation, the same for both models (it changes QDQ numerics).",
        ),
        click.option(
            "--threads",
            type=int,
            default=1,
            show_default=True,
            help="onnxruntime intra-op threads for both models (0: onnxruntime's default; capped at the CPUs).",
        ),
        click.option(
            "--custom-op-library",
            type=click.Path(dir_okay=False),
            default=None,
            help="Run the original's vendor ops with this library instead of the reference kernels.",
        ),
        output_file_option("--save-inputs", "save_inputs", "Write the inputs used to this .npz file."),
        output_file_option(
            "--save-outputs",
            "save_outputs",
            "Write the inputs and the original's outputs to this .npz file (for --load-outputs).",
        ),
        click.option(
            "--runtime",
            type=click.Choice(["onnxruntime", "openvino", "tract", "qnn", "tflite"]),
            default=runtime_default,
            show_default=runtime_default is not None,
            help=runtime_help,
        ),
        click.option(
            "--providers",
            default=None,
            metavar="EP[,EP...]",
            help="onnxruntime execution providers for the rewritten model, e.g. CUDAExecutionProvider.",
        ),
        click.option(
            "--localize/--no-localize",
            default=True,
            show_default=True,
            help="On disagreement, name the first differing node of the rewritten model.",
        ),
    ]


def verify_kwargs(
    *,
    inputs_file: str | None,
    samples: int,
    seed: int,
    int_range: str | None,
    val_ranges: tuple[str, ...],
    input_shapes: tuple[str, ...],
    battery: bool,
    atol: tuple[str, ...],
    rtol: tuple[str, ...],
    lsb: tuple[str, ...],
    tolerance_rule: str,
    ort_opt_level: str,
    threads: int,
    custom_op_library: str | None,
    save_inputs: str | None,
    save_outputs: str | None,
    localize: bool,
    runtime: str | None = "onnxruntime",
    providers: str | None = None,
    drift_mode: str = "auto",
    drift_rel_l2: tuple[str, ...] = (),
    drift_cosine: tuple[str, ...] = (),
    drift_argmax: tuple[str, ...] = (),
    drift_atol: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Option values -> keyword arguments of ``verify``; raises UsageError naming a bad option.
    Everything that can be checked without the models is checked here, before any work."""
    from onnx_qrewrite.cli import import_quietly
    from onnx_qrewrite.io.input_shape import parse_input_shapes

    import_quietly("onnx_qrewrite.verify")  # numpy and onnxruntime: see import_quietly
    from onnx_qrewrite.verify import DriftThresholds, GenerationOptions, SessionSettings, Tolerances
    from onnx_qrewrite.verify.inputs import parse_int_range, parse_val_range

    given = parse_input_shapes(input_shapes)  # the one parser of --input-shape, as rewrite --target's
    shapes = dict(given.inputs)
    ranges = dict(parse_val_range(text) for text in val_ranges)
    generation = GenerationOptions(
        samples=samples,
        seed=seed,
        int_range=None if int_range is None else parse_int_range(int_range),
        shapes=shapes,
        battery=battery,
        value_ranges=ranges,
        dims=dict(given.dims),
    )
    session = SessionSettings(opt_level=ort_opt_level, threads=threads)
    provider_list = [p.strip() for p in providers.split(",") if p.strip()] if providers else []
    return {
        "inputs": inputs_file,
        "samples": generation.samples,
        "seed": generation.seed,
        "int_range": generation.int_range,
        "value_ranges": ranges,
        "input_shapes": shapes,
        "input_dims": dict(generation.dims),
        "battery": battery,
        "tolerances": Tolerances.from_options(atol, rtol, lsb, tolerance_rule),
        "opt_level": ort_opt_level,
        "threads": session.threads,
        "custom_op_library": custom_op_library,
        "save_inputs": save_inputs,
        "save_outputs": save_outputs,
        "localize_failures": localize,
        "runtime": _checked_runtime(runtime, provider_list),
        "providers": provider_list or None,
        "drift": DriftThresholds.from_options(drift_mode, drift_rel_l2, drift_cosine, drift_argmax, drift_atol),
    }


def _checked_runtime(runtime: str | None, providers: list[str]) -> str:
    """The runtime the rewrite runs on (onnxruntime unless given). ``--providers`` are onnxruntime's:
    ``verify`` refuses them with another runtime too, but ``rewrite --verify`` would only after its
    work, so they are refused here, with the other option checks."""
    runtime = runtime or "onnxruntime"
    if providers and runtime != "onnxruntime":
        raise UsageError(
            f"--providers chooses onnxruntime's execution providers; it does not apply to --runtime {runtime}"
        )
    if providers:
        from onnx_qrewrite.verify.runtimes import check_providers

        check_providers(providers)
    return runtime


def combined_junit(
    documents: Sequence[str | None], labels: Sequence[str], errors: Sequence[str | None], path: str
) -> None:
    """One JUnit file for several models: their ``<testsuite>`` elements side by side; a model that
    could not be verified at all becomes a suite with one errored case, so CI shows it too."""
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name="onnx-qrewrite verify")
    tests = failures = errored = 0
    for document, label, error in zip(documents, labels, errors, strict=True):
        if document is not None:
            for suite in ET.fromstring(document).iter("testsuite"):
                root.append(suite)
                tests += int(suite.get("tests", 0))
                failures += int(suite.get("failures", 0))
        else:
            suite = ET.SubElement(root, "testsuite", name=label, tests="1", failures="0", errors="1", skipped="0")
            case = ET.SubElement(suite, "testcase", classname=Path(label).stem, name="verify")
            ET.SubElement(case, "error", message=error or "not verified", type="error")
            tests += 1
            errored += 1
    root.set("tests", str(tests))
    root.set("failures", str(failures))
    root.set("errors", str(errored))
    tree = ET.ElementTree(root)
    ET.indent(tree)
    write_report_file(path, ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n", "--junit")


def _verify_one(args: tuple[str | None, str, dict[str, Any]]) -> Outcome:
    from onnx_qrewrite.cli.batch import Outcome
    from onnx_qrewrite.verify import verify

    original, rewritten, kwargs = args
    report = verify(original, rewritten, **kwargs)
    return Outcome(
        0,
        original or rewritten,
        report.exit_code,
        [report.to_table()],
        payload={"report": report.to_dict(), "junit": report.junit_xml()},
    )


@click.command("verify")
@global_options
@click.argument("models", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--rewritten-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Verify each ORIGINAL against the model of the same name in this folder.",
)
@click.option(
    "--load-outputs",
    type=click.Path(dir_okay=False),
    default=None,
    help="Compare one MODEL with the inputs and outputs stored by --save-outputs, instead of an original.",
)
@jobs_option
@verify_options()
@click.pass_context
def verify_command(
    ctx: click.Context,
    models: tuple[str, ...],
    rewritten_dir: str | None,
    load_outputs: str | None,
    jobs: int,
    report_path: str | None,
    junit_path: str | None,
    **options: Any,
) -> None:
    """Run ORIGINAL and REWRITTEN in onnxruntime on the same inputs and compare every output.

    \b
    onnx-qrewrite verify ORIGINAL REWRITTEN
    onnx-qrewrite verify ORIGINAL... --rewritten-dir DIR [--jobs N]
    onnx-qrewrite verify MODEL --load-outputs FILE   (FILE from --save-outputs)

    Vendor ops in ORIGINAL run on numpy reference kernels of their measured semantics (or on
    --custom-op-library); REWRITTEN runs in stock onnxruntime.

    A rewrite that carries approximate rules (numerics changed by design) is judged by its drift
    (--drift, --drift-*): relative L2 error, cosine similarity, argmax agreement.

    \b
    Exit codes: 0 they agree (approximate rewrites: drift within thresholds); 1 they differ, or
    the drift is beyond a threshold (the first differing node is named with its rule);
    6 nothing was compared (zero-size or no outputs, the same file twice, every sample
    excluded); 2 usage, 3 invalid model, 5 internal error. With several models, the worst.
    """
    pairs = _model_pairs(models, rewritten_dir, load_outputs)
    _check_writes(pairs, options, load_outputs, report_path, junit_path)
    kwargs = verify_kwargs(**options)
    if load_outputs is not None:
        kwargs["load_outputs"] = load_outputs
    quiet = bool((ctx.obj or {}).get("quiet"))
    if len(pairs) == 1:
        code = _verify_pair(pairs[0], kwargs, report_path, junit_path, quiet)
    else:
        code = _verify_pairs(pairs, kwargs, jobs, report_path, junit_path, quiet)
    if code:
        ctx.exit(code)


def _model_pairs(
    models: tuple[str, ...], rewritten_dir: str | None, load_outputs: str | None
) -> list[tuple[str | None, str]]:
    """(original, rewritten) per comparison, from the three ways verify is called; ``None`` as the
    original: compare with the stored outputs of --load-outputs. A usage error before any work."""
    if load_outputs is not None:
        if len(models) != 1 or rewritten_dir is not None:
            raise UsageError("--load-outputs takes one MODEL (compared with the stored outputs)")
        return [(None, models[0])]
    if rewritten_dir is None:
        if len(models) != 2:
            raise UsageError("verify takes ORIGINAL REWRITTEN, or ORIGINAL... with --rewritten-dir")
        return [(models[0], models[1])]
    return [(m, str(Path(rewritten_dir) / Path(m).name)) for m in models]


def _check_writes(
    pairs: list[tuple[str | None, str]],
    options: dict[str, Any],
    load_outputs: str | None,
    report_path: str | None,
    junit_path: str | None,
) -> None:
    """Before any work: what verify writes (reports, saved inputs and outputs) is writable, none
    of it is a file verify reads (the models, their external data, --inputs, --load-outputs,
    --custom-op-library) nor a FIFO or device, and saved inputs or outputs are of one pair."""
    for option in ("save_inputs", "save_outputs"):
        if options.get(option) and len(pairs) > 1:
            raise UsageError(f"--{option.replace('_', '-')} takes one model pair; verify the others separately")
    check_report_paths(
        report=report_path,
        junit=junit_path,
        save_inputs=options.get("save_inputs"),
        save_outputs=options.get("save_outputs"),
    )
    _refuse_writing_what_is_read(
        [m for pair in pairs for m in pair if m is not None]
        + [p for p in (options.get("inputs_file"), load_outputs, options.get("custom_op_library")) if p],
        report=report_path,
        junit=junit_path,
        save_inputs=options.get("save_inputs"),
        save_outputs=options.get("save_outputs"),
    )
    # ... nor the external data those models reference, nor a FIFO or device (clash.check_writes).
    # Finding that data reads every model file once more: only worth it when something is written.
    writes = [("--report", report_path), ("--junit", junit_path)]
    writes += [("--save-inputs", options.get("save_inputs")), ("--save-outputs", options.get("save_outputs"))]
    if any(path for _, path in writes):
        reads: dict[tuple[int, int], Path] = {}
        for pair in pairs:
            for model in pair:
                if model is not None:
                    reads.update(model_reads(model))
        for option in ("inputs_file", "load_outputs"):
            given = options.get(option) if option != "load_outputs" else load_outputs
            if given:
                reads.update(model_reads(given))
        check_writes(writes, reads)


def _verify_pair(
    pair: tuple[str | None, str],
    kwargs: dict[str, Any],
    report_path: str | None,
    junit_path: str | None,
    quiet: bool,
) -> int:
    """One comparison, in this process (with a progress bar): its report, and its exit code."""
    from onnx_qrewrite.progress import TerminalProgress
    from onnx_qrewrite.verify import verify

    progress = TerminalProgress(quiet=quiet)
    try:
        report = verify(pair[0], pair[1], progress=progress, **kwargs)
    finally:
        progress.close()
    emit_report(report, report_path=report_path, junit_path=junit_path, quiet=quiet)
    return report.exit_code


def _verify_pairs(
    pairs: list[tuple[str | None, str]],
    kwargs: dict[str, Any],
    jobs: int,
    report_path: str | None,
    junit_path: str | None,
    quiet: bool,
) -> int:
    """Several comparisons in worker processes, each one's lines as it ends; one report and one
    JUnit file for all, in the order given, and a count. The worst exit code."""
    from onnx_qrewrite.cli.batch import run_tasks  # worker processes: only for several models

    outcomes = []
    labels = [o or r for o, r in pairs]
    for outcome in run_tasks(_verify_one, [(o, r, kwargs) for o, r in pairs], labels, jobs):
        outcomes.append(outcome)
        if not quiet:
            click.echo("\n".join(outcome.lines))
        if outcome.error:
            click.echo(f"onnx-qrewrite: error: {outcome.label}: {outcome.error}", err=True)
    outcomes.sort(key=lambda o: o.index)
    if report_path:
        body = {"models": [o.payload.get("report") or {"original": o.label, "error": o.error} for o in outcomes]}
        import json  # only reports need it: not imported on every verify

        write_report_file(report_path, json.dumps(body, indent=2) + "\n", "--report")
    if junit_path:
        combined_junit(
            [o.payload.get("junit") for o in outcomes],
            [o.label for o in outcomes],
            [o.error for o in outcomes],
            junit_path,
        )
    failed = [o for o in outcomes if o.exit_code]
    worst = worst_exit_code(o.exit_code for o in outcomes)
    if not quiet:
        click.echo(
            f"{len(pairs)} models: {len(pairs) - len(failed)} agree, {len(failed)} not"
            + (f" (worst exit code {worst})" if failed else "")
        )
    return worst


def _refuse_writing_what_is_read(read: list[str], **written: str | None) -> None:
    """No file verify writes (reports, saved inputs or outputs) may be a file it reads (the models,
    --inputs, --load-outputs), compared by inode, nor two of them one file: a usage error naming
    both, before any work."""
    from onnx_qrewrite.io import outputs

    reads: dict[tuple[int, int], Path] = {}
    for path in read:
        try:
            reads.setdefault(outputs.file_id(os.stat(path)), Path(path))
        except OSError:
            continue  # a missing input is reported when it is opened
    seen: dict[str, str] = {}
    for key, target in written.items():
        if not target:
            continue
        option = "--" + key.replace("_", "-")
        outputs.refuse_clash(Path(target), reads, option)
        resolved = os.path.realpath(target)
        if resolved in seen:
            raise UsageError(f"{option} {target}: is also given to {seen[resolved]}; give each its own file")
        seen[resolved] = option


def emit_report(report: Any, *, report_path: str | None, junit_path: str | None, quiet: bool) -> None:
    """Write the requested report files and, unless quiet, print the table."""
    if report_path:
        report.write_json(report_path)
    if junit_path:
        report.write_junit(junit_path)
    if not quiet:
        click.echo(report.to_table())
