"""Triton compatibility of the pure core: config parsing, data types, model and ensemble rules,
repository layout, request checks.

Tests pin behaviour that matches Triton; several started as proofs of a discrepancy that has
since been fixed.

References (triton-inference-server, main branch):
- core ``src/model_config_utils.cc``: ``ValidateIOShape``, ``ValidateModelConfig``,
  ``ValidateInstanceGroup``, ``ValidateEnsembleSchedulingConfig``, ``AutoCompleteBackendFields``.
- core ``src/ensemble_scheduler/ensemble_utils.cc``: ``ValidateEnsembleConfig``,
  ``ValidateTensorConsistency``; ``ensemble_scheduler.cc``: ``ReshapeTensorDims``.
- core ``src/model_repository_manager/model_lifecycle.cc``: ``VersionsToLoad``.
- server ``docs/user_guide/model_configuration.md``, ``model_repository.md``.
- server ``qa/L0_model_config/...``: Triton's own config cases with their expected outcome; the
  case name is given where a test mirrors one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.utils
from tritonclient.grpc import model_config_pb2

from orchestrion.protocols import (
    ConfigError,
    DataType,
    DynamicBatching,
    EnsembleScheduling,
    EnsembleStep,
    InstanceGroup,
    InstanceKind,
    InvalidRequestError,
    ModelConfig,
    ModelTransactionPolicy,
    QueuePolicy,
    Reshape,
    TensorConfig,
    check_inputs,
    format_model_config,
    parse_model_config,
    validate_ensemble,
    validate_model_config,
    validate_repository,
)
from orchestrion.repository import scan_repository

FP32 = DataType.FP32
INT32 = DataType.INT32
UINT32 = DataType.UINT32


def tc(
    name: str, dims: Iterable[int] = (4,), data_type: DataType = FP32, **kw: Any
) -> TensorConfig:
    """A tensor config, FP32 [4] unless told otherwise."""
    return TensorConfig(name=name, data_type=data_type, dims=tuple(dims), **kw)


def composing(
    name: str,
    inputs: Iterable[TensorConfig] = (),
    outputs: Iterable[TensorConfig] = (),
    **kw: Any,
) -> ModelConfig:
    """A Python composing model; one FP32 [4] input IN and output OUT unless told otherwise."""
    return ModelConfig(
        name=name,
        backend="python",
        input=tuple(inputs) or (tc("IN"),),
        output=tuple(outputs) or (tc("OUT"),),
        **kw,
    )


def step(model: str, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> EnsembleStep:
    """One ensemble step (latest version)."""
    return EnsembleStep(model_name=model, input_map=dict(inputs), output_map=dict(outputs))


def ensemble(
    name: str,
    inputs: Iterable[TensorConfig],
    outputs: Iterable[TensorConfig],
    steps: Iterable[EnsembleStep],
    **kw: Any,
) -> ModelConfig:
    """An ensemble config."""
    return ModelConfig(
        name=name,
        platform="ensemble",
        input=tuple(inputs),
        output=tuple(outputs),
        ensemble_scheduling=EnsembleScheduling(step=tuple(steps)),
        **kw,
    )


def repo(*configs: ModelConfig) -> dict[str, ModelConfig]:
    """Configs by name."""
    return {c.name: c for c in configs}


PY_IO = """
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def write_model(
    root: Path,
    folder: str,
    config: str,
    versions: Iterable[str] = ("1",),
    code_file: str | None = "model.py",
) -> None:
    """A model folder: config.pbtxt and version folders (each with ``code_file`` if given)."""
    (root / folder).mkdir(parents=True)
    (root / folder / "config.pbtxt").write_text(config)
    for version in versions:
        (root / folder / version).mkdir()
        if code_file is not None:
            (root / folder / version / code_file).write_text("def execute(IN):\n    return {}\n")


# 1. Parsing config.pbtxt as Python-backend users write it.


def test_typical_python_backend_config_is_accepted() -> None:
    """A Python-backend config with the fields such configs commonly carry parses and validates."""
    config = parse_model_config(
        """
        name: "tokenizer"
        backend: "python"
        max_batch_size: 8
        input [
          { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] },
          { name: "LANG" data_type: TYPE_STRING dims: [ 1 ] optional: true }
        ]
        output [ { name: "IDS" data_type: TYPE_INT64 dims: [ -1 ] } ]
        instance_group [ { count: 2 kind: KIND_CPU } ]
        dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
        parameters: { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }
        parameters: { key: "EMPTY" value: { string_value: "" } }
        model_transaction_policy { decoupled: False }
        optimization { input_pinned_memory { enable: false } }
        model_warmup [ { name: "w" batch_size: 1 inputs { key: "TEXT" value { data_type: TYPE_STRING dims: [ 1 ] zero_data: true } } } ]
        version_policy: { latest: { num_versions: 2 } }
        """
    )
    assert validate_model_config(config) == []
    assert config.input[0].data_type is DataType.BYTES
    assert config.input[1].optional
    assert config.instance_group == (InstanceGroup(kind=InstanceKind.KIND_CPU, count=2),)
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.preferred_batch_size == (4, 8)
    assert config.parameters == {
        "EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env.tar.gz",
        "EMPTY": "",
    }
    assert not config.decoupled
    assert config.version_policy is not None
    assert config.version_policy.latest == 2


def test_missing_data_type_is_an_error() -> None:
    """A tensor without data_type is refused (Triton: "must specify 'data_type'")."""
    with pytest.raises(ConfigError, match=r"input\[0\]\.data_type"):
        parse_model_config('name: "m" input [ { name: "I" dims: [ 1 ] } ]')


@pytest.mark.parametrize(
    "snippet",
    [
        'input [ { name: "S" data_type: TYPE_INT32 dims: [ 2 ] is_shape_tensor: true } ]',
        'input [ { name: "S" data_type: TYPE_INT32 dims: [ 2 ] is_non_linear_format_io: true } ]',
        'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "C" data_type: TYPE_INT32 '
        'source_input: "IN" } ]',
        'instance_group [ { kind: KIND_GPU profile: "0" } ]',
    ],
)
def test_tensorrt_only_fields_stay_refused(snippet: str) -> None:
    """Fields Triton itself refuses outside TensorRT/custom backends are refused here too."""
    with pytest.raises(ConfigError, match="not supported by orchestrion"):
        parse_model_config(f'name: "m" backend: "python" {snippet}')


def test_config_without_name_parses() -> None:
    """A config.pbtxt without `name` parses, with an empty name to be filled from the folder."""
    assert parse_model_config('backend: "python"' + PY_IO).name == ""


def test_scan_repository_takes_the_name_from_the_folder(tmp_path: Path) -> None:
    """A model whose config omits `name` is served under its folder's name."""
    write_model(tmp_path, "identity_py", 'backend: "python"' + PY_IO)
    entries, errors = scan_repository(tmp_path)
    assert errors == []
    assert [e.name for e in entries] == ["identity_py"]
    assert entries[0].config.name == "identity_py"


@pytest.mark.parametrize(
    "snippet",
    [
        # docs/examples/model_repository/densenet_onnx, qa/python_models/torchvision/resnet50
        'input [ { name: "IMG" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 8, 8 ] } ]',
        # docs/examples/model_repository/densenet_onnx; qa/ensemble_models/label_override_*
        'output [ { name: "P" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" } ]',
        # model_configuration.md "Priority"; qa/L0_model_config/noautofill_platform/priority_*
        "dynamic_batching { priority_levels: 2 default_priority_level: 1 "
        "priority_queue_policy { key: 1 value { max_queue_size: 4 } } }",
        # model_configuration.md "Host Policy"
        'instance_group [ { kind: KIND_CPU host_policy: "policy_0" } ]',
        # model_configuration.md "Rate Limiter Configuration"
        'instance_group [ { kind: KIND_CPU rate_limiter { resources [ { name: "R" count: 1 } ] '
        "priority: 2 } } ]",
        'metric_tags { key: "team" value: "search" }',
    ],
    ids=[
        "input.format",
        "output.label_filename",
        "priority_queue_policy",
        "host_policy",
        "rate_limiter",
        "metric_tags",
    ],
)
def test_common_triton_field_is_accepted(snippet: str) -> None:
    """A field Triton users commonly write, harmless for a Python model, is accepted."""
    parse_model_config(f'name: "m" backend: "python" max_batch_size: 8 {snippet}')


# 2. Data types.


def test_every_triton_data_type_has_a_name_here() -> None:
    """Every TYPE_* of Triton's schema (but TYPE_INVALID) maps to a DataType and back."""
    names = [n for n in model_config_pb2.DataType.DESCRIPTOR.values_by_name if n != "TYPE_INVALID"]
    assert sorted(DataType.from_config_name(n).config_name for n in names) == sorted(names)
    assert DataType.from_config_name("TYPE_STRING") is DataType.BYTES
    assert DataType.from_config_name("TYPE_BF16") is DataType.BF16
    with pytest.raises(ValueError, match="unknown data_type"):
        DataType.from_config_name("TYPE_INVALID")


@pytest.mark.parametrize("data_type", list(DataType), ids=lambda t: t.value)
def test_numpy_dtypes_agree_with_tritonclient(data_type: DataType) -> None:
    """numpy dtypes are the ones tritonclient uses for each protocol name, and back."""
    assert data_type.numpy_dtype == np.dtype(tritonclient.utils.triton_to_np_dtype(data_type.value))
    assert tritonclient.utils.np_to_triton_dtype(data_type.numpy_dtype) == data_type.value
    assert DataType.from_numpy(data_type.numpy_dtype) is data_type


def test_type_string_round_trips_through_pbtxt() -> None:
    """TYPE_STRING reads as BYTES and is written back as TYPE_STRING (with its reshape)."""
    text = (
        'name: "m" max_batch_size: 4 '
        'input [ { name: "T" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ] '
        'output [ { name: "O" data_type: TYPE_BF16 dims: [ -1 ] } ]'
    )
    config = parse_model_config(text)
    assert config.input[0].data_type is DataType.BYTES
    assert config.input[0].reshape == Reshape(shape=())
    assert "TYPE_STRING" in format_model_config(config)
    assert parse_model_config(format_model_config(config)) == config


# 3. Rules of one config (ValidateIOShape, ValidateModelConfig, ValidateInstanceGroup).


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        (tc("input", dims=(0,)), "dims must be positive or -1"),  # zerodims_input1
        (tc("input", dims=(1, 0, 28)), "dims must be positive or -1"),  # zerodims_input0
        (tc("input", dims=(2, 2), reshape=Reshape(shape=(0,))), "reshape [0]"),  # reshape_zerodims0
        (tc("input", dims=(1, 3, 2), reshape=Reshape(shape=(5,))), "reshape [5]"),  # elementcount0
    ],
)
def test_dims_and_reshape_errors_triton_also_reports(tensor: TensorConfig, expected: str) -> None:
    """Zero dims and reshapes of another element count are refused, as in Triton's QA cases."""
    config = composing("m", inputs=[tensor], max_batch_size=4)
    assert any(expected in e for e in validate_model_config(config))


def test_batched_scalar_reshape_is_valid() -> None:
    """dims [1] with reshape [] on a batching model is Triton's documented batch-of-scalars form."""
    config = composing(
        "m", inputs=[tc("IN", dims=(1,), reshape=Reshape(shape=()))], max_batch_size=8
    )
    assert validate_model_config(config) == []
    assert check_inputs(config, {"IN": np.zeros((3, 1), np.float32)})["IN"].shape == (3, 1)


def test_empty_dims_are_refused_even_when_batching() -> None:
    """An input with empty dims is an error whatever max_batch_size is."""
    config = composing("m", inputs=[tc("IN", dims=())], max_batch_size=8)
    assert any("dims" in e for e in validate_model_config(config))


@pytest.mark.parametrize(
    ("max_batch_size", "dims", "shape"),
    [
        (4, (2, -1), (2, 2)),  # qa reshape_variable0: different size
        (4, (2, -1), (2, -1, 2)),  # qa reshape_variable2: different size between wildcards
        (4, (2, -1), (2, -1, -1)),  # qa reshape_variable4: different number of wildcards
        (0, (-1, 2), (1, -1)),  # trunks [1,2] vs [1,1]; pinned valid in test_validation_at_load.py
        (0, (1,), ()),  # qa reshape_nobatch_empty0: scalar without batching
    ],
    ids=["variable0", "variable2", "variable4", "trunks", "nobatch_empty0"],
)
def test_reshape_rules_from_triton(
    max_batch_size: int, dims: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    """A reshape Triton refuses is refused."""
    config = composing(
        "m",
        inputs=[tc("input", dims=dims, reshape=Reshape(shape=shape))],
        max_batch_size=max_batch_size,
    )
    assert validate_model_config(config) != []


@pytest.mark.parametrize(
    "kw",
    [
        {"dynamic_batching": DynamicBatching(preferred_batch_size=(16,))},  # > max_batch_size
        {"dynamic_batching": DynamicBatching(preferred_batch_size=(0,))},  # must be positive
        {"dynamic_batching": DynamicBatching(priority_levels=3)},  # qa default_priority_level0
        {
            "dynamic_batching": DynamicBatching(priority_levels=3, default_priority_level=5)
        },  # qa default_priority_level1
        {
            "dynamic_batching": DynamicBatching(
                preserve_ordering=True,
                default_queue_policy=QueuePolicy(
                    timeout_action="DELAY", default_timeout_microseconds=1000
                ),
            )
        },  # qa preserve_ordering1
        {"instance_group": (InstanceGroup(kind=InstanceKind.KIND_CPU, gpus=(0,)),)},  # invalid_cpu
    ],
    ids=[
        "preferred>max",
        "preferred=0",
        "default_priority_level0",
        "default_priority_level1",
        "preserve_ordering_delay",
        "cpu_with_gpus",
    ],
)
def test_scheduling_rules_from_triton(kw: dict[str, Any]) -> None:
    """A dynamic_batching or instance_group setting Triton refuses is refused."""
    assert validate_model_config(composing("m", max_batch_size=8, **kw)) != []


# 4. Ensembles (ValidateEnsembleSchedulingConfig, ValidateEnsembleConfig).


def test_triton_qa_inconsistent_shape_success() -> None:
    """qa autofill_noplatform_success/ensemble/inconsistent_shape: batching into non-batching."""
    models = repo(
        composing(
            "fp32_dim1_batch4", [tc("INPUT0", (16,))], [tc("OUTPUT0", (16,))], max_batch_size=4
        ),
        composing("fp32_dim2_nobatch", [tc("INPUT0", (-1, 16))], [tc("OUTPUT0", (-1, 16))]),
        ensemble(
            "inconsistent_shape",
            [tc("data", (16,))],
            [tc("prob", (16,))],
            [
                step("fp32_dim1_batch4", {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor"}),
                step("fp32_dim2_nobatch", {"INPUT0": "temp_tensor"}, {"OUTPUT0": "prob"}),
            ],
            max_batch_size=2,
        ),
    )
    assert validate_repository(models) == []


def test_triton_qa_inconsistent_shape_2_success() -> None:
    """qa autofill_noplatform_success/ensemble/inconsistent_shape_2: non-batching into batching."""
    models = repo(
        composing(
            "fp32_dim1_batch4", [tc("INPUT0", (16,))], [tc("OUTPUT0", (16,))], max_batch_size=4
        ),
        composing("fp32_dim2_nobatch", [tc("INPUT0", (-1, 16))], [tc("OUTPUT0", (-1, 16))]),
        ensemble(
            "inconsistent_shape_2",
            [tc("data", (4, 16))],
            [tc("prob", (4, 16))],
            [
                step("fp32_dim2_nobatch", {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor"}),
                step("fp32_dim1_batch4", {"INPUT0": "temp_tensor"}, {"OUTPUT0": "prob"}),
            ],
        ),
    )
    assert validate_repository(models) == []


def test_nested_ensemble_and_unmapped_composing_output_are_valid() -> None:
    """qa embedded_ensemble and unmapped_output: nesting, and leaving a model output unmapped."""
    models = repo(
        composing(
            "three_out",
            [tc("INPUT0", (16,))],
            [tc("OUTPUT0", (16,)), tc("OUTPUT1", (16,)), tc("OUTPUT2", (16,))],
            max_batch_size=4,
        ),
        ensemble(
            "inner",
            [tc("data", (16,))],
            [tc("prob", (16,))],
            [step("three_out", {"INPUT0": "data"}, {"OUTPUT0": "prob"})],
            max_batch_size=2,
        ),
        ensemble(
            "outer",
            [tc("data", (16,))],
            [tc("prob", (16,))],
            [step("inner", {"data": "data"}, {"prob": "prob"})],
            max_batch_size=2,
        ),
    )
    assert validate_repository(models) == []


def test_optional_input_may_stay_unmapped_but_required_may_not() -> None:
    """Only inputs marked optional may be left out of input_map (ValidateTensorMapping)."""
    model = composing("m", inputs=[tc("IN"), tc("EXTRA", optional=True), tc("NEEDED")])
    wiring = {"IN": "X", "NEEDED": "X"}
    good = ensemble("e", [tc("X")], [tc("Y")], [step("m", wiring, {"OUT": "Y"})])
    assert validate_ensemble(good, repo(model)) == []
    bad = ensemble("e", [tc("X")], [tc("Y")], [step("m", {"IN": "X"}, {"OUT": "Y"})])
    assert any("'NEEDED'" in e for e in validate_ensemble(bad, repo(model)))


def test_ensemble_output_may_also_feed_a_later_step() -> None:
    """A tensor can be an ensemble output and the input of another step at once."""
    models = repo(
        composing("a"),
        composing("b"),
        ensemble(
            "e",
            [tc("X")],
            [tc("MID"), tc("Y")],
            [step("a", {"IN": "X"}, {"OUT": "MID"}), step("b", {"IN": "MID"}, {"OUT": "Y"})],
        ),
    )
    assert validate_repository(models) == []


def test_one_tensor_may_feed_two_inputs_of_one_step() -> None:
    """The same ensemble tensor may be mapped to several inputs of a step."""
    models = repo(
        composing("add", [tc("A"), tc("B")]),
        ensemble("e", [tc("X")], [tc("Y")], [step("add", {"A": "X", "B": "X"}, {"OUT": "Y"})]),
    )
    assert validate_repository(models) == []


def test_unused_intermediate_tensor_is_an_error() -> None:
    """qa redundant_tensor_as_output: a step output nobody consumes is an error."""
    models = repo(
        composing("two", outputs=[tc("OUT"), tc("AUX")]),
        ensemble("e", [tc("X")], [tc("Y")], [step("two", {"IN": "X"}, {"OUT": "Y", "AUX": "t"})]),
    )
    assert any("tensor 't'" in e for e in validate_repository(models))


def test_composing_reshape_does_not_change_the_ensemble_shape() -> None:
    """For a composing model Triton compares its `dims`, not its `reshape`."""
    model = composing("m", inputs=[tc("IN", (4,), reshape=Reshape(shape=(2, 2)))])
    good = ensemble("e", [tc("X", (4,))], [tc("Y")], [step("m", {"IN": "X"}, {"OUT": "Y"})])
    assert validate_ensemble(good, repo(model)) == []
    bad = ensemble("e", [tc("X", (2, 2))], [tc("Y")], [step("m", {"IN": "X"}, {"OUT": "Y"})])
    assert validate_ensemble(bad, repo(model)) != []


def test_max_batch_size_relation() -> None:
    """qa invalid_batch_size: a batching step must allow the ensemble's max_batch_size."""
    small = composing("small", max_batch_size=2)
    e = ensemble(
        "e", [tc("X")], [tc("Y")], [step("small", {"IN": "X"}, {"OUT": "Y"})], max_batch_size=3
    )
    assert any("max_batch_size 2" in err for err in validate_ensemble(e, repo(small)))
    nobatch = composing("nobatch", [tc("IN", (-1, 4))], [tc("OUT", (-1, 4))])
    e = ensemble(
        "e", [tc("X")], [tc("Y")], [step("nobatch", {"IN": "X"}, {"OUT": "Y"})], max_batch_size=3
    )
    assert validate_ensemble(e, repo(nobatch)) == []


def test_decoupled_branching_is_refused() -> None:
    """qa invalid_decoupled_branching: a step joining two decoupled producers is an error."""
    repeat = composing(
        "repeat",
        outputs=[tc("OUT")],
        model_transaction_policy=ModelTransactionPolicy(decoupled=True),
    )
    join = composing("join", [tc("A"), tc("B")])
    e = ensemble(
        "e",
        [tc("X")],
        [tc("Y")],
        [
            step("repeat", {"IN": "X"}, {"OUT": "a"}),
            step("repeat", {"IN": "X"}, {"OUT": "b"}),
            step("join", {"A": "a", "B": "b"}, {"OUT": "Y"}),
        ],
    )
    assert any(
        "different decoupled producers" in err for err in validate_ensemble(e, repo(repeat, join))
    )


@pytest.mark.parametrize(
    ("field", "pbtxt"),
    [
        ("optimization", "optimization { input_pinned_memory { enable: false } }"),
        ("model_warmup", 'model_warmup [ { name: "w" batch_size: 1 } ]'),
        ("instance_group", "instance_group [ { kind: KIND_CPU } ]"),
        ("backend", 'backend: "python"'),
    ],
)
def test_ensemble_forbidden_fields(field: str, pbtxt: str) -> None:
    """qa optimization_set, model_warm_up_set, instance_group_set, has_backend."""
    text = (
        f'name: "e" platform: "ensemble" {pbtxt} '
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'ensemble_scheduling { step [ { model_name: "m" input_map { key: "IN" value: "X" } '
        'output_map { key: "OUT" value: "Y" } } ] }'
    )
    errors = validate_repository(repo(composing("m"), parse_model_config(text)))
    assert any(f"must not set '{field}'" in e for e in errors)


def test_ensemble_input_reshape_is_the_tensor_shape() -> None:
    """An ensemble input [4] reshaped to [2,2] feeds a model input [2,2]."""
    model = composing("m", [tc("IN", (2, 2))], [tc("OUT", (2, 2))])
    e = ensemble(
        "e",
        [tc("X", (4,), reshape=Reshape(shape=(2, 2)))],
        [tc("Y", (2, 2))],
        [step("m", {"IN": "X"}, {"OUT": "Y"})],
    )
    assert validate_ensemble(e, repo(model)) == []


def test_nonbatching_ensemble_may_feed_a_batching_model_with_the_same_dims() -> None:
    """A non-batching ensemble tensor [16] feeds a batching model whose dims are [16]."""
    model = composing("b", [tc("IN", (16,))], [tc("OUT", (16,))], max_batch_size=8)
    e = ensemble("e", [tc("X", (16,))], [tc("Y", (16,))], [step("b", {"IN": "X"}, {"OUT": "Y"})])
    assert validate_ensemble(e, repo(model)) == []


def test_ensemble_outputs_from_different_decoupled_producers_are_refused() -> None:
    """Two ensemble outputs, each from its own decoupled step, are an error."""
    repeat = composing(
        "repeat_int32",
        [tc("IN", (-1,), INT32)],
        [tc("OUT", (1,), INT32), tc("IDX", (1,), UINT32)],
        model_transaction_policy=ModelTransactionPolicy(decoupled=True),
    )
    e = ensemble(
        "invalid_decoupled_branching_2",
        [tc("IN", (-1,), INT32)],
        [tc("OUT", (1,), INT32), tc("IDX", (1,), UINT32)],
        [
            step("repeat_int32", {"IN": "IN"}, {"OUT": "OUT"}),
            step("repeat_int32", {"IN": "IN"}, {"IDX": "IDX"}),
        ],
    )
    assert any("decoupled" in err for err in validate_ensemble(e, repo(repeat)))


def test_nested_decoupled_ensembles_count_as_decoupled_producers() -> None:
    """A step joining the outputs of two ensembles that each stream is an error."""
    repeat = composing("repeat", model_transaction_policy=ModelTransactionPolicy(decoupled=True))
    inner = [
        ensemble(n, [tc("X")], [tc("Y")], [step("repeat", {"IN": "X"}, {"OUT": "Y"})])
        for n in ("inner_a", "inner_b")
    ]
    outer = ensemble(
        "outer",
        [tc("X")],
        [tc("Y")],
        [
            step("inner_a", {"X": "X"}, {"Y": "a"}),
            step("inner_b", {"X": "X"}, {"Y": "b"}),
            step("join", {"A": "a", "B": "b"}, {"OUT": "Y"}),
        ],
    )
    models = repo(repeat, composing("join", [tc("A"), tc("B")]), *inner, outer)
    assert any("decoupled" in err for err in validate_repository(models))


# 5. Repository layout (model_repository.md "Model Versions", VersionsToLoad).


def test_version_folders_follow_triton(tmp_path: Path) -> None:
    """Numeric folders are versions; leading zeros and non-numeric names are ignored."""
    config = 'name: "m" backend: "python" version_policy: { all { } }' + PY_IO
    write_model(tmp_path, "m", config, versions=("1", "3", "03", "v2", "configs"))
    entries, errors = scan_repository(tmp_path)
    assert errors == []
    assert entries[0].versions == (1, 3)


def test_default_policy_and_latest_n(tmp_path: Path) -> None:
    """No version_policy serves the highest version; latest { num_versions: 2 } the top two."""
    write_model(tmp_path, "a", 'name: "a" backend: "python"' + PY_IO, versions=("1", "2", "10"))
    latest2 = 'name: "b" backend: "python" version_policy: { latest: { num_versions: 2 } }'
    write_model(tmp_path, "b", latest2 + PY_IO, versions=("1", "2", "10"))
    entries, errors = scan_repository(tmp_path)
    assert errors == []
    assert {e.name: e.versions for e in entries} == {"a": (10,), "b": (2, 10)}


def test_name_must_match_the_folder(tmp_path: Path) -> None:
    """A `name` that differs from the folder is an error (directory name must equal model name)."""
    write_model(tmp_path, "folder", 'name: "other" backend: "python"' + PY_IO)
    _, errors = scan_repository(tmp_path)
    assert any("does not match the folder" in e for e in errors)


def test_default_model_filename_names_the_code_file(tmp_path: Path) -> None:
    """default_model_filename replaces model.py inside the version folder, as in the Python backend."""
    config = 'name: "m" backend: "python" default_model_filename: "pipeline.py"' + PY_IO
    write_model(tmp_path, "m", config, code_file="pipeline.py")
    entries, errors = scan_repository(tmp_path)
    assert errors == []
    assert entries[0].model_file(1) == tmp_path / "m" / "1" / "pipeline.py"


def test_ensemble_needs_a_version_folder_but_no_code(tmp_path: Path) -> None:
    """An ensemble's version folder may be empty but must exist."""
    text = (
        'name: "e" platform: "ensemble" '
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'ensemble_scheduling { step [ { model_name: "m" input_map { key: "IN" value: "X" } '
        'output_map { key: "OUT" value: "Y" } } ] }'
    )
    write_model(tmp_path / "ok", "e", text, code_file=None)
    write_model(tmp_path / "ok", "m", 'name: "m" backend: "python"' + PY_IO)
    entries, errors = scan_repository(tmp_path / "ok")
    assert errors == []
    assert validate_repository({e.name: e.config for e in entries}) == []
    write_model(tmp_path / "bad", "e", text, versions=(), code_file=None)
    _, errors = scan_repository(tmp_path / "bad")
    assert any("no version folder" in e for e in errors)


def test_step_asking_for_a_version_that_is_not_served_is_an_error(tmp_path: Path) -> None:
    """qa no_required_version: a step's model_version must be one of the served versions."""
    write_model(tmp_path, "simple", 'name: "simple" backend: "python"' + PY_IO)
    e = ensemble(
        "e",
        [tc("X")],
        [tc("Y")],
        [
            EnsembleStep(
                model_name="simple", model_version=2, input_map={"IN": "X"}, output_map={"OUT": "Y"}
            )
        ],
    )
    entries, _ = scan_repository(tmp_path)
    models = {x.name: x.config for x in entries} | {"e": e}
    errors = validate_repository(models, {x.name: x.versions for x in entries})
    assert any("requires version 2" in err for err in errors)


def test_specific_version_without_folder_still_serves_the_others(tmp_path: Path) -> None:
    """version_policy specific [1, 2] with only folder 1 serves version 1."""
    config = 'name: "m" backend: "python" version_policy: { specific: { versions: [ 1, 2 ] } }'
    write_model(tmp_path, "m", config + PY_IO)
    entries, errors = scan_repository(tmp_path)
    assert errors == []
    assert entries[0].versions == (1,)


# 6. Request checks (Triton's request normalisation).


def test_bytes_inputs_with_batch_and_variable_dims() -> None:
    """TYPE_STRING accepts str or bytes elements, batched [B,1] or variable [-1]."""
    batched = composing("m", [tc("T", (1,), DataType.BYTES)], max_batch_size=8)
    out = check_inputs(batched, {"T": [["a"], [b"b"]]})["T"]
    assert out.shape == (2, 1)
    assert out.dtype == object
    assert out.tolist() == [[b"a"], [b"b"]]
    variable = composing("m", [tc("T", (-1,), DataType.BYTES)])
    assert check_inputs(variable, {"T": ["x", b"", "yz"]})["T"].tolist() == [b"x", b"", b"yz"]


def test_request_checks_are_strict_like_triton() -> None:
    """Exact data type, batch size within max_batch_size, no unknown inputs."""
    config = composing("m", max_batch_size=2)
    with pytest.raises(InvalidRequestError, match="expected FP32"):
        check_inputs(config, {"IN": np.zeros((1, 4), np.float64)})
    with pytest.raises(InvalidRequestError, match="batch size 3"):
        check_inputs(config, {"IN": np.zeros((3, 4), np.float32)})
    with pytest.raises(InvalidRequestError, match="unexpected inputs 'NOPE'"):
        check_inputs(config, {"IN": np.zeros((1, 4), np.float32), "NOPE": np.zeros(1)})
