"""The KServe v2 wire formats (pure): tensors as bytes, HTTP bodies, gRPC messages, errors."""

from __future__ import annotations

import json
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.grpc import service_pb2

from orchestrion.protocols import (
    DataType,
    InferenceError,
    InferResponse,
    InvalidRequestError,
    ModelConfig,
    ModelControlError,
    ModelNotFoundError,
    QueueFullError,
    TensorConfig,
    parse_model_config,
)
from orchestrion.protocols._json_objects import Nested, load_json_object
from orchestrion.protocols._kserve_documents import model_config_json, model_metadata
from orchestrion.protocols._kserve_grpc import (
    decode_grpc_request,
    encode_grpc_response,
    serialized_grpc_response,
)
from orchestrion.protocols._kserve_http import (
    decode_http_request,
    decode_raw_request,
    encode_http_response,
)
from orchestrion.protocols._kserve_status import grpc_status, http_status
from orchestrion.protocols._kserve_tensors import (
    element_count,
    tensor_from_bytes,
    tensor_to_bytes,
)

NUMERIC = [t for t in DataType if t is not DataType.BYTES]


@given(
    st.sampled_from(NUMERIC).flatmap(
        lambda t: st.tuples(
            st.just(t),
            hnp.arrays(
                t.numpy_dtype if t is not DataType.BF16 else np.dtype(np.uint16),
                hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
            ),
        )
    )
)
def test_numeric_tensors_round_trip_through_bytes(case: tuple[DataType, Any]) -> None:
    """Any numeric tensor comes back bit for bit from its raw bytes."""
    dtype, array = case
    if dtype is DataType.BF16:
        array = array.view(ml_dtypes.bfloat16)
    if dtype is DataType.BOOL:
        array = array.astype(np.bool_)
    back = tensor_from_bytes(bytes(tensor_to_bytes(array)), dtype, list(array.shape), "X")
    assert back.dtype == dtype.numpy_dtype
    assert back.shape == array.shape
    assert back.tobytes() == array.tobytes()


@given(st.lists(st.binary(max_size=20), min_size=1, max_size=12))
def test_bytes_tensors_round_trip_with_length_prefixes(items: list[bytes]) -> None:
    """BYTES elements travel as 4-byte little-endian lengths and come back unchanged."""
    array = np.empty(len(items), dtype=object)
    array[:] = items
    raw = bytes(tensor_to_bytes(array))
    assert raw[:4] == struct.pack("<I", len(items[0]))
    back = tensor_from_bytes(raw, DataType.BYTES, [len(items)], "S")
    assert back.tolist() == items


@pytest.mark.parametrize(
    ("raw", "count", "message"),
    [
        (b"\x05\x00\x00\x00ab", 1, "claims 5 bytes, only 2 remain"),
        (b"\x01\x00\x00\x00a", 2, "5 bytes cannot hold 2 BYTES elements"),
        (b"\x04\x00\x00\x00abcd", 2, "ends after 1 of 2 elements"),
        (b"\x01\x00\x00\x00ab", 1, "1 bytes left over"),
    ],
)
def test_lying_bytes_prefixes_are_invalid_requests(raw: bytes, count: int, message: str) -> None:
    """A BYTES buffer whose length prefixes do not add up is refused, saying how."""
    with pytest.raises(InvalidRequestError, match=message):
        tensor_from_bytes(raw, DataType.BYTES, [count], "S")


def test_byte_size_and_bool_values_are_checked() -> None:
    """A buffer of the wrong size, or BOOL bytes other than 0/1, are refused."""
    with pytest.raises(InvalidRequestError, match="unexpected total byte size 7"):
        tensor_from_bytes(b"\x00" * 7, DataType.FP32, [2], "X")
    with pytest.raises(InvalidRequestError, match="BOOL elements must be bytes 0 or 1"):
        tensor_from_bytes(b"\x00\x02", DataType.BOOL, [2], "B")
    with pytest.raises(InvalidRequestError, match="dims must be non-negative"):
        tensor_from_bytes(b"", DataType.FP32, [-1], "X")


def _http(document: dict[str, Any], binary: bytes = b"") -> Any:
    header = json.dumps(document).encode()
    return decode_http_request("m", "", header + binary, len(header) if binary else None)


def test_http_json_and_binary_inputs_decode() -> None:
    """JSON data (flat or nested) and binary data decode to the declared dtype and shape."""
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    request = _http(
        {
            "id": "r1",
            "inputs": [
                {"name": "A", "datatype": "INT32", "shape": [2, 3], "data": [[0, 1, 2], [3, 4, 5]]},
                {
                    "name": "B",
                    "datatype": "INT32",
                    "shape": [2, 3],
                    "parameters": {"binary_data_size": 24},
                },
            ],
            "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
            "parameters": {
                "sequence_id": 9,
                "sequence_start": True,
                "priority": 2,
                "timeout": 1500000,
                "custom": "yes",
            },
        },
        x.tobytes(),
    )
    assert request.inputs["A"].tolist() == x.tolist()
    assert request.inputs["B"].tolist() == x.tolist()
    options = request.options
    assert options.request_id == "r1"
    assert options.outputs == frozenset({"Y"})
    assert request.binary_outputs == {"Y": True}
    assert (options.sequence_id, options.sequence_start, options.priority) == (9, True, 2)
    assert options.timeout == pytest.approx(1.5)
    assert options.parameters == {"custom": "yes"}


@pytest.mark.parametrize(
    ("document", "binary", "message"),
    [
        ({"inputs": {}}, b"", "needs an 'inputs' array"),
        (
            {"inputs": [{"name": "A", "datatype": "FP33", "shape": [1], "data": [1]}]},
            b"",
            "invalid datatype 'FP33'",
        ),
        (
            {"inputs": [{"name": "A", "datatype": "FP32", "shape": [2], "data": [1]}]},
            b"",
            "unexpected number of elements 1",
        ),
        (
            {"inputs": [{"name": "A", "datatype": "INT8", "shape": [1], "data": [300]}]},
            b"",
            "does not fit in INT8",
        ),
        (
            {"inputs": [{"name": "A", "datatype": "INT8", "shape": [1], "data": [1.5]}]},
            b"",
            "must be integers",
        ),
        (
            {"inputs": [{"name": "A", "datatype": "FP16", "shape": [1], "data": [1.0]}]},
            b"",
            "only be sent as binary data",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "A",
                        "datatype": "FP32",
                        "shape": [1],
                        "parameters": {"binary_data_size": 8},
                    }
                ]
            },
            b"\x00" * 4,
            "runs past the end of the body",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "A",
                        "datatype": "FP32",
                        "shape": [1],
                        "parameters": {"binary_data_size": 4},
                    }
                ]
            },
            b"\x00" * 8,
            "4 bytes of binary data follow",
        ),
        (
            {
                "inputs": [
                    {"name": "A", "datatype": "FP32", "shape": [1], "data": [1]},
                    {"name": "A", "datatype": "FP32", "shape": [1], "data": [1]},
                ]
            },
            b"",
            "given twice",
        ),
        ({"inputs": [], "parameters": {"priority": -1}}, b"", "priority must be"),
        (
            {
                "inputs": [
                    {
                        "name": "A",
                        "datatype": "FP32",
                        "shape": [1],
                        "data": [1],
                        "parameters": {"shared_memory_region": "r"},
                    }
                ]
            },
            b"",
            "Input must set only one of the following fields.*But set 'data' "
            "'shared_memory_region'",
        ),
        (
            {"inputs": [{"name": "A", "datatype": "FP32", "shape": [1]}]},
            b"",
            "But no field is set",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "A",
                        "datatype": "FP32",
                        "shape": [1],
                        "parameters": {"shared_memory_region": "r"},
                    }
                ]
            },
            b"",
            "'shared_memory_byte_size' must be specified along with 'shared_memory_region'",
        ),
        (
            {"inputs": [], "outputs": [{"name": "Y", "parameters": {"shared_memory_offset": 4}}]},
            b"",
            "'shared_memory_offset' can not be specified without 'shared_memory_region'",
        ),
        (
            {
                "inputs": [],
                "outputs": [
                    {
                        "name": "Y",
                        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": -1},
                    }
                ],
            },
            b"",
            "invalid value for 'shared_memory_byte_size'",
        ),
        (
            {
                "inputs": [],
                "outputs": [
                    {
                        "name": "Y",
                        "parameters": {
                            "shared_memory_region": "r",
                            "shared_memory_byte_size": 8,
                            "binary_data": True,
                        },
                    }
                ],
            },
            b"",
            "Output can't set both 'shared_memory_region' and 'binary_data'",
        ),
        (
            {"inputs": [], "outputs": [{"name": "Y", "parameters": {"classification": -3}}]},
            b"",
            "invalid value for 'classification'",
        ),
        (
            {"inputs": [], "outputs": [{"name": "Y"}, {"name": "Y"}]},
            b"",
            "output 'Y' already exists in request",
        ),
    ],
)
def test_malformed_http_bodies_say_what_is_wrong(
    document: dict[str, Any], binary: bytes, message: str
) -> None:
    """Each malformed request is an InvalidRequestError naming the problem."""
    with pytest.raises(InvalidRequestError, match=message):
        _http(document, binary)


def test_header_length_past_the_body_is_refused() -> None:
    """An Inference-Header-Content-Length larger than the body is a clear error."""
    with pytest.raises(InvalidRequestError, match="larger than the body"):
        decode_http_request("m", "", b"{}", 10)


def test_http_response_mixes_json_and_binary_outputs() -> None:
    """Outputs asked as binary follow the JSON header; the others are JSON data."""
    response = InferResponse(
        model_name="m",
        model_version=3,
        request_id="r",
        outputs={"A": np.array([[1.5, 2.5]], np.float32), "B": np.array([b"\xff"], object)},
        parameters={"sequence_id": 4},
    )
    request = _http(
        {
            "inputs": [],
            "outputs": [{"name": "A"}, {"name": "B", "parameters": {"binary_data": True}}],
        }
    )
    chunks, length = encode_http_response(response, request)
    header = json.loads(chunks[0])
    assert length == len(chunks[0])
    assert header["model_version"] == "3"
    assert header["id"] == "r"
    assert header["parameters"] == {"sequence_id": 4}
    assert header["outputs"][0]["data"] == [1.5, 2.5]
    assert header["outputs"][1]["parameters"] == {"binary_data_size": 5}
    assert bytes(chunks[1]) == b"\x01\x00\x00\x00\xff"
    json_only = _http({"inputs": []})
    with pytest.raises(InvalidRequestError, match="not UTF-8"):
        encode_http_response(response, json_only)


def test_grpc_request_and_response_messages() -> None:
    """A ModelInferRequest with raw and typed contents decodes; responses carry raw bytes."""
    message = service_pb2.ModelInferRequest(model_name="m", model_version="2", id="g")
    message.parameters["sequence_id"].string_param = "abc"
    message.parameters["sequence_end"].bool_param = True
    message.parameters["flavour"].double_param = 0.5
    a = message.inputs.add(name="A", datatype="INT64", shape=[2])
    a.contents.int64_contents.extend([1, -2])
    both = service_pb2.ModelInferRequest()
    both.CopyFrom(message)
    both.raw_input_contents.append(b"\x00" * 16)
    with pytest.raises(InvalidRequestError, match="contents field must not be specified when"):
        decode_grpc_request(both)
    request = decode_grpc_request(message)
    assert request.inputs["A"].tolist() == [1, -2]
    options = request.options
    assert (options.model_version, options.sequence_id, options.sequence_end) == (2, "abc", True)
    assert options.parameters == {"flavour": 0.5}
    fp16 = service_pb2.ModelInferRequest(model_name="m")
    fp16.inputs.add(name="H", datatype="FP16", shape=[1]).contents.fp32_contents.append(1.0)
    with pytest.raises(InvalidRequestError, match="only be sent in raw_input_contents"):
        decode_grpc_request(fp16)
    missing = service_pb2.ModelInferRequest(model_name="m")
    missing.inputs.add(name="H", datatype="FP16", shape=[1])
    with pytest.raises(InvalidRequestError, match="unable to find data for input tensor 'H'"):
        decode_grpc_request(missing)
    response = encode_grpc_response(
        InferResponse(model_name="m", model_version=2, outputs={"Y": np.array([1, 2], np.int16)}),
        final=True,
    )
    assert response.raw_output_contents[0] == np.array([1, 2], np.int16).tobytes()
    assert response.parameters["triton_final_response"].bool_param


def test_status_codes_follow_triton() -> None:
    """Unknown model 404/NOT_FOUND, bad request 400, busy 503, model failure 500."""
    cases = [
        (ModelNotFoundError("x"), 404, "NOT_FOUND"),
        (InvalidRequestError("x"), 400, "INVALID_ARGUMENT"),
        (QueueFullError("x"), 503, "UNAVAILABLE"),
        (ModelControlError("x"), 503, "UNAVAILABLE"),
        (InferenceError("x", model_name="m"), 500, "INTERNAL"),
        (RuntimeError("x"), 500, "INTERNAL"),
    ]
    for error, status, code in cases:
        assert (http_status(error), grpc_status(error)) == (status, code)


def test_metadata_and_config_documents() -> None:
    """Metadata prepends -1 when the model batches; the config has numbers and defaults."""
    config = parse_model_config(
        'name: "m" max_batch_size: 4 input [{ name: "X" data_type: TYPE_FP32 dims: [3] }] '
        'output [{ name: "Y" data_type: TYPE_INT64 dims: [-1] }] '
        "dynamic_batching { max_queue_delay_microseconds: 100 }"
    )
    metadata = model_metadata(config, [1, 2])
    assert metadata["versions"] == ["1", "2"]
    assert metadata["inputs"][0]["shape"] == [-1, 3]
    assert metadata["outputs"][0] == {"name": "Y", "datatype": "INT64", "shape": [-1, -1]}
    document = model_config_json(config)
    assert document["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert document["input"][0]["dims"] == [3]
    assert document["model_transaction_policy"] == {"decoupled": False}
    assert document["version_policy"] == {"latest": {"num_versions": 1}}
    assert [(g["kind"], g["count"]) for g in document["instance_group"]] == [("KIND_CPU", 1)]
    two = parse_model_config(
        'name: "m" input [{ name: "X" data_type: TYPE_FP32 dims: [3] }] '
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [3] }] '
        "instance_group [{ count: 1 kind: KIND_CPU }, { count: 3 kind: KIND_CPU }]"
    )
    assert [g["count"] for g in model_config_json(two)["instance_group"]] == [1, 3]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([np.float32, np.int64, np.uint8, np.bool_, object]), max_size=4),
    st.integers(0, 300),
    st.dictionaries(st.sampled_from(["sequence_id", "sequence_end"]), st.integers(0, 2**64 - 1)),
)
def test_serialized_response_parses_as_the_message(
    kinds: list[Any], size: int, parameters: dict[str, int]
) -> None:
    """The hand-written serialization of a ModelInferResponse parses back into exactly the
    message protobuf makes (outputs of every kind, empty and large raw contents)."""
    outputs = {}
    for index, kind in enumerate(kinds):
        if kind is object:
            array = np.array([b"x" * (i % 5) for i in range(size)], dtype=object)
        else:
            array = (np.arange(size) % 2).astype(kind)
        outputs[f"OUT{index}"] = array
    response = InferResponse(
        model_name="m", model_version=3, request_id="r", outputs=outputs, parameters=parameters
    )
    parsed = service_pb2.ModelInferResponse.FromString(serialized_grpc_response(response))
    assert parsed == encode_grpc_response(response)


def _one_input(dtype: DataType, dims: tuple[int, ...], batch: int) -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=batch,
        input=(TensorConfig(name="IN", data_type=dtype, dims=dims),),
        output=(TensorConfig(name="OUT", data_type=dtype, dims=dims),),
    )


def test_a_raw_binary_request_deduces_its_shape_from_the_config() -> None:
    """A batching model gets [1, ...]; one variable dim takes what the body leaves; a BYTES
    input of one element is the whole body; every output is asked as binary data."""
    fixed = decode_raw_request(_one_input(DataType.INT16, (2, -1), 8), "3", b"\x01\x00" * 6)
    assert fixed.inputs["IN"].shape == (1, 2, 3)
    assert (fixed.options.model_version, fixed.binary_default) == (3, True)
    word = decode_raw_request(_one_input(DataType.BYTES, (1,), 0), "", b"\xff\x00")
    assert word.inputs["IN"].tolist() == [b"\xff\x00"]
    with pytest.raises(InvalidRequestError, match="the model must have input shape \\[1\\]"):
        decode_raw_request(_one_input(DataType.BYTES, (-1,), 0), "", b"ab")
    with pytest.raises(InvalidRequestError, match="unexpected total byte size 5"):
        decode_raw_request(_one_input(DataType.INT16, (-1,), 0), "", b"\x00" * 5)
    empty = decode_raw_request(_one_input(DataType.FP32, (0, -1), 0), "", b"")
    assert empty.inputs["IN"].shape == (0, 0)


def test_control_documents_too_deep_for_python_are_read_member_by_member() -> None:
    """Scalars parsed, containers kept as Nested (never parsed), strings with brackets in
    them skipped right; what is not an object, or is malformed, is refused."""
    deep = b"[" * 5000 + b"1" + b"]" * 5000
    document = load_json_object(
        b'{"ready": ' + deep + b', "a": "x]}", "b": {"c": ' + deep + b"}, " + b'"n": -2.5e1}'
    )
    assert document == {"ready": Nested("array"), "a": "x]}", "b": Nested("object"), "n": -25.0}
    for bad in (deep, b'{"a": ' + deep, b'{"a" ' + deep + b"}", b'{"a": ' + deep + b" x}"):
        with pytest.raises(InvalidRequestError):
            load_json_object(bad)


@pytest.mark.parametrize(
    ("shape", "itemsize", "words"),
    [
        (
            [16, 2**60 + 2],
            4,
            "causes total element count to exceed maximum size of 9223372036854775807",
        ),
        ([4, 2**60 + 2], 4, "element count \\(4611686018427387912\\) \\* data type size \\(4\\)"),
        ([2**41], 1, "dim 2199023255552 is too large"),
        ([0, 2**41], 4, "is too large"),
    ],
)
def test_shapes_past_64_bits_are_refused_in_tritons_words(
    shape: list[int], itemsize: int, words: str
) -> None:
    """Counts and byte sizes past int64 in Triton's words; past numpy's reach in ours."""
    with pytest.raises(InvalidRequestError, match=words):
        element_count(shape, "X", itemsize)
