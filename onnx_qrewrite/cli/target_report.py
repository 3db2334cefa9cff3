"""The text of ``inspect --target``: per node, what the target refuses, the rule that fixes it,
and what it would still refuse after the rewrite."""

from __future__ import annotations

from typing import Any

import click

__all__ = ["print_plan"]


def print_plan(plan: Any, profile: Any, all_nodes: bool = False) -> None:
    """Print ``inspect --target``'s plan: what the target refuses today, and what each node becomes.
    With ``all_nodes`` (``-a``) a list of refused nodes longer than 3 is printed in full once and
    named where it comes again (:class:`_Listed`): a form's whole-model trial leaves every refused
    node and every node the form could rewrite weighs it, so listing it each time made the text
    grow with the square of the model (5 million lines for a 1000-block chain on tensorrt)."""
    listed_once = _Listed(all_nodes)
    click.echo(f"{plan.model}: target {profile.id} ({profile.title}, {profile.version}; proven by {profile.proof})")
    if plan.input_shapes:
        shapes = ", ".join(f"{k} {v}" for k, v in plan.input_shapes["shapes"].items())
        fixed = ", ".join(plan.input_shapes["fixed"]) or "nothing"
        click.echo(f"input shapes (--input-shape): fixed {fixed}; static inputs: {shapes or 'none'}")
    click.echo(f"refused today: {len(plan.before)} node(s); after the rewrite: {len(plan.after)}")
    for rule_id, why in plan.skipped_rules.items():
        click.echo(f"  rule {rule_id} not used: {why}")
    for rule_id, said in plan.rule_options.items():
        click.echo(f"  rule {rule_id}: {_rule_options_words(said, profile.id)}")
    for n in plan.nodes:
        click.echo(f"  {n.node} ({n.op}): {n.status}")
        for reason in n.reasons:
            click.echo(f"      today: {reason}")
        if n.rule:
            exact = f" ({n.exactness})" if n.exactness else ""
            form = f", form {n.form} asked for by the target" if n.form else ""
            click.echo(f"      rewrite: {n.rule}{exact}{form}")
            for later in n.then:  # a later stage's rule on what this rewrite emitted
                click.echo(f"      then: {later}")
            for caveat in n.caveats:
                click.echo(f"      caveat: {caveat}")
        elif n.considered:
            click.echo(
                "      rewrite: none; left as it is, since every rule leaves the target as much or more to refuse"
            )
        elif n.reasons and not n.after:
            forms = ", ".join(plan.forms) or "none"
            click.echo(f"      rewrite: none of its own; accepted once other nodes are rewritten (forms: {forms})")
        else:
            click.echo("      rewrite: no rule rewrites it")
        for alternative in n.considered:
            click.echo(f"      weighed: {alternative}")
            rule_id = alternative.partition(" (")[0]
            left = n.weighed_left.get(rule_id, ())
            listed_once.print("          left", left, f"{n.node} (weighed: {rule_id})")
        if n.hint:
            click.echo(f"      hint: {n.hint}")
        listed_once.print("      after", n.after, f"{n.node} (after)")
    # Refusals after the rewrite that no refused original node accounts for (should not happen:
    # such rules are dropped for the target), listed so nothing is hidden.
    listed = {(n.scope, n.node) for n in plan.nodes}
    extra = [r for r in plan.after if r.origin is None and (r.scope, r.node) not in listed]
    for r in extra:
        click.echo(f"  {r.node} ({r.op_key}): refused after the rewrite: {'; '.join(r.reasons)}")
    for name, form in plan.forms.items():
        loud = " APPROXIMATE: the model's numerics change by design." if form["exactness"] == "approximate" else ""
        click.echo(
            f"  form {name} ({form['exactness']}, asked for by the target {form['source']}): "
            f"{form['nodes']} node(s).{loud}"
        )
    if plan.float64:
        rules = ", ".join(f"{rule} ({n} node(s))" for rule, n in plan.float64["rules"].items())
        click.echo(
            f"  float64: {rules} compute in float64, which {plan.float64['loss']}: their declared exactness holds "
            f"where float64 is computed as float64 (onnxruntime), not on {profile.id}"
        )
    for r in plan.differs:
        click.echo(f"  {r.node} ({r.op_key}): runs, computed otherwise than in onnxruntime (no rewrite changes it)")
        for reason in r.reasons:
            click.echo(f"      differs: {reason}")
    if plan.ok:
        click.echo(f"{profile.id} would run the rewritten model: nothing refused after the rewrite")
    else:
        click.echo(f"{profile.id} would still refuse {len(plan.after)} node(s) after the rewrite (exit code 4)")
        if plan.with_consent:
            click.echo(f"  {plan.consent_note().lstrip('; ')}")


def _rule_options_words(said: dict[str, Any], target: str) -> str:
    """A rule's options set by the profile, and those the user's own options set instead, in words."""
    parts = []
    if said["options"]:
        words = ", ".join(f"{k} = {v!r}" for k, v in said["options"].items())
        why = f": {said['why']}" if said["why"] else ""
        parts.append(f"{words} for {target} {said['source']}{why}")
    for key, value in said["user"].items():
        parts.append(f"{key} = {value!r} from your options, over {target}'s {said['profile'][key]!r} {said['source']}")
    return "options " + "; ".join(parts)


class _Listed:
    """Prints refused nodes in words, one a line: the first 3 and how many more, or with ``-a``
    all of them, each list longer than 3 in full only where it first comes; where it comes again,
    one line names that place. A list is known again by the identity of its tuple (the nodes a
    form's trial names share one, ``targets/account.py``), else by its contents."""

    def __init__(self, all_nodes: bool) -> None:
        self.all_nodes = all_nodes
        self._by_id: dict[int, str] = {}
        self._by_words: dict[tuple[str, ...], str] = {}
        self._kept: list[tuple[str, ...]] = []  # keeps the ids of _by_id from being reused

    def print(self, head: str, lines: tuple[str, ...], where: str) -> None:
        if not self.all_nodes or len(lines) <= 3:
            _print_some(head, lines, self.all_nodes)
            return
        first = self._by_id.get(id(lines)) or self._by_words.get(lines)
        if first is None:  # its first place: listed in full
            first = self._by_words[lines] = where
            _print_some(head, lines, True)
        else:
            click.echo(f"{head}: the same {len(lines)} lines as listed above under {first}")
        if id(lines) not in self._by_id:
            self._by_id[id(lines)] = first
            self._kept.append(lines)


def _print_some(head: str, lines: tuple[str, ...], all_nodes: bool) -> None:
    """Refused nodes in words, one a line: the first 3 unless ``-a``, then how many more."""
    for line in lines[: None if all_nodes else 3]:
        click.echo(f"{head}: {line}")
    if not all_nodes and len(lines) > 3:
        click.echo(f"{head}: ... and {len(lines) - 3} more (-a shows all)")
