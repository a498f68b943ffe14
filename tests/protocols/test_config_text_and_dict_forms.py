"""`config.pbtxt` (the protobuf text of Triton's `ModelConfig`, read with Triton's own schema)
to orchestrion's `ModelConfig` and back, and its dict form: the fields of Python models,
ensembles, decoupled and stateful models and version policies, their defaults, and errors that
name the file and the field (syntax, fields unknown to Triton or unsupported here, wrong
values)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrion.protocols import (
    ConfigError,
    DataType,
    DynamicBatching,
    EnsembleScheduling,
    EnsembleStep,
    InstanceGroup,
    InstanceKind,
    ModelConfig,
    ModelTransactionPolicy,
    QueuePolicy,
    Reshape,
    ResponseCache,
    SequenceBatching,
    TensorConfig,
    VersionPolicy,
    format_model_config,
    model_config_from_dict,
    model_config_to_dict,
    parse_model_config,
)

SOURCE = "models/resnet/config.pbtxt"

PYTHON_MODEL = """
name: "resnet"
backend: "python"
max_batch_size: 8
version_policy { specific { versions: [1, 3] } }
input [
  {
    name: "IMAGE"
    data_type: TYPE_UINT8
    dims: [ -1, -1, 3 ]
  },
  {
    name: "SCALE"
    data_type: TYPE_FP32
    dims: [ 1 ]
    reshape { shape: [ ] }
    optional: true
  }
]
output [
  {
    name: "PROBS"
    data_type: TYPE_FP32
    dims: [ 1000 ]
  },
  {
    name: "LABELS"
    data_type: TYPE_STRING
    dims: [ 5 ]
  }
]
instance_group [
  { count: 2 kind: KIND_CPU },
  { kind: KIND_GPU gpus: [ 0 ] }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  default_queue_policy { max_queue_size: 16 }
}
response_cache { enable: true }
parameters { key: "mode" value { string_value: "fast" } }
parameters { key: "threads" value { string_value: "4" } }
"""

ENSEMBLE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 4
input [ { name: "RAW" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling {
  max_inflight_requests: 16
  step [
    {
      model_name: "decode"
      model_version: -1
      input_map { key: "BYTES_IN" value: "RAW" }
      output_map { key: "PIXELS" value: "image" }
    },
    {
      model_name: "classify"
      model_version: 2
      input_map { key: "INPUT0" value: "image" }
      output_map { key: "OUTPUT0" value: "SCORES" }
    }
  ]
}
"""

DECOUPLED = """
name: "tokens"
backend: "python"
input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""

STATEFUL = """
name: "accumulate"
max_batch_size: 2
input [ { name: "X" data_type: TYPE_BF16 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_FP64 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [ { name: "START" } ]
  oldest { max_candidate_sequences: 4 }
}
version_policy { latest { num_versions: 2 } }
"""


def test_parse_python_model() -> None:
    """Every field of a realistic Python model's config arrives in the attrs classes."""
    config = parse_model_config(PYTHON_MODEL, source=SOURCE)
    assert config == ModelConfig(
        name="resnet",
        backend="python",
        max_batch_size=8,
        version_policy=VersionPolicy(specific=(1, 3)),
        input=(
            TensorConfig(name="IMAGE", data_type=DataType.UINT8, dims=(-1, -1, 3)),
            TensorConfig(
                name="SCALE",
                data_type=DataType.FP32,
                dims=(1,),
                reshape=Reshape(shape=()),
                optional=True,
            ),
        ),
        output=(
            TensorConfig(name="PROBS", data_type=DataType.FP32, dims=(1000,)),
            TensorConfig(name="LABELS", data_type=DataType.BYTES, dims=(5,)),
        ),
        instance_group=(
            InstanceGroup(count=2, kind=InstanceKind.KIND_CPU),
            InstanceGroup(count=1, kind=InstanceKind.KIND_GPU, gpus=(0,)),
        ),
        dynamic_batching=DynamicBatching(
            preferred_batch_size=(4, 8),
            max_queue_delay_microseconds=100,
            preserve_ordering=True,
            default_queue_policy=QueuePolicy(max_queue_size=16),
        ),
        response_cache=ResponseCache(enable=True),
        parameters={"mode": "fast", "threads": "4"},
    )
    assert not config.is_ensemble
    assert not config.decoupled
    assert config.input_named("SCALE") is config.input[1]
    assert config.output_named("NOPE") is None


def test_parse_ensemble() -> None:
    """An ensemble's steps, maps, versions and max_inflight_requests are parsed."""
    config = parse_model_config(ENSEMBLE, source=SOURCE)
    assert config.is_ensemble
    assert config.ensemble_scheduling == EnsembleScheduling(
        max_inflight_requests=16,
        step=(
            EnsembleStep(
                model_name="decode",
                model_version=-1,
                input_map={"BYTES_IN": "RAW"},
                output_map={"PIXELS": "image"},
            ),
            EnsembleStep(
                model_name="classify",
                model_version=2,
                input_map={"INPUT0": "image"},
                output_map={"OUTPUT0": "SCORES"},
            ),
        ),
    )
    assert config.input == (TensorConfig(name="RAW", data_type=DataType.BYTES, dims=(1,)),)


def test_parse_step_without_model_version_means_latest() -> None:
    """A step that leaves out model_version gets -1 (latest)."""
    config = parse_model_config(
        'name: "e" platform: "ensemble" ensemble_scheduling { step [ { model_name: "m" } ] }'
    )
    assert config.ensemble_scheduling is not None
    assert config.ensemble_scheduling.step[0].model_version == -1


def test_parse_decoupled_model() -> None:
    """model_transaction_policy.decoupled makes a decoupled model."""
    config = parse_model_config(DECOUPLED)
    assert config.model_transaction_policy == ModelTransactionPolicy(decoupled=True)
    assert config.decoupled


def test_parse_sequence_batching() -> None:
    """sequence_batching keeps its strategy and controls as plain data."""
    config = parse_model_config(STATEFUL)
    assert config.sequence_batching == SequenceBatching(
        max_sequence_idle_microseconds=5_000_000,
        control_input=({"name": "START"},),
        oldest={"max_candidate_sequences": 4},
    )
    assert config.input[0].data_type is DataType.BF16


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("latest { num_versions: 2 }", VersionPolicy(latest=2)),
        ("all { }", VersionPolicy(all=True)),
        ("specific { versions: [ 1, 4 ] }", VersionPolicy(specific=(1, 4))),
    ],
)
def test_parse_version_policy(text: str, policy: VersionPolicy) -> None:
    """Each kind of version_policy is parsed."""
    config = parse_model_config(f'name: "m" version_policy {{ {text} }}')
    assert config.version_policy == policy


def test_parse_minimal_config_uses_defaults() -> None:
    """Fields left out take Triton's defaults."""
    config = parse_model_config('name: "m"')
    assert config == ModelConfig(name="m")
    assert config.version_policy is None
    assert config.parameters == {}


def test_parse_instance_group_count_defaults_to_one() -> None:
    """An instance_group without count has one instance, as in Triton."""
    config = parse_model_config('name: "m" instance_group [ { kind: KIND_GPU } ]')
    assert config.instance_group == (InstanceGroup(kind=InstanceKind.KIND_GPU, count=1),)


def test_parse_empty_parameter_value() -> None:
    """A parameter whose string_value is empty is kept as the empty string."""
    config = parse_model_config(
        'name: "m" parameters { key: "EXECUTION_ENV_PATH" value { string_value: "" } }'
    )
    assert config.parameters == {"EXECUTION_ENV_PATH": ""}


def test_syntax_error_names_source() -> None:
    """A syntax error is a ConfigError naming the file and the position."""
    with pytest.raises(ConfigError, match=r"models/resnet/config\.pbtxt:2:") as info:
        parse_model_config('name: "m"\ninput [ { name "x" } ]', source=SOURCE)
    assert isinstance(info.value, ValueError)


def test_field_unknown_to_triton_names_source_and_field() -> None:
    """A field that is not in Triton's schema is an error naming the file and the field."""
    with pytest.raises(ConfigError) as info:
        parse_model_config('name: "m"\nmax_batch_sise: 4', source=SOURCE)
    assert SOURCE in str(info.value)
    assert "max_batch_sise" in str(info.value)


def test_nested_field_unknown_to_triton_names_field() -> None:
    """A misspelt field inside a nested message is named too."""
    with pytest.raises(ConfigError) as info:
        parse_model_config(
            'name: "m" input [ { name: "x" data_type: TYPE_FP32 dimz: [ 1 ] } ]', source=SOURCE
        )
    assert SOURCE in str(info.value)
    assert "dimz" in str(info.value)


@pytest.mark.parametrize(
    ("text", "where", "field"),
    [
        (
            'model_repository_agents { agents [ { name: "a" } ] }',
            "(top level)",
            "model_repository_agents",
        ),
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [1] is_shape_tensor: true } ]',
            "input[0]",
            "is_shape_tensor",
        ),
        (
            "instance_group [ { count: 1 passive: true } ]",
            "instance_group[0]",
            "passive",
        ),
        (
            'instance_group [ { count: 1 }, { count: 1 profile: "p" } ]',
            "instance_group[1]",
            "profile",
        ),
    ],
)
def test_field_not_supported_by_orchestrion(text: str, where: str, field: str) -> None:
    """A schema field orchestrion does not implement is an error naming it and its place."""
    with pytest.raises(ConfigError) as info:
        parse_model_config(f'name: "m" {text}', source=SOURCE)
    [message] = info.value.errors
    assert message.startswith(SOURCE)
    path = field if where == "(top level)" else f"{where}.{field}"
    assert f"field {path}: not supported by orchestrion" in message


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('max_batch_size: "eight"', "max_batch_size"),
        ('input [ { name: "x" data_type: TYPE_FLOAT dims: [ 1 ] } ]', "TYPE_FLOAT"),
        ("version_policy { }", "version_policy"),
        ('input [ { name: "x" dims: [ 1 ] } ]', "input[0].data_type"),
    ],
)
def test_wrong_value_names_source_and_field(text: str, field: str) -> None:
    """A value of the wrong kind is an error naming the file and the field or value."""
    with pytest.raises(ConfigError) as info:
        parse_model_config(f'name: "m" {text}', source=SOURCE)
    assert SOURCE in str(info.value)
    assert field in str(info.value)


def test_from_dict_wrong_value_names_field() -> None:
    """model_config_from_dict names the source and the field of a wrong value."""
    with pytest.raises(ConfigError) as info:
        model_config_from_dict({"name": "m", "max_batch_size": "lots"}, source="embedded")
    [message] = info.value.errors
    assert message.startswith("embedded: field max_batch_size")


def test_from_dict_unknown_key_names_field() -> None:
    """model_config_from_dict rejects keys it does not know, naming them."""
    with pytest.raises(ConfigError, match="colour"):
        model_config_from_dict({"name": "m", "output": [{"name": "y", "colour": "red"}]})


@pytest.mark.parametrize("text", [PYTHON_MODEL, ENSEMBLE, DECOUPLED, STATEFUL])
def test_format_parse_round_trip(text: str) -> None:
    """format_model_config writes text that parse_model_config reads back unchanged."""
    config = parse_model_config(text)
    formatted = format_model_config(config)
    assert parse_model_config(formatted) == config
    assert model_config_from_dict(model_config_to_dict(config)) == config


def test_to_dict_leaves_out_defaults() -> None:
    """The dict form has proto field names and no default values."""
    config = ModelConfig(
        name="m",
        input=(TensorConfig(name="x", data_type=DataType.BYTES, dims=(2,)),),
        parameters={"k": "v"},
    )
    assert model_config_to_dict(config) == {
        "name": "m",
        "input": [{"name": "x", "data_type": "TYPE_STRING", "dims": [2]}],
        "parameters": {"k": {"string_value": "v"}},
    }


def test_default_version_policy_formats_as_latest_one() -> None:
    """VersionPolicy() (Triton's default: the latest version) is written as num_versions 1."""
    config = ModelConfig(name="m", version_policy=VersionPolicy())
    parsed = parse_model_config(format_model_config(config))
    assert parsed.version_policy == VersionPolicy(latest=1)


# Hypothesis: generated configs survive text and dict round trips.

_names = st.text(alphabet="abXY_0é", min_size=1, max_size=4)
_ints = st.lists(st.integers(1, 16), max_size=3).map(tuple)
_dims = st.lists(st.sampled_from([-1, 1, 2, 3, 16]), min_size=1, max_size=3).map(tuple)

_tensors = st.builds(
    TensorConfig,
    name=_names,
    data_type=st.sampled_from(DataType),
    dims=_dims,
    reshape=st.none() | st.builds(Reshape, shape=_ints),
    optional=st.booleans(),
)
# Triton's ModelOutput has no `optional`.
_outputs = _tensors.map(lambda t: attrs.evolve(t, optional=False))
_version_policies = st.one_of(
    st.none(),
    st.builds(VersionPolicy, latest=st.integers(1, 5)),
    st.just(VersionPolicy(all=True)),
    st.builds(VersionPolicy, specific=_ints),
)
_instance_groups = st.builds(
    InstanceGroup,
    name=st.just("") | _names,
    kind=st.sampled_from(InstanceKind),
    count=st.integers(1, 4),
    gpus=st.lists(st.integers(0, 3), max_size=2).map(tuple),
)
_queue_policies = st.builds(
    QueuePolicy,
    timeout_action=st.sampled_from(["REJECT", "DELAY"]),
    default_timeout_microseconds=st.integers(0, 10**6),
    allow_timeout_override=st.booleans(),
    max_queue_size=st.integers(0, 64),
)
_dynamic_batching = st.builds(
    DynamicBatching,
    preferred_batch_size=_ints,
    max_queue_delay_microseconds=st.integers(0, 10**6),
    preserve_ordering=st.booleans(),
    priority_levels=st.integers(0, 3),
    default_priority_level=st.integers(0, 3),
    default_queue_policy=st.none() | _queue_policies,
)
_sequence_batching = st.one_of(
    st.builds(SequenceBatching),
    st.builds(
        SequenceBatching,
        max_sequence_idle_microseconds=st.integers(0, 10**6),
        control_input=st.lists(st.builds(dict, name=_names), max_size=2).map(tuple),
        direct=st.just({}),
    ),
    st.builds(
        SequenceBatching,
        oldest=st.builds(dict, max_candidate_sequences=st.integers(1, 8)),
    ),
)
_steps = st.builds(
    EnsembleStep,
    model_name=_names,
    model_version=st.sampled_from([-1, 1, 2, 7]),
    input_map=st.dictionaries(_names, _names, max_size=3),
    output_map=st.dictionaries(_names, _names, max_size=3),
)
_ensemble_scheduling = st.builds(
    EnsembleScheduling,
    step=st.lists(_steps, max_size=3).map(tuple),
    max_inflight_requests=st.integers(0, 2**32 - 1),
)
_model_configs = st.builds(
    ModelConfig,
    name=_names,
    platform=st.sampled_from(["", "ensemble"]),
    backend=st.sampled_from(["", "python", "jax"]),
    max_batch_size=st.integers(0, 64),
    version_policy=_version_policies,
    input=st.lists(_tensors, max_size=3).map(tuple),
    output=st.lists(_outputs, max_size=3).map(tuple),
    instance_group=st.lists(_instance_groups, max_size=2).map(tuple),
    model_transaction_policy=st.none() | st.builds(ModelTransactionPolicy, decoupled=st.booleans()),
    response_cache=st.none() | st.builds(ResponseCache, enable=st.booleans()),
    parameters=st.dictionaries(_names, st.text(alphabet="ab c", max_size=4), max_size=3),
    default_model_filename=st.sampled_from(["", "model.py"]),
    optimization=st.sampled_from([None, {}, {"priority": "PRIORITY_MAX"}]),
    model_warmup=st.lists(
        st.builds(dict, name=_names, batch_size=st.integers(1, 8)), max_size=2
    ).map(tuple),
)


# Triton's scheduling_choice is a oneof: at most one of the three is set.
_scheduling = st.one_of(
    st.just({}),
    st.builds(dict, dynamic_batching=_dynamic_batching),
    st.builds(dict, sequence_batching=_sequence_batching),
    st.builds(dict, ensemble_scheduling=_ensemble_scheduling),
)


@settings(max_examples=75, deadline=None)
@given(_model_configs, _scheduling)
def test_round_trip_property(config: ModelConfig, scheduling: dict[str, Any]) -> None:
    """Any config survives format -> parse and to_dict -> from_dict unchanged."""
    config = attrs.evolve(config, **scheduling)
    assert parse_model_config(format_model_config(config)) == config
    assert model_config_from_dict(model_config_to_dict(config)) == config
