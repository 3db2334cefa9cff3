"""Which rules and engine options a target gets: the catalogue without what it runs natively or
avoids, with the options its profile sets, plus the rules of the forms it names within their
consent; and the engine options that keep a rewrite within the opset it loads."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from onnx_qrewrite.rewriter.catalogue import Catalogue, Rule
from onnx_qrewrite.targets.profile import TargetProfile

#: Preference between choices that leave the target nothing to refuse (lower first).
RANK = {"exact": 0, "bounded": 2, "approximate": 3}


def target_catalogue(catalogue: Catalogue, profile: TargetProfile) -> tuple[Catalogue, dict[str, str]]:
    """The rules to use for ``profile``: without those that rewrite only ops it keeps, nor those
    it avoids."""
    skipped = {}
    for rule in catalogue:
        if rule.id in profile.avoid:
            skipped[rule.id] = (
                f"{profile.id} was seen not to run what it emits as onnxruntime does "
                f"{profile.cite(profile.rewrites_source)}"
            )
        elif rule.match and all(ref.domain in ("", "ai.onnx") and ref.op in profile.keep for ref in rule.match):
            ops = ", ".join(ref.op for ref in rule.match)
            skipped[rule.id] = f"{profile.id} runs {ops} natively {profile.cite(profile.rewrites_source)}"
    kept = [r.id for r in catalogue if r.id not in skipped]
    return catalogue.select(only=kept) if skipped else catalogue, skipped


def profile_rule_options(catalogue: Catalogue, profile: TargetProfile) -> tuple[Catalogue, dict[str, dict[str, Any]]]:
    """``catalogue`` with the options ``profile`` sets for its rules (``[[rewrites.options]]``),
    and per rule what was set. An option the user set for the rule (``--rule-option RULE.KEY=V``, the
    API's ``options=``: ``Rule.overridden``) wins over the profile's: the user asked for it by
    name, and the plan then judges the rule with it like any other. Rules not in ``catalogue``
    (``--skip``, ``--only``) get nothing."""
    from onnx_qrewrite.errors import UsageError

    rules = {r.id: r for r in catalogue}
    overrides: dict[str, dict[str, Any]] = {}
    said: dict[str, dict[str, Any]] = {}
    for entry in profile.rule_options:
        rule = rules.get(entry.rule)
        if rule is None:
            continue
        applied = {k: v for k, v in entry.options.items() if k not in rule.overridden}
        user = {k: rule.options[k] for k in entry.options if k in rule.overridden}
        if applied:
            overrides[entry.rule] = applied
        said[entry.rule] = {
            "profile": dict(entry.options),
            "options": applied,
            "user": user,
            "why": entry.why,
            "source": profile.cite(entry.source),
        }
    if not overrides:
        return catalogue, said
    try:
        return catalogue.with_options(overrides), said
    except UsageError as exc:  # the rule of that id is not the shipped one the profile was checked against
        raise UsageError(f"{profile.path}: target {profile.id!r}, [[rewrites.options]]: {exc}") from None


def form_rules(
    profile: TargetProfile, taken: Collection[str] = (), user_allow: Collection[str] | None = None
) -> tuple[list[Rule], dict[str, str], dict[str, int]]:
    """The rules of the forms ``profile`` names (``[[rewrites.form]]``), within each listing's
    consent and with its options; per rule the form it comes from, and the listing (index into
    ``profile.forms``: a form listed twice with different options is two listings). Rules whose id
    is in ``taken`` (the user added the form's file already) are not repeated. A listing with
    ``consent = "user"`` uses approximate rules only when ``user_allow`` has "approximate"."""
    rules: list[Rule] = []
    form_of: dict[str, str] = {}
    listing: dict[str, int] = {}
    user = set(user_allow) if user_allow is not None else set()
    for index, form in enumerate(profile.forms):
        allow = form.allow
        if form.consent == "user" and "approximate" not in user and RANK[allow] > RANK["bounded"]:
            allow = "bounded"
        for rule in form.rules():
            base_id = rule.id.split("[", 1)[0]
            if base_id in profile.avoid or rule.id in taken or rule.id in form_of:
                continue
            if RANK[rule.exactness] <= RANK[allow]:
                rules.append(rule)
                form_of[rule.id] = form.name
                listing[rule.id] = index
    return rules, form_of, listing


def withheld_forms(profile: TargetProfile, user_allow: Collection[str] | None) -> list[str]:
    """The listings whose approximate rules wait for the user's consent (--allow-approximate)."""
    user = set(user_allow) if user_allow is not None else set()
    return [
        f.name + (f"[{f.variant}]" if f.variant else "")
        for f in profile.forms
        if f.consent == "user" and f.allow == "approximate" and "approximate" not in user
    ]


def engine_options(
    profile: TargetProfile,
    *,
    target_opset: int | None = None,
    keep_opset: bool = False,
    allow: Collection[str] | None = None,
    node_rules: dict[tuple[str, int], tuple[str, ...]] | None = None,
    later_stage: bool = False,
) -> Any:
    """The engine's options for ``profile``: a rewrite never raises the opset above what the
    target loads (``[opset] max``), so rules that would need more give way to the next rule.
    Exactness levels as for any rewrite (exact first, bounded where no exact rule applies,
    approximate only when ``allow`` names it). ``later_stage``: the model holds an earlier stage's
    replacements, whose provenance (and bound) an exact rule rewriting their nodes continues."""
    from onnx_qrewrite.rewriter import engine
    from onnx_qrewrite.rewriter.opset import MAX_RUNTIME_OPSET

    highest = min(MAX_RUNTIME_OPSET, profile.opset_max or MAX_RUNTIME_OPSET)
    levels = frozenset(allow) if allow is not None else engine.DEFAULT_ALLOW
    return engine.EngineOptions(
        target_opset=target_opset,
        keep_opset=keep_opset,
        allow_unlowered=True,
        max_opset=highest,
        provenance="full",
        allow=levels,
        node_rules=node_rules,
        continue_provenance=later_stage,
    )


def listed_as(request: Any) -> str:
    return request.name + (f"[{request.variant}]" if request.variant else "")
