"""Triton's quick-start model repository (``docs/examples/model_repository``) through
`orchestrion serve`, checked as Triton's own example clients check it: the ONNX add/sub
models of INT32, INT8 and strings, the two stateful ONNX models (``simple_sequence``: Direct,
START and READY controls; ``simple_dyna_sequence``: Oldest over two instances, START, END,
READY and a UINT64 CORRID), a python identity model, model control with a config override
that names no backend, and the two folders whose graphs Triton's ``fetch_models.sh``
downloads. The graphs are this suite's own (tests/support/onnx_graphs.py), of the same
shapes and arithmetic; the configs say what Triton's say."""

from __future__ import annotations

import json
import queue
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrion.protocols import DataType
from orchestrion.testing import Served
from support.onnx_graphs import add_sub, model_folder, sequence_controls
from support.served import start_server

SIMPLE = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: {type} dims: [ 16 ] }},
        {{ name: "INPUT1" data_type: {type} dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {type} dims: [ 16 ] }},
         {{ name: "OUTPUT1" data_type: {type} dims: [ 16 ] }} ]
"""
FLAG = '{{ name: "{0}" control [ {{ kind: CONTROL_SEQUENCE_{0} int32_false_true: [ 0, 1 ] }} ] }}'
SEQUENCE = """
name: "simple_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{ control_input [ {start}, {ready} ] }}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU }} ]
""".format(start=FLAG.format("START"), ready=FLAG.format("READY"))
DYNA_SEQUENCE = """
name: "simple_dyna_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: 10000000
  oldest {{ max_candidate_sequences: 1024 max_queue_delay_microseconds: 10000 }}
  control_input [ {start}, {end}, {ready},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
""".format(start=FLAG.format("START"), end=FLAG.format("END"), ready=FLAG.format("READY"))
IDENTITY = """
name: "simple_identity"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
IDENTITY_CODE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            out = pb_utils.Tensor("OUTPUT0", tensor.as_numpy())
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""
DOWNLOADED = {
    # Their graphs come from fetch_models.sh: the folders hold a config and labels only.
    "densenet_onnx": 'name: "densenet_onnx"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
    'input [ { name: "data_0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ] '
    "reshape { shape: [ 1, 3, 224, 224 ] } } ]\n"
    'output [ { name: "fc6_1" data_type: TYPE_FP32 dims: [ 1000 ] '
    'reshape { shape: [ 1, 1000, 1, 1 ] } label_filename: "densenet_labels.txt" } ]\n',
    "inception_onnx": 'name: "inception_onnx"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
    'input [ { name: "input:0" data_type: TYPE_FP32 format: FORMAT_NHWC dims: [ 299, 299, 3 ] '
    "reshape { shape: [ 1, 299, 299, 3 ] } } ]\n"
    'output [ { name: "InceptionV3/Predictions/Softmax:0" data_type: TYPE_FP32 dims: [ 1001 ] '
    'reshape { shape: [ 1, 1001 ] } label_filename: "inception_labels.txt" } ]\n',
}


def write_repository(root: Path, *, downloaded: bool = False) -> Path:
    """The quick-start repository's six models (and, with ``downloaded``, the two folders
    whose graphs are not there)."""
    for name, data_type in (
        ("simple", DataType.INT32),
        ("simple_int8", DataType.INT8),
        ("simple_string", DataType.BYTES),
    ):
        config = SIMPLE.format(name=name, type=data_type.config_name)
        model_folder(root, name, add_sub(data_type), config)
    model_folder(root, "simple_sequence", sequence_controls(corrid=False), SEQUENCE)
    model_folder(root, "simple_dyna_sequence", sequence_controls(corrid=True), DYNA_SEQUENCE)
    model_folder(root, "simple_identity", IDENTITY_CODE.encode(), IDENTITY, filename="model.py")
    if downloaded:
        for name, config in DOWNLOADED.items():
            (root / name).mkdir()
            (root / name / "config.pbtxt").write_text(config)
            (root / name / f"{name.split('_')[0]}_labels.txt").write_text("a\nb\n")
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("quick_start"))


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Served]:
    served = start_server("--id", "triton", repository=repository)
    yield served
    assert served.stop() == 0, served.text()


# -- the stateless models ------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(
    ("model", "datatype"),
    [("simple", "INT32"), ("simple_int8", "INT8"), ("simple_string", "BYTES")],
)
def test_the_add_sub_models_add_and_subtract(
    server: Served, protocol: str, model: str, datatype: str
) -> None:
    """As the simple_*_infer and explicit-content clients check: OUTPUT0 = INPUT0 + INPUT1,
    OUTPUT1 = INPUT0 - INPUT1, strings as decimal text."""
    module: Any = httpclient if protocol == "http" else grpcclient
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), np.int32)
    values = [a, b]
    if datatype == "BYTES":
        values = [
            np.array([str(x).encode() for x in v.ravel()], dtype=object).reshape(1, 16)
            for v in values
        ]
    elif datatype == "INT8":
        values = [v.astype(np.int8) for v in values]
    client = module.InferenceServerClient(getattr(server, protocol))
    try:
        inputs = [module.InferInput(f"INPUT{i}", [1, 16], datatype) for i in (0, 1)]
        for tensor, value in zip(inputs, values, strict=True):
            tensor.set_data_from_numpy(value)
        result = client.infer(model, inputs)
    finally:
        client.close()
    sums, differences = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
    if datatype == "BYTES":
        sums, differences = (np.array([int(x) for x in t.ravel()]) for t in (sums, differences))
    assert np.asarray(sums).ravel().tolist() == (a + b).ravel().tolist()
    assert np.asarray(differences).ravel().tolist() == (a - b).ravel().tolist()


def test_the_python_identity_model_returns_its_strings(server: Served) -> None:
    """simple_identity (a python model) answers its strings unchanged."""
    client = httpclient.InferenceServerClient(server.http)
    try:
        words = np.array([[b"hello", "héllo".encode(), b""]], dtype=object)
        tensor = httpclient.InferInput("INPUT0", [1, 3], "BYTES")
        tensor.set_data_from_numpy(words)
        result = client.infer("simple_identity", [tensor])
    finally:
        client.close()
    assert result.as_numpy("OUTPUT0").tolist() == words.tolist()


def test_the_server_says_its_id_as_its_name(server: Served) -> None:
    """With --id triton, the health-and-metadata clients' check passes: the server's name
    is triton over HTTP and gRPC, every model ready."""
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    try:
        assert http.get_server_metadata()["name"] == "triton"
        assert grpc.get_server_metadata().name == "triton"
        for model in ("simple", "simple_sequence", "simple_dyna_sequence", "simple_identity"):
            assert http.is_model_ready(model)
    finally:
        http.close()
        grpc.close()


# -- the stateful models -------------------------------------------------------------------

VALUES = [11, 7, 5, 3, 2, 0, 1]


def _expected(values: list[int], first: int, sequence_id: int, *, dyna: bool) -> list[int]:
    """What the sequence clients expect: the first request (START) adds 1, a dyna model
    adds the correlation id on the last (END), others pass INPUT through."""
    expected = [first + 1, *values]
    if dyna:
        expected[-1] += sequence_id
    return expected


def _sequence_inputs(module: Any, value: int) -> list[Any]:
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.full((1, 1), value, np.int32))
    return [tensor]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["simple_sequence", "simple_dyna_sequence"])
def test_sequences_sent_one_request_at_a_time(server: Served, protocol: str, model: str) -> None:
    """As the simple_*_sequence_sync clients: two sequences interleaved, request by request,
    each answered with its controls' effect (START adds one; dyna's END adds the id)."""
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(getattr(server, protocol))
    dyna = model == "simple_dyna_sequence"
    ids = (1000, 1001) if protocol == "http" else (2000, 2001)
    sequences = {ids[0]: [0, *VALUES], ids[1]: [100, *(-v for v in VALUES)]}
    got: dict[int, list[int]] = {key: [] for key in ids}
    try:
        for index in range(len(VALUES) + 1):
            for key, values in sequences.items():
                result = client.infer(
                    model,
                    _sequence_inputs(module, values[index]),
                    sequence_id=key,
                    sequence_start=index == 0,
                    sequence_end=index == len(values) - 1,
                )
                got[key].append(int(result.as_numpy("OUTPUT")[0][0]))
    finally:
        client.close()
    for key, values in sequences.items():
        assert got[key] == _expected(values[1:], values[0], key, dyna=dyna)


def test_sequences_on_one_stream_with_an_id_that_is_a_string(server: Served) -> None:
    """As simple_grpc_sequence_stream_infer_client: three sequences sent on one stream
    without waiting (one id a UUID string, for the model without CORRID), each answered in
    its order."""
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    string_id = str(uuid.uuid4())
    sequences: dict[int | str, list[int]] = {
        3000: [0, *VALUES],
        3001: [100, *(-v for v in VALUES)],
        string_id: [20, *(-v for v in VALUES)],
    }
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for key, values in sequences.items():
            for index, value in enumerate(values):
                client.async_stream_infer(
                    "simple_sequence",
                    _sequence_inputs(grpcclient, value),
                    request_id=f"{key}_{index}",
                    sequence_id=key,
                    sequence_start=index == 0,
                    sequence_end=index == len(values) - 1,
                )
        got: dict[str, list[int]] = {str(key): [] for key in sequences}
        for _ in range(sum(map(len, sequences.values()))):
            result = answers.get(timeout=30)
            assert not isinstance(result, InferenceServerException), result
            key = result.get_response().id.rsplit("_", 1)[0]
            got[key].append(int(result.as_numpy("OUTPUT")[0][0]))
    finally:
        client.stop_stream()
        client.close()
    for key, values in sequences.items():
        assert got[str(key)] == _expected(values[1:], values[0], 0, dyna=False)


# -- model control -------------------------------------------------------------------------


def test_model_control_loads_with_an_override_that_names_no_backend(tmp_path: Path) -> None:
    """As simple_http_model_control.py and simple_grpc_model_control.py check, in explicit
    mode: the index lists the seven folders; an override that is not JSON fails to load;
    ``{"max_batch_size": "16"}`` for the ONNX simple loads (its backend from the folder's
    model.onnx, inputs and outputs from the graph) and says 16; unload; an unknown model
    fails to load."""
    root = write_repository(tmp_path / "models")
    (root / "inception_onnx").mkdir()
    (root / "inception_onnx" / "config.pbtxt").write_text(DOWNLOADED["inception_onnx"])
    served = start_server("--model-control-mode", "explicit", repository=root)
    try:
        for module, address in ((httpclient, served.http), (grpcclient, served.grpc)):
            client: Any = module.InferenceServerClient(address)
            try:
                index = client.get_model_repository_index()
                count = len(index) if module is httpclient else len(index.models)
                assert count == 7, index
                client.load_model("simple")
                assert client.is_model_ready("simple")
                with pytest.raises(InferenceServerException, match="failed to load"):
                    client.load_model("simple", config='"parameters": {"config": {{}}}')
                client.load_model("simple", config=json.dumps({"max_batch_size": "16"}))
                config = client.get_model_config("simple")
                if module is grpcclient:
                    config = json.loads(
                        __import__(
                            "google.protobuf.json_format"
                        ).protobuf.json_format.MessageToJson(config.config)
                    )
                    config["max_batch_size"] = config.get("maxBatchSize", 0)
                assert int(config["max_batch_size"]) == 16
                client.unload_model("simple")
                assert not client.is_model_ready("simple")
                with pytest.raises(InferenceServerException, match="failed to load"):
                    client.load_model("wrong_model_name")
            finally:
                client.close()
    finally:
        assert served.stop() == 0, served.text()


def test_the_folders_without_their_graphs(tmp_path: Path) -> None:
    """The repository as shipped, before fetch_models.sh: the start fails naming the two
    folders without a version folder; with --exit-on-error=false the other six serve and the
    two are listed UNAVAILABLE with the reason."""
    root = write_repository(tmp_path / "models", downloaded=True)
    with pytest.raises(RuntimeError) as refused:
        start_server(repository=root)
    assert "densenet_onnx" in str(refused.value)
    served = start_server("--exit-on-error=false", "--strict-readiness=false", repository=root)
    try:
        client = httpclient.InferenceServerClient(served.http)
        try:
            index = {m["name"]: m for m in client.get_model_repository_index()}
            assert client.is_model_ready("simple")
        finally:
            client.close()
    finally:
        assert served.stop() == 0, served.text()
    assert index["densenet_onnx"]["state"] == "UNAVAILABLE"
    assert "no version folder" in index["densenet_onnx"]["reason"]
    assert index["simple_dyna_sequence"]["state"] == "READY"
