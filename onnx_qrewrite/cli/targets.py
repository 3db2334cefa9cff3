"""``onnx-qrewrite targets``: the deployment targets the tool knows, their versions and sources."""

from __future__ import annotations

import json

import click


@click.command("targets")
@click.argument("names", nargs=-1)
@click.option("--long", "long_", is_flag=True, help="Also show every source each target's verdicts cite.")
@click.option("--json", "as_json", is_flag=True, help="Print the targets as JSON.")
def targets_command(names: tuple[str, ...], long_: bool, as_json: bool) -> None:
    """List the targets (rules/targets/*.toml): id, runtime version, how verdicts are proven, and
    the `verify --runtime` that runs it here. With NAMES, only those."""
    from onnx_qrewrite.targets import load_target, load_targets

    profiles = [load_target(n) for n in names] if names else list(load_targets().values())
    if as_json:
        body = [
            {
                "id": p.id,
                "title": p.title,
                "version": p.version,
                "proof": p.proof,
                "runtime": p.runtime,
                "extra": p.extra,
                "opsets": [p.opset_min, p.opset_max],
                "ir_max": p.ir_max,
                "float64": p.float64,
                "keeps": sorted(p.keep),
                "avoids": sorted(p.avoid),
                "static_shapes": p.static_shapes,
                "forms": [
                    {
                        "name": f.name,
                        "allow": f.allow,
                        "consent": f.consent,
                        "variant": f.variant,
                        "why": f.why,
                        "source": f.source,
                        "options": {k: dict(v) for k, v in f.options.items()},
                        "form_options": dict(f.form_options),
                    }
                    for f in p.forms
                ],
                "rule_options": [
                    {"rule": o.rule, "options": dict(o.options), "why": o.why, "source": o.source}
                    for o in p.rule_options
                ],
                "sources": {s.id: {"document": s.document, "version": s.version} for s in p.sources.values()},
                "file": p.path,
            }
            for p in profiles
        ]
        click.echo(json.dumps(body, indent=2))
        return
    rows = [("target", "version", "proven by", "verify --runtime", "title")]
    for p in profiles:
        runtime = p.runtime or "-"
        if p.extra:
            runtime += f" (pip extra [{p.extra}])"
        rows.append((p.id, p.version, p.proof, runtime, p.title))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        click.echo("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
        if long_ and r is not rows[0]:
            p = next(x for x in profiles if x.id == r[0])
            for s in p.sources.values():
                click.echo(f"    [{p.id}/{s.id}] {s.document} ({s.version})")
            for f in p.forms:
                why = f": {f.why}" if f.why else ""
                variant = f"[{f.variant}]" if f.variant else ""
                consent = ", with --allow-approximate" if f.consent == "user" else ""
                click.echo(f"    form {f.name}{variant} (up to {f.allow}{consent}){why} {p.cite(f.source)}")
            for o in p.rule_options:
                why = f": {o.why}" if o.why else ""
                click.echo(f"    options of rule {o.rule}: {o.words()}{why} {p.cite(o.source)}")
            if p.ir_max is not None:
                click.echo(f"    IR versions up to {p.ir_max} {p.cite(p.ir_source)}")
            if p.float64 is not None:
                click.echo(f"    float64 arithmetic: {p.float64} {p.cite(p.arithmetic_source)}")
            if p.static_shapes:
                click.echo(f"    static input shapes: give --input-shape for symbolic dims {p.cite(p.shapes_source)}")
