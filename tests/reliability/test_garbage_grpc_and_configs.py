"""Hypothesis throws malformed gRPC requests (unary and streamed), malformed model configs and
a few HTTP bodies the HTTP fuzzer does not reach at orchestrion: each gets a clear
INVALID_ARGUMENT / 4xx or a `ConfigError` naming the file, and the server keeps serving."""

from __future__ import annotations

import collections
import gzip
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

import orchestrion
from orchestrion import ConfigError, ModelLoadError
from orchestrion.testing import Served, get, post
from support.reliability_report import examples, record
from support.served import MODELS, start_server

LIMIT = 65536
"""Both ``--grpc-max-message-size`` and ``--http-max-input-size`` of the served child."""

DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
    "FP8",
    "",
    "fp32",
    "STRING",
    "TYPE_FP32",
]
ITEMSIZE = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "FP32": 4,
    "FP64": 8,
    "BF16": 2,
}
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
CONTENT_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=8),
}
NAMES = ["IN_FP32", "IN_BYTES", "IN_BOOL", "IN_INT32", "IN_FP16", "IN_BF16", "IN_UINT64"]
NAMES += ["Y", "X", "INPUT", "", "ünï\u2028"]
MODELS_UNARY = ["identity_plain", "identity_batch"] * 2 + ["square", "pipeline", "counter"]
MODELS_UNARY += ["repeat", "repeat_squares"]
DECOUPLED = ("repeat", "repeat_squares")
MODELS_STREAM = ["identity_plain", "identity_batch", "square", "pipeline", "counter"]
OUTPUT_NAMES = ["OUT_FP32", "OUT_BYTES", "OUT_INT32", "Z", "Y", "CLASS", "SEG", "TOTAL", ""]
VERSIONS = ["", "", "1", "-1", "0", "2", "01", "x", "99999999999999999999", "１", " 1", "²"]
PARAMETER_KEYS = [
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "priority",
    "timeout",
    "binary_data_output",
    "triton_enable_empty_final_response",
    "shared_memory_region",
    "headers",
    "custom",
]
dims = st.integers(-3, 6) | st.sampled_from([2**31, 2**40, 2**40 + 1, 2**62, 2**63 - 1, -(2**63)])
parameter_values = st.one_of(
    st.tuples(st.just("bool_param"), st.booleans()),
    st.tuples(st.just("int64_param"), st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 3)),
    st.tuples(st.just("uint64_param"), st.integers(0, 2**64 - 1) | st.integers(0, 3)),
    st.tuples(st.just("double_param"), st.floats()),
    st.tuples(st.just("string_param"), st.text(max_size=6)),
)


def _set_parameter(parameters: Any, key: str, kind_value: tuple[str, Any]) -> None:
    kind, value = kind_value
    setattr(parameters[key], kind, value)


IDENTITY_TYPES = [*ITEMSIZE, "BYTES"]
INTEGER_RANGES = {
    "INT8": (-(2**7), 2**7 - 1),
    "INT16": (-(2**15), 2**15 - 1),
    "INT32": (-(2**31), 2**31 - 1),
    "INT64": (-(2**63), 2**63 - 1),
    "UINT8": (0, 2**8 - 1),
    "UINT16": (0, 2**16 - 1),
    "UINT32": (0, 2**32 - 1),
    "UINT64": (0, 2**64 - 1),
}
MUTATIONS = [
    "datatype",
    "shape",
    "dim",
    "raw short",
    "raw long",
    "raw random",
    "raw prefixes",
    "raw count",
    "contents kind",
    "contents count",
    "version",
    "parameter",
    "tensor parameter",
    "output",
    "rename",
    "duplicate",
    "drop",
    "model",
    "oversize",
]


def _values(draw: st.DrawFn, datatype: str, count: int) -> list[Any]:
    """``count`` valid element values of ``datatype`` (floats include NaN and infinities)."""
    if datatype in INTEGER_RANGES:
        low, high = INTEGER_RANGES[datatype]
        element: st.SearchStrategy[Any] = st.integers(low, high)
    elif datatype == "BOOL":
        element = st.booleans()
    elif datatype == "BYTES":
        element = st.binary(max_size=5)  # non-UTF-8 too
    elif datatype == "FP64":
        element = st.floats()
    else:
        element = st.floats(width=32)
    return draw(st.lists(element, min_size=count, max_size=count))


def _raw(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(item)) + item for item in values)
    numpy_type = {"BF16": np.uint16}.get(datatype) or np.dtype(
        datatype.lower().replace("fp", "float")
    )
    if datatype == "BF16":  # the top half of each float32
        return (np.array(values, np.float32).view(np.uint32) >> 16).astype(numpy_type).tobytes()
    if datatype == "BOOL":
        return np.array(values, np.bool_).tobytes()
    with np.errstate(over="ignore"):
        return np.array(values, numpy_type).tobytes()


def _valid_inputs(draw: st.DrawFn, model: str) -> list[tuple[str, str, list[int]]]:
    """(name, datatype, shape) of a request ``model`` accepts."""
    if model in ("identity_plain", "identity_batch"):
        types = draw(st.lists(st.sampled_from(IDENTITY_TYPES), min_size=1, max_size=3, unique=True))
        first = 2 if model == "identity_plain" else draw(st.integers(1, 3))
        return [(f"IN_{t}", t, [first, draw(st.integers(0, 3))]) for t in types]
    if model == "pipeline":
        return [("INPUT", "FP32", [draw(st.integers(1, 3)), 16])]
    if model == "square":
        return [("Y", "INT32", [1])]
    if model == "repeat_squares":
        return [("N", "INT32", [1])]
    return [("X", "INT32", [1])]  # counter, repeat


@st.composite
def infer_requests(
    draw: st.DrawFn, models: list[str], oversize: bool = True
) -> tuple[Any, list[str]]:
    """A valid ``ModelInferRequest`` for one of ``models``, then up to three mutations: the
    request and the mutations applied (none: the request is correct)."""
    model = draw(st.sampled_from(models))
    request = service_pb2.ModelInferRequest(model_name=model)
    inputs = _valid_inputs(draw, model)
    raw_mode = any(t in ("FP16", "BF16") for _, t, _ in inputs) or draw(st.booleans())
    for name, datatype, shape in inputs:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        values = _values(draw, datatype, math.prod(shape))
        if model in DECOUPLED:
            values = [draw(st.integers(0, 3))]
        if raw_mode:
            request.raw_input_contents.append(_raw(datatype, values))
        else:
            getattr(tensor.contents, CONTENTS[datatype]).extend(values)
    if model == "counter":
        sequence_id = draw(st.integers(1, 2**63 - 1))
        request.parameters["sequence_id"].int64_param = sequence_id
        request.parameters["sequence_start"].bool_param = True
        request.parameters["sequence_end"].bool_param = True
    choices = MUTATIONS if oversize else [m for m in MUTATIONS if m != "oversize"]
    mutations = draw(st.lists(st.sampled_from(choices), max_size=3))
    for mutation in mutations:
        _mutate(draw, request, mutation, [*models, "nope", ""])
    return request, mutations


def _mutate(draw: st.DrawFn, request: Any, mutation: str, models: list[str]) -> None:
    """Spoil ``request`` in the way ``mutation`` names (``models``: what it may be sent to)."""
    tensors, raw = request.inputs, request.raw_input_contents
    i = draw(st.integers(0, len(tensors) - 1)) if tensors else None
    if mutation == "datatype" and i is not None:
        tensors[i].datatype = draw(st.sampled_from(DATATYPES))
    elif mutation == "shape" and i is not None:
        shape = draw(st.lists(dims, max_size=5))
        del tensors[i].shape[:]
        tensors[i].shape.extend(shape)
    elif mutation == "dim" and i is not None and tensors[i].shape:
        shape = list(tensors[i].shape)
        shape[draw(st.integers(0, len(shape) - 1))] = draw(dims)
        tensors[i].shape[:] = shape
    elif mutation.startswith("raw ") and i is not None and len(raw) == len(tensors):
        entry = raw[i]
        if mutation == "raw short":
            raw[i] = entry[: draw(st.integers(0, max(len(entry) - 1, 0)))]
        elif mutation == "raw long":
            raw[i] = entry + draw(st.binary(min_size=1, max_size=9))
        elif mutation == "raw random":
            raw[i] = draw(st.binary(max_size=40))
        elif mutation == "raw prefixes":  # BYTES length prefixes that may run past the end
            parts = draw(
                st.lists(
                    st.tuples(
                        st.integers(0, 8) | st.sampled_from([2**31, 2**32 - 1]),
                        st.binary(max_size=6),
                    ),
                    max_size=4,
                )
            )
            tail = draw(st.binary(max_size=3))
            raw[i] = b"".join(struct.pack("<I", n) + data for n, data in parts) + tail
        elif mutation == "raw count":
            if draw(st.booleans()):
                del raw[i]
            else:
                raw.append(draw(st.binary(max_size=8)))
    elif mutation == "contents kind" and i is not None:
        field = draw(st.sampled_from(sorted(CONTENT_VALUES)))
        count = len(tensors[i].shape) and math.prod(min(max(d, 0), 4) for d in tensors[i].shape)
        tensors[i].contents.Clear()
        values = draw(st.lists(CONTENT_VALUES[field], min_size=count, max_size=count))
        getattr(tensors[i].contents, field).extend(values)
    elif mutation == "contents count" and i is not None and tensors[i].HasField("contents"):
        field = (
            tensors[i].contents.ListFields()[0][0].name
            if tensors[i].contents.ListFields()
            else "fp32_contents"
        )
        values = getattr(tensors[i].contents, field)
        if values and draw(st.booleans()):
            del values[-1]
        else:
            values.append(draw(CONTENT_VALUES[field]))
    elif mutation == "version":
        request.model_version = draw(st.sampled_from(VERSIONS))
    elif mutation == "parameter":
        key = draw(st.sampled_from(PARAMETER_KEYS))
        request.parameters[key].Clear()
        _set_parameter(request.parameters, key, draw(parameter_values))
    elif mutation == "tensor parameter" and i is not None:
        key = draw(st.sampled_from(["shared_memory_region", "binary_data_size", "x"]))
        _set_parameter(tensors[i].parameters, key, draw(parameter_values))
    elif mutation == "output":
        output = request.outputs.add(name=draw(st.sampled_from(OUTPUT_NAMES)))
        for key in draw(st.lists(st.sampled_from(["classification", "binary_data"]), max_size=1)):
            _set_parameter(output.parameters, key, draw(parameter_values))
    elif mutation == "rename" and i is not None:
        tensors[i].name = draw(st.sampled_from(NAMES))
    elif mutation == "duplicate" and i is not None:
        tensors.add().CopyFrom(tensors[i])
        if raw:
            raw.append(raw[min(i, len(raw) - 1)])
    elif mutation == "drop" and i is not None:
        del tensors[i]
        if i < len(raw):
            del raw[i]
    elif mutation == "model":
        request.model_name = draw(st.sampled_from(models))
    elif mutation == "oversize":
        request.parameters["padding"].string_param = "p" * (LIMIT + 10)


def _good_request(value: int, request_id: str = "") -> Any:
    request = service_pb2.ModelInferRequest(model_name="square", id=request_id)
    request.inputs.add(name="Y", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([value], np.int32).tobytes())
    return request


def _square_of(response: Any) -> int:
    return int(np.frombuffer(response.raw_output_contents[0], np.int32)[0])


# ------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server(
        "--http-max-input-size", str(LIMIT), "--grpc-max-message-size", str(LIMIT)
    )
    yield served
    assert served.stop() == 0, served.text()


@pytest.fixture(scope="module")
def stub(server: Served) -> Iterator[Any]:
    with grpc.insecure_channel(server.grpc) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


_COUNTS: dict[str, int] = {}


def _count(tried: str, unit: str, happened: str) -> None:
    _COUNTS[tried] = _COUNTS.get(tried, 0) + 1
    record("Bad input", tried, f"{_COUNTS[tried]} {unit} (Hypothesis)", happened)


def _still_serving(stub: Any) -> None:
    """The server is live and answers a correct inference correctly."""
    assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live
    assert _square_of(stub.ModelInfer(_good_request(7), timeout=10)) == 49


def _timeout_set(request: Any) -> bool:
    """Whether the request carries a positive ``timeout`` (it may legitimately expire)."""
    if "timeout" not in request.parameters:
        return False
    parameter = request.parameters["timeout"]
    which = parameter.WhichOneof("parameter_choice")
    value = getattr(parameter, which) if which else 0
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ------------------------------------------------------------------------ gRPC unary


def _check_refusal(request: Any, exc: grpc.RpcError, *, expected: bool = True) -> None:
    """A refused ModelInfer: a status the request explains, with a message (``expected``:
    whether the request was wrong at all)."""
    code, details = exc.code(), exc.details() or ""
    assert expected, (code, details)
    if request.ByteSize() > LIMIT:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    elif code == grpc.StatusCode.UNAVAILABLE and _timeout_set(request):
        pass  # the request's own timeout expired
    else:
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (
            code,
            details,
        )
    assert details, code


def _check_answer(request: Any, response: Any) -> None:
    """A correct request's response: identity models echo their inputs byte for byte."""
    if request.model_name.startswith("identity") and request.raw_input_contents:
        echoed = dict(
            zip((o.name for o in response.outputs), response.raw_output_contents, strict=True)
        )
        for tensor, data in zip(request.inputs, request.raw_input_contents, strict=True):
            assert echoed["OUT_" + tensor.name[3:]] == data, tensor.name


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=infer_requests(MODELS_UNARY))
def test_malformed_grpc_infer_requests_get_invalid_argument(
    stub: Any, case: tuple[Any, list[str]]
) -> None:
    """Correct ModelInferRequests spoiled up to three ways (bad datatypes, negative and
    2**63-1 dims, raw contents too short, too long or too many, BYTES with bad prefixes, typed
    contents of the wrong kind or count, unknown models and versions, wrongly typed parameters,
    messages over the limit; NaNs and non-UTF-8 BYTES in the data): OK or INVALID_ARGUMENT /
    NOT_FOUND / RESOURCE_EXHAUSTED with a message, never INTERNAL or UNKNOWN; unspoiled ones
    are answered right; the server then still answers a correct request."""
    request, mutations = case
    try:
        response = stub.ModelInfer(request, timeout=20)
    except grpc.RpcError as exc:
        _check_refusal(request, exc, expected=bool(mutations) or request.model_name in DECOUPLED)
    else:
        assert request.ByteSize() <= LIMIT
        assert request.model_name not in DECOUPLED
        if not mutations:
            _check_answer(request, response)
    _still_serving(stub)
    _count(
        "Malformed ModelInferRequests over gRPC (bad datatypes, dims up to 2**63-1, raw contents "
        "of the wrong length or count, wrong typed contents, bad BYTES prefixes, NaNs, unknown "
        "models/versions, wrongly typed parameters, over --grpc-max-message-size)",
        "requests",
        "each OK, INVALID_ARGUMENT, NOT_FOUND or (oversized) RESOURCE_EXHAUSTED with a message; "
        "never INTERNAL/UNKNOWN; unspoiled ones answered right; the server then answers a "
        "correct inference",
    )


def test_grpc_superscript_version_is_invalid_argument(stub: Any) -> None:
    """A model_version of "²" (a Unicode digit that int() refuses) is INVALID_ARGUMENT,
    not INTERNAL."""
    request = _good_request(3)
    request.model_version = "²"
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    _still_serving(stub)


def test_grpc_empty_tensor_with_huge_dims_is_invalid_argument(stub: Any) -> None:
    """A raw FP32 input of shape [2, 0, 2**40, 2**40] (no elements, each dim within the
    2**40 limit, but numpy cannot shape an array so) is INVALID_ARGUMENT, not INTERNAL."""
    request = service_pb2.ModelInferRequest(model_name="identity_plain")
    request.inputs.add(name="IN_FP32", datatype="FP32", shape=[2, 0, 2**40, 2**40])
    request.raw_input_contents.append(b"")
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    _still_serving(stub)


def test_grpc_non_utf8_string_field_is_invalid_argument(server: Served, stub: Any) -> None:
    """A ModelInferRequest whose id holds invalid UTF-8 (the message cannot be parsed)
    is INVALID_ARGUMENT with a message, not UNKNOWN ("Unexpected DecodeError"); on a stream
    the same message ends the whole stream with UNKNOWN."""
    request = _good_request(3, "AAAA")
    data = request.SerializeToString().replace(b"AAAA", b"\xff\xfe\xfd\xfc")
    with grpc.insecure_channel(server.grpc) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            infer(data, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
        refused.value.code(),
        refused.value.details(),
    )
    _still_serving(stub)


def test_oversized_grpc_message_is_resource_exhausted(stub: Any) -> None:
    """A ModelInferRequest larger than --grpc-max-message-size is RESOURCE_EXHAUSTED, and the
    same channel goes on serving."""
    request = _good_request(3)
    request.raw_input_contents[0] += b"\0" * (LIMIT + 1)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.details()
    _still_serving(stub)


# ------------------------------------------------------------------------ gRPC streams


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=st.lists(
        st.one_of(
            st.integers(-1000, 1000).map(lambda v: ("good", v)),
            infer_requests(MODELS_STREAM, oversize=False).map(lambda c: ("fuzzed", c)),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_malformed_requests_on_a_stream_fail_alone(stub: Any, items: list[tuple[str, Any]]) -> None:
    """A ModelStreamInfer stream mixing malformed requests with good ones: each request gets
    exactly one response or one error_message, the good ones the right answer, and the stream
    runs to its end."""
    requests, expected, correct = [], {}, {}
    for i, (kind, item) in enumerate(items):
        request_id = f"{kind}-{i}"
        if kind == "good":
            requests.append(_good_request(item, request_id))
            expected[request_id] = item * item
        else:
            request, mutations = item
            request.id = request_id
            requests.append(request)
            if not mutations:
                correct[request_id] = request
    try:
        replies = list(stub.ModelStreamInfer(iter(requests), timeout=30))
    except grpc.RpcError as exc:
        pytest.fail(f"the stream failed: {exc.code()} {exc.details()}")
    seen = collections.Counter(reply.infer_response.id for reply in replies)
    assert seen == collections.Counter(r.id for r in requests), seen
    for reply in replies:
        request_id = reply.infer_response.id
        if request_id in expected:
            assert not reply.error_message, reply.error_message
            assert _square_of(reply.infer_response) == expected[request_id]
        elif request_id in correct:
            assert not reply.error_message, reply.error_message
            _check_answer(correct[request_id], reply.infer_response)
        elif reply.error_message:
            assert not reply.error_message.startswith("internal error"), reply.error_message
    _still_serving(stub)
    _count(
        "ModelStreamInfer streams mixing malformed requests with good ones",
        "streams",
        "each request one response or one error_message (never an internal error), good ones "
        "answered right, the stream runs to its end",
    )


# ------------------------------------------------------------------------ model configs

CONFIG_MODELS = ("square", "repeat", "repeat_squares", "pipeline", "preprocess", "classify")
CONFIG_MODELS += ("segment",)
JUNK = [
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    '"',
    '""',
    '"x"',
    "-1",
    "0",
    "-9223372036854775809",
    "9223372036854775808",
    "99999999999999999999999",
    "1.5",
    "nan",
    "-inf",
    "true",
    "TYPE_NOPE",
    "KIND_FOO",
    "TYPE_FP32",
    "max_batch_size",
    "input",
    "nope_field",
    "#",
    "<",
    "'",
    "\\",
]
SNIPPETS = [
    "max_batch_size: -4",
    "max_batch_size: 4",
    "max_batch_size: 9223372036854775807",
    'name: "other"',
    'platform: "tensorflow_savedmodel"',
    'platform: "ensemble"',
    'backend: "python"',
    "instance_group [ { kind: KIND_GPU count: -3 } ]",
    "instance_group [ { kind: KIND_CPU count: 0 } ]",
    "instance_group [ { count: 2147483647 } ]",
    "dynamic_batching { max_queue_delay_microseconds: 18446744073709551615 }",
    "dynamic_batching { preferred_batch_size: [ -2, 0 ] }",
    "dynamic_batching { default_queue_policy { timeout_action: DELAY max_queue_size: -1 } }",
    "version_policy { specific { versions: [ 7, -1 ] } }",
    "version_policy { latest { num_versions: 0 } }",
    "sequence_batching { }",
    "sequence_batching { direct { } oldest { } }",
    "model_transaction_policy { decoupled: true }",
    'parameters { key: "a" value: { string_value: "b" } }',
    "optimization { }",
    "model_warmup [ { } ]",
    "response_cache { enable: true }",
    'default_model_filename: "../../etc/passwd"',
    'default_model_filename: "nope.py"',
    'input [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]',
    'input [ { name: "" data_type: TYPE_INVALID dims: [ ] } ]',
    'output [ { name: "Z" data_type: TYPE_STRING dims: [ -2 ] } ]',
    'input [ { name: "W" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ 7 ] } } ]',
    "ensemble_scheduling { }",
    'ensemble_scheduling { step [ { model_name: "repeat_squares" } ] }',
    'ensemble_scheduling { step [ { model_name: "square" input_map { key: "Y" value: "Z" } '
    'output_map { key: "Z" value: "Z" } } ] }',
]
SUBSTITUTIONS = [
    (r"dims: \[[^\]]*\]", ["dims: [ -5 ]", "dims: [ 0 ]", "dims: [ 1099511627776 ]"]),
    (r"dims: \[[^\]]*\]", ["dims: [ 9223372036854775807 ]", "dims: [ -1, -1 ]", "dims: [ ]"]),
    (r"dims: \[[^\]]*\]", ['dims: "1"', "dims: [ 1.5 ]", "dims: [ 1, 2, 3, 4, 5, 6, 7, 8, 9 ]"]),
    (r"TYPE_\w+", ["TYPE_NOPE", "TYPE_INVALID", "TYPE_BF16", "TYPE_STRING", "3", '"TYPE_FP32"']),
    (r"max_batch_size: \d+", ["max_batch_size: -1", 'max_batch_size: "8"', "max_batch_size"]),
    (r'value: "\w+"', ['value: "nowhere"', 'value: "N"', 'value: "SQUARE"', 'value: ""']),
    (r'key: "\w+"', ['key: "NOPE"', 'key: ""', 'key: "Y"', 'key: "X"']),
    (r'model_name: "\w+"', ['model_name: "nope"', 'model_name: "repeat_squares"']),
    (r'model_name: "\w+"', ['model_name: "pipeline"', 'model_name: ""']),
    (r'name: "\w+"', ['name: "other"', 'name: ""', 'name: "a b"']),
    (r"decoupled: true", ["decoupled: false", "decoupled: 2", "decoupled: yes"]),
    (r"enable: true", ["enable: 1", "enable: maybe"]),
    (r"max_inflight_requests: \d+", ["max_inflight_requests: -1"]),
]
_TOKENS = re.compile(r'"[^"\n]*"|[\w.+-]+|\S')


@st.composite
def mutated_configs(draw: st.DrawFn, text: str) -> bytes:
    """``text`` (a config.pbtxt) with one to three mutations."""
    data = text
    for _ in range(draw(st.integers(1, 3))):
        how = draw(
            st.sampled_from(
                ["delete line", "duplicate line", "token", "snippet", "substitute", "bytes"]
            )
        )
        lines = data.splitlines()
        if how in ("delete line", "duplicate line") and lines:
            i = draw(st.integers(0, len(lines) - 1))
            lines[i : i + 1] = [] if how == "delete line" else [lines[i], lines[i]]
            data = "\n".join(lines)
        elif how == "token":
            tokens = list(_TOKENS.finditer(data))
            if not tokens:
                continue
            token = tokens[draw(st.integers(0, len(tokens) - 1))]
            action = draw(st.sampled_from(["delete", "duplicate", "replace", "insert"]))
            junk = draw(st.sampled_from(JUNK))
            new = {
                "delete": "",
                "duplicate": token.group() * 2,
                "replace": junk,
                "insert": f"{junk} {token.group()}",
            }[action]
            data = data[: token.start()] + new + data[token.end() :]
        elif how == "snippet":
            data = data + "\n" + draw(st.sampled_from(SNIPPETS)) + "\n"
        elif how == "substitute":
            pattern, choices = draw(st.sampled_from(SUBSTITUTIONS))
            matches = list(re.finditer(pattern, data))
            if not matches:
                continue
            match = matches[draw(st.integers(0, len(matches) - 1))]
            data = data[: match.start()] + draw(st.sampled_from(choices)) + data[match.end() :]
    encoded = data.encode()
    if draw(st.integers(0, 9)) == 0:  # non-UTF-8 bytes somewhere in the file
        at = draw(st.integers(0, len(encoded)))
        encoded = (
            encoded[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\x80\x80"])) + encoded[at:]
        )
    return encoded


def _repository(target: str, config: bytes) -> tuple[Path, Path]:
    """A fresh repository of CONFIG_MODELS with ``target``'s config.pbtxt replaced."""
    root = Path(tempfile.mkdtemp(prefix="orchestrion-config-fuzz-"))
    for name in CONFIG_MODELS:
        shutil.copytree(MODELS / name, root / name)
    path = root / target / "config.pbtxt"
    path.write_bytes(config)
    return root, path


_WHERE_IN_FILE = re.compile(
    r"config\.pbtxt(:\d+:\d+ ?: | ?: field [\w.\[\]]+: | ?: cannot be read: | \(model '\w+'\): "
    r"|: (model|ensemble) '\w+'|: .*out of range)"
)


def _check_load_error(exc: BaseException, root: Path) -> None:
    """A documented load error in which every problem says where it is: a config.pbtxt with
    the line or the field (or a model.py), or, for validation and an ensemble's wiring, the
    model or ensemble by name."""
    assert type(exc) in (ConfigError, ModelLoadError), repr(exc)
    assert str(exc).strip(), repr(exc)
    lines = exc.errors if isinstance(exc, ConfigError) else tuple(str(exc).splitlines())
    for line in lines:
        assert str(root) in line or any(f"'{n}'" in line for n in CONFIG_MODELS), line
        if "config.pbtxt" in line:
            assert _WHERE_IN_FILE.search(line), line


TEXTS = {name: (MODELS / name / "config.pbtxt").read_text() for name in CONFIG_MODELS}


@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target_config=st.sampled_from(["square", "repeat_squares", "pipeline"]).flatmap(
        lambda name: st.tuples(st.just(name), mutated_configs(TEXTS[name]))
    )
)
async def test_malformed_configs_load_or_raise_config_error(
    target_config: tuple[str, bytes],
) -> None:
    """A model (square) or an ensemble (repeat_squares, pipeline) whose config.pbtxt has
    lines deleted or duplicated, tokens replaced by junk, wrong enums, huge or negative dims,
    broken input_map/output_map, cycles or non-UTF-8 bytes: open_server either serves or raises
    ConfigError / ModelLoadError naming the file (or the ensemble), never anything else."""
    target, config = target_config
    root, _ = _repository(target, config)
    names: list[str] = []
    try:
        async with orchestrion.open_server(model_repository=root) as server:
            names = server.model_names()
    except BaseException as exc:
        _check_load_error(exc, root)
    else:
        assert target in names, names
    finally:
        shutil.rmtree(root)
    _count(
        "Malformed config.pbtxt (deleted/duplicated lines, junk tokens, wrong enums, huge or "
        "negative dims, broken input_map/output_map, cycles, non-UTF-8 bytes) loaded in-process",
        "configs",
        "each loads, or open_server raises ConfigError/ModelLoadError naming the file or the "
        "ensemble; never another exception",
    )


async def test_config_validation_errors_name_the_file(tmp_path: Path) -> None:
    """A config.pbtxt that parses but breaks a rule (negative dims) is a ConfigError
    that names the file and the field, as ConfigError's documentation promises."""
    shutil.copytree(MODELS / "square", tmp_path / "square")
    path = tmp_path / "square" / "config.pbtxt"
    path.write_text(TEXTS["square"].replace("dims: [ 1 ] } ]\n", "dims: [ -5 ] } ]\n"))
    with pytest.raises(ConfigError) as refused:
        async with orchestrion.open_server(model_repository=tmp_path):
            pass
    assert "dims" in str(refused.value)
    assert str(path) in str(refused.value), str(refused.value)


async def test_enum_field_set_to_a_huge_number_is_a_config_error(tmp_path: Path) -> None:
    """``data_type: 2147483648`` (an enum set to a number beyond int32) is a
    ConfigError naming the file, not a bare ValueError("Value out of range") from protobuf's
    text parser inside an ExceptionGroup."""
    shutil.copytree(MODELS / "square", tmp_path / "square")
    path = tmp_path / "square" / "config.pbtxt"
    path.write_text(TEXTS["square"].replace("data_type: TYPE_INT32", "data_type: 2147483648", 1))
    with pytest.raises(ConfigError) as refused:
        async with orchestrion.open_server(model_repository=tmp_path):
            pass
    assert str(path) in str(refused.value), str(refused.value)


def test_validate_cli_enum_field_set_to_a_huge_number(tmp_path: Path) -> None:
    """`orchestrion validate` on a config with ``data_type: 2147483648`` reports the
    file with exit status 1, not a traceback."""
    shutil.copytree(MODELS / "square", tmp_path / "square")
    path = tmp_path / "square" / "config.pbtxt"
    path.write_text(TEXTS["square"].replace("data_type: TYPE_INT32", "data_type: 2147483648", 1))
    done = subprocess.run(
        [sys.executable, "-m", "orchestrion", "validate", "--model-repository", str(tmp_path)],
        capture_output=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "300"},
    )
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert "Traceback" not in output, output[-2000:]
    assert done.returncode == 1, output[-2000:]
    assert str(path) in output, output[-2000:]


_LOAD_IN_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
import trio, orchestrion
async def main():
    async with orchestrion.open_server(model_repository=sys.argv[1]):
        pass
try:
    trio.run(main)
except BaseException as exc:
    print(f"{type(exc).__name__}: {exc}")
else:
    print("loaded")
"""


def _load_in_child(root: Path) -> str:
    """open_server on ``root`` in a child process with 8 GiB of address space (so that a
    config that asks for too much memory fails there, not here): what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_CHILD, str(root)],
        capture_output=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return (done.stdout + done.stderr).decode(errors="replace")


def test_huge_instance_count_is_a_config_error(tmp_path: Path) -> None:
    """instance_group count 2147483647 is refused as a ConfigError naming the field,
    rather than the server building instances until the memory runs out (a MemoryError in an
    ExceptionGroup here; without a memory limit the process is killed)."""
    shutil.copytree(MODELS / "square", tmp_path / "square")
    path = tmp_path / "square" / "config.pbtxt"
    path.write_text(TEXTS["square"] + "instance_group [ { count: 2147483647 } ]\n")
    output = _load_in_child(tmp_path)
    assert output.startswith("ConfigError: "), output[-3000:]
    assert "instance_group" in output, output[-3000:]


def test_jitted_model_with_huge_dims_is_a_load_error(tmp_path: Path) -> None:
    """A jitted model whose config declares dims [1099511627776] cannot be warmed up:
    open_server raises ModelLoadError (or ConfigError) naming the model, not an
    ExceptionGroup holding an UnboundLocalError from the warm-up's error handler."""
    shutil.copytree(MODELS / "classify", tmp_path / "classify")
    path = tmp_path / "classify" / "config.pbtxt"
    path.write_text(TEXTS["classify"].replace("dims: [ 16 ]", "dims: [ 1099511627776 ]"))
    output = _load_in_child(tmp_path)
    assert output.startswith(("ModelLoadError: ", "ConfigError: ")), output[-3000:]
    assert "classify" in output, output[-3000:]


BROKEN_CONFIGS = {
    "syntax error": ("square", b'name: "square"\nmax_batch_size: 0\ninput [ { name: "Y" '),
    "unknown enum": (
        "square",
        TEXTS["square"].replace("TYPE_INT32", "TYPE_NOPE", 1).encode(),
    ),
    "non-UTF-8 bytes": ("square", TEXTS["square"].encode().replace(b"Y * Y", b"\xff\xfe")),
    "negative dims": ("square", TEXTS["square"].replace("[ 1 ]", "[ -7 ]").encode()),
    "ensemble cycle": (
        "repeat_squares",
        TEXTS["repeat_squares"]
        .replace('model_name: "square"', 'model_name: "repeat_squares"')
        .encode(),
    ),
    "broken input_map": (
        "pipeline",
        TEXTS["pipeline"].replace('value: "pre"', 'value: "nowhere"', 1).encode(),
    ),
}


def test_validate_cli_reports_broken_repositories() -> None:
    """`orchestrion validate` on repositories with a broken config exits non-zero, names the
    file or ensemble, and prints no traceback."""
    for case, (target, config) in BROKEN_CONFIGS.items():
        root, path = _repository(target, config)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "orchestrion", "validate", "--model-repository", str(root)],
                capture_output=True,
                timeout=60,
                env={**os.environ, "COLUMNS": "300"},
            )
        finally:
            shutil.rmtree(root)
        output = (done.stdout + done.stderr).decode(errors="replace")
        assert done.returncode != 0, (case, output)
        assert "Traceback" not in output, (case, output)
        assert str(path) in output or f"'{target}'" in output, (case, output)
    record(
        "Bad input",
        "`orchestrion validate` on repositories with a broken config (syntax error, unknown "
        "enum, non-UTF-8 bytes, negative dims, ensemble cycle, broken input_map)",
        f"{len(BROKEN_CONFIGS)} repositories",
        "each a non-zero exit naming the file or ensemble, no traceback",
    )


# ------------------------------------------------------------------------ HTTP extras


def _check_http(status: int, body: bytes, server: Served) -> None:
    assert status in (200, 400, 404, 413), (status, body[:300])
    if status != 200:
        assert json.loads(body)["error"], body[:300]
    live, _ = get(server.http, "/v2/health/live")
    assert live == 200
    status, reply = post(server.http, "/v2/models/square/infer", _SQUARE_BODY)
    assert status == 200, reply
    assert json.loads(reply)["outputs"][0]["data"] == [49]


_SQUARE_BODY = json.dumps(
    {"inputs": [{"name": "Y", "datatype": "INT32", "shape": [1], "data": [7]}]}
).encode()


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(["identity_batch", "pipeline", "square"]),
    name=st.sampled_from(["IN_FP32", "IN_FP64", "IN_INT32", "IN_BOOL", "IN_BYTES", "INPUT", "Y"]),
    datatype=st.sampled_from(["FP32", "FP64", "INT32", "BOOL", "BYTES", "FP16"]),
    tokens=st.lists(
        st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-0", "1.5", "3", "nan", "inf"]),
        min_size=1,
        max_size=16,
    ),
)
def test_http_nan_and_infinity_tokens(
    server: Served, model: str, name: str, datatype: str, tokens: list[str]
) -> None:
    """JSON data with NaN / Infinity tokens (not JSON, but Python's parser takes them) or
    1e400: a 200 (the floats echoed) or a JSON 400, never a 500."""
    shape = [1, len(tokens)] if model != "square" else [len(tokens)]
    body = (
        f'{{"inputs": [{{"name": "{name}", "datatype": "{datatype}", "shape": {shape}, '
        f'"data": [{", ".join(tokens)}]}}]}}'
    ).encode()
    status, reply = post(server.http, f"/v2/models/{model}/infer", body)
    _check_http(status, reply, server)
    _count(
        "HTTP JSON data with NaN/Infinity/1e400 tokens",
        "requests",
        "each a 200 (NaN/Infinity accepted and echoed as such) or a JSON 400; the server "
        "keeps serving",
    )


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    junk=st.binary(min_size=1, max_size=4).filter(lambda b: not _is_utf8(b)),
    where=st.sampled_from(["name", "id", "datatype", "data", "key", "outside"]),
    binary=st.booleans(),
)
def test_http_non_utf8_json_header(server: Served, junk: bytes, where: str, binary: bool) -> None:
    """Invalid UTF-8 inside the JSON header (in a string, a key, or between tokens), with and
    without binary tensor data after it: a JSON 400."""
    marker = "@@"
    if binary and where == "data":
        where = "key"  # binary data has no JSON "data" string to spoil
    document: dict[str, Any] = {
        "id": "id" + marker if where == "id" else "ok",
        "inputs": [
            {
                "name": "IN_BYTES" + (marker if where == "name" else ""),
                "datatype": "BYTES" + (marker if where == "datatype" else ""),
                "shape": [1, 1],
                **(
                    {"parameters": {"binary_data_size": 7}}
                    if binary
                    else {"data": ["a" + (marker if where == "data" else "")]}
                ),
            }
        ],
    }
    if where == "key":
        document["k" + marker] = 1
    header = json.dumps(document).encode()
    if where == "outside":
        header = header[:-1] + b" " + marker.encode() + b"}"
    header = header.replace(marker.encode(), junk)
    headers = {}
    body = header
    if binary:
        body += struct.pack("<I", 3) + b"abc"
        headers["Inference-Header-Content-Length"] = str(len(header))
    status, reply = post(server.http, "/v2/models/identity_batch/infer", body, headers)
    assert status == 400, (status, reply[:300])
    _check_http(status, reply, server)
    _count(
        "Invalid UTF-8 bytes inside the JSON header of an HTTP infer request",
        "requests",
        "each a JSON 400; the server keeps serving",
    )


def _is_utf8(data: bytes) -> bool:
    """Whether ``data`` decodes as UTF-8, counting encoded lone surrogates (which Python's
    json.loads lets through: see test_http_lone_surrogate_in_bytes_data_is_400) as UTF-8."""
    try:
        data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    elements=st.lists(
        st.tuples(st.integers(0, 10) | st.sampled_from([2**31, 2**32 - 1]), st.binary(max_size=10)),
        min_size=1,
        max_size=4,
    ),
    tail=st.binary(max_size=3),
    declared=st.integers(1, 4),
)
def test_http_bytes_length_prefixes_past_the_end(
    server: Served, elements: list[tuple[int, bytes]], tail: bytes, declared: int
) -> None:
    """Binary BYTES tensors whose 4-byte length prefixes claim more (or fewer) bytes than
    follow, or whose element count differs from the shape: a JSON 400 (200 when consistent)."""
    data = b"".join(struct.pack("<I", n) + payload for n, payload in elements) + tail
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "IN_BYTES",
                    "datatype": "BYTES",
                    "shape": [1, declared],
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "outputs": [{"name": "OUT_BYTES", "parameters": {"binary_data": True}}],
        }
    ).encode()
    consistent = _bytes_parse(data, declared)
    status, reply = post(
        server.http,
        "/v2/models/identity_batch/infer",
        header + data,
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == (200 if consistent else 400), (status, reply[:300])
    if consistent:  # echoed as binary data, byte for byte
        assert reply.endswith(data), (reply[:300], data)
    _check_http(status, reply, server)
    _count(
        "HTTP binary BYTES tensors whose length prefixes run past the end (or fall short)",
        "requests",
        "each a JSON 400 (a 200 when consistent); the server keeps serving",
    )


def _bytes_parse(data: bytes, count: int) -> bool:
    """Whether ``data`` is exactly ``count`` BYTES elements with 4-byte length prefixes."""
    offset = 0
    for _ in range(count):
        if offset + 4 > len(data):
            return False
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4 + length
    return offset == len(data)


def test_http_body_over_max_input_size_is_413(server: Served) -> None:
    """A body larger than --http-max-input-size (as sent, or once gzip-inflated) is a JSON
    413, and the server keeps serving."""
    document = {
        "inputs": [
            {"name": "IN_FP32", "datatype": "FP32", "shape": [1, 20000], "data": [0.5] * 20000}
        ]
    }
    plain = json.dumps(document).encode()
    assert len(plain) > LIMIT
    packed = gzip.compress(plain)
    assert len(packed) < LIMIT
    for body, headers in ((plain, {}), (packed, {"Content-Encoding": "gzip"})):
        status, reply = post(server.http, "/v2/models/identity_batch/infer", body, headers)
        assert status == 413, (headers, status, reply[:300])
        _check_http(status, reply, server)
    record(
        "Bad input",
        "HTTP bodies over --http-max-input-size (plain, and a small gzip body inflating past it)",
        "2 requests",
        "each a JSON 413; the server keeps serving",
    )


def test_http_superscript_version_is_400(server: Served) -> None:
    """/v2/models/square/versions/%C2%B2/infer (version "²") is a JSON 400, not a 500."""
    status, reply = post(server.http, "/v2/models/square/versions/%C2%B2/infer", _SQUARE_BODY)
    assert status == 400, (status, reply[:300])
    _check_http(status, reply, server)


def test_http_empty_tensor_with_huge_dims_is_400(server: Served) -> None:
    """A JSON input of shape [1, 0, 2**40, 2**40] with no data (each dim within the
    limit, the product of the others too large for numpy) is a JSON 400, not a 500."""
    document = {
        "inputs": [
            {"name": "IN_FP32", "datatype": "FP32", "shape": [1, 0, 2**40, 2**40], "data": []}
        ]
    }
    status, reply = post(
        server.http, "/v2/models/identity_batch/infer", json.dumps(document).encode()
    )
    assert status == 400, (status, reply[:300])
    _check_http(status, reply, server)


def test_http_lone_surrogate_in_bytes_data_is_400(server: Served) -> None:
    """A BYTES element written with the JSON escape \\ud800 (a lone surrogate: valid
    JSON syntax, not encodable as UTF-8) is a JSON 400, not a 500."""
    body = b'{"inputs": [{"name": "IN_BYTES", "datatype": "BYTES", "shape": [1, 1], "data": ["a\\ud800"]}]}'
    status, reply = post(server.http, "/v2/models/identity_batch/infer", body)
    assert status == 400, (status, reply[:300])
    _check_http(status, reply, server)
