"""Per target and per real model (benchmarks/target_models.py: the test suite's models plus ones
the producers make here, seeded): what ``inspect --target`` refuses before and after ``rewrite
--target``, which rules that rewrite used (and their exactness, forms named), whether the original
and the rewrite load, run and agree on the runtime installed here, their max abs and relative L2
errors against onnxruntime running the original, and the runtime's latency for both. Prints
Markdown tables: per target and model, then per target (the README's Targets table is the latter).

    python benchmarks/targets.py [--repeat 5] [--targets openvino,tract,...] [--models a,b] [-o DIR]
                                 [--default] [--seeds N] [--fix-shapes] [--allow-approximate]
    python benchmarks/targets.py --repeat 3 --doc docs/targets-battery.md

``--doc FILE`` writes docs/targets-battery.md whole from one invocation: the battery as given, again
with ``--fix-shapes`` (the rows that change), and with ``--fix-shapes --allow-approximate`` on the
targets whose profile has a form that waits for the user's consent (the rows that change), headed by
the command, commit, date, machine, load average while it ran and the runtimes' versions; the
README's Targets table is its as-given summary. Each row goes to stderr as it is measured.

Targets without a runtime here (tensorrt, nnapi, coreml, webgpu) get the counts, and the rewrite's
errors in onnxruntime (CPU): what an approximate form costs, measured. Latency: the fastest of
``--repeat`` runs after one warm-up (the least disturbed by other work on a shared machine), one
thread where the runtime takes a thread count, the recorded inputs (batch 1). QNN runs on the HTP
simulator: its latency says nothing about a device. TFLite runs in its own interpreter process
(verify/tflite_host.py; one process per call before 2026-11-28, docs generated before then include
its start), so its latency includes passing the inputs and outputs there as .npz files.
``--default`` adds today's default rewrite (every rule, no target) on each runtime, for contrast.
A target that needs static input shapes (QNN: its profile's ``[shapes]``) is planned with each
model's symbolic dimensions fixed to its recorded inputs' shapes (``--input-shape``), as its runtime
runs it; ``--fix-shapes`` plans every target so (what ``inspect``/``rewrite --target T
--input-shape`` see: shapes recorded through the com.microsoft ops, onnx_qrewrite/targets/shapes.py),
and runs the original with those dims fixed too (what its before-verdict judged).
``--allow-approximate`` plans as ``rewrite --target T --allow-approximate`` does: a profile's forms
that wait for the user's consent (``consent = "user"``) are used too.
A disagreement on the recorded inputs is confirmed on two more seeded inputs (target_models.py's
CONFIRM_SEEDS, as tests/test_targets_runtime.py does): when both agree the cell says ``(step
flip)``, a requantized activation one step off through float rounding, not a wrong runtime.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from target_models import CONFIRM_SEEDS, Battery, make_battery, seeded_like  # noqa: E402

ALL_TARGETS = "openvino,tract,qnn,tflite,tensorrt,nnapi,coreml,webgpu,onnx"


def _io(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The recorded inputs, and onnxruntime's outputs for the original with its graph
    optimizations off (as ``verify`` runs it); the recorded outputs where stock onnxruntime cannot
    run the original (the Quark models: Quark's custom-op library measured them)."""
    from onnx_qrewrite.errors import QRewriteError

    stem = str(path)[: -len(".onnx")]
    inputs = dict(np.load(stem + ".inputs.npz"))
    try:
        return inputs, _OrtRunner(onnx.load(path)).run(inputs)
    except QRewriteError:
        return inputs, dict(np.load(stem + ".outputs.npz"))


def _run(
    runtime: str, model: onnx.ModelProto, inputs, expected, repeat: int, same=None, reference=None, seeds: int = 0
) -> dict[str, Any]:
    """Load and run ``model`` on ``runtime``: its errors against the recorded outputs of the
    original (what the user gets), and whether the runtime agrees, within its default tolerance,
    with onnxruntime running the same model (``same``; default: the original's outputs). For an
    exact rewrite the two references are the same; for a bounded or approximate one the second
    separates what the runtime computes wrongly from what the rule changes by its declaration.

    A disagreement is confirmed on two more seeded inputs (target_models.CONFIRM_SEEDS), whose
    expected outputs ``reference(feeds)`` gives (onnxruntime running what ``same`` or the original
    came from): when both agree, the recorded inputs met a float-rounding step flip, not a runtime
    that computes the model wrongly, and the cell says so. ``seeds`` > 0 counts, on that many more
    seeded inputs, how often the runtime is outside its tolerance (``--seeds``: the flip rate)."""
    from onnx_qrewrite.errors import QRewriteError
    from onnx_qrewrite.verify.runtimes import RUNTIMES, make_runner

    spec = RUNTIMES[runtime]
    try:
        if runtime == "onnxruntime":
            runner = _OrtRunner(model)
        else:
            shapes = {k: v.shape for k, v in inputs.items()}
            with _native_stdout_to_stderr():
                runner = make_runner(runtime, model, label="model", threads=1, shapes=shapes)
        got = runner.run(inputs)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            runner.run(inputs)
            times.append(time.perf_counter() - start)
    except QRewriteError as exc:
        return {"runs": False, "why": " ".join(str(exc).split(": ", 2)[-1].split())[:70]}
    max_abs = rel_l2 = 0.0
    for name, want in expected.items():
        have = np.asarray(got[name], np.float64)
        ref = np.asarray(want, np.float64)
        if have.shape != ref.shape:
            return {"runs": False, "why": f"{name}: shape {have.shape} != {ref.shape}"}
        diff = np.abs(have - ref)
        max_abs = max(max_abs, float(np.max(diff)) if np.all(np.isfinite(have)) else float("inf"))
        rel_l2 = max(rel_l2, float(np.linalg.norm(have - ref) / max(np.linalg.norm(ref), 1e-30)))
    agrees = _agrees(spec, got, same or expected)
    flip = False
    if not agrees and reference is not None:
        try:
            flip = all(
                _agrees(spec, runner.run(f), reference(f)) for f in (seeded_like(inputs, s) for s in CONFIRM_SEEDS)
            )
        except QRewriteError:
            flip = False
    off = None
    if seeds and reference is not None:
        try:
            feeds = (seeded_like(inputs, 1000 + i) for i in range(seeds))
            off = sum(not _agrees(spec, runner.run(f), reference(f)) for f in feeds)
        except QRewriteError:
            off = None
    ms = 1000 * min(times) if times else None
    return {
        "runs": agrees or flip,
        "flip": flip,
        "off": off,
        "seeds": seeds,
        "max_abs": max_abs,
        "rel_l2": rel_l2,
        "ms": ms,
        "vs_same": same is not None,
    }


def _agrees(spec: Any, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    """Every output within the runtime's default tolerance of ``want`` (NaN where it has NaN)."""
    for name, value in want.items():
        have = np.asarray(got[name], np.float64)
        mine = np.asarray(value, np.float64)
        if have.shape != mine.shape or not np.all(np.isfinite(have) == np.isfinite(mine)):
            return False
        finite = np.isfinite(mine)
        if np.any(np.abs(have - mine)[finite] > (spec.atol + spec.rtol * np.abs(mine))[finite]):
            return False
    return True


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """The QNN backend prints a line to the process's stdout when it loads (a libnative_tls.conf
    notice), which would land in the Markdown table: native writes to fd 1 go to stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class _OrtRunner:
    """onnxruntime (CPU, one thread), for targets with no runtime here: what the rewrite computes."""

    def __init__(self, model: onnx.ModelProto) -> None:
        import onnxruntime as ort

        from onnx_qrewrite.errors import QRewriteError

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as verify runs it
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
            raise QRewriteError(f"onnxruntime cannot load it: {exc}") from None
        self.names = [o.name for o in self.session.get_outputs()]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.names, self.session.run(None, inputs), strict=True))


def _cell(result: dict[str, Any] | None) -> str:
    if result is None:
        return "-"
    if "max_abs" not in result:
        return f"no ({result['why']})"
    verdict = "runs" if result["runs"] else "WRONG"
    if result.get("flip"):
        verdict += " (step flip)"
    if result.get("vs_same"):
        verdict += " (vs the rewrite in onnxruntime)"
    if result.get("ort"):
        verdict = "in onnxruntime"
    ms = f", {result['ms']:.2f} ms" if result.get("ms") is not None else ""
    if result.get("off") is not None:
        ms += f", off on {result['off']} of {result['seeds']} seeded inputs"
    return f"{verdict}, {result['max_abs']:.2g} / {result['rel_l2']:.2g}{ms}"


def _rules(plan: Any) -> str:
    """The rewrite's rules by exactness, e.g. "exact 12, bounded 3, approximate 6 (weight-only)"."""
    levels: collections.Counter[str] = collections.Counter()
    forms = set()
    for n in plan.nodes:
        if n.rule:
            levels[n.exactness or "exact"] += 1
            if n.form:
                forms.add(n.form)
    for name, used in plan.forms.items():  # a form that rewrote only nodes the target accepts (a folded constant)
        if not any(n.rule and n.form == name for n in plan.nodes):
            levels[used["exactness"]] += used["nodes"]
            forms.add(name)
    text = ", ".join(f"{k} {levels[k]}" for k in ("exact", "bounded", "approximate") if levels[k])
    return (text or "none") + (f" ({', '.join(sorted(forms))})" if forms else "")


def _identical(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    def key(m: onnx.ModelProto) -> bytes:
        c = onnx.ModelProto()
        c.CopyFrom(m)
        del c.metadata_props[:]
        for node in c.graph.node:
            del node.metadata_props[:]
        return c.SerializeToString()

    return key(a) == key(b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--targets", default=ALL_TARGETS)
    parser.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    parser.add_argument("-o", "--models-dir", type=Path, default=None, help="where to make the models (default: temp)")
    parser.add_argument("--default", action="store_true", help="also run today's default rewrite on each runtime")
    parser.add_argument(
        "--seeds", type=int, default=0, help="also count on how many of N seeded inputs each runtime is off (N runs)"
    )
    parser.add_argument(
        "--fix-shapes", action="store_true", help="plan every target with the recorded inputs' shapes fixed"
    )
    parser.add_argument(
        "--allow-approximate",
        action="store_true",
        help="plan as `rewrite --target T --allow-approximate` does (forms that wait for the user's consent)",
    )
    parser.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="run the three passes of docs/targets-battery.md (as given; --fix-shapes; --fix-shapes "
        "--allow-approximate on the targets with forms that wait for consent) and write that document here",
    )
    args = parser.parse_args(argv)
    if args.doc is not None and (args.fix_shapes or args.allow_approximate or args.default or args.seeds):
        parser.error("--doc runs its own passes: it takes no --fix-shapes, --allow-approximate, --default or --seeds")

    from onnx_qrewrite.api import load_rules
    from onnx_qrewrite.targets import load_target

    code = _code_state() if args.doc is not None else ""  # before anything else: the tree may change meanwhile
    with tempfile.TemporaryDirectory() as tmp:
        battery = make_battery(args.models_dir or tmp, set(args.models.split(",")) if args.models else None)
        catalogue = load_rules()
        # Every profile read once, as the run starts (editing one meanwhile changes nothing here).
        profiles = {t: load_target(t) for t in args.targets.split(",")}
        if args.doc is not None:
            _write(args.doc, battery_document(battery, catalogue, profiles, args, argv, code))
            return 0
        rows = _battery_pass(battery, catalogue, profiles, args, args.fix_shapes, args.allow_approximate, stream=True)
        print("\n" + CELLS)
        print("\n" + _agreement(rows))
        print("\n" + "\n".join(_summary(rows)))
    return 0


CELLS = (
    "cells: on the target's runtime (onnxruntime CPU where none is installed here): `runs` = loads, runs and "
    "agrees with onnxruntime running the original within the runtime's default tolerance (for a rewrite "
    "that used bounded or approximate rules: with onnxruntime running that rewrite, the rule's own "
    "difference being what its declaration and `verify` bound), WRONG = runs outside it, no = fails to "
    "load or run; then max abs error / relative L2 error against onnxruntime running the original, "
    "fastest run. A rewrite identical to the original is not run twice. `(step flip)`: outside the "
    "tolerance on the recorded inputs only, within it on two more seeded inputs: a requantized activation "
    "one step off through float rounding (the model's numbers are still those of the recorded inputs)."
)


def _battery_pass(
    battery: list[Battery],
    catalogue: Any,
    profiles: dict[str, Any],
    args: Any,
    fix_shapes: bool,
    allow_approximate: bool,
    stream: bool = False,
) -> list[dict[str, Any]]:
    """Every model of ``battery`` on every target, planned as given or with the recorded input
    shapes fixed (``fix_shapes``), with or without the user's consent to approximate forms. With
    ``stream`` the per-model table is printed as each row is measured (a long run shows progress);
    else each row goes to stderr as progress."""
    from onnx_qrewrite.errors import MissingDependencyError
    from onnx_qrewrite.targets import plan_for_target
    from onnx_qrewrite.verify.runtimes import RUNTIMES, runtime_info

    rows: list[dict[str, Any]] = []
    out = sys.stdout if stream else sys.stderr
    print(_table_header(args.default), file=out, flush=True)
    for target, profile in profiles.items():
        runtime = profile.runtime if profile.runtime in RUNTIMES else None
        if runtime is not None:
            try:
                runtime_info(runtime)
            except MissingDependencyError as exc:
                print(f"{target}: {exc}; counts only", file=sys.stderr)
                runtime = None
        measured_on = runtime or "onnxruntime"
        for item in battery:
            row = _measure(
                item,
                target,
                profile,
                runtime,
                measured_on,
                catalogue,
                args,
                plan_for_target,
                fix_shapes,
                allow_approximate,
            )
            row["load"] = os.getloadavg()[0]
            rows.append(row)
            print(_table_row(row, args.default), file=out, flush=True)
    return rows


def _table_header(default: bool = False) -> str:
    header = "| target | model | family | refused before → after | rules used | original on the runtime | "
    header += "default rewrite | " if default else ""
    return header + "`rewrite --target` on the runtime |\n" + "|---" * (8 if default else 7) + "|"


def _table_row(r: dict[str, Any], default: bool = False) -> str:
    cells = [r["original"], *([r["default"]] if default else []), r["rewrite"]]
    ran = " | ".join(_cell(c) for c in cells)
    return f"| {r['target']} | {r['model']} | {r['family']} | {r['before']} → {r['after']} | {r['rules']} | {ran} |"


def _agreement(rows: list[dict[str, Any]]) -> str:
    """Whether ``inspect --target`` said "refused" exactly where the runtime did not load, run and
    agree (each distinct model form once: a rewrite identical to the original is the original).
    Not for the ``onnx`` target: it is standard ONNX, of which onnxruntime runs a superset (its
    contrib ops), so onnxruntime running a model proves nothing about it."""
    agree, disagree, ran = 0, [], set()
    for r in rows:
        if r["runtime"] in (None, "onnxruntime"):
            continue
        ran.add(r["runtime"])
        forms = [("original", r["before"], r["original"])]
        if r["rewrite"] is not r["original"]:
            forms.append(("rewrite", r["after"], r["rewrite"]))
        for form, refused, cell in forms:
            if cell is None:
                continue
            if (refused == 0) == bool(cell["runs"]):
                agree += 1
            else:
                disagree.append(f"{r['target']} {r['model']} {form}")
    return (
        f"Verdict vs runtime: `inspect --target` agrees with the runtime on {agree} of {agree + len(disagree)} "
        f"model forms run on {', '.join(sorted(ran)) or 'no runtime'} here"
        f"{'; disagrees on ' + ', '.join(disagree) if disagree else ''}."
    )


def _measure(
    item: Battery,
    target: str,
    profile: Any,
    runtime: str | None,
    on: str,
    catalogue: Any,
    args: Any,
    plan_for: Any,
    fix_shapes: bool,
    allow_approximate: bool,
) -> dict[str, Any]:
    from onnx_qrewrite import rewrite

    inputs, expected = _io(item.path)
    shapes = None
    if fix_shapes or profile.static_shapes:
        from onnx_qrewrite.targets.shapes import InputShapes

        shapes = InputShapes({name: tuple(value.shape) for name, value in inputs.items()})
    allow = ("exact", "bounded", "approximate") if allow_approximate else None
    plan = plan_for(item.path, catalogue, profile, input_shapes=shapes, allow=allow)
    row: dict[str, Any] = {
        "target": target,
        "model": item.name,
        "family": item.family,
        "before": len(plan.before),
        "after": len(plan.after),
        "rules": _rules(plan),
        "levels": {n.exactness or "exact" for n in plan.nodes if n.rule},
        "forms": sorted({n.form for n in plan.nodes if n.form}),
        "first_refusal": plan.after[0].reasons[0] if plan.after else "",
        "original": None,
        "default": None,
        "rewrite": None,
        "proof": profile.proof,
        "runtime": runtime,
    }
    original = onnx.load(item.path)
    if shapes is not None:  # what the before-verdict judged: the original with those dims fixed
        from onnx_qrewrite.targets.shapes import fix_input_shapes

        fix_input_shapes(original, shapes)
    reference = _reference(original)
    if runtime is not None:
        row["original"] = _run(runtime, original, inputs, expected, args.repeat, reference=reference, seeds=args.seeds)
        if args.default:
            default = rewrite(item.path, rules=catalogue, allow_unlowered=True).model
            row["default"] = _run(
                runtime, default, inputs, expected, args.repeat, reference=reference, seeds=args.seeds
            )
    assert plan.rewritten is not None
    if runtime is not None and _identical(plan.rewritten, original):
        row["rewrite"] = row["original"]
    elif runtime is None and not plan.after:
        # No runtime for the target here: the rewrite's numbers in onnxruntime (what its rules cost).
        row["rewrite"] = _run(on, plan.rewritten, inputs, expected, args.repeat)
        row["rewrite"]["ort"] = True
    elif runtime is not None:
        exact = row["levels"] <= {"exact"}
        same = None if exact else _OrtRunner(plan.rewritten).run(inputs)
        ref = reference if exact else _reference(plan.rewritten)
        row["rewrite"] = _run(runtime, plan.rewritten, inputs, expected, args.repeat, same, ref, args.seeds)
    return row


def _reference(model: onnx.ModelProto) -> Any:
    """onnxruntime running ``model`` (as the outputs were recorded), for the confirming inputs; None
    when it cannot (the Quark originals' vendor ops)."""
    from onnx_qrewrite.errors import QRewriteError

    try:
        return _OrtRunner(model).run
    except QRewriteError:
        return None


def _reached(r: dict[str, Any]) -> bool:
    """Nothing refused after the rewrite and, where the runtime is here, the rewrite runs and agrees;
    where it is not, the rewrite at least loads and runs in onnxruntime (a rewrite onnxruntime
    refuses as an invalid model reaches nothing, whatever the profile says)."""
    if r["after"] or not r["rewrite"]:
        return False
    return "max_abs" in r["rewrite"] if r["runtime"] is None else bool(r["rewrite"]["runs"])


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per target: the model families `rewrite --target` makes run there, and what is not reached."""
    lines = [
        "| target | reached after `rewrite --target` (models) | not reached: first reason | exactness | proven by |",
        "|---|---|---|---|---|",
    ]
    by_target: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        by_target[r["target"]].append(r)
    for target, items in by_target.items():
        reached, missing = collections.defaultdict(list), collections.defaultdict(list)
        levels: set[str] = set()
        forms: set[str] = set()
        for r in items:
            if _reached(r):
                reached[r["family"]].append(r["model"])
                levels |= r["levels"]
                forms |= set(r["forms"])
            else:
                missing[r["family"]].append(f"{r['model']} ({_why_not(r)})")
        proof = items[0]["proof"] + (f" ({items[0]['runtime']})" if items[0]["runtime"] else "")
        reach = "; ".join(f"{fam}: {', '.join(ms)}" for fam, ms in reached.items()) or "-"
        miss = "; ".join(f"{fam}: {', '.join(ms)}" for fam, ms in missing.items()) or "-"
        level = ", ".join(sorted(levels, key=["exact", "bounded", "approximate"].index)) or "none needed"
        level += f" (form {', '.join(sorted(forms))})" if forms else ""
        lines.append(f"| `{target}` | {reach} | {miss} | {level} | {proof} |")
    return lines


def _why_not(r: dict[str, Any]) -> str:
    """Why a row is not reached: the first refusal left, or what the runtime did with the rewrite."""
    if r["after"]:
        return f"{r['after']} refused: {r['first_refusal'].split(' [')[0].split(': ')[0]}"
    if r["rewrite"] and "why" in r["rewrite"]:
        return f"fails on {r['runtime'] or 'onnxruntime'}: {r['rewrite']['why']}"
    return f"WRONG on {r['runtime']}: max abs {r['rewrite']['max_abs']:.2g}" if r["rewrite"] else "?"


def battery_document(
    battery: list[Battery], catalogue: Any, profiles: dict[str, Any], args: Any, argv: list[str] | None, code: str
) -> str:
    """docs/targets-battery.md, whole, from one invocation: the battery as given, with the recorded
    input shapes fixed, and (on the targets whose profile has a form that waits for the user's
    consent) with ``--allow-approximate`` too; headed by the command, commit, date, machine, load
    and runtime versions it ran with, so a regeneration is this one command."""
    # The runtimes as the run starts (``code``: the commit and tree as the invocation started).
    started, versions = time.time(), _versions(profiles)
    consent = {t: p for t, p in profiles.items() if any(f.consent == "user" for f in p.forms)}
    given = _battery_pass(battery, catalogue, profiles, args, False, False)
    fixed = _battery_pass(battery, catalogue, profiles, args, True, False)
    approx = _battery_pass(battery, catalogue, consent, args, True, True) if consent else []
    command = "python benchmarks/targets.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# Targets: every model of the battery on every target",
        "",
        *_doc_header(command, started, code, given + fixed + approx, args.repeat, versions),
        "",
        "## As given",
        "",
        "Every model is planned as given, except for QNN, whose profile needs static input shapes: it is "
        "planned with each model's recorded input shapes fixed (`--input-shape`, as `verify --runtime qnn` "
        "runs it).",
        "",
        _table_header(),
        *(_table_row(r) for r in given),
        "",
        CELLS,
        "",
        _agreement(given),
        "",
        "Per target (the README's Targets table is this table):",
        "",
        *_summary(given),
        "",
        "## Reached, per target and pass",
        "",
        *_reach_counts(given, fixed, approx),
        "",
        "## With `--input-shape` on every target",
        "",
        "Every target planned with each model's recorded input shapes fixed (batch 1, sequence 16 for the "
        "BERTs; what `inspect`/`rewrite --target T --input-shape` see: the shapes recorded through the "
        "com.microsoft ops, onnx_qrewrite/targets/shapes.py), the original run with those dims fixed too. "
        "The rows whose counts, rules or verdicts differ from the pass as given:",
        "",
        *_changed(given, fixed),
        "",
        _agreement(fixed),
    ]
    if approx:
        lines += [
            "",
            "## With `--input-shape` and `--allow-approximate`",
            "",
            f"The targets whose profile has a form that waits for the user's consent ({', '.join(consent)}), "
            "planned as `rewrite --target T --input-shape ... --allow-approximate` does. The rows that "
            "differ from the `--input-shape` pass:",
            "",
            *_changed(fixed, approx),
        ]
    return "\n".join(lines) + "\n"


def _code_state() -> str:
    """The commit the run starts from, and whether tracked files differ from it."""
    import subprocess

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *cmd], capture_output=True, text=True, check=False)
        return done.stdout.strip()

    dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"commit {git('rev-parse', '--short=12', 'HEAD')}{dirty}"


def _doc_header(
    command: str, started: float, code: str, rows: list[dict[str, Any]], repeat: int, versions: str
) -> list[str]:
    """Which command, code, machine, load and runtimes produced the document."""
    import platform

    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)) + time.strftime("-%H:%M UTC", time.gmtime())
    cpu = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")), platform.processor())
    loads = [r["load"] for r in rows]
    return [
        f"Generated by `{command}`, one invocation (run it again to regenerate; do not edit by hand): "
        f"{when}, {code}, on a {os.cpu_count()}-core "
        f"{platform.machine()} ({cpu}) shared with other work: load average (1 min) {min(loads):.1f} to "
        f"{max(loads):.1f} while it ran. Latencies are the fastest of {repeat} runs after a warm-up, one "
        "thread, and noisy under that load; QNN's are the HTP simulator's (nothing about a device), "
        "TFLite's include passing inputs and outputs to its interpreter process as .npz files.",
        "",
        f"Runtimes: {versions}.",
        "",
        "The models: [`benchmarks/target_models.py`](../benchmarks/target_models.py) (each made by its "
        "producer here, seeded, plus the committed test models); what each column means: the docstring of "
        "[`benchmarks/targets.py`](../benchmarks/targets.py). Why some verdicts are what they are (QNN and the "
        "quantized BERTs, TFLite and ortqop_bert, what `--input-shape` changes): "
        "[targets-notes.md](targets-notes.md).",
    ]


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _versions(profiles: dict[str, Any]) -> str:
    """The version of each runtime the targets run on (and onnxruntime's), as verify reports them."""
    from onnx_qrewrite.errors import MissingDependencyError
    from onnx_qrewrite.verify.runtimes import RUNTIMES, runtime_info

    names = ["onnxruntime", *(p.runtime for p in profiles.values() if p.runtime in RUNTIMES)]
    out = [f"onnx {onnx.__version__}"]
    for name in dict.fromkeys(names):
        try:
            out.append(f"{name} {runtime_info(name).version}")
        except MissingDependencyError:
            out.append(f"{name} not installed (counts only)")
    return ", ".join(out)


def _verdict(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    if "max_abs" not in cell:
        return "no"
    return "in onnxruntime" if cell.get("ort") else "runs" if cell["runs"] else "WRONG"


def _changed(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[str]:
    """The rows of ``other`` whose counts, rules or verdicts differ from ``base``'s for the same
    target and model (errors and latencies aside)."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["before"], r["after"], r["rules"], _verdict(r["original"]), _verdict(r["rewrite"])

    was = {(r["target"], r["model"]): key(r) for r in base}
    rows = [_table_row(r) for r in other if was.get((r["target"], r["model"])) != key(r)]
    return [_table_header(), *rows] if rows else ["None."]


def _reach_counts(given: list[dict[str, Any]], fixed: list[dict[str, Any]], approx: list[dict[str, Any]]) -> list[str]:
    """Per target: how many models are reached as given, with the shapes fixed, and with consent."""

    def count(rows: list[dict[str, Any]]) -> dict[str, int]:
        out: dict[str, int] = collections.Counter()
        for r in rows:
            out[r["target"]] += _reached(r)
        return out

    total = collections.Counter(r["target"] for r in given)
    a, b, c = count(given), count(fixed), count(approx)
    lines = [
        "| target | models | reached as given | with `--input-shape` | with `--input-shape --allow-approximate` |",
        "|---|---|---|---|---|",
    ]
    for target in total:
        third = str(c[target]) if any(r["target"] == target for r in approx) else "-"
        lines.append(f"| `{target}` | {total[target]} | {a[target]} | {b[target]} | {third} |")
    return lines


def _write(path: Path, text: str) -> None:
    """All or nothing: a temporary file beside ``path``, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8") as f:
        f.write(text)
    os.replace(f.name, path)


if __name__ == "__main__":
    sys.exit(main())
