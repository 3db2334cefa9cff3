"""Input generation, the quantization battery, and .npz sample files."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.verify.inputs import (
    BATTERY,
    DEFAULT_DIM,
    GenerationOptions,
    generate_samples,
    input_specs,
    load_samples,
    parse_input_shape,
    parse_int_range,
    save_samples,
)


def _model(*inputs: tuple[str, int, list | None]) -> onnx.ModelProto:
    infos = [helper.make_tensor_value_info(name, t, shape) for name, t, shape in inputs]
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name, _, _ in inputs]
    outs = [helper.make_tensor_value_info(f"{name}_out", t, None) for name, t, _ in inputs]
    weight = onnx.numpy_helper.from_array(np.zeros(2, np.float32), "w")
    graph = helper.make_graph(
        nodes, "g", [*infos, helper.make_tensor_value_info("w", TensorProto.FLOAT, [2])], outs, initializer=[weight]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


MIXED = _model(
    ("pixels", TensorProto.FLOAT, ["batch", 3, "h", 4]),
    ("ids", TensorProto.INT64, ["batch", 5]),
    ("mask", TensorProto.BOOL, [2]),
)


def test_initializers_are_not_inputs_to_feed():
    assert [s.name for s in input_specs(MIXED)] == ["pixels", "ids", "mask"]


def test_symbolic_dimensions_default_to_one_and_can_be_given():
    samples = generate_samples(input_specs(MIXED), GenerationOptions(samples=1, battery=False))
    assert samples[0].feeds["pixels"].shape == (DEFAULT_DIM, 3, DEFAULT_DIM, 4)
    shaped = generate_samples(input_specs(MIXED), GenerationOptions(samples=1, shapes={"pixels": (2, 3, 7, 4)}))
    assert shaped[0].feeds["pixels"].shape == (2, 3, 7, 4)
    assert shaped[0].feeds["ids"].shape == (1, 5)  # only the named input changes


def test_random_samples_are_seeded_and_typed():
    specs = input_specs(MIXED)
    a = generate_samples(specs, GenerationOptions(samples=2, seed=3, int_range=(5, 7)))
    b = generate_samples(specs, GenerationOptions(samples=2, seed=3, int_range=(5, 7)))
    c = generate_samples(specs, GenerationOptions(samples=2, seed=4, int_range=(5, 7)))
    assert [s.name for s in a] == ["random-0", "random-1", *BATTERY]
    assert all(np.array_equal(x.feeds["pixels"], y.feeds["pixels"]) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0].feeds["pixels"], c[0].feeds["pixels"])
    assert not np.array_equal(a[0].feeds["pixels"], a[1].feeds["pixels"])
    ids = np.concatenate([s.feeds["ids"].ravel() for s in a])
    assert ids.dtype == np.int64 and ids.min() >= 5 and ids.max() <= 7
    assert a[0].feeds["mask"].dtype == np.bool_


def test_the_battery_covers_the_quantization_edge_cases():
    samples = {s.name: s.feeds["pixels"] for s in generate_samples(input_specs(MIXED), GenerationOptions(samples=0))}
    assert set(samples) == set(BATTERY)
    assert not samples["zeros"].any()
    assert np.unique(samples["constant"]).size == 1 and samples["constant"].flat[0] != 0
    wide = np.abs(samples["wide-range"])
    assert wide.max() > 100 and wide.min() < 0.01 and (samples["wide-range"] < 0).any()
    assert (samples["negative"] < 0).all()


def test_no_battery_for_models_without_float_inputs():
    ids_only = _model(("ids", TensorProto.INT32, [3]))
    assert [s.name for s in generate_samples(input_specs(ids_only), GenerationOptions())] == ["random-0", "random-1"]


def test_narrow_float_inputs_are_generated_in_their_own_dtype():
    model = _model(("h", TensorProto.FLOAT16, [4]), ("b", TensorProto.BFLOAT16, [4]))
    (sample,) = generate_samples(input_specs(model), GenerationOptions(samples=1, battery=False))
    assert sample.feeds["h"].dtype == np.float16 and sample.feeds["b"].dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"pixels": (1, 3, 4)}, "--input-shape: 'pixels' has rank 4 but 3 dimensions were given"),
        ({"pixels": (1, 2, 4, 4)}, "--input-shape: 'pixels' dimension 1 is fixed at 3, got 2"),
        ({"nope": (1,)}, "--input-shape: the model has no input named 'nope'"),
    ],
)
def test_bad_input_shapes_name_the_option(shapes, message):
    with pytest.raises(UsageError) as info:
        generate_samples(input_specs(MIXED), GenerationOptions(shapes=shapes))
    assert str(info.value) == message


def test_a_named_dimension_sizes_it_in_every_input_that_has_it():
    specs = input_specs(MIXED)  # pixels [batch, 3, h, 4], ids [batch, 5], mask [2]
    (sample,) = generate_samples(specs, GenerationOptions(samples=1, battery=False, dims={"batch": 2, "h": 5}))
    assert {k: v.shape for k, v in sample.feeds.items()} == {"pixels": (2, 3, 5, 4), "ids": (2, 5), "mask": (2,)}
    given = GenerationOptions(samples=1, battery=False, dims={"batch": 2}, shapes={"ids": (3, 5)})
    (sample,) = generate_samples(specs, given)  # an input's own shape wins; the others take DIM=N
    assert sample.feeds["ids"].shape == (3, 5) and sample.feeds["pixels"].shape == (2, 3, DEFAULT_DIM, 4)
    with pytest.raises(UsageError) as info:
        generate_samples(specs, GenerationOptions(dims={"seq": 4}))
    assert str(info.value) == "--input-shape seq=4: no input of the model has a dimension named 'seq' (named: batch, h)"


def test_an_input_without_a_shape_needs_one():
    model = _model(("x", TensorProto.FLOAT, None))
    with pytest.raises(UsageError, match=r"input 'x' declares no shape; give one with --input-shape x:"):
        generate_samples(input_specs(model), GenerationOptions())
    (sample, *_) = generate_samples(input_specs(model), GenerationOptions(shapes={"x": (2, 2)}))
    assert sample.feeds["x"].shape == (2, 2)


def test_option_parsers():
    assert parse_input_shape("input:0:1,3,224,224") == ("input:0", (1, 3, 224, 224))
    assert parse_input_shape("scalar:") == ("scalar", ())
    assert parse_int_range("-3,7") == (-3, 7)
    for bad in ("input", "x:1,a", "x:-1"):
        with pytest.raises(UsageError, match=r"^--input-shape: "):
            parse_input_shape(bad)
    with pytest.raises(UsageError, match=r"^--int-range: expected LO,HI"):
        parse_int_range("1")
    with pytest.raises(UsageError, match=r"^--int-range: the low end 9 is above the high end 1"):
        GenerationOptions(int_range=(9, 1))
    with pytest.raises(UsageError, match=r"^--int-range: \[300, 400\] holds no uint8 value \(input 'u'\)"):
        generate_samples(input_specs(_model(("u", TensorProto.UINT8, [2]))), GenerationOptions(int_range=(300, 400)))


@pytest.mark.parametrize(
    ("elem_type", "largest"),
    [(TensorProto.FLOAT, "3.40282e+38"), (TensorProto.FLOAT16, "65504"), (TensorProto.BFLOAT16, "3.38953e+38")],
)
def test_a_value_range_beyond_the_inputs_finite_values_is_a_usage_error(elem_type, largest):
    """Values beyond the type's largest finite value would be generated as infinities (a numpy
    overflow warning on the user's terminal, found by the CLI fuzz test): refused, naming the input."""
    specs = input_specs(_model(("x", elem_type, [4])))
    for low, high in ((0.0, 5.3e38), (-1e39, 0.0), (0.0, 7e4)):
        if elem_type != TensorProto.FLOAT16 and high == 7e4:
            continue
        expected = rf"^--val-range x: \[.*\] goes beyond .* {re.escape(largest)} \(input 'x'\)$"
        with pytest.raises(UsageError, match=expected):
            generate_samples(specs, GenerationOptions(value_ranges={"x": (low, high)}))
    (sample, *_) = generate_samples(specs, GenerationOptions(value_ranges={"x": (-65504.0, 65504.0)}, battery=False))
    assert np.isfinite(sample.feeds["x"].astype(np.float64)).all()


def test_saved_samples_load_back_including_bfloat16_bit_patterns(tmp_path):
    model = _model(("x", TensorProto.FLOAT, [2, 2]), ("b", TensorProto.BFLOAT16, [3]))
    specs = input_specs(model)
    samples = generate_samples(specs, GenerationOptions(samples=2))
    path = tmp_path / "inputs.npz"
    save_samples(path, samples)
    with np.load(path) as raw:
        assert raw["random-0::b"].dtype == np.uint16  # bit patterns, as in the shared vectors
    loaded = load_samples(path, specs)
    assert [s.name for s in loaded] == [s.name for s in samples]
    for mine, theirs in zip(samples, loaded, strict=True):
        for name in ("x", "b"):
            assert theirs.feeds[name].dtype == mine.feeds[name].dtype
            assert np.array_equal(theirs.feeds[name].view(np.uint8), mine.feeds[name].view(np.uint8))


def test_a_single_sample_file_is_keyed_by_input_name(tmp_path):
    model = _model(("x", TensorProto.FLOAT, ["n", 2]))
    path = tmp_path / "one.npz"
    np.savez(path, x=np.ones((5, 2), np.float32))
    (sample,) = load_samples(path, input_specs(model))
    assert sample.feeds["x"].shape == (5, 2)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"y": np.ones((1, 2), np.float32)}, "'y' is not an input of the model"),
        ({"x": np.ones((1, 2), np.float64)}, "'x' has dtype float64, but the model input is float"),
        ({"x": np.ones((1, 3), np.float32)}, "'x' has shape [1, 3], but the model declares ['n', 2]"),
        ({"a::x": np.ones((1, 2), np.float32), "b::z": np.ones(1)}, "'b::z' is not an input of the model"),
    ],
)
def test_bad_sample_files_are_usage_errors(tmp_path, arrays, message):
    model = _model(("x", TensorProto.FLOAT, ["n", 2]))
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(UsageError) as info:
        load_samples(path, input_specs(model))
    assert str(info.value).startswith("--inputs: ") and message in str(info.value)


def test_an_unreadable_sample_file_is_a_usage_error(tmp_path):
    path = tmp_path / "not.npz"
    path.write_text("hello")
    with pytest.raises(UsageError, match=r"^--inputs: .*not\.npz: cannot read as \.npz"):
        load_samples(path, input_specs(MIXED))
