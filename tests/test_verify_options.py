"""verify's defaults on real exported models, Polygraphy-compatible options, stored outputs, the
"nothing was compared" outcome, and clean errors for every option that could exhaust the machine.

Most cases run in-process (click's CliRunner); a few run the real program to pin down what a user
sees: the exit code and exactly one line on stderr, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from _verify_helpers import cli, invoke, one_error_line, save_toy_models
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_INCONCLUSIVE, UsageError, worst_exit_code
from onnx_qrewrite.verify import SCHEMA_PATH, Sample, Tolerances, verify
from onnx_qrewrite.verify.compare import compare_values
from onnx_qrewrite.verify.inputs import (
    MAX_INPUT_BYTES,
    GenerationOptions,
    gather_index_limits,
    generate_samples,
    input_specs,
    parse_val_range,
    resolve_value_ranges,
)
from onnx_qrewrite.verify.session import available_cpus


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return save_toy_models(tmp_path_factory.mktemp("toy"))


# -- defaults that keep exported models valid ---------------------------------------------------


def _bert_like() -> onnx.ModelProto:
    """input_ids -> Cast -> Gather(embeddings [30, 4]); token_type_ids -> Gather(quantized table
    [2, 4] behind DequantizeLinear); attention_mask -> Cast -> arithmetic; a free-standing count."""
    table = numpy_helper.from_array(np.ones((30, 4), np.float32), "emb")
    types_q = numpy_helper.from_array(np.ones((2, 4), np.uint8), "types_q")
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "types_scale")
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids32"], to=TensorProto.INT32),
        helper.make_node("Gather", ["emb", "ids32"], ["e"], name="word_embeddings"),
        helper.make_node("DequantizeLinear", ["types_q", "types_scale"], ["types"]),
        helper.make_node("Gather", ["types", "token_type_ids"], ["t"], name="token_types"),
        helper.make_node("Add", ["e", "t"], ["h"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "axes"], ["m3"]),
        helper.make_node("Mul", ["h", "m3"], ["out"]),
        helper.make_node("Identity", ["count"], ["count_out"]),
    ]
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes")
    graph = helper.make_graph(
        nodes,
        "bert_like",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"]),
            helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, [1, "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "seq"]),
            helper.make_tensor_value_info("count", TensorProto.INT32, [1]),
        ],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "seq", 4]),
            helper.make_tensor_value_info("count_out", TensorProto.INT32, [1]),
        ],
        initializer=[table, types_q, scale, axes],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_gather_indices_stay_within_the_table_and_other_integers_default_to_0_1():
    model = _bert_like()
    limits = gather_index_limits(model)
    assert {k: v[0] for k, v in limits.items()} == {"input_ids": 30, "token_type_ids": 2}
    specs = input_specs(model)
    options = GenerationOptions(
        samples=20, shapes=dict.fromkeys(("input_ids", "token_type_ids", "attention_mask"), (1, 64))
    )
    ranges = resolve_value_ranges(specs, options, limits)
    assert (ranges["input_ids"].low, ranges["input_ids"].high) == (0, 29)
    assert "word_embeddings" in ranges["input_ids"].why
    values = {n: np.concatenate([s.feeds[n].ravel() for s in generate_samples(specs, options, ranges)]) for n in ranges}
    assert values["input_ids"].min() == 0 and values["input_ids"].max() == 29
    assert set(np.unique(values["token_type_ids"])) == {0, 1}
    assert set(np.unique(values["attention_mask"])) == {0, 1}
    assert set(np.unique(values["count"])) == {0, 1}
    # the model runs on them, and the report says where every range came from
    report = verify(model, _bert_like(), samples=3, input_shapes={"input_ids": (1, 8)})
    assert report.passed
    assert report.to_dict()["settings"]["inputs"]["value_ranges"]["attention_mask"]["why"] == "integer default {0, 1}"


def test_val_range_in_polygraphy_spelling_sets_per_input_and_global_ranges():
    assert parse_val_range("input0:[0.0,15.0]") == ("input0", (0.0, 15.0))
    assert parse_val_range("[-2,2]") == ("", (-2.0, 2.0))
    assert parse_val_range("out:0:[1,2]") == ("out:0", (1.0, 2.0))
    for bad in ("x:[1]", "x:1,2", "[a,b]", ":[1,2]"):
        with pytest.raises(UsageError, match=r"^--val-range: "):
            parse_val_range(bad)
    model = _bert_like()
    specs = input_specs(model)
    options = GenerationOptions(samples=5, value_ranges={"": (3, 4), "attention_mask": (1, 1)}, battery=False)
    ranges = resolve_value_ranges(specs, options, gather_index_limits(model))
    samples = generate_samples(specs, options, ranges)
    assert all((s.feeds["attention_mask"] == 1).all() for s in samples)
    assert all(((s.feeds["input_ids"] >= 3) & (s.feeds["input_ids"] <= 4)).all() for s in samples)
    with pytest.raises(UsageError, match=r"^--val-range: the model has no input named 'nope'"):
        resolve_value_ranges(specs, GenerationOptions(value_ranges={"nope": (0, 1)}))
    with pytest.raises(UsageError, match=r"^--val-range x:\[2.0,1.0\]: the low end is above the high end"):
        GenerationOptions(value_ranges={"x": (2.0, 1.0)})


def test_val_range_several_values_after_one_flag_on_the_command_line(toy, tmp_path):
    saved = tmp_path / "in.npz"
    result = invoke(
        "verify", "--val-range", "x:[5,6]", "[0,1]", toy["original"], toy["good"], "--save-inputs", saved, "-q"
    )
    assert result.exit_code == 0, result.output
    with np.load(saved) as data:
        x = np.concatenate([data[k].ravel() for k in data.files if k.startswith("random")])
    assert x.min() >= 5 and x.max() <= 6


def _nan_upstream_model() -> onnx.ModelProto:
    """x -> Sqrt -> DynamicQuantizeLinear: a negative x[0] becomes NaN before the DQL."""
    nodes = [
        helper.make_node("Sqrt", ["x"], ["root"], name="sqrt"),
        helper.make_node("DynamicQuantizeLinear", ["root"], ["y", "y_scale", "y_zp"], name="dql"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, [16]),
            helper.make_tensor_value_info("y_scale", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("y_zp", TensorProto.UINT8, []),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_nan_reaching_dynamic_quantize_linear_is_inconclusive_not_a_disagreement():
    model = _nan_upstream_model()
    rewritten = onnx_qrewrite.rewrite(model).model
    finite = np.linspace(0.0, 2.0, 16, dtype=np.float32)
    poisoned = finite.copy()
    poisoned[0] = -1.0  # sqrt(-1) = NaN at position 0: onnxruntime's kernel and the expansion differ
    bare = verify(model, rewritten, inputs=[Sample("poisoned", {"x": poisoned})], localize_failures=False)
    assert bare.verdict_key == "inconclusive" and bare.exit_code == EXIT_INCONCLUSIVE
    (hazard,) = bare.excluded
    assert (hazard.sample, hazard.node, hazard.value) == ("poisoned", "dql", "root")
    assert bare.summary.startswith("INCONCLUSIVE | nothing was compared: every sample was excluded: NaN reached")
    mixed = verify(model, rewritten, inputs=[Sample("finite", {"x": finite}), Sample("poisoned", {"x": poisoned})])
    assert mixed.passed and mixed.outputs[0].elements == 16
    assert "1 sample excluded (NaN into a non-deterministic kernel)" in mixed.summary
    assert "excluded sample 'poisoned': NaN reached DynamicQuantizeLinear 'dql'" in mixed.to_table()
    data = mixed.to_dict()
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["excluded_samples"][0]["value"] == "root" and data["verdict"] == "passed"


# -- nothing compared is never a pass -----------------------------------------------------------


def test_zero_size_outputs_are_inconclusive_with_exit_6_in_table_json_and_cli(toy, tmp_path):
    report_path = tmp_path / "r.json"
    result = invoke("verify", toy["original"], toy["good"], "--input-shape", "x:0,4", "--report", report_path)
    assert result.exit_code == EXIT_INCONCLUSIVE, result.output
    assert "EMPTY" in result.output
    assert result.output.splitlines()[-1] == (
        "INCONCLUSIVE | nothing was compared: every output has zero elements on every sample"
    )
    data = json.loads(report_path.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["verdict"] == "inconclusive" and {o["verdict"] for o in data["outputs"]} == {"empty"}


def test_input_shape_takes_a_named_dimension_as_rewrite_target_does(toy, tmp_path):
    """``verify --input-shape DIM=N`` is the spelling ``rewrite --target`` takes (one parser): the
    symbolic dimension DIM of every input gets N; an input's own NAME:D0,D1 wins; a DIM the model
    does not have is exit 2 naming it (a typo must not silently verify on the default 1)."""
    report_path = tmp_path / "r.json"
    done = invoke("verify", toy["original"], toy["good"], "--input-shape", "batch=3", "--report", report_path)
    assert done.exit_code == 0, done.output
    data = json.loads(report_path.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["settings"]["inputs"]["input_dims"] == {"batch": 3}
    assert {tuple(i["shape"]) for s in data["inputs"]["samples"] for i in s["inputs"]} == {(3, 4)}
    args = ("--input-shape", "batch=3", "--input-shape", "x:2,4", "--report", report_path)
    assert invoke("verify", toy["original"], toy["good"], *args).exit_code == 0
    data = json.loads(report_path.read_text())
    assert {tuple(i["shape"]) for s in data["inputs"]["samples"] for i in s["inputs"]} == {(2, 4)}
    bad = invoke("verify", toy["original"], toy["good"], "--input-shape", "seq=3")
    assert bad.exit_code == 2
    assert one_error_line(bad.output) == (
        "onnx-qrewrite: error: --input-shape seq=3: no input of the model has a dimension named 'seq' (named: batch)"
    )
    for text, message in (("batch=x", "expected DIM=N with N an integer"), ("batch=-1", "must be >= 0")):
        bad = invoke("verify", toy["original"], toy["good"], "--input-shape", text)
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_the_same_file_twice_is_inconclusive(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(_nan_upstream_model(), model)
    proc = cli("verify", model, model)
    assert proc.returncode == EXIT_INCONCLUSIVE and proc.stderr == ""
    assert proc.stdout.splitlines()[-1].startswith("INCONCLUSIVE | nothing was compared: ORIGINAL and REWRITTEN")


def test_an_inconclusive_result_ranks_between_success_and_everything_else():
    assert worst_exit_code([0, 6]) == 6 and worst_exit_code([6, 1]) == 1 and worst_exit_code([5, 6]) == 5
    assert worst_exit_code([]) == 0


# -- Polygraphy-compatible options ---------------------------------------------------------------


def test_global_options_work_after_the_subcommand(toy):
    proc = cli("verify", toy["original"], toy["bad"], "-q")
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "")
    loud = invoke("verify", toy["original"], toy["good"], "-v", "-v", "--samples", "1")
    assert loud.exit_code == 0 and loud.output.splitlines()[-1].startswith("PASSED")


def test_atol_takes_several_values_after_one_flag_and_positionals_stay_positional(toy):
    args = ["--no-localize", "--lsb", "yq:255"]
    one_flag = invoke("verify", "--atol", "1e-5", "y:10", toy["original"], toy["bad"], *args)
    assert one_flag.exit_code == 0, one_flag.output
    assert "atol 10, rtol 1e-05" in one_flag.output
    repeated = invoke("verify", toy["original"], toy["bad"], "--atol", "1e-5", "--atol", "y:10", *args)
    assert repeated.exit_code == 0 and repeated.output.splitlines()[-1] == one_flag.output.splitlines()[-1]


def test_tolerance_rules_differ_exactly_where_documented():
    numpy_rule = Tolerances(atol=0.0, rtol=0.9).for_value("v", np.dtype(np.float32))
    polygraphy = Tolerances(atol=0.0, rtol=0.9, rule="polygraphy").for_value("v", np.dtype(np.float32))
    original, rewritten = np.array([1.0, 10.0], np.float32), np.array([10.0, 1.0], np.float32)
    # element 0: |9| / |rewritten 10| = 0.9 passes Polygraphy, 9 > 0.9 * |original 1| fails numpy;
    # element 1: 9 <= 0.9 * |original 10| passes numpy, |9| / |rewritten 1| = 9 fails Polygraphy.
    a = compare_values("v", "s", original, rewritten, numpy_rule)
    b = compare_values("v", "s", original, rewritten, polygraphy)
    assert a.mismatches == 1 and b.mismatches == 1
    assert compare_values("v", "s", original[:1], rewritten[:1], polygraphy).passed
    assert not compare_values("v", "s", original[:1], rewritten[:1], numpy_rule).passed
    assert polygraphy.describe(False) == "atol 0 or rtol 0.9"
    with pytest.raises(UsageError, match=r"^--tolerance-rule: "):
        Tolerances(rule="loose")


def test_saved_outputs_replay_against_the_rewritten_model(toy, tmp_path):
    stored = tmp_path / "ref.npz"
    first = invoke("verify", toy["original"], toy["good"], "--save-outputs", stored, "--samples", "1")
    assert first.exit_code == 0, first.output
    with np.load(stored) as data:
        keys = set(data.files)
    assert "__meta__" in keys and "input::random-0::x" in keys and "output::random-0::y" in keys
    good = invoke("verify", toy["good"], "--load-outputs", stored)
    assert good.exit_code == 0, good.output
    assert good.output.splitlines()[-1] == first.output.splitlines()[-1]
    bad = invoke("verify", toy["bad"], "--load-outputs", stored)
    assert bad.exit_code == 1
    assert "no original model to localize against" in bad.output


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({}, "not an onnx-qrewrite outputs file"),
        ({"x": np.zeros(2)}, "not an onnx-qrewrite outputs file"),
    ],
)
def test_a_foreign_outputs_file_is_a_usage_error(toy, tmp_path, content, expected):
    path = tmp_path / "foreign.npz"
    np.savez(path, **content)
    result = invoke("verify", toy["good"], "--load-outputs", path)
    assert result.exit_code == 2 and expected in result.output


# -- clean errors, bounded time and memory --------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--seed", "-1"], "--seed: expected an integer from 0 to 2**64-1, got -1"),
        (["--samples", "1000000000"], "--samples: expected a count from 0 to 100000, got 1000000000"),
        (["--lsb", str(10**30)], "--lsb: at most 18446744073709551615 (any 64-bit difference)"),
        (["--input-shape", "x:100000000,4"], "input 'x' of shape [100000000, 4] (--input-shape) would need"),
        (
            ["--samples", "100000", "--input-shape", "x:1024,4"],
            "100004 samples of 16.0 KiB each (--samples) would need",
        ),
        (["--val-range", "x:[1,nan]"], "--val-range x:[1.0,nan]: both ends must be finite numbers"),
        (["--tolerance-rule", "fuzzy"], "--tolerance-rule"),
    ],
)
def test_options_that_would_exhaust_the_machine_are_refused_in_one_line(toy, tmp_path, args, expected):
    report = tmp_path / "r.json"
    proc = cli_in_process("verify", toy["original"], toy["good"], *args, "--report", report)  # in this process
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and expected in proc.stderr
    if args[0] != "--tolerance-rule":  # click's own usage errors come with its usage lines
        one_error_line(proc.stderr)
    assert not report.exists()


def test_the_bound_is_the_documented_one():
    assert MAX_INPUT_BYTES == 1 << 30


def test_threads_above_the_machine_are_capped_with_a_warning(toy):
    proc = cli("verify", toy["original"], toy["good"], "--threads", "100000", "--samples", "1")
    assert proc.returncode == 0, proc.stderr
    assert one_error_line(proc.stderr) == (
        f"onnx-qrewrite: WARNING: --threads 100000: this machine has {available_cpus()} CPU(s); "
        f"using {available_cpus()}"
    )


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    ("name", "arrays", "expected"),
    [
        ("empty", {}, "the file holds no arrays"),
        ("names", {"nope": np.zeros((3, 4), np.float32)}, "'nope' is not an input of the model"),
        ("dtype", {"x": np.zeros((3, 4), np.float64)}, "has dtype float64, but the model input is float"),
        ("rank", {"x": np.zeros((3, 4, 1), np.float32)}, "has shape [3, 4, 1], but the model declares"),
        ("objects", {"x": np.array([{}], dtype=object)}, "holds Python objects"),
    ],
)
def test_bad_inputs_files_are_one_line_usage_errors(toy, tmp_path, name, arrays, expected):
    path = tmp_path / f"{name}.npz"
    if name == "objects":
        np.savez(path, allow_pickle=True, **arrays)
    else:
        _npz(path, **arrays)
    result = invoke("verify", toy["original"], toy["good"], "--inputs", path)
    assert result.exit_code == 2, result.output
    assert expected in result.output


def test_an_npz_declaring_a_huge_array_is_refused_before_reading_it(toy, tmp_path):
    path = tmp_path / "bomb.npz"
    # A header claiming 2**40 float32 elements and no data: refused from the header alone.
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**20, 2**20)})
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue())
    result = invoke("verify", toy["original"], toy["good"], "--inputs", path)
    assert result.exit_code == 2, result.output
    assert "its arrays would take 4.0 TiB (4398046511104 bytes), more than the 1.0 GiB bound" in result.output


def test_rewrite_verify_that_proves_nothing_or_cannot_run_leaves_no_output(tmp_path):
    from conftest import SAMPLES

    out = tmp_path / "mlp.onnx"
    empty = invoke("rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out, "--verify", "--input-shape", "input:0,64")
    assert empty.exit_code == EXIT_INCONCLUSIVE, empty.output
    assert "verification proved nothing (--keep-failed keeps it)" in empty.output and not out.exists()
    kept = invoke(
        "rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out, "--verify", "--input-shape", "input:0,64", "--keep-failed"
    )
    assert kept.exit_code == EXIT_INCONCLUSIVE and out.exists()
    out.unlink()
    bad = invoke("rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out, "--verify", "--input-shape", "nope:1,64")
    assert bad.exit_code == 2 and "--input-shape: the model has no input named 'nope'" in bad.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--runtime", "openvino"], "--runtime"),
        (["--atol", "1e-3"], "--atol"),
        (["--samples", "3"], "--samples"),
        (["--providers", "CPUExecutionProvider"], "--providers"),
        (["--no-battery"], "--battery/--no-battery"),
        (["--save-inputs", "in.npz"], "--save-inputs"),
    ],
)
def test_rewrite_refuses_a_verification_option_without_verify(tmp_path, args, named):
    """Given without --verify, the option would act on nothing: exit 2 before any work, as
    --keep-failed and --junit are (it was silently ignored)."""
    from conftest import SAMPLES

    out = tmp_path / "mlp.onnx"
    result = invoke("rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out, *args)
    assert result.exit_code == 2, result.output
    assert f"{named} needs --verify" in result.output
    assert list(tmp_path.iterdir()) == []
    assert invoke("rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out, "-q").exit_code == 0


@pytest.mark.parametrize("option", ["--save-outputs", "--save-inputs", "--report", "--junit"])
def test_verify_never_writes_a_file_it_reads(toy, tmp_path, option):
    original = tmp_path / "o.onnx"
    original.write_bytes(toy["original"].read_bytes())
    before = original.read_bytes()
    proc = cli_in_process("verify", original, toy["good"], option, original)  # an option battery: in this process
    assert proc.returncode == 2
    assert one_error_line(proc.stderr) == (
        f"onnx-qrewrite: error: {option} {original}: refusing to overwrite the input file {original} (the same "
        "file), which this invocation reads; choose another path"
    )
    assert original.read_bytes() == before


def test_two_outputs_of_verify_cannot_be_one_file(toy, tmp_path):
    same = tmp_path / "same.npz"
    result = invoke("verify", toy["original"], toy["good"], "--save-inputs", same, "--save-outputs", same)
    assert (
        result.exit_code == 2
        and "--save-outputs" in result.output
        and "is also given to --save-inputs" in result.output
    )
    assert not same.exists()
