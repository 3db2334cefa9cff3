"""The samples both models run on: the caller's (a ``.npz`` file, a mapping, a list) or
generated from the original's input specs (:mod:`.inputs`; attention lengths consistent with
the shapes, :mod:`.attention_inputs`), and how they came to be (for the report)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.verify.attention_inputs import head_dims, length_inputs
from onnx_qrewrite.verify.inputs import (
    GenerationOptions,
    Sample,
    ValueRange,
    gather_index_limits,
    generate_samples,
    input_specs,
    load_samples,
    resolve_value_ranges,
)
from onnx_qrewrite.verify.options import InputsLike

if TYPE_CHECKING:
    import onnx


class GivenSamples(NamedTuple):
    """The samples both models run on, and how they came to be (for the report's settings)."""

    samples: list[Sample]
    generation: GenerationOptions | None  # None: the samples were given
    inputs_file: str | None
    ranges: dict[str, ValueRange]


def resolve_samples(
    inputs: InputsLike, model: onnx.ModelProto, generation: GenerationOptions, defaults: bool = False
) -> GivenSamples:
    """The caller's samples (a ``.npz`` file, one mapping, a list), else generated ones from the
    model's input specs and ``generation``. ``defaults``: the generated samples also feed the
    initializers the model lists as inputs (:func:`input_specs`), which only onnxruntime's runner
    passes on."""
    specs = input_specs(model, defaults)
    if inputs is None:
        heads = head_dims(model, specs, generation)  # past_key's heads and head size, where symbolic
        generation = dataclasses.replace(generation, dims={**heads, **generation.dims}) if heads else generation
        ranges = resolve_value_ranges(specs, generation, gather_index_limits(model))
        lengths = length_inputs(model, specs, generation)
        ranges |= lengths.ranges if lengths is not None else {}
        return GivenSamples(generate_samples(specs, generation, ranges, lengths), generation, None, ranges)
    if isinstance(inputs, (str, os.PathLike)):
        return GivenSamples(load_samples(inputs, specs), None, str(inputs), {})
    if isinstance(inputs, Mapping):
        return GivenSamples([Sample("inputs", dict(inputs))], None, None, {})
    given = list(inputs)
    if not given:  # as `--inputs` with a file that holds no arrays: nothing to run, so nothing to prove
        raise UsageError("inputs: an empty sequence of samples leaves nothing to run")
    return GivenSamples(given, None, None, {})
