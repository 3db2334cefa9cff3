"""The sessions of a comparison: one factory opens a runner for either side with the comparison's
settings, so the checks after the main run (NaN hazards, bounds, localisation) run their cut-out or
edited models exactly as the main run did; both sides are checked to take the same inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from onnx_qrewrite.errors import InvalidModelError, UsageError
from onnx_qrewrite.progress import stage
from onnx_qrewrite.verify.models import Models, NotFast, Source
from onnx_qrewrite.verify.options import Options
from onnx_qrewrite.verify.session import ModelRunner

if TYPE_CHECKING:
    import onnx


class RunnerFactory:
    """Opens a runner for either side with the comparison's settings: ``(model, side)`` with side
    "original" or "rewritten". The checks after the main run (NaN hazards, bounds, localisation)
    open more runners on cut-out or edited models, and must run them exactly as the main run did."""

    def __init__(self, options: Options, original_label: str, rewritten_label: str, reference_kernels: bool) -> None:
        self.options = options
        self.original_label = original_label
        self.rewritten_label = rewritten_label
        self.reference_kernels = reference_kernels

    def __call__(self, model: onnx.ModelProto | bytes, side: str) -> ModelRunner:
        options = self.options
        if side == "original":
            return ModelRunner(
                model,
                label=self.original_label,
                settings=options.session,
                reference_kernels=self.reference_kernels,
                register_custom_library=True,
            )
        if options.runtime != "onnxruntime":
            from onnx_qrewrite.verify.runtimes import make_runner as make_runtime_runner

            assert not isinstance(model, bytes)  # the fast path runs onnxruntime only
            return make_runtime_runner(
                options.runtime,
                model,
                label=self.rewritten_label,
                threads=options.threads,
                shapes=options.generation.shapes,
                dims=options.generation.dims,
            )
        return ModelRunner(
            model,
            label=self.rewritten_label,
            settings=options.session,
            providers=options.providers or ("CPUExecutionProvider",),
        )


def start_sessions(
    models: Models, make_runner: RunnerFactory, options: Options, *, same_file: bool, fast: bool
) -> tuple[ModelRunner, Any]:
    """Both models' runners, checked to take the same inputs. On the fast path a model
    onnxruntime refuses goes to the full path, which parses it and says what is wrong."""
    with stage(options.progress, "starting onnxruntime"):
        try:
            original_runner = make_runner(models.reference.runnable, "original")
            rewritten_runner = original_runner if same_file else open_rewritten(models.rewritten_run, make_runner)
        except InvalidModelError as exc:
            if fast:
                raise NotFast(str(exc)) from None
            raise
    _check_interfaces(original_runner, rewritten_runner)
    return original_runner, rewritten_runner


def _input_types(runner: Any) -> dict[str, str]:
    if isinstance(runner, ModelRunner):
        return {i.name: i.type for i in runner.session.get_inputs()}
    return dict(runner.input_types)  # another runtime's runner (verify/runtimes.py)


def _check_interfaces(original: ModelRunner, rewritten: Any) -> None:
    a = _input_types(original)
    b = _input_types(rewritten)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))
        raise UsageError(
            f"{original.label} and {rewritten.label} have different inputs (first difference: {diff[0][0]} "
            f"{diff[0][1]}); they are not a rewrite of each other"
        )


def open_rewritten(source: Source, make_runner: Callable[[Any, str], ModelRunner]) -> ModelRunner:
    """The rewritten model's session; when onnxruntime refuses it, say which op is left over (on
    the fast path, the refusal is passed on: the full path then says it)."""
    try:
        return make_runner(source.runnable, "rewritten")
    except InvalidModelError as exc:
        if source.fast:
            raise
        from onnx_qrewrite.verify.reference_ops import iter_all_nodes

        leftover = [n for n in iter_all_nodes(source.proto) if n.domain not in ("", "ai.onnx", "ai.onnx.ml")]
        if not leftover:
            raise
        first = leftover[0]
        raise InvalidModelError(
            f"{exc} (the rewritten model must run in stock onnxruntime, but it still holds {len(leftover)} "
            f"non-standard node(s), the first {first.name or first.output[0]!r} ({first.domain}::{first.op_type}))"
        ) from None
