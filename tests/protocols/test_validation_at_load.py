"""Load-time validation of model configs and ensembles: each problem is a clear error naming
the ensemble, the step and the tensor (the ensemble platform and its scheduling, steps and
their models, cycles, tensors produced once and consumed, input and output maps, data types
and shapes along each tensor, batch sizes, decoupled producers, `max_inflight_requests`,
versions, caching), and the ensemble graph that scheduling uses."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrion.protocols import (
    DataType,
    EnsembleGraph,
    EnsembleScheduling,
    EnsembleStep,
    InstanceGroup,
    ModelConfig,
    ModelTransactionPolicy,
    Reshape,
    ResponseCache,
    SequenceBatching,
    StepPlan,
    TensorConfig,
    VersionPolicy,
    bytes_tensors,
    validate_ensemble,
    validate_model_config,
    validate_repository,
)

FP32 = DataType.FP32


def tensor(
    name: str, data_type: DataType = FP32, dims: Iterable[int] = (4,), **kwargs: Any
) -> TensorConfig:
    """A tensor config, FP32 [4] unless told otherwise."""
    return TensorConfig(name=name, data_type=data_type, dims=tuple(dims), **kwargs)


def model(
    name: str,
    inputs: Iterable[TensorConfig] = (),
    outputs: Iterable[TensorConfig] = (),
    **kwargs: Any,
) -> ModelConfig:
    """A composing model; by default one FP32 [4] input IN and one output OUT."""
    return ModelConfig(
        name=name,
        input=tuple(inputs) or (tensor("IN"),),
        output=tuple(outputs) or (tensor("OUT"),),
        **kwargs,
    )


def step(
    model_name: str,
    inputs: Mapping[str, str],
    outputs: Mapping[str, str],
    version: int = -1,
) -> EnsembleStep:
    """A step; maps go from the model's tensor names to the ensemble's."""
    return EnsembleStep(
        model_name=model_name, model_version=version, input_map=inputs, output_map=outputs
    )


def ensemble(
    name: str,
    steps: Iterable[EnsembleStep],
    inputs: Iterable[TensorConfig] = (),
    outputs: Iterable[TensorConfig] = (),
    max_inflight_requests: int = 0,
    **kwargs: Any,
) -> ModelConfig:
    """An ensemble; by default input RAW and output RESULT, both FP32 [4]."""
    return ModelConfig(
        name=name,
        platform="ensemble",
        input=tuple(inputs) or (tensor("RAW"),),
        output=tuple(outputs) or (tensor("RESULT"),),
        ensemble_scheduling=EnsembleScheduling(
            step=tuple(steps), max_inflight_requests=max_inflight_requests
        ),
        **kwargs,
    )


def repo(*configs: ModelConfig) -> dict[str, ModelConfig]:
    """Configs by name."""
    return {c.name: c for c in configs}


def pipeline(**kwargs: Any) -> ModelConfig:
    """The two-step ensemble 'pipe': RAW -> pre -> mid -> infer -> RESULT."""
    return ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}),
            step("infer", {"IN": "mid"}, {"OUT": "RESULT"}),
        ],
        **kwargs,
    )


def pipeline_repo(**models: ModelConfig) -> dict[str, ModelConfig]:
    """'pipe' with models 'pre' and 'infer', any of them replaced by keyword."""
    return repo(
        models.get("pipe", pipeline()),
        models.get("pre", model("pre")),
        models.get("infer", model("infer")),
    )


def the_error(errors: list[str]) -> str:
    """The one error of a list that must hold exactly one."""
    assert len(errors) == 1, errors
    return errors[0]


def test_valid_pipeline_has_no_errors() -> None:
    """A correctly wired ensemble and its models give no errors."""
    assert validate_repository(pipeline_repo()) == []
    assert validate_ensemble(pipeline(), pipeline_repo()) == []


def test_ensemble_platform_needs_ensemble_scheduling() -> None:
    """platform 'ensemble' without ensemble_scheduling is an error naming the ensemble."""
    config = ModelConfig(name="pipe", platform="ensemble", output=(tensor("RESULT"),))
    message = the_error(validate_model_config(config))
    assert "ensemble 'pipe'" in message
    assert "needs ensemble_scheduling" in message
    assert validate_ensemble(config, {}) == [message]
    assert validate_repository(repo(config)) == [message]


def test_ensemble_scheduling_needs_ensemble_platform() -> None:
    """ensemble_scheduling on a model that is not an ensemble is an error naming it."""
    config = attrs.evolve(pipeline(), platform="")
    message = the_error(validate_model_config(config))
    assert "model 'pipe'" in message
    assert "ensemble_scheduling is only allowed with platform 'ensemble'" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backend", "python"),
        ("instance_group", (InstanceGroup(count=2),)),
        ("optimization", {}),
        ("model_warmup", ({"name": "warm"},)),
    ],
)
def test_ensemble_must_not_set_model_fields(field: str, value: Any) -> None:
    """An ensemble may not set backend, instance_group, optimization or model_warmup."""
    models = pipeline_repo(pipe=pipeline(**{field: value}))
    message = the_error(validate_repository(models))
    assert "ensemble 'pipe'" in message
    assert f"must not set '{field}'" in message


def test_ensemble_needs_a_step() -> None:
    """An ensemble with no step is an error."""
    message = the_error(validate_repository(repo(ensemble("pipe", []))))
    assert message == "ensemble 'pipe': ensemble_scheduling has no step"


def test_step_needs_model_name() -> None:
    """A step without model_name is an error naming the ensemble and step index."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}),
            step("", {"IN": "mid"}, {"OUT": "RESULT"}),
        ],
    )
    errors = validate_repository(pipeline_repo(pipe=config))
    assert "ensemble 'pipe' step[1]: model_name is required" in errors


@pytest.mark.parametrize("missing", ["input_map", "output_map"])
def test_step_needs_input_and_output_map(missing: str) -> None:
    """A step without input_map or output_map is an error naming the step and model."""
    second = attrs.evolve(step("infer", {"IN": "mid"}, {"OUT": "RESULT"}), **{missing: {}})
    config = ensemble("pipe", [step("pre", {"IN": "RAW"}, {"OUT": "mid"}), second])
    errors = validate_repository(pipeline_repo(pipe=config))
    assert f"ensemble 'pipe' step[1] (model 'infer'): {missing} is required" in errors


def test_unknown_step_models_are_listed() -> None:
    """Every step model missing from the repository is listed in one error."""
    config = ensemble(
        "pipe",
        [
            step("ghost", {"IN": "RAW"}, {"OUT": "mid"}),
            step("phantom", {"IN": "mid"}, {"OUT": "RESULT"}),
        ],
    )
    message = the_error(validate_repository(repo(config)))
    assert message.startswith("ensemble 'pipe':")
    assert "not in the repository: 'ghost', 'phantom'" in message


def test_nested_ensembles_are_allowed() -> None:
    """An ensemble may be a step of another ensemble."""
    outer = ensemble("outer", [step("pipe", {"RAW": "RAW"}, {"RESULT": "RESULT"})])
    assert validate_repository({**pipeline_repo(), "outer": outer}) == []


def test_ensemble_cycle_is_reported_with_path() -> None:
    """Ensembles that use each other in a cycle are reported with the cycle's path."""
    a = ensemble("a", [step("b", {"RAW": "RAW"}, {"RESULT": "RESULT"})])
    b = ensemble("b", [step("c", {"RAW": "RAW"}, {"RESULT": "RESULT"})])
    c = ensemble("c", [step("a", {"RAW": "RAW"}, {"RESULT": "RESULT"})])
    message = the_error(validate_repository(repo(a, b, c)))
    assert message == "ensembles form a cycle: 'a' -> 'b' -> 'c' -> 'a'"


def test_ensemble_using_itself_is_a_cycle() -> None:
    """An ensemble that is one of its own steps is a cycle."""
    a = ensemble("a", [step("a", {"RAW": "RAW"}, {"RESULT": "RESULT"})])
    assert validate_repository(repo(a)) == ["ensembles form a cycle: 'a' -> 'a'"]


def test_tensor_produced_twice() -> None:
    """Two steps writing the same tensor is an error naming the tensor and both producers."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}),
            step("infer", {"IN": "RAW"}, {"OUT": "mid"}),
            step("post", {"IN": "mid"}, {"OUT": "RESULT"}),
        ],
    )
    errors = validate_repository(pipeline_repo(pipe=config) | repo(model("post")))
    message = the_error(errors)
    assert message.startswith("ensemble 'pipe' step[1] (model 'infer'): tensor 'mid'")
    assert "produced more than once" in message
    assert "step[0] (model 'pre') output 'OUT'" in message


def test_step_overwriting_ensemble_input() -> None:
    """A step may not produce a tensor that is an ensemble input."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "RAW"}),
            step("infer", {"IN": "RAW"}, {"OUT": "RESULT"}),
        ],
    )
    message = the_error(validate_repository(pipeline_repo(pipe=config)))
    assert "step[0] (model 'pre'): tensor 'RAW' is produced more than once" in message
    assert "ensemble input 'RAW'" in message


def test_ensemble_input_not_used() -> None:
    """An ensemble input that no step consumes is an error naming it."""
    config = pipeline(inputs=[tensor("RAW"), tensor("EXTRA")])
    message = the_error(validate_repository(pipeline_repo(pipe=config)))
    assert message == "ensemble 'pipe': ensemble input 'EXTRA' is not used by any step"


def test_ensemble_output_not_produced() -> None:
    """An ensemble output that no step produces is an error naming it."""
    config = pipeline(outputs=[tensor("RESULT"), tensor("MISSING")])
    message = the_error(validate_repository(pipeline_repo(pipe=config)))
    assert message == "ensemble 'pipe': ensemble output 'MISSING' is not produced by any step"


def test_ensemble_output_unreachable() -> None:
    """Two steps waiting on each other's outputs leave the ensemble output unreachable."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"A": "RAW", "B": "loop_b"}, {"OUT": "loop_a"}),
            step("infer", {"IN": "loop_a"}, {"OUT": "loop_b", "OUT2": "RESULT"}),
        ],
    )
    models = pipeline_repo(
        pipe=config,
        pre=model("pre", inputs=[tensor("A"), tensor("B")]),
        infer=model("infer", outputs=[tensor("OUT"), tensor("OUT2")]),
    )
    message = the_error(validate_repository(models))
    assert message.startswith("ensemble 'pipe': ensemble output 'RESULT' is not reachable")


def test_intermediate_tensor_not_consumed() -> None:
    """A step output that is neither consumed nor an ensemble output is an error."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid", "SIDE": "dangling"}),
            step("infer", {"IN": "mid"}, {"OUT": "RESULT"}),
        ],
    )
    models = pipeline_repo(pipe=config, pre=model("pre", outputs=[tensor("OUT"), tensor("SIDE")]))
    message = the_error(validate_repository(models))
    assert message == (
        "ensemble 'pipe': tensor 'dangling' (step[0] (model 'pre') output 'SIDE') is neither "
        "consumed by a step nor an ensemble output"
    )


def test_step_input_nobody_produces() -> None:
    """A step input that is neither an ensemble input nor produced is an error."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}),
            step("infer", {"IN": "nowhere"}, {"OUT": "RESULT"}),
        ],
    )
    errors = validate_repository(pipeline_repo(pipe=config))
    assert any(
        e.startswith("ensemble 'pipe' step[1] (model 'infer'): input 'IN' takes tensor 'nowhere'")
        for e in errors
    ), errors


def test_input_map_key_not_a_model_input() -> None:
    """An input_map key that the step's model does not have is an error listing its inputs."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}),
            step("infer", {"IN": "mid", "BOGUS": "RAW"}, {"OUT": "RESULT"}),
        ],
    )
    message = the_error(validate_repository(pipeline_repo(pipe=config)))
    assert message == (
        "ensemble 'pipe' step[1] (model 'infer'): input_map key 'BOGUS' is not an input of "
        "the model (inputs: IN)"
    )


def test_output_map_key_not_a_model_output() -> None:
    """An output_map key that the step's model does not have is an error listing its outputs."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}),
            step("infer", {"IN": "mid"}, {"WRONG": "RESULT"}),
        ],
    )
    message = the_error(validate_repository(pipeline_repo(pipe=config)))
    assert message == (
        "ensemble 'pipe' step[1] (model 'infer'): output_map key 'WRONG' is not an output of "
        "the model (outputs: OUT)"
    )


def test_required_model_input_not_mapped() -> None:
    """A required input of the step's model left out of input_map is an error naming it."""
    infer = model("infer", inputs=[tensor("IN"), tensor("MASK")])
    message = the_error(validate_repository(pipeline_repo(infer=infer)))
    assert message == (
        "ensemble 'pipe' step[1] (model 'infer'): required model inputs are not mapped in "
        "input_map: 'MASK'"
    )


def test_optional_model_input_may_be_left_out() -> None:
    """An optional input of the step's model need not be mapped."""
    infer = model("infer", inputs=[tensor("IN"), tensor("MASK", optional=True)])
    assert validate_repository(pipeline_repo(infer=infer)) == []


def test_data_type_mismatch() -> None:
    """A tensor whose producer and consumer disagree on the data type is an error."""
    pre = model("pre", outputs=[tensor("OUT", DataType.INT32)])
    message = the_error(validate_repository(pipeline_repo(pre=pre)))
    assert message == (
        "ensemble 'pipe' step[1] (model 'infer'): tensor 'mid' is INT32 "
        "(step[0] (model 'pre') output 'OUT') but input 'IN' expects FP32"
    )


def test_ensemble_input_data_type_mismatch() -> None:
    """An ensemble input of another type than the step input it feeds is an error."""
    config = pipeline(inputs=[tensor("RAW", DataType.BYTES)])
    message = the_error(validate_repository(pipeline_repo(pipe=config)))
    assert "step[0] (model 'pre'): tensor 'RAW' is BYTES (ensemble input 'RAW')" in message
    assert "expects FP32" in message


def test_ensemble_output_data_type_mismatch() -> None:
    """An ensemble output of another type than the step output that makes it is an error."""
    config = pipeline(outputs=[tensor("RESULT", DataType.FP16)])
    message = the_error(validate_repository(pipeline_repo(pipe=config)))
    assert "ensemble 'pipe': ensemble output 'RESULT' is FP16" in message
    assert "step[1] (model 'infer') output 'OUT' is FP32" in message


def test_fixed_shape_mismatch() -> None:
    """Fixed dims that disagree along a tensor are an error showing both shapes."""
    infer = model("infer", inputs=[tensor("IN", dims=(5,))])
    message = the_error(validate_repository(pipeline_repo(infer=infer)))
    assert message == (
        "ensemble 'pipe' step[1] (model 'infer'): tensor 'mid' has shape [4] "
        "(step[0] (model 'pre') output 'OUT') but input 'IN' expects [5]"
    )


def test_rank_mismatch() -> None:
    """Tensors of different rank do not agree."""
    infer = model("infer", inputs=[tensor("IN", dims=(2, 2))])
    message = the_error(validate_repository(pipeline_repo(infer=infer)))
    assert "tensor 'mid' has shape [4]" in message
    assert "expects [2,2]" in message


def test_wildcard_dims_agree_with_fixed() -> None:
    """-1 on either side of a tensor matches any size."""
    pre = model("pre", outputs=[tensor("OUT", dims=(-1,))])
    infer = model("infer", inputs=[tensor("IN", dims=(-1,))], outputs=[tensor("OUT", dims=(-1,))])
    assert validate_repository(pipeline_repo(pre=pre, infer=infer)) == []


def test_ensemble_output_shape_mismatch() -> None:
    """An ensemble output whose dims disagree with the producing step is an error."""
    config = pipeline(outputs=[tensor("RESULT", dims=(8,))])
    message = the_error(validate_repository(pipeline_repo(pipe=config)))
    assert "ensemble output 'RESULT' has shape [8]" in message
    assert "step[1] (model 'infer') output 'OUT' has shape [4]" in message


def test_batching_matches_non_batching_with_leading_wildcard() -> None:
    """A batching [16] tensor matches a non-batching model's [-1,16]."""
    config = pipeline(
        max_batch_size=8, inputs=[tensor("RAW", dims=(16,))], outputs=[tensor("RESULT", dims=(16,))]
    )
    pre = model("pre", inputs=[tensor("IN", dims=(-1, 16))], outputs=[tensor("OUT", dims=(-1, 16))])
    infer = model(
        "infer",
        max_batch_size=8,
        inputs=[tensor("IN", dims=(16,))],
        outputs=[tensor("OUT", dims=(16,))],
    )
    assert validate_repository(pipeline_repo(pipe=config, pre=pre, infer=infer)) == []


def test_batching_matches_non_batching_with_the_same_item_dims() -> None:
    """A batching [16] tensor may feed a non-batching [16] (Triton adds/removes a batch of 1)."""
    config = pipeline(max_batch_size=8, inputs=[tensor("RAW", dims=(16,))])
    pre = model("pre", inputs=[tensor("IN", dims=(16,))])
    errors = validate_repository(pipeline_repo(pipe=config, pre=pre))
    assert not any("tensor 'RAW' has shape" in e for e in errors), errors


def test_batching_does_not_match_non_batching_with_other_item_dims() -> None:
    """A batching [16] tensor does not fit a non-batching [8]."""
    config = pipeline(max_batch_size=8, inputs=[tensor("RAW", dims=(16,))])
    pre = model("pre", inputs=[tensor("IN", dims=(8,))])
    errors = validate_repository(pipeline_repo(pipe=config, pre=pre))
    assert any(
        "step[0] (model 'pre'): tensor 'RAW' has shape [-1,16]" in e and "expects [8]" in e
        for e in errors
    ), errors


def test_composing_max_batch_size_smaller_than_ensemble() -> None:
    """A batching model that allows fewer than the ensemble's max_batch_size is an error."""
    config = pipeline(max_batch_size=8)
    pre = model("pre", max_batch_size=8)
    infer = model("infer", max_batch_size=4)
    message = the_error(validate_repository(pipeline_repo(pipe=config, pre=pre, infer=infer)))
    assert message == (
        "ensemble 'pipe' step[1] (model 'infer'): the model's max_batch_size 4 is smaller than "
        "the ensemble's max_batch_size 8"
    )


def test_composing_max_batch_size_larger_is_fine() -> None:
    """A batching model that allows more than the ensemble's max_batch_size is fine."""
    config = pipeline(max_batch_size=4)
    pre = model("pre", max_batch_size=4)
    infer = model("infer", max_batch_size=32)
    assert validate_repository(pipeline_repo(pipe=config, pre=pre, infer=infer)) == []


def decoupled(name: str, **kwargs: Any) -> ModelConfig:
    """A decoupled composing model."""
    return model(name, model_transaction_policy=ModelTransactionPolicy(decoupled=True), **kwargs)


def test_inputs_from_two_decoupled_producers() -> None:
    """A step joining the outputs of two decoupled steps is an error naming both."""
    config = ensemble(
        "pipe",
        [
            step("gen_a", {"IN": "RAW"}, {"OUT": "a"}),
            step("gen_b", {"IN": "RAW"}, {"OUT": "b"}),
            step("join", {"L": "a", "R": "b"}, {"OUT": "RESULT"}),
        ],
    )
    models = repo(
        config,
        decoupled("gen_a"),
        decoupled("gen_b"),
        model("join", inputs=[tensor("L"), tensor("R")]),
    )
    message = the_error(validate_repository(models))
    assert message == (
        "ensemble 'pipe' step[2] (model 'join'): takes inputs from different decoupled "
        "producers: step[0] (model 'gen_a'), step[1] (model 'gen_b')"
    )


def test_one_decoupled_producer_with_ensemble_input_is_fine() -> None:
    """A step may combine one decoupled producer's outputs with ensemble inputs."""
    config = ensemble(
        "pipe",
        [
            step("gen", {"IN": "RAW"}, {"OUT": "a"}),
            step("after", {"IN": "a"}, {"OUT": "b"}),
            step("join", {"L": "b", "R": "RAW"}, {"OUT": "RESULT"}),
        ],
    )
    models = repo(
        config, decoupled("gen"), model("after"), model("join", inputs=[tensor("L"), tensor("R")])
    )
    assert validate_repository(models) == []


@pytest.mark.parametrize("limit", [-1, 2**32, 2**40])
def test_max_inflight_requests_out_of_range(limit: int) -> None:
    """max_inflight_requests outside [0, 2^32) is an error showing the value."""
    message = the_error(
        validate_repository(pipeline_repo(pipe=pipeline(max_inflight_requests=limit)))
    )
    assert message.startswith("ensemble 'pipe': max_inflight_requests")
    assert str(limit) in message


@pytest.mark.parametrize("limit", [0, 1, 2**32 - 1])
def test_max_inflight_requests_in_range(limit: int) -> None:
    """max_inflight_requests in [0, 2^32) is accepted (0 is unbounded)."""
    assert validate_repository(pipeline_repo(pipe=pipeline(max_inflight_requests=limit))) == []


def test_specific_model_version_not_available() -> None:
    """A step asking for a version that is not available is an error listing those that are."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}, version=3),
            step("infer", {"IN": "mid"}, {"OUT": "RESULT"}),
        ],
    )
    versions = {"pre": [2, 1], "infer": [1], "pipe": [1]}
    message = the_error(validate_repository(pipeline_repo(pipe=config), versions))
    assert message == (
        "ensemble 'pipe' step[0] (model 'pre'): requires version 3, which is not available "
        "(available: 1, 2)"
    )


@pytest.mark.parametrize("version", [-1, 0, 2])
def test_latest_or_available_model_version_is_fine(version: int) -> None:
    """model_version -1 or 0 means latest (Better than Triton); an available version is fine."""
    config = ensemble(
        "pipe",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}, version=version),
            step("infer", {"IN": "mid"}, {"OUT": "RESULT"}),
        ],
    )
    versions = {"pre": [1, 2], "infer": [1], "pipe": [1]}
    assert validate_repository(pipeline_repo(pipe=config), versions) == []


def test_ensemble_cache_with_decoupled_model_caches_its_stream() -> None:
    """An ensemble containing a decoupled model streams, and may cache its whole stream
    (Triton refuses it)."""
    config = pipeline(response_cache=ResponseCache(enable=True))
    assert validate_repository(pipeline_repo(pipe=config, infer=decoupled("infer"))) == []


def test_ensemble_cache_with_sequence_model() -> None:
    """An ensemble containing a sequence model cannot enable response_cache."""
    config = pipeline(response_cache=ResponseCache(enable=True))
    pre = model("pre", sequence_batching=SequenceBatching())
    message = the_error(validate_repository(pipeline_repo(pipe=config, pre=pre)))
    assert "sequence model 'pre'" in message


def test_ensemble_cache_with_nested_sequence_model() -> None:
    """An ensemble whose nested ensemble contains a sequence model cannot enable the cache."""
    outer = ensemble(
        "outer",
        [step("pipe", {"RAW": "RAW"}, {"RESULT": "RESULT"})],
        response_cache=ResponseCache(enable=True),
    )
    pre = model("pre", sequence_batching=SequenceBatching())
    models = {**pipeline_repo(pre=pre), "outer": outer}
    message = the_error(validate_repository(models))
    assert message.startswith("ensemble 'outer': cannot enable response_cache")
    assert "sequence model 'pre'" in message


def test_step_order_does_not_matter() -> None:
    """Steps may be listed in any order; the wiring decides what runs first."""
    config = ensemble(
        "pipe",
        [
            step("infer", {"IN": "mid"}, {"OUT": "RESULT"}),
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}),
        ],
    )
    assert validate_repository(pipeline_repo(pipe=config)) == []


# validate_model_config: rules of one config on its own.


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (model(""), "a model config has no name"),
        (model("m", max_batch_size=-1), "model 'm': max_batch_size must be >= 0, got -1"),
        (model("m", platform="tensorrt_plan"), "model 'm': platform 'tensorrt_plan' is not"),
        (model("m", backend="../up"), "model 'm': backend '../up' is not a backend name"),
        (
            model("m", platform="onnxruntime_onnx", backend="python"),
            "model 'm': platform 'onnxruntime_onnx' and backend 'python' disagree",
        ),
        (
            model("m", inputs=[tensor("IN"), tensor("IN")]),
            "model 'm': input 'IN' is declared twice",
        ),
        (model("m", inputs=[tensor("", dims=(1,))]), "model 'm': an input has no name"),
        (
            model("m", inputs=[tensor("IN", dims=(0, 3))]),
            "model 'm' input 'IN': dims must be positive or -1, got [0, 3]",
        ),
        (
            model("m", outputs=[tensor("OUT", dims=(-2,))]),
            "model 'm' output 'OUT': dims must be positive or -1, got [-2]",
        ),
        (model("m", inputs=[tensor("IN", dims=())]), "model 'm' input 'IN': dims is empty"),
        (
            model("m", inputs=[tensor("IN", dims=(2, 3), reshape=Reshape(shape=(5,)))]),
            "model 'm' input 'IN': reshape [5] does not hold the elements of dims [2, 3]",
        ),
        (
            model("m", max_batch_size=8, inputs=[tensor("IN", dims=())]),
            "model 'm' input 'IN': dims is empty (Triton needs dims",
        ),
        (
            model("m", inputs=[tensor("IN", dims=(-1, 2), reshape=Reshape(shape=(1, -1)))]),
            "model 'm' input 'IN': reshape [1, -1] does not hold the elements of dims [-1, 2]",
        ),
        (
            ModelConfig(name="m", input=(tensor("IN"),)),
            "model 'm': a model needs at least one output",
        ),
        (
            model("m", instance_group=(InstanceGroup(count=0),)),
            "model 'm': instance_group count must be >= 1",
        ),
        (
            model("m", version_policy=VersionPolicy(latest=0)),
            "model 'm': version_policy latest num_versions must be >= 1",
        ),
        (
            model("m", version_policy=VersionPolicy(specific=())),
            "model 'm': version_policy specific needs positive versions",
        ),
        (
            model("m", version_policy=VersionPolicy(specific=(1, 0))),
            "model 'm': version_policy specific needs positive versions",
        ),
        (
            model(
                "m",
                sequence_batching=SequenceBatching(),
                response_cache=ResponseCache(enable=True),
            ),
            "model 'm': a sequence (stateful) model cannot enable response_cache",
        ),
        (
            ModelConfig(
                name="e",
                platform="ensemble",
                input=(tensor("RAW"),),
                ensemble_scheduling=EnsembleScheduling(
                    step=(step("m", {"IN": "RAW"}, {"OUT": "RESULT"}),)
                ),
            ),
            "ensemble 'e': an ensemble needs at least one output",
        ),
    ],
)
def test_model_config_rule(config: ModelConfig, expected: str) -> None:
    """Each rule of a single config gives one error that says what is wrong."""
    assert the_error(validate_model_config(config)).startswith(expected)


@pytest.mark.parametrize(
    "config",
    [
        model("m"),
        model(
            "m",
            backend="python",
            max_batch_size=8,
            inputs=[tensor("IN", dims=(1,), reshape=Reshape(shape=()))],
        ),
        model("m", backend="jax", inputs=[tensor("IN", dims=(-1, 4))]),
        model("m", inputs=[tensor("IN", dims=(2, 2), reshape=Reshape(shape=(4,)))]),
        model("m", inputs=[tensor("IN", dims=(-1, 2), reshape=Reshape(shape=(-1, 2, 1)))]),
        model("m", version_policy=VersionPolicy()),
        model("m", version_policy=VersionPolicy(latest=2)),
        model("m", version_policy=VersionPolicy(all=True)),
        model("m", version_policy=VersionPolicy(specific=(1, 3))),
        model("m", response_cache=ResponseCache(enable=True), instance_group=(InstanceGroup(),)),
        decoupled("m", response_cache=ResponseCache(enable=False)),
        model("m", platform="onnxruntime_onnx"),
        model("m", backend="onnxruntime"),
        model("m", platform="onnxruntime_onnx", backend="onnxruntime"),
    ],
)
def test_valid_model_config(config: ModelConfig) -> None:
    """Valid single configs give no errors."""
    assert validate_model_config(config) == []


def test_bytes_tensors() -> None:
    """bytes_tensors lists the BYTES inputs and outputs."""
    config = model(
        "m",
        inputs=[tensor("TEXT", DataType.BYTES), tensor("X")],
        outputs=[tensor("Y"), tensor("LABEL", DataType.BYTES)],
    )
    assert bytes_tensors(config) == ["TEXT", "LABEL"]


# EnsembleGraph: the wiring the scheduler runs, and pruning.


def branching() -> ModelConfig:
    """RAW -> pre -> mid, then mid -> left -> L and mid -> right -> R."""
    return ensemble(
        "branch",
        [
            step("pre", {"IN": "RAW"}, {"OUT": "mid"}, version=0),
            step("left", {"IN": "mid"}, {"OUT": "L"}, version=2),
            step("right", {"IN": "mid"}, {"OUT": "R"}),
        ],
        outputs=[tensor("L"), tensor("R")],
    )


def test_graph_from_config() -> None:
    """from_config lists steps with their maps, each tensor's consumers and producer."""
    config = branching()
    graph = EnsembleGraph.from_config(config)
    assert validate_repository(repo(config, model("pre"), model("left"), model("right"))) == []
    assert graph.name == "branch"
    assert graph.inputs == ("RAW",)
    assert graph.outputs == ("L", "R")
    assert graph.steps[0] == StepPlan(
        index=0,
        model_name="pre",
        model_version=-1,
        inputs=(("IN", "RAW"),),
        outputs=(("OUT", "mid"),),
        waits=("RAW",),
    )
    assert graph.steps[1].model_version == 2
    assert graph.consumers == {"RAW": (0,), "mid": (1, 2)}
    assert graph.producer == {"mid": 0, "L": 1, "R": 2}
    assert graph.steps[2].describe("branch") == "ensemble 'branch' step[2] (model 'right')"


def test_graph_consumers_list_each_step_once() -> None:
    """A step that reads one tensor through two inputs is listed once as its consumer."""
    config = ensemble("e", [step("join", {"L": "RAW", "R": "RAW"}, {"OUT": "RESULT"})])
    assert EnsembleGraph.from_config(config).consumers == {"RAW": (0,)}


def test_needed_steps_prunes_unrequested_branch() -> None:
    """Only the steps leading to the requested outputs are needed."""
    graph = EnsembleGraph.from_config(branching())
    assert graph.needed_steps(frozenset({"L"})) == {0, 1}
    assert graph.needed_steps(frozenset({"R"})) == {0, 2}
    assert graph.needed_steps(frozenset({"L", "R"})) == {0, 1, 2}
    assert graph.needed_steps(frozenset()) == frozenset()
    assert graph.needed_steps(frozenset({"L"})) is graph.needed_steps(frozenset({"L"}))


# Hypothesis: ensembles built valid (chains and fan-outs) have no errors.

_dtypes = st.sampled_from([DataType.FP32, DataType.INT64, DataType.BYTES, DataType.BF16])
_shapes = st.lists(st.sampled_from([-1, 1, 3, 16]), min_size=1, max_size=2).map(tuple)


@st.composite
def valid_repositories(draw: st.DrawFn) -> dict[str, ModelConfig]:
    """An ensemble whose steps each read earlier tensors, with models that fit the wiring."""
    ensemble_batch = draw(st.sampled_from([0, 4]))
    # Tensor name -> (data type, dims without the batch dimension).
    available: dict[str, tuple[DataType, tuple[int, ...]]] = {}
    ensemble_inputs = []
    for i in range(draw(st.integers(1, 3))):
        dtype, dims = draw(_dtypes), draw(_shapes)
        available[f"x{i}"] = (dtype, dims)
        ensemble_inputs.append(tensor(f"x{i}", dtype, dims))
    consumed: set[str] = set()
    models: dict[str, ModelConfig] = {}
    steps = []
    first_decoupled = draw(st.booleans())
    for s in range(draw(st.integers(1, 5))):
        if s == 0:
            chosen = sorted(available)  # the first step reads every ensemble input
        else:
            chosen = draw(
                st.lists(st.sampled_from(sorted(available)), min_size=1, max_size=3, unique=True)
            )
        consumed.update(chosen)
        # A batching ensemble may use batching models (any allowed size) or non-batching
        # ones that spell the batch dimension as -1.
        batching = ensemble_batch > 0 and draw(st.booleans())
        model_batch = draw(st.integers(ensemble_batch, 8)) if batching else 0
        lead = (-1,) if ensemble_batch > 0 and not batching else ()
        inputs = [
            tensor(f"IN{j}", available[t][0], lead + available[t][1]) for j, t in enumerate(chosen)
        ]
        outputs = []
        output_map = {}
        for j in range(draw(st.integers(1, 2))):
            dtype, dims = draw(_dtypes), draw(_shapes)
            outputs.append(tensor(f"OUT{j}", dtype, lead + dims))
            output_map[f"OUT{j}"] = f"t{s}_{j}"
            available[f"t{s}_{j}"] = (dtype, dims)
        policy = ModelTransactionPolicy(decoupled=s == 0 and first_decoupled)
        name = f"m{s}"
        models[name] = model(
            name,
            inputs,
            outputs,
            max_batch_size=model_batch,
            model_transaction_policy=policy,
        )
        steps.append(
            step(
                name,
                {f"IN{j}": t for j, t in enumerate(chosen)},
                output_map,
                version=draw(st.sampled_from([-1, 0, 1])),
            )
        )
    # Every step output nobody reads becomes an ensemble output.
    ensemble_outputs = [
        tensor(t, *available[t]) for t in available if t.startswith("t") and t not in consumed
    ]
    config = ensemble(
        "e",
        steps,
        inputs=ensemble_inputs,
        outputs=ensemble_outputs,
        max_batch_size=ensemble_batch,
        max_inflight_requests=draw(st.integers(0, 2**32 - 1)),
    )
    return {"e": config, **models}


@settings(max_examples=75, deadline=None)
@given(valid_repositories())
def test_valid_generated_ensembles_have_no_errors(models: dict[str, ModelConfig]) -> None:
    """Any ensemble built valid passes validation, and every step is needed for all outputs."""
    versions = {name: [1] for name in models}
    assert validate_repository(models, versions) == []
    graph = EnsembleGraph.from_config(models["e"])
    assert graph.needed_steps(frozenset(graph.outputs)) == set(range(len(graph.steps)))
