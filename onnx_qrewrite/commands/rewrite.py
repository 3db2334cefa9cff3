"""``onnx-qrewrite rewrite``: rewrite a model and say what changed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

from onnx_qrewrite.commands.options import float16_semantics_option, load_selected_rules, rule_selection
from onnx_qrewrite.errors import UsageError

logger = logging.getLogger(__name__)


@click.command("rewrite")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the rewritten model.")
@rule_selection
@float16_semantics_option
@click.option("--target-opset", type=int, default=None, help="Raise the default-domain opset to N first (max 26).")
@click.option("--keep-opset", is_flag=True, help="Never change the opset; use exact decompositions instead.")
@click.option("--allow-unlowered", is_flag=True, help="Leave nodes no rule can lower in place, with a warning.")
@click.option("--reference-external-data", is_flag=True,
              help="Zero copy: reference the input's external data file (output must be in the same folder).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None,
              help="Write a JSON report of every rewrite.")
@click.pass_context
def rewrite_command(ctx, model, output, rule_files, only, skip, rule_options, dql_semantics, float16_semantics,  # noqa: ANN001
                    target_opset, keep_opset, allow_unlowered, reference_external_data, report_path) -> None:
    """Rewrite MODEL with the rules and write it to OUTPUT."""
    from onnx_qrewrite.api import rewrite

    if keep_opset and target_opset is not None:
        raise UsageError("--keep-opset and --target-opset contradict each other; give one")
    if Path(output).resolve() == Path(model).resolve():
        raise UsageError(f"{output}: refusing to overwrite the input model; choose another output path")
    catalogue = load_selected_rules(rule_files, only, skip, rule_options, dql_semantics, float16_semantics)
    result = rewrite(model, rules=catalogue, target_opset=target_opset, keep_opset=keep_opset,
                     allow_unlowered=allow_unlowered)
    info = result.save(output, reference_external_data=reference_external_data)
    if report_path:
        payload = {"input": str(model), "output": str(output), **result.report.to_dict()}
        if info.referenced:
            payload["external_data_referenced"] = list(info.referenced)
        Path(report_path).write_text(json.dumps(payload, indent=2) + "\n")
    if not ctx.obj.get("quiet"):
        click.echo(f"{model} -> {output}")
        for line in result.report.summary_lines():
            click.echo(line)
        if info.referenced:
            click.echo(f"  external data referenced in place (zero copy): {', '.join(info.referenced)}")
        elif info.data_path is not None:
            click.echo(f"  external data written to {info.data_path} ({info.external_bytes} bytes)")
        for w in result.report.warnings:
            logger.warning(w)
