"""``onnx-qrewrite rules``: the catalogue, one line per rule."""

from __future__ import annotations

import click

from onnx_qrewrite.cli.options import expand_forms, global_options, load_selected_rules, rule_selection


@click.command("rules")
@global_options
@rule_selection
@click.option("--long", "long_", is_flag=True, help="Also show conditions, options and the source file.")
def rules_command(rule_files, only, skip, rule_options, forms, form_options, dql_semantics, long_) -> None:
    """List the available rules: id, what it matches, what it emits."""
    rule_files, rule_options = expand_forms(forms, form_options, rule_files, rule_options)
    catalogue = load_selected_rules(rule_files, only, skip, rule_options, dql_semantics)
    width = max((len(r.id) for r in catalogue), default=0)
    for rule in catalogue:
        click.echo(f"{rule.id.ljust(width)}  {rule.describe_match()}  ->  {rule.emits or rule.builder}")
        if long_:
            click.echo(f"{'':{width}}  {rule.summary}")
            conds = []
            if rule.dtypes is not None:
                conds.append("dtypes " + ",".join(sorted(rule.dtypes)))
            if rule.min_opset is not None or rule.max_opset is not None:
                conds.append(f"opset {rule.min_opset or ''}..{rule.max_opset or ''}")
            if conds:
                click.echo(f"{'':{width}}  when: {'; '.join(conds)}")
            contract = rule.contract
            click.echo(f"{'':{width}}  exactness: {rule.exactness}" + (f" ({rule.bound})" if rule.bound else ""))
            click.echo(f"{'':{width}}  emitted ops need opset: {contract.opset(rule.options, rule.dtypes)}")
            if rule.options:
                click.echo(f"{'':{width}}  options: {dict(rule.options)}")
            click.echo(f"{'':{width}}  from {rule.source}")
