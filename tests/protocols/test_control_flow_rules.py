"""The rules of an ensemble's control flow declarations, checked at load: every mistake is one
clear error naming the ensemble, the parameter (and the step or tensor); a config that uses
them still parses in Triton; constants can come from files of the ensemble's folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

import orchestrion
from orchestrion.protocols import (
    DataType,
    EnsembleScheduling,
    EnsembleStep,
    ModelConfig,
    ModelTransactionPolicy,
    Reshape,
    TensorConfig,
    parse_model_config,
    read_control,
    validate_repository,
)

BOOL = DataType.BOOL


def tensor(
    name: str, data_type: DataType = DataType.FP32, dims: tuple[int, ...] = (4,)
) -> TensorConfig:
    return TensorConfig(name=name, data_type=data_type, dims=dims)


def model(
    name: str, inputs: list[TensorConfig], outputs: list[TensorConfig], **kw: Any
) -> ModelConfig:
    return ModelConfig(name=name, input=tuple(inputs), output=tuple(outputs), **kw)


def step(name: str, inputs: dict[str, str], outputs: dict[str, str]) -> EnsembleStep:
    return EnsembleStep(model_name=name, input_map=inputs, output_map=outputs)


MODELS = {
    "detect": model(
        "detect", [tensor("IMG")], [tensor("BOXES", dims=(-1, 4)), tensor("UNSURE", BOOL, (1,))]
    ),
    "classify": model(
        "classify",
        [tensor("BOX"), tensor("SCALE", dims=(1,))],
        [tensor("SCORE", dims=(1,))],
        max_batch_size=8,
    ),
    "second": model("second", [tensor("IMG")], [tensor("OPINION", dims=(1,))]),
    "refine": model(
        "refine",
        [tensor("X", dims=(-1, 1)), tensor("N", DataType.INT32, (1,))],
        [
            tensor("Y", dims=(-1, 1)),
            tensor("AGAIN", BOOL, (1,)),
            tensor("N1", DataType.INT32, (1,)),
        ],
    ),
}
STEPS = (
    step("detect", {"IMG": "IMG"}, {"BOXES": "boxes", "UNSURE": "unsure"}),
    step("classify", {"BOX": "boxes", "SCALE": "scale"}, {"SCORE": "scores"}),
    step("second", {"IMG": "IMG"}, {"OPINION": "OPINION"}),
    step(
        "refine", {"X": "scores", "N": "zero"}, {"Y": "REFINED", "AGAIN": "again", "N1": "ROUNDS"}
    ),
)
VALID = {
    "step[1].map": "boxes",
    "step[1].max_items_in_flight": "16",
    "step[2].when": "unsure",
    "step[2].timeout_ms": "500",
    "step[2].parameters": '{"threshold": 0.5}',
    "constant.scale": '{"data_type": "TYPE_FP32", "dims": [1], "value": [0.5]}',
    "constant.zero": '{"data_type": "TYPE_INT32", "dims": [1], "value": [0]}',
    "default.OPINION": '{"data_type": "TYPE_FP32", "dims": [1], "value": [-1]}',
    "loop.refine": '{"steps": [3], "while": "again", "max_iterations": 3, '
    '"next": {"REFINED": "scores", "ROUNDS": "zero"}}',
    "fusion": "on",  # not a control declaration: left alone
}


def pipeline(
    parameters: dict[str, str], steps: tuple[EnsembleStep, ...] = STEPS, **kw: Any
) -> ModelConfig:
    return ModelConfig(
        name="pipe",
        platform="ensemble",
        input=(tensor("IMG"),),
        output=(
            tensor("REFINED", dims=(-1, 1)),
            tensor("OPINION", dims=(1,)),
            tensor("ROUNDS", DataType.INT32, (1,)),
        ),
        ensemble_scheduling=EnsembleScheduling(step=steps),
        parameters=parameters,
        **kw,
    )


def in_out(steps: list[EnsembleStep], parameters: dict[str, str] | None = None) -> ModelConfig:
    """An ensemble 'pipe' of FP32 [4] input IN and output OUT."""
    return ModelConfig(
        name="pipe",
        platform="ensemble",
        input=(tensor("IN"),),
        output=(tensor("OUT"),),
        ensemble_scheduling=EnsembleScheduling(step=tuple(steps)),
        parameters=parameters or {},
    )


def errors_of(parameters: dict[str, str], **models: ModelConfig) -> list[str]:
    return validate_repository({**MODELS, **models, "pipe": pipeline(parameters)})


def test_every_construct_declared_at_once_is_valid() -> None:
    """The detection pipeline's declarations pass, and read as declared."""
    assert errors_of(VALID) == []
    control, problems = read_control(pipeline(VALID))
    assert problems == []
    assert control.steps[1].mapped == frozenset({"boxes"})
    assert control.steps[1].max_items == 16
    assert (control.steps[2].when, control.steps[2].negate) == ("unsure", False)
    assert control.steps[2].timeout == 0.5
    assert control.steps[2].parameters == {"threshold": 0.5}
    assert control.constants["scale"].value.tolist() == [0.5]
    assert control.defaults["OPINION"].value.tolist() == [-1.0]
    (loop,) = control.loops
    assert (loop.steps, loop.condition, loop.max_iterations) == (frozenset({3}), "again", 3)
    assert loop.carry == (("REFINED", "scores"), ("ROUNDS", "zero"))


def without(key: str) -> dict[str, str]:
    return {k: v for k, v in VALID.items() if k != key}


BROKEN = [
    (
        {"step[9].when": "unsure"},
        "parameters 'step[9].when': there is no step[9] (the ensemble has 4)",
    ),
    (
        {"step[2].whenever": "unsure"},
        "parameters 'step[2].whenever': unknown field 'whenever' (known: when, parameters, timeout_ms, map, max_items_in_flight)",
    ),
    (
        {"step[2].when": "IMG"},
        "parameters 'step[2].when': tensor 'IMG' (ensemble input 'IMG') is FP32; a condition is BOOL",
    ),
    (
        {"step[2].when": "nothing"},
        "parameters 'step[2].when': tensor 'nothing' is not made by any step",
    ),
    (
        {"step[2].when": "if unsure"},
        "parameters 'step[2].when': give a BOOL tensor's name, or 'not' and one: 'if unsure'",
    ),
    (
        {"step[2].timeout_ms": "-5"},
        "parameters 'step[2].timeout_ms': must be a positive integer, got '-5'",
    ),
    (
        {"step[2].parameters": "[1, 2]"},
        "parameters 'step[2].parameters': give a JSON object of strings, numbers and booleans",
    ),
    ({"step[1].map": "IMG"}, "parameters 'step[1].map': tensor 'IMG' is not one the step takes"),
    (
        {"constant.scale": '{"data_type": "TYPE_FP32", "dims": [1], "value": [0.5, 1]}'},
        "parameters 'constant.scale': 'value' does not make a TYPE_FP32 tensor of dims [1]",
    ),
    (
        {"constant.scale": '{"data_type": "TYPE_FP32", "dims": [1]'},
        "parameters 'constant.scale': not valid JSON",
    ),
    (
        {"constant.scale": '{"data_type": "FLOAT", "dims": [1], "value": [1]}'},
        "parameters 'constant.scale': 'data_type' must be a TYPE_... name, got 'FLOAT'",
    ),
    (
        {
            "constant.scale": '{"data_type": "TYPE_FP32", "dims": [1], "value": [1], "file": "a.npy"}'
        },
        "parameters 'constant.scale': give exactly one of 'value' and 'file'",
    ),
    (
        {"constant.IMG": '{"data_type": "TYPE_FP32", "dims": [4], "value": [1, 2, 3, 4]}'},
        "parameters 'constant.IMG': the name is taken by ensemble input 'IMG'",
    ),
    (
        {"constant.spare": '{"data_type": "TYPE_FP32", "dims": [1], "value": [1]}'},
        "parameters 'constant.spare': the constant is not used by any step",
    ),
    (
        {"default.OPINION": '{"data_type": "TYPE_INT32", "dims": [1], "value": [1]}'},
        "parameters 'default.OPINION': the default is INT32 and step[2] (model 'second') output 'OPINION' is FP32",
    ),
    (
        {"default.IMG": '{"data_type": "TYPE_FP32", "dims": [4], "value": [1, 2, 3, 4]}'},
        "parameters 'default.IMG': tensor 'IMG' is not made by any step",
    ),
    (
        {"any.either": "scores"},
        "parameters 'any.either': give two or more tensor names, comma-separated: 'scores'",
    ),
    (
        {"loop.refine": '{"steps": [3], "while": "again"}'},
        "parameters 'loop.refine': a loop needs 'max_iterations', its bound",
    ),
    (
        {"loop.refine": '{"steps": [3], "while": "again", "max_iterations": 0}'},
        "parameters 'loop.refine max_iterations': must be a positive integer, got 0",
    ),
    (
        {
            "loop.refine": '{"steps": [3], "while": "unsure", "max_iterations": 3, "next": {"REFINED": "scores", "ROUNDS": "zero"}}'
        },
        "parameters 'loop.refine': 'while' tensor 'unsure' is not made by a step of the loop",
    ),
    (
        {
            "loop.refine": '{"steps": [3], "while": "ROUNDS", "max_iterations": 3, "next": {"REFINED": "scores"}}'
        },
        "parameters 'loop.refine': 'while' tensor 'ROUNDS' is INT32; a condition is BOOL",
    ),
    (
        {"loop.refine": '{"steps": [7], "while": "again", "max_iterations": 3}'},
        "parameters 'loop.refine': there is no step [7] (the ensemble has 4)",
    ),
    (
        {
            "loop.refine": '{"steps": [3], "while": "again", "max_iterations": 3, "next": {"again": "scores"}}'
        },
        "parameters 'loop.refine': 'next' feeds 'again' (BOOL) to 'scores' (FP32)",
    ),
    (
        {"loop.refine": '{"steps": [3], "whilst": "again", "max_iterations": 3}'},
        "parameters 'loop.refine': unknown fields ['whilst'] (known: max_iterations, next, steps, while)",
    ),
    (
        {"step.2.when": "unsure"},
        "parameters 'step.2.when': a step's key is 'step[N].FIELD', N its index from 0",
    ),
    ({"constant.": "{}"}, "parameters 'constant.': the key names no tensor or loop after the dot"),
    (
        {"constant.scale": '{"data_type": "TYPE_INT8", "dims": [1], "value": [300]}'},
        "parameters 'constant.scale': 'value' does not make a TYPE_INT8 tensor of dims [1]: "
        "Python integer 300 out of bounds for int8",
    ),
    (
        {"step[2].max_items_in_flight": "4"},
        "parameters 'step[2].max_items_in_flight': step[2] has no 'map'",
    ),
    (
        {"loop.refine": '{"steps": [true], "while": "again", "max_iterations": 3}'},
        "parameters 'loop.refine': 'steps' must list the loop's step indices, got [True]",
    ),
    (
        {"any.A": "scores, OPINION", "any.B": "A, REFINED"},
        "parameters 'any.B': alternative 'A' is itself a join: list all the alternatives in "
        "one join (the first of them to arrive is the same)",
    ),
    (
        {
            "loop.refine": '{"steps": [3], "while": "again", "max_iterations": 3, '
            '"next": {"REFINED": "scores", "ROUNDS": "zero", "again": "nothing"}}'
        },
        "parameters 'loop.refine': 'next' feeds 'nothing', which no step of the loop takes",
    ),
]


CONSEQUENCES = {
    # A condition replaced leaves the tensor it took unused; an output behind a tensor
    # nobody makes is unreachable.
    "step[2].when=IMG": ["tensor 'unsure'"],
    "step[2].when=nothing": ["tensor 'unsure'", "ensemble output 'OPINION' is not reachable"],
    "loop.refine:unsure": ["tensor 'again'"],
    "loop.refine:ROUNDS": ["tensor 'again'"],
}


def case_name(change: dict[str, str]) -> str:
    key, value = next(iter(change.items()))
    if key == "loop.refine":
        return f"{key}:{json.loads(value).get('while')}" if value.endswith("}") else key
    return f"{key}={value}"


@pytest.mark.parametrize(("change", "expected"), BROKEN, ids=[case_name(c) for c, _ in BROKEN])
def test_each_mistake_is_one_clear_error(change: dict[str, str], expected: str) -> None:
    """Each mistake gives an error that names the ensemble and the parameter, first; the only
    others are what the mistake itself leaves unused or unreachable."""
    found = errors_of({**VALID, **change})
    assert found[0].startswith(f"ensemble 'pipe': {expected}"), found
    consequences = CONSEQUENCES.get(case_name(change), [])
    assert len(found) == 1 + len(consequences), found
    for consequence, error in zip(consequences, found[1:], strict=True):
        assert consequence in error, found


def test_a_map_over_a_tensor_without_a_dimension_is_refused() -> None:
    """A scalar (an ensemble input reshaped to no dims) has no items to map over."""
    models = {"use": model("use", [tensor("X", dims=(1,))], [tensor("Y", dims=(1,))])}
    scalar = TensorConfig(name="IN", data_type=DataType.FP32, dims=(1,), reshape=Reshape(shape=()))
    config = ModelConfig(
        name="pipe",
        platform="ensemble",
        input=(scalar,),
        output=(tensor("OUT", dims=(-1, 1)),),
        ensemble_scheduling=EnsembleScheduling(step=(step("use", {"X": "IN"}, {"Y": "OUT"}),)),
        parameters={"step[0].map": "IN"},
    )
    assert validate_repository({**models, "pipe": config}) == [
        "model 'pipe' input 'IN': an empty reshape needs max_batch_size > 0",
        "ensemble 'pipe' step[0] (model 'use'): parameters 'step[0].map': tensor 'IN' "
        "(ensemble input 'IN') has no dimension to map over",
    ]


def test_a_mapped_tensor_whose_items_do_not_fit_the_model_is_refused() -> None:
    """Each item is the tensor without its first dimension: a model that wants the whole
    list of boxes cannot be mapped over them."""
    whole = model(
        "classify",
        [tensor("BOX", dims=(-1, 4)), tensor("SCALE", dims=(1,))],
        [tensor("SCORE", dims=(1,))],
    )
    (error,) = errors_of(VALID, classify=whole)
    assert error == (
        "ensemble 'pipe' step[1] (model 'classify'): tensor 'boxes' has shape [4] (an item "
        "of step[0] (model 'detect') output 'BOXES') but input 'BOX' expects [-1,4]"
    )


def test_a_cycle_without_a_loop_declaration_names_its_steps() -> None:
    """Steps that wait on each other are a cycle; only a loop may repeat steps."""
    models = {
        "a": model("a", [tensor("X"), tensor("B")], [tensor("Y")]),
        "b": model("b", [tensor("X")], [tensor("Y"), tensor("Z")]),
    }
    config = in_out(
        [
            step("a", {"X": "IN", "B": "back"}, {"Y": "forth"}),
            step("b", {"X": "forth"}, {"Y": "back", "Z": "OUT"}),
        ]
    )
    (error,) = validate_repository({**models, "pipe": config})
    assert error == (
        "ensemble 'pipe': ensemble output 'OUT' is not reachable from the ensemble inputs "
        "(steps wait on each other in a cycle: step[0] -> step[1] -> step[0]; repeat steps "
        "with a 'loop.NAME' parameter)"
    )


def test_a_loop_fed_tensor_taken_outside_the_loop_is_refused() -> None:
    """What ``next`` feeds changes each iteration: a step outside the loop must take the
    loop's output instead."""
    steps = (*STEPS, step("second", {"IMG": "IMG"}, {"OPINION": "unused"}))
    parameters = {**VALID, "loop.refine": VALID["loop.refine"].replace('"scores"', '"IMG2"')}
    config = pipeline(parameters, steps)
    found = validate_repository({**MODELS, "pipe": config})
    assert any("'next' feeds 'IMG2', which no step of the loop takes" in e for e in found), found


def test_steps_in_two_loops_are_refused() -> None:
    """Loops do not nest."""
    parameters = {**VALID, "loop.again": '{"steps": [3], "while": "again", "max_iterations": 2}'}
    found = errors_of(parameters)
    assert (
        "ensemble 'pipe': parameters 'loop.refine': step[3] is already in loop 'again' (loops do not nest)"
        in found
    )


def test_control_flow_in_a_streaming_ensemble_is_refused() -> None:
    """An ensemble with a decoupled step streams through another path: conditions, loops,
    maps and joins are refused there (constants and step parameters work)."""
    decoupled = ModelConfig(
        name="second",
        input=(tensor("IMG"),),
        output=(tensor("OPINION", dims=(1,)),),
        model_transaction_policy=ModelTransactionPolicy(decoupled=True),
    )
    found = errors_of(VALID, second=decoupled)
    assert (
        "ensemble 'pipe': conditions, joins, loops, maps, defaults and step timeouts are not "
        "available in an ensemble that streams (it has a decoupled step)"
    ) in found


CONFIG = """
name: "pipe"
platform: "ensemble"
input [ { name: "IMG" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "REFINED" data_type: TYPE_FP32 dims: [ -1, 1 ] },
  { name: "OPINION" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "ROUNDS" data_type: TYPE_INT32 dims: [ 1 ] }
]
ensemble_scheduling {
  step [
    { model_name: "detect" model_version: -1
      input_map { key: "IMG" value: "IMG" }
      output_map [ { key: "BOXES" value: "boxes" }, { key: "UNSURE" value: "unsure" } ] },
    { model_name: "classify" model_version: -1
      input_map [ { key: "BOX" value: "boxes" }, { key: "SCALE" value: "scale" } ]
      output_map { key: "SCORE" value: "scores" } },
    { model_name: "second" model_version: -1
      input_map { key: "IMG" value: "IMG" }
      output_map { key: "OPINION" value: "OPINION" } },
    { model_name: "refine" model_version: -1
      input_map [ { key: "X" value: "scores" }, { key: "N" value: "zero" } ]
      output_map [ { key: "Y" value: "REFINED" }, { key: "AGAIN" value: "again" },
                   { key: "N1" value: "ROUNDS" } ] }
  ]
}
"""


def pbtxt_parameters(parameters: dict[str, str]) -> str:
    return "".join(
        f"parameters {{ key: {json.dumps(k)} value {{ string_value: {json.dumps(v)} }} }}\n"
        for k, v in parameters.items()
    )


def test_a_config_that_declares_control_flow_still_parses_in_triton() -> None:
    """Triton's own ModelConfig message takes the file (its parser refuses unknown fields),
    and orchestrion reads the same declarations from it."""
    text = CONFIG + pbtxt_parameters(VALID)
    triton = text_format.Parse(text, model_config_pb2.ModelConfig())
    as_triton = json_format.MessageToDict(triton, preserving_proto_field_name=True)
    assert {k: v["string_value"] for k, v in as_triton["parameters"].items()} == VALID
    ours = parse_model_config(text)
    assert validate_repository({**MODELS, "pipe": ours}) == []
    assert read_control(ours) == read_control(pipeline(VALID))


def write_repository(root: Path, constant: str, weights: np.ndarray | None) -> Path:
    """An ensemble 'pipe' that multiplies by constant 'w', and its model 'mul'."""
    (root / "mul" / "1").mkdir(parents=True)
    (root / "mul" / "config.pbtxt").write_text(
        'name: "mul"\nbackend: "python"\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] }, '
        '{ name: "W" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
    )
    (root / "mul" / "1" / "model.py").write_text("def execute(X, W):\n    return {'Y': X * W}\n")
    (root / "pipe" / "1").mkdir(parents=True)
    (root / "pipe" / "config.pbtxt").write_text(
        'name: "pipe"\nplatform: "ensemble"\n'
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "mul" model_version: -1 '
        'input_map [ { key: "X" value: "IN" }, { key: "W" value: "w" } ] '
        'output_map { key: "Y" value: "OUT" } } ] }\n' + pbtxt_parameters({"constant.w": constant})
    )
    if weights is not None:
        np.save(root / "pipe" / "1" / "weights.npy", weights)
    return root


FROM_FILE = '{"data_type": "TYPE_FP32", "dims": [2], "file": "weights.npy"}'


async def test_a_constant_from_a_file_of_the_version_folder(tmp_path: Path) -> None:
    """``"file"``: the ``.npy`` file in the ensemble's version folder is the constant."""
    root = write_repository(tmp_path, FROM_FILE, np.array([3.0, 4.0], np.float32))
    async with orchestrion.open_server(root) as server:
        response = await server.infer("pipe", {"IN": np.array([1.0, 2.0], np.float32)})
    assert response.outputs["OUT"].tolist() == [3.0, 8.0]


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        (None, "cannot be read as a .npy file"),
        (np.array([3, 4], np.int64), "holds int64, and the parameter declares TYPE_FP32 (float32)"),
        (np.array([3, 4, 5], np.float32), "has shape [3], and the parameter declares dims [2]"),
    ],
)
async def test_a_bad_constant_file_is_refused_naming_file_and_parameter(
    tmp_path: Path, weights: np.ndarray | None, expected: str
) -> None:
    """A missing file, or one of another type or shape: the load fails, naming both."""
    root = write_repository(tmp_path, FROM_FILE, weights)
    with pytest.raises(orchestrion.ConfigError) as raised:
        async with orchestrion.open_server(root):
            pass
    message = str(raised.value)
    assert f"parameters 'constant.w': {root / 'pipe' / '1' / 'weights.npy'}: {expected}" in message


async def test_a_file_constant_of_an_ensemble_made_in_python_needs_its_value() -> None:
    """An ensemble made in Python has no folder: a file constant must come as a value."""
    pipe = ModelConfig(
        name="pipe",
        platform="ensemble",
        input=(tensor("IN", dims=(2,)),),
        output=(tensor("OUT", dims=(2,)),),
        ensemble_scheduling=EnsembleScheduling(
            step=(step("mul", {"X": "IN", "W": "w"}, {"Y": "OUT"}),)
        ),
        parameters={"constant.w": FROM_FILE},
    )
    mul = orchestrion.Model(
        ModelConfig(
            name="mul",
            input=(tensor("X", dims=(2,)), tensor("W", dims=(2,))),
            output=(tensor("Y", dims=(2,)),),
        ),
        execute=lambda X, W: {"Y": X * W},
    )
    with pytest.raises(orchestrion.ConfigError, match=r"parameters 'constant.w' name a file"):
        async with orchestrion.open_server(models=[mul, orchestrion.Model(pipe)]):
            pass
    given = orchestrion.Model(pipe, constants={"w": np.array([2.0, 5.0], np.float32)})
    async with orchestrion.open_server(models=[mul, given]) as server:
        response = await server.infer("pipe", {"IN": np.array([1.0, 1.0], np.float32)})
    assert response.outputs["OUT"].tolist() == [2.0, 5.0]


def test_an_ensemble_made_in_python_declares_the_same_with_typed_values() -> None:
    """`EnsembleControl.to_parameters` writes what `read_control` reads back, values included,
    so an ensemble made in Python needs no hand-written JSON."""
    control = orchestrion.EnsembleControl(
        constants={
            "scale": orchestrion.DeclaredTensor.of(np.array([0.5], np.float32)),
            "zero": orchestrion.DeclaredTensor.of(np.array([0], np.int32)),
        },
        defaults={"OPINION": orchestrion.DeclaredTensor.of(np.array([-1.0], np.float32))},
        steps={
            1: orchestrion.StepControl(mapped="boxes", max_items=16),
            2: orchestrion.StepControl(when="unsure", timeout=0.5, parameters={"threshold": 0.5}),
        },
        loops=[
            orchestrion.EnsembleLoop(
                "refine", [3], "again", 3, {"REFINED": "scores", "ROUNDS": "zero"}
            )
        ],
    )
    parameters = control.to_parameters()
    assert errors_of(parameters) == []
    again, problems = read_control(pipeline(parameters))
    assert problems == []
    assert again == control
    for name in ("scale", "zero"):
        value = again.constants[name].value
        assert value is not None
        np.testing.assert_array_equal(value, control.constants[name].value)
        assert value.dtype == control.constants[name].value.dtype
    assert (
        read_control(pipeline(VALID))[0] == read_control(pipeline(parameters | {"fusion": "on"}))[0]
    )
    strings = orchestrion.DeclaredTensor.of(np.array([b"a", b"bc"], dtype=object))
    assert json.loads(strings.as_parameter()) == {
        "data_type": "TYPE_STRING",
        "dims": [2],
        "value": ["a", "bc"],
    }


def test_join_alternatives_agree_in_shape_and_carry_no_default() -> None:
    """A join's alternatives are one tensor to what takes it: the same shape; a default on
    one of them would win the join whenever its step is skipped, so it belongs on the join."""
    models = {
        "left": model("left", [tensor("X")], [tensor("Y")]),
        "right": model("right", [tensor("X")], [tensor("Y", dims=(2,))]),
        "finish": model("finish", [tensor("X")], [tensor("Y")]),
    }

    def config(parameters: dict[str, str]) -> ModelConfig:
        return in_out(
            [
                step("left", {"X": "IN"}, {"Y": "a"}),
                step("right", {"X": "IN"}, {"Y": "b"}),
                step("finish", {"X": "j"}, {"Y": "OUT"}),
            ],
            {"any.j": "a, b", **parameters},
        )

    (error,) = validate_repository({**models, "pipe": config({})})
    assert error == (
        "ensemble 'pipe': parameters 'any.j': the alternatives differ in shape: 'a' is [4], "
        "'b' is [2]"
    )
    same = {**models, "right": model("right", [tensor("X")], [tensor("Y")])}
    default = '{"data_type": "TYPE_FP32", "dims": [4], "value": [0, 0, 0, 0]}'
    (error,) = validate_repository({**same, "pipe": config({"default.a": default})})
    assert error == (
        "ensemble 'pipe': parameters 'any.j': alternative 'a' has a default, which would "
        "arrive first whenever its step is skipped; declare 'default.j' instead"
    )
    assert validate_repository({**same, "pipe": config({"default.j": default})}) == []


def test_a_step_between_two_steps_of_a_loop_must_be_in_it() -> None:
    """A step outside a loop that takes what the loop makes and makes what it takes would
    wait for the loop's end, and the loop for it."""
    models = {
        "a": model("a", [tensor("X")], [tensor("Y")]),
        "b": model("b", [tensor("X")], [tensor("Y")]),
        "c": model("c", [tensor("X")], [tensor("Y"), tensor("AGAIN", BOOL, (1,))]),
    }
    config = in_out(
        [
            step("a", {"X": "IN"}, {"Y": "mid"}),
            step("b", {"X": "mid"}, {"Y": "mid2"}),
            step("c", {"X": "mid2"}, {"Y": "OUT", "AGAIN": "again"}),
        ],
        {
            "loop.l": '{"steps": [0, 2], "while": "again", "max_iterations": 3, '
            '"next": {"OUT": "IN"}}'
        },
    )
    found = validate_repository({**models, "pipe": config})
    assert found[0] == (
        "ensemble 'pipe': parameters 'loop.l': step[1] (model 'b') takes what the loop makes "
        "and makes what the loop takes, so it would wait for the loop's end and the loop for "
        "it: add it to the loop's 'steps'"
    ), found


def test_steps_of_a_loop_that_wait_on_each_other_are_told_about_next() -> None:
    """Within a loop, an iteration's output reaches the next through 'next', not wiring."""
    models = {
        "a": model("a", [tensor("X"), tensor("F")], [tensor("Y")]),
        "b": model("b", [tensor("X")], [tensor("Y"), tensor("AGAIN", BOOL, (1,))]),
    }
    config = in_out(
        [
            step("a", {"X": "IN", "F": "OUT"}, {"Y": "mid"}),
            step("b", {"X": "mid"}, {"Y": "OUT", "AGAIN": "again"}),
        ],
        {"loop.l": '{"steps": [0, 1], "while": "again", "max_iterations": 3}'},
    )
    assert validate_repository({**models, "pipe": config}) == [
        "ensemble 'pipe': ensemble output 'OUT' is not reachable from the ensemble inputs "
        "(steps of loop 'l' wait on each other: step[0] -> step[1] -> step[0]; an iteration "
        "feeds the next through the loop's 'next')"
    ]
