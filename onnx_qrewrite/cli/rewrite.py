"""``onnx-qrewrite rewrite``: rewrite one model or many, optionally verify, say what changed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.cli.batch import Outcome, run_tasks
from onnx_qrewrite.cli.options import (
    check_report_paths,
    expand_forms,
    float16_semantics_option,
    global_options,
    jobs_option,
    load_selected_rules,
    output_file_option,
    plan_options,
    rule_selection,
    target_input_shapes,
)
from onnx_qrewrite.cli.verify import combined_junit, verify_kwargs, verify_options
from onnx_qrewrite.errors import UsageError, worst_exit_code
from onnx_qrewrite.io.clash import check_writes, model_reads
from onnx_qrewrite.rewriter.report import write_report_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Task:
    """Everything a worker needs for one model (picklable)."""

    model: str
    output: str
    rule_files: tuple[str, ...]
    only: tuple[str, ...]
    skip: tuple[str, ...]
    rule_options: tuple[str, ...]
    dql_semantics: str | None
    float16_semantics: str | None
    engine: dict[str, Any]
    reference_external_data: bool
    verify: dict[str, Any] | None
    keep_failed: bool
    progress: bool
    want_report: bool
    #: Every file the whole invocation reads, as (st_dev, st_ino, path): never written or removed.
    reads: tuple[tuple[int, int, str], ...] = ()
    #: The other files the invocation writes (--report, --junit, --save-inputs), as (option, path).
    other_writes: tuple[tuple[str, str], ...] = ()


def _rewrite_one(task: _Task) -> Outcome:
    from onnx_qrewrite.api import rewrite
    from onnx_qrewrite.progress import TerminalProgress

    progress = TerminalProgress(enabled=task.progress)
    catalogue = load_selected_rules(
        task.rule_files, task.only, task.skip, task.rule_options, task.dql_semantics, task.float16_semantics
    )
    try:
        result = rewrite(task.model, rules=catalogue, progress=progress, **task.engine)
        # Checked again against the files this worker really opened (the parent scanned bytes).
        reads = {(d, i): Path(p) for d, i, p in task.reads}
        reads.update(result.reads)
        check_writes([("-o", task.output), *task.other_writes], reads, [task.output])
        result.reads = reads
        info = result.save(task.output, reference_external_data=task.reference_external_data, progress=progress)
        report = None
        if task.verify is not None:
            from onnx_qrewrite.verify import verify

            try:
                report = verify(task.model, task.output, progress=progress, **_verify_args(task, result))
            except BaseException:
                # A verification that could not run (a bad --input-shape name, a model onnxruntime
                # refuses, Ctrl-C) proved nothing: the output goes, as on a disagreement.
                _remove_output(task.output, info.data_path)
                raise
    finally:
        progress.close()
    outcome = Outcome(0, task.model)
    outcome.lines.append(f"{task.model} -> {task.output}")
    outcome.lines.extend(result.report.summary_lines())
    if info.referenced:
        outcome.lines.append(f"  external data referenced in place (zero copy): {', '.join(info.referenced)}")
    elif info.data_path is not None:
        outcome.lines.append(f"  external data written to {info.data_path} ({info.external_bytes} bytes)")
    outcome.lines.extend(f"  warning: {w}" for w in result.report.warnings)
    if task.want_report:
        outcome.payload = {"input": task.model, "output": task.output, **result.report.to_dict()}
        if info.referenced:
            outcome.payload["external_data_referenced"] = list(info.referenced)
    if report is not None:
        outcome.lines.append(report.to_table())
        if task.want_report:
            outcome.payload["verification"] = report.to_dict()
        outcome.payload["_junit"] = report.junit_xml()
        if not report.passed:
            outcome.exit_code = report.exit_code
            if not task.keep_failed:
                _remove_output(task.output, info.data_path)
                why = "verification failed" if report.verdict_key == "failed" else "verification proved nothing"
                outcome.lines.append(f"  removed {task.output}: {why} (--keep-failed keeps it)")
    return outcome


def _refuse_verify_options(ctx: click.Context, verify_opts: dict[str, Any]) -> None:
    """A verification option the user gave without ``--verify`` would act on nothing: say so
    (exit 2) rather than ignore it. ``--input-shape`` also serves ``--target``, which checks it."""
    for name in verify_opts:
        if name == "input_shapes":
            continue
        source = ctx.get_parameter_source(name)
        if source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            param = next(p for p in ctx.command.params if p.name == name)
            raise UsageError(f"{'/'.join([*param.opts, *param.secondary_opts])} needs --verify")


def _split_input_shapes(verify_opts: dict[str, Any], target: str | None, do_verify: bool) -> tuple[Any, dict[str, Any]]:
    """``--input-shape`` with ``--target``: the dimensions to fix (targets/shapes.py), and verify's
    options without the DIM=N ones (its samples take the fixed model's shapes, :func:`_verify_args`).
    Without ``--target`` the rewrite's shapes stay as they are and ``--verify``'s samples take them,
    as ``verify --input-shape`` does; with neither, the option would act on nothing: a UsageError."""
    texts = verify_opts["input_shapes"]
    if texts and target is None and not do_verify:
        raise UsageError(
            f"--input-shape {texts[0]}: fixes shapes for --target's plan or --verify's samples; give one of them"
        )
    shapes = target_input_shapes(texts, target)
    if shapes is None:
        return None, verify_opts
    return shapes, {**verify_opts, "input_shapes": tuple(t for t in texts if ":" in t or "=" not in t)}


def _verify_args(task: _Task, result: Any) -> dict[str, Any]:
    """``verify``'s arguments; when ``--input-shape`` fixed dimensions for the target, the samples
    take the output's static input shapes, and each fixed DIM=N by name (the original's inputs have
    it too): an input whose other dimensions stay symbolic, e.g. ``seq=16`` on ``[batch, seq]``, has
    no static shape, and its samples must still have the 16 the output now declares."""
    assert task.verify is not None
    fixed = (result.report.target or {}).get("input_shapes") if task.engine.get("input_shapes") else None
    if not fixed:
        return task.verify
    return {
        **task.verify,
        "input_shapes": {**fixed["shapes"], **task.verify["input_shapes"]},
        "input_dims": {**fixed["dims"], **task.verify["input_dims"]},
    }


def _target_runtime(profile: Any, verify_opts: dict[str, Any]) -> str:
    """``rewrite --target T --verify`` verifies on T's runtime when it is installed, and says so
    clearly (on stderr) when it is not and onnxruntime verifies instead. "Installed" is decided by
    the check ``verify --runtime`` makes (:func:`~onnx_qrewrite.verify.runtimes.require_runtime`):
    for tflite, the interpreter ``$ONNX_QREWRITE_TFLITE_PYTHON`` names, not this one. A runtime
    the user named (``--runtime``, onnxruntime included) wins: it has no default here.
    ``--providers`` (onnxruntime's) with T's runtime is a usage error naming the target."""
    from onnx_qrewrite.errors import MissingDependencyError
    from onnx_qrewrite.verify.runtimes import RUNTIMES, install_hint, require_runtime

    asked, providers = verify_opts.get("runtime"), verify_opts.get("providers")
    if asked is not None:
        return asked
    runtime = profile.runtime
    if runtime is None or runtime not in RUNTIMES:
        click.echo(f"onnx-qrewrite: note: no runtime for target {profile.id} here; verifying in onnxruntime", err=True)
        return "onnxruntime"
    try:
        require_runtime(runtime)  # verify needs it next anyway
    except MissingDependencyError:
        click.echo(
            f"onnx-qrewrite: note: target {profile.id}'s runtime ({RUNTIMES[runtime].distribution}) is not installed "
            f"({install_hint(runtime)}); verifying in onnxruntime instead",
            err=True,
        )
        return "onnxruntime"
    if providers:
        raise UsageError(
            f"--providers chooses onnxruntime's execution providers; --target {profile.id} --verify verifies on "
            f"{runtime}: give --runtime onnxruntime to verify in onnxruntime with them"
        )
    return runtime


def _remove_output(output: str, data_path: Path | None) -> None:
    """Remove an output model and the external data file written with it (never a referenced input's)."""
    for path in (Path(output), data_path):
        if path is not None:
            path.unlink(missing_ok=True)


def _outputs_for(models: tuple[str, ...], output: str) -> list[str]:
    out = Path(output)
    if len(models) == 1 and not (out.is_dir() or output.endswith(("/", "\\"))):
        return [output]
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {output}: with several models, -o names a folder, and this is a file")
    names = [Path(m).name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UsageError(f"-o {output}: two input models are both named {dupes[0]!r}; rewrite them separately")
    return [str(out / n) for n in names]


@click.command("rewrite")
@global_options
@click.argument("models", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(),
    help="Output model file; with several models (or a trailing /), the output folder.",
)
@rule_selection
@float16_semantics_option
@plan_options(inspecting=False)
@click.option("--allow-unlowered", is_flag=True, help="Leave nodes no rule can lower in place, with a warning.")
@click.option(
    "--target",
    "target",
    default=None,
    metavar="NAME",
    help="Rewrite for this deployment target (see `onnx-qrewrite targets`, or a .toml profile): keep what it "
    "runs natively, stay within its opsets; exit 4 naming each node it would still refuse unless --allow-unlowered.",
)
@click.option(
    "--check/--no-check",
    default=None,
    help="Run onnx's checker on the result (default: when it has at most 20k nodes).",
)
@click.option(
    "--provenance",
    type=click.Choice(["compact", "full", "none"]),
    default="compact",
    show_default=True,
    help="Rule/origin metadata on the first created node of each rewrite (compact), on every "
    "created node (full) or none; --report always has the full mapping.",
)
@click.option(
    "--reference-external-data",
    is_flag=True,
    help="Zero copy: reference the input's external data file (output must be in the same folder).",
)
@output_file_option("--report", "report_path", "Write a JSON report of every rewrite (and verification).")
@jobs_option
@click.option(
    "--verify",
    "do_verify",
    is_flag=True,
    help="Verify each rewrite in onnxruntime (with --target: on its runtime when installed; --runtime "
    "chooses); a disagreement "
    "exits 1 and removes the output.",
)
@click.option("--keep-failed", is_flag=True, help="With --verify: keep an output that failed verification.")
@output_file_option("--junit", "junit_path", "With --verify: JUnit XML, one test suite per model, one case per output.")
@verify_options(report=False, junit=False, runtime_default=None)
@click.pass_context
def rewrite_command(
    ctx: click.Context,
    models: tuple[str, ...],
    output: str,
    rule_files,
    only,
    skip,
    rule_options,
    forms,
    form_options,
    dql_semantics,
    float16_semantics,
    target_opset,
    keep_opset,
    allow_unlowered,
    target,
    allow_approximate,
    check,
    provenance,
    reference_external_data,
    report_path,
    jobs,
    do_verify,
    keep_failed,
    junit_path,
    **verify_opts: Any,
) -> None:
    """Rewrite MODELS with the rules and write them to OUTPUT.

    Exit code: the worst over all models (0 ok, 1 verification disagreed, 3 invalid model,
    4 a node could not be lowered, 5 internal error, 6 --verify compared nothing); 2 for usage
    errors, before any work.
    """
    _check_usage(ctx, keep_opset, target_opset, do_verify, keep_failed, junit_path, verify_opts)
    rule_files, rule_options = expand_forms(
        forms, form_options, rule_files, rule_options, allow_approximate=allow_approximate
    )
    outputs, reads, other_writes = _plan_writes(models, output, report_path, junit_path, verify_opts)
    # Validate the rules and options once, before any work (usage errors are exit 2 for all).
    load_selected_rules(rule_files, only, skip, rule_options, dql_semantics, float16_semantics)
    shapes, verify_args = _verify_settings(target, do_verify, verify_opts)
    quiet = bool((ctx.obj or {}).get("quiet"))
    from onnx_qrewrite.progress import TerminalProgress

    show_progress = TerminalProgress(quiet=quiet).enabled and len(models) == 1
    engine = {
        "target_opset": target_opset,
        "keep_opset": keep_opset,
        "allow_unlowered": allow_unlowered,
        "allow": ("exact", "bounded", "approximate") if allow_approximate else None,
        "check": check,
        "provenance": provenance,
        "target": target,
        "input_shapes": shapes,
    }
    tasks = [
        _Task(
            m,
            o,
            tuple(rule_files),
            tuple(only),
            tuple(skip),
            tuple(rule_options),
            dql_semantics,
            float16_semantics,
            engine,
            reference_external_data,
            verify_args,
            keep_failed,
            show_progress,
            want_report=report_path is not None,
            reads=tuple((d, i, str(p)) for (d, i), p in reads.items()),
            other_writes=tuple(other_writes),
        )
        for m, o in zip(models, outputs, strict=True)
    ]
    outcomes = _run_all(tasks, models, jobs, quiet)
    _write_reports(outcomes, len(models), report_path, junit_path)
    worst = worst_exit_code(o.exit_code for o in outcomes)
    if worst:
        ctx.exit(worst)


def _check_usage(
    ctx: click.Context,
    keep_opset: bool,
    target_opset: int | None,
    do_verify: bool,
    keep_failed: bool,
    junit_path: str | None,
    verify_opts: dict[str, Any],
) -> None:
    """Options that contradict each other, or act on nothing without --verify: a usage error
    (exit 2) before any work, rather than one of them ignored."""
    if keep_opset and target_opset is not None:
        raise UsageError("--keep-opset and --target-opset contradict each other; give one")
    if (keep_failed or junit_path) and not do_verify:
        raise UsageError(f"{'--keep-failed' if keep_failed else '--junit'} needs --verify")
    if not do_verify:
        _refuse_verify_options(ctx, verify_opts)


def _verify_settings(
    target: str | None, do_verify: bool, verify_opts: dict[str, Any]
) -> tuple[Any, dict[str, Any] | None]:
    """The dimensions --input-shape fixes for --target's plan, and verify's arguments (None
    without --verify): on the target's runtime when it has one (:func:`_target_runtime`), with the
    samples of the fixed shapes (:func:`_split_input_shapes`)."""
    if target is not None:
        from onnx_qrewrite.targets import load_target

        profile = load_target(target)
        if do_verify:
            verify_opts = {**verify_opts, "runtime": _target_runtime(profile, verify_opts)}
    shapes, verify_opts = _split_input_shapes(verify_opts, target, do_verify)
    return shapes, verify_kwargs(**verify_opts) if do_verify else None


def _plan_writes(
    models: tuple[str, ...], output: str, report_path: str | None, junit_path: str | None, verify_opts: dict[str, Any]
) -> tuple[list[str], dict[tuple[int, int], Path], list[tuple[str, str]]]:
    """Before any work: the output of each model, the files the models read and the other files
    this invocation writes; no output may be a file it reads, or another output (usage errors)."""
    check_report_paths(
        report=report_path,
        junit=junit_path,
        save_inputs=verify_opts.get("save_inputs"),
        save_outputs=verify_opts.get("save_outputs"),
    )
    for option in ("save_inputs", "save_outputs"):
        if verify_opts.get(option) and len(models) > 1:
            raise UsageError(f"--{option.replace('_', '-')} takes one model; rewrite the others separately")
    outputs = _outputs_for(models, output)
    reads: dict[tuple[int, int], Path] = {}
    for model in models:
        reads.update(model_reads(model))
    other_writes = [
        (option, str(path))
        for option, path in (
            ("--report", report_path),
            ("--junit", junit_path),
            ("--save-inputs", verify_opts.get("save_inputs")),
        )
        if path
    ]
    check_writes([*(("-o", o) for o in outputs), *other_writes], reads, outputs)
    if outputs != [output]:  # -o names a folder (several models, or a trailing slash)
        try:
            Path(output).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"-o {output}: cannot create the folder: {exc.strerror or exc}") from None
    return outputs, reads, other_writes


def _write_reports(outcomes: list[Outcome], n_models: int, report_path: str | None, junit_path: str | None) -> None:
    """The --report and --junit files over all models; nothing when the one model was refused (it
    gets its error line)."""
    refused = n_models == 1 and outcomes[0].error is not None
    if report_path and not refused:
        payloads = [
            {k: v for k, v in o.payload.items() if k != "_junit"} or {"input": o.label, "error": o.error}
            for o in outcomes
        ]
        body = payloads[0] if n_models == 1 and not outcomes[0].error else {"models": payloads}
        write_report_file(report_path, json.dumps(body, indent=2) + "\n", "--report")
    if junit_path and not refused:
        combined_junit(
            [o.payload.get("_junit") for o in outcomes],
            [o.label for o in outcomes],
            [o.error for o in outcomes],
            junit_path,
        )


def _run_all(tasks: list[_Task], models: tuple[str, ...], jobs: int, quiet: bool) -> list[Outcome]:
    from onnx_qrewrite.progress import TerminalProgress

    outcomes: list[Outcome] = []
    overall = TerminalProgress(quiet=quiet) if len(models) > 1 else None
    for outcome in run_tasks(_rewrite_one, tasks, list(models), jobs):
        outcomes.append(outcome)
        if not quiet:
            for line in outcome.lines:
                click.echo(line)
        if outcome.error:
            # In a batch every message names its model (most already do: they start with its path).
            named = len(models) == 1 or outcome.label in outcome.error
            click.echo(f"onnx-qrewrite: error: {'' if named else outcome.label + ': '}{outcome.error}", err=True)
        if overall is not None:
            overall("models", len(outcomes), len(models))
    outcomes.sort(key=lambda o: o.index)
    if len(models) > 1 and not quiet:
        failed = [o for o in outcomes if o.exit_code]
        click.echo(
            f"{len(models)} models: {len(models) - len(failed)} ok, {len(failed)} failed"
            + (f" (worst exit code {worst_exit_code(o.exit_code for o in failed)})" if failed else "")
        )
    return outcomes
