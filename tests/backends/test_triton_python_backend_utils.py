"""``triton_python_backend_utils`` on its own, as a model's unit tests use it: tensors and
their DLPack and BYTES forms, responses and errors, the config helpers, auto-complete's
``ModelConfig``, the logger and metric families; calls into a server outside one say so."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

from orchestrion.backends._triton_metrics import MetricStore, ModelScope, enter_scope, leave_scope


def test_tensor_wraps_its_array_and_names_its_type() -> None:
    """A Tensor is its name and its array (the same memory), with Triton's type number."""
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor("X", data)
    assert tensor.name() == "X"
    assert tensor.as_numpy() is data
    assert tensor.shape() == [2, 3]
    assert tensor.triton_dtype() == 11  # TYPE_FP32
    assert tensor.data_type() == "FP32"
    assert tensor.is_cpu()


def test_strings_become_bytes_elements() -> None:
    """Text and fixed-width numpy strings become a BYTES tensor of bytes objects."""
    tensor = pb_utils.Tensor("S", np.array(["héllo", "x"]))
    assert tensor.as_numpy().dtype == object
    assert tensor.as_numpy().tolist() == ["héllo".encode(), b"x"]


def test_dlpack_round_trip_shares_memory() -> None:
    """to_dlpack and from_dlpack (a capsule, or any object with __dlpack__) share memory."""
    data = np.arange(4, dtype=np.int32)
    back = pb_utils.Tensor.from_dlpack("Y", pb_utils.Tensor("X", data).to_dlpack())
    assert back.as_numpy().tolist() == [0, 1, 2, 3]
    assert np.shares_memory(back.as_numpy(), data)
    assert pb_utils.Tensor.from_dlpack("Z", data).as_numpy().tolist() == [0, 1, 2, 3]


class _Exported:
    """A capsule as an object with ``__dlpack__``, for consumers that take no raw capsule
    (JAX): what a model does with ``torch.utils.dlpack.from_dlpack(tensor.to_dlpack())``."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, **_: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def test_bf16_tensors_go_through_dlpack_as_in_triton() -> None:
    """A BF16 tensor (which numpy's DLPack refuses) exports as DLPack's bfloat16, which
    another framework (JAX here, PyTorch in Triton's QA) reads as its own bfloat16, and
    imports back from it; as_numpy() refuses it in Triton's words."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    values = np.array([[1.5, -2.0], [3e30, 0.0]], ml_dtypes.bfloat16)
    tensor = pb_utils.Tensor("X", values)
    imported = jax.dlpack.from_dlpack(_Exported(tensor.to_dlpack()))
    assert imported.dtype == jnp.bfloat16
    assert np.asarray(imported).tolist() == values.tolist()
    back = pb_utils.Tensor.from_dlpack("Y", imported * 2)
    assert back.data_type() == "BF16"
    assert back.triton_dtype() == pb_utils.numpy_to_triton_type(ml_dtypes.bfloat16)
    doubled = jax.dlpack.from_dlpack(_Exported(back.to_dlpack()))
    assert np.asarray(doubled).tolist() == (values.astype(np.float32) * 2).tolist()
    with pytest.raises(
        pb_utils.TritonModelException, match="tensor dtype is bf16 and cannot be converted"
    ):
        tensor.as_numpy()


def test_a_read_only_tensor_exports_a_copy() -> None:
    """A request's inputs are read-only (they may be shared with other steps and the
    cache): what a framework imports of one is a copy, which it may write into without
    changing the request (numpy's own export refuses read-only arrays)."""
    data = np.arange(4, dtype=np.float32)
    data.flags.writeable = False
    imported = np.from_dlpack(_Exported(pb_utils.Tensor("X", data).to_dlpack()))
    assert imported.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not np.shares_memory(imported, data)


def test_bytes_tensors_have_no_dlpack_form() -> None:
    """A BYTES tensor's to_dlpack is a TritonModelException naming the tensor."""
    with pytest.raises(pb_utils.TritonModelException, match="'S'"):
        pb_utils.Tensor("S", np.array([b"a"], dtype=object)).to_dlpack()


def test_bytes_wire_form_round_trips() -> None:
    """serialize_byte_tensor and deserialize_bytes_tensor are each other's inverse."""
    values = np.array([b"", b"ab", "é".encode(), b"\x00\xff"], dtype=object)
    wire = pb_utils.serialize_byte_tensor(values)
    assert wire[:4] == b"\x00\x00\x00\x00"
    assert pb_utils.deserialize_bytes_tensor(wire).tolist() == values.tolist()


def test_type_tables_agree_with_triton() -> None:
    """TYPE_* names and Triton's numbers map to numpy as Triton's python backend maps them."""
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.triton_string_to_numpy("TYPE_BOOL") is bool
    assert pb_utils.triton_to_numpy_type(9) is np.int64
    assert pb_utils.numpy_to_triton_type(np.float16) == 10
    assert pb_utils.numpy_to_triton_type(np.object_) == 13


def test_responses_and_errors() -> None:
    """A response holds tensors or an error with a code (INTERNAL unless given)."""
    ok = pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.ones(2))], parameters={"k": 1})
    assert not ok.has_error()
    assert pb_utils.get_output_tensor_by_name(ok, "Y") is not None
    assert pb_utils.get_output_tensor_by_name(ok, "Z") is None
    assert json.loads(ok.parameters()) == {"k": 1}
    failed = pb_utils.InferenceResponse(error=pb_utils.TritonError("no"))
    assert failed.has_error()
    assert failed.error().message() == "no"
    assert failed.error().code() == pb_utils.TritonError.INTERNAL
    assert pb_utils.TritonError("x", pb_utils.TritonError.NOT_FOUND).code() == 2
    with pytest.raises(pb_utils.TritonModelException, match="pb_utils.Tensor"):
        pb_utils.InferenceResponse([np.ones(2)])


def test_config_helpers_read_tritons_json() -> None:
    """The config helpers read the JSON a model's initialize receives."""
    config = {
        "input": [{"name": "A", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "B", "data_type": "TYPE_FP32", "dims": [2]}],
        "model_transaction_policy": {"decoupled": True},
    }
    assert pb_utils.get_input_config_by_name(config, "A")["dims"] == [1]
    assert pb_utils.get_output_config_by_name(config, "B")["data_type"] == "TYPE_FP32"
    assert pb_utils.get_input_config_by_name(config, "B") is None
    assert pb_utils.using_decoupled_model_transaction_policy(config)
    assert not pb_utils.using_decoupled_model_transaction_policy({})


def test_auto_complete_config_adds_completes_and_refuses() -> None:
    """ModelConfig adds inputs and outputs, completes a named one, and refuses a
    contradiction, an unknown property, a missing one and a smaller max_batch_size."""
    config = pb_utils.ModelConfig(
        json.dumps(
            {
                "name": "m",
                "max_batch_size": 8,
                "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": []}],
                "output": [],
            }
        )
    )
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})
    config.add_input({"name": "B", "data_type": "TYPE_INT32", "dims": [1], "optional": True})
    config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [4]})
    config.set_dynamic_batching()
    config.set_model_transaction_policy({"decoupled": False})
    document = config.as_dict()
    assert [i["dims"] for i in document["input"]] == [[4], [1]]
    assert document["dynamic_batching"] == {}
    with pytest.raises(ValueError, match="data_type TYPE_FP32, the model TYPE_INT32"):
        config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": [4]})
    with pytest.raises(ValueError, match="dims \\[4\\], the model \\[5\\]"):
        config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="unknown properties \\['format'\\]"):
        config.add_input({"name": "D", "data_type": "TYPE_FP32", "dims": [1], "format": "x"})
    with pytest.raises(ValueError, match="'dims' property is missing"):
        config.add_output({"name": "E", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="max_batch_size 8"):
        config.set_max_batch_size(4)
    with pytest.raises(ValueError, match="decoupled True"):
        config.set_model_transaction_policy({"decoupled": True})


def test_the_logger_writes_to_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    """Logger's levels reach the ``orchestrion.models`` logger (VERBOSE as DEBUG)."""
    with caplog.at_level(logging.DEBUG, logger="orchestrion.models"):
        pb_utils.Logger.log_info("one")
        pb_utils.Logger.log_warn("two")
        pb_utils.Logger.log_error("three")
        pb_utils.Logger.log_verbose("four")
        pb_utils.Logger.log("five", pb_utils.Logger.ERROR)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "one"),
        ("WARNING", "two"),
        ("ERROR", "three"),
        ("DEBUG", "four"),
        ("ERROR", "five"),
    ]


def test_metric_families_count_outside_a_server() -> None:
    """A counter only grows, a gauge is set, a histogram observes (buckets cumulative); each
    kind refuses what is not its own."""
    counters = pb_utils.MetricFamily("c_total", "c", pb_utils.MetricFamily.COUNTER)
    counter = counters.Metric(labels={"a": "1"})
    counter.increment(2)
    counter.increment(3)
    assert counter.value() == 5
    with pytest.raises(pb_utils.TritonModelException):
        counter.increment(-1)
    with pytest.raises(pb_utils.TritonModelException):
        counter.set(1)
    gauges = pb_utils.MetricFamily("g", "g", pb_utils.MetricFamily.GAUGE)
    gauge = gauges.Metric()
    gauge.set(7)
    gauge.increment(-2)
    assert gauge.value() == 5
    family = pb_utils.MetricFamily("h", "h", pb_utils.MetricFamily.HISTOGRAM)
    histogram = family.Metric(buckets=[1, 10])
    for v in (0.5, 5, 50):
        histogram.observe(v)
    sample = family.snapshot().samples[0]
    assert [count for _, count in sample.buckets] == [1, 2, 3]
    assert sample.count == 3
    with pytest.raises(pb_utils.TritonModelException, match="needs buckets"):
        family.Metric(labels={"b": "2"})
    for unordered in ([2.5, 0.1, 1.0], [1, 1, 2]):
        with pytest.raises(pb_utils.TritonModelException, match="strictly ascending"):
            family.Metric(labels={"b": "2"}, buckets=unordered)
    family.Metric(labels={"b": "3"}, buckets=[])  # only +Inf
    with pytest.raises(pb_utils.TritonModelException, match="not a valid Prometheus name"):
        pb_utils.MetricFamily("1bad-name", "x", pb_utils.MetricFamily.GAUGE)


def test_metric_families_share_by_name_and_die_with_their_last_handle() -> None:
    """As Triton's (its QA's custom_metrics): a family made again with the same name is
    the same family (the first description kept, another kind refused), two metrics with
    the same labels are one series, and once every handle of the family is deleted it
    leaves the model's metrics and its metrics refuse every operation."""
    store = MetricStore()
    token = enter_scope(ModelScope("m", 1, store))
    try:
        first = pb_utils.MetricFamily("dup", "first", pb_utils.MetricFamily.GAUGE)
        second = pb_utils.MetricFamily("dup", "second", pb_utils.MetricFamily.GAUGE)
        with pytest.raises(pb_utils.TritonModelException, match="same kind"):
            pb_utils.MetricFamily("dup", "x", pb_utils.MetricFamily.COUNTER)
        one = first.Metric(labels={"k": "v"})
        same = second.Metric(labels={"k": "v"})
        one.increment(7.5)
        assert same.value() == 7.5
        [shown] = store.snapshot()
        assert (shown.description, len(shown.samples)) == ("first", 1)
        del first
        assert [f.name for f in store.snapshot()] == ["dup"]  # `second` still holds it
        del second
        assert store.snapshot() == []
        said = "Invalid metric operation as the corresponding 'MetricFamily' has been deleted."
        for call in (lambda: one.set(1), lambda: one.increment(1), one.value):
            with pytest.raises(pb_utils.TritonModelException, match=re.escape(said)):
                call()
    finally:
        leave_scope(token)


def test_calls_into_a_server_outside_execute_say_so() -> None:
    """exec(), async_exec() and is_model_ready() outside a model's execute raise a
    TritonModelException that names the call; the model-loading API says it is not offered;
    release flags are kept for the execution to read (see test_python_backend_rescheduling)."""
    request = pb_utils.InferenceRequest(model_name=b"m", inputs=[], requested_output_names=["Y"])
    assert request.model_name() == "m"
    with pytest.raises(pb_utils.TritonModelException) as outside:
        request.exec()
    assert str(outside.value).startswith("BLS is only supported during the 'execute' function.")
    assert "InferenceRequest.exec was called outside a model's execute" in str(outside.value)
    with pytest.raises(pb_utils.TritonModelException, match="async_exec"):
        request.async_exec()
    with pytest.raises(pb_utils.TritonModelException, match="is_model_ready"):
        pb_utils.is_model_ready("m")
    with pytest.raises(pb_utils.TritonModelException, match="BLS is only supported"):
        pb_utils.load_model("m")
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)  # kept
    assert request.release_flags() == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
    with pytest.raises(pb_utils.TritonModelException, match="only a request that execute received"):
        request.get_response_sender()


def _tensor() -> pb_utils.Tensor:
    return pb_utils.Tensor("IN", np.array([1, 2], np.int32))


@pytest.mark.parametrize(
    ("make", "error", "named"),
    [
        (lambda: pb_utils.InferenceRequest("m", None, []), TypeError, "inputs"),
        (
            lambda: pb_utils.InferenceRequest("m", [None], []),
            pb_utils.TritonModelException,
            "Tensor",
        ),
        (lambda: pb_utils.InferenceRequest(None, [_tensor()], []), TypeError, "model_name"),
        (lambda: pb_utils.InferenceRequest("m", [], None), TypeError, "requested_output_names"),
        (lambda: pb_utils.InferenceRequest("m", [], [None]), TypeError, "requested_output_names"),
        (lambda: pb_utils.InferenceRequest("m", [], [], request_id=None), TypeError, "request_id"),
        (
            lambda: pb_utils.InferenceRequest("m", [], [], correlation_id=None),
            TypeError,
            "correlation_id",
        ),
        (lambda: pb_utils.InferenceRequest("m", [], [], model_version=None), TypeError, "model_"),
        (lambda: pb_utils.InferenceRequest("m", [], [], flags=None), TypeError, "flags"),
        (lambda: pb_utils.InferenceResponse(output_tensors=None), TypeError, "output_tensors"),
        (lambda: pb_utils.InferenceResponse([None]), pb_utils.TritonModelException, "Tensor"),
        (lambda: pb_utils.Tensor(None, np.array([1])), TypeError, "name"),
        (lambda: pb_utils.Tensor("OUT", None), TypeError, "data"),
        (lambda: pb_utils.Tensor.from_dlpack("OUT", None), pb_utils.TritonModelException, "OUT"),
        (lambda: pb_utils.Logger.log("message", 1), TypeError, "level"),
        (lambda: pb_utils.Logger.log("message", None), TypeError, "level"),
        (lambda: pb_utils.Logger.log_info(None), TypeError, "message"),
        (lambda: pb_utils.Logger.log_verbose(None), TypeError, "message"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_as_in_triton(
    make: object, error: type[Exception], named: str
) -> None:
    """Triton's QA argument_validation: its pybind11 API refuses an argument of the wrong
    type with a TypeError (here naming it), and a list holding None where tensors go with
    a TritonModelException."""
    with pytest.raises(error, match=re.escape(named)):
        make()  # type: ignore[operator]


def test_the_arguments_triton_takes_are_taken() -> None:
    """Empty lists, a correlation id as an integer or a string (kept as given, 0 by
    default), and a log level from Logger.LogLevel."""
    pb_utils.InferenceRequest(requested_output_names=[], inputs=[], model_name="m")
    pb_utils.InferenceResponse(output_tensors=[])
    for given in (5, "test_str_id-5"):
        request = pb_utils.InferenceRequest("m", [_tensor()], ["OUT"], correlation_id=given)
        assert request.correlation_id() == given
    assert pb_utils.InferenceRequest("m", [], []).correlation_id() == 0
    assert pb_utils.Logger.INFO is pb_utils.Logger.LogLevel.INFO
    pb_utils.Logger.log("message")
    pb_utils.Logger.log("message", pb_utils.Logger.WARNING)
