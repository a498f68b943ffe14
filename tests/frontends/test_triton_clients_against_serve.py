"""`orchestrion serve` against Triton's own clients (tritonclient.http and tritonclient.grpc).

One server process (the real CLI, on free loopback ports) serves the whole module; the
tests are synchronous, like the clients. The repository is tests/kserve_models.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served
from support.served import start_server

TYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BF16": ml_dtypes.bfloat16,
    "BYTES": np.object_,
}


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server("--cache-config", "local,size=1048576")
    yield served
    assert served.stop() == 0, served.text()


@pytest.fixture
def http(server: Served) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(server.http)
    yield client
    client.close()


@pytest.fixture
def grpc(server: Served) -> Iterator[Any]:
    client = grpcclient.InferenceServerClient(server.grpc)
    yield client
    client.close()


def _sample(datatype: str, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape))
    if datatype == "BYTES":
        items = [bytes(rng.integers(0, 256, size=i % 5)) for i in range(count)]
        items[0] = "héllo".encode() if datatype == "BYTES" else items[0]
        array = np.empty(count, dtype=object)
        array[:] = items
        return array.reshape(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    dtype = np.dtype(TYPES[datatype])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def _inputs(module: Any, arrays: dict[str, np.ndarray[Any, Any]], binary: bool = True) -> list[Any]:
    made = []
    for datatype, array in arrays.items():
        item = module.InferInput(f"IN_{datatype}", list(array.shape), datatype)
        if module is httpclient:
            item.set_data_from_numpy(array, binary_data=binary)
        else:
            item.set_data_from_numpy(array)
        made.append(item)
    return made


@pytest.mark.parametrize("model", ["identity_batch", "identity_plain"])
@pytest.mark.parametrize("protocol", ["http-binary", "http-json", "grpc"])
def test_every_data_type_round_trips(http: Any, grpc: Any, model: str, protocol: str) -> None:
    """Every data type goes out and comes back bit for bit, batching and not, binary and JSON."""
    shape = (3, 4) if model == "identity_batch" else (2, 3)
    json_only = protocol == "http-json"
    types = [t for t in TYPES if not (json_only and t in ("FP16", "BF16"))]
    arrays = {t: _sample(t, shape, seed) for seed, t in enumerate(types)}
    if json_only:  # JSON carries text: BYTES must be UTF-8 there
        arrays["BYTES"] = np.array(
            [[f"é{i}{j}" for j in range(shape[1])] for i in range(shape[0])], dtype=object
        )
        arrays["BYTES"] = np.vectorize(lambda s: s.encode(), otypes=[object])(arrays["BYTES"])
    if protocol == "grpc":
        module, client = grpcclient, grpc
        outputs = [grpcclient.InferRequestedOutput(f"OUT_{t}") for t in types]
    else:
        module, client = httpclient, http
        outputs = [
            httpclient.InferRequestedOutput(f"OUT_{t}", binary_data=not json_only) for t in types
        ]
    result = client.infer(model, _inputs(module, arrays, binary=not json_only), outputs=outputs)
    for datatype, sent in arrays.items():
        got = result.as_numpy(f"OUT_{datatype}")
        assert got.shape == sent.shape, datatype
        if datatype == "BYTES":  # tritonclient gives JSON strings back as str
            back = [x.encode() if isinstance(x, str) else x for x in got.reshape(-1)]
            assert back == sent.reshape(-1).tolist()
        else:
            assert got.dtype == sent.dtype, datatype
            assert got.tobytes() == sent.tobytes(), datatype


def test_json_refuses_fp16_inputs_with_a_clear_message(server: Served) -> None:
    """FP16 and BF16 travel only as binary data (as in Triton): a JSON FP16 tensor is a 400."""
    import http.client

    connection = http.client.HTTPConnection(server.http, timeout=30)
    body = b'{"inputs":[{"name":"IN_FP16","datatype":"FP16","shape":[1,1],"data":[1.0]}]}'
    connection.request("POST", "/v2/models/identity_batch/infer", body)
    response = connection.getresponse()
    assert response.status == 400
    assert b"FP16 tensors can only be sent as binary data" in response.read()


def _pipeline_reference(x: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
    pre = x * 2 + 1
    return np.stack([pre[:, :8].sum(1), pre[:, 8:].sum(1)], axis=1), -pre


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_answers_match_the_reference(http: Any, grpc: Any, protocol: str) -> None:
    """The 3-step ensemble over the network computes what numpy computes, batch of 3."""
    module, client = (httpclient, http) if protocol == "http" else (grpcclient, grpc)
    x = np.random.default_rng(7).standard_normal((3, 16)).astype(np.float32)
    item = module.InferInput("INPUT", [3, 16], "FP32")
    item.set_data_from_numpy(x)
    result = client.infer("pipeline", [item], request_id="req-7")
    want_class, want_seg = _pipeline_reference(x)
    np.testing.assert_allclose(result.as_numpy("CLASS"), want_class, rtol=1e-5)
    np.testing.assert_allclose(result.as_numpy("SEG"), want_seg, rtol=1e-6)
    response = result.get_response()
    request_id = response["id"] if protocol == "http" else response.id
    assert request_id == "req-7"


def test_requested_outputs_only(http: Any) -> None:
    """Asking for one output returns only that one."""
    item = httpclient.InferInput("INPUT", [1, 16], "FP32")
    item.set_data_from_numpy(np.ones((1, 16), np.float32))
    result = http.infer("pipeline", [item], outputs=[httpclient.InferRequestedOutput("CLASS")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["CLASS"]


def test_metadata_config_and_readiness(http: Any, grpc: Any) -> None:
    """Metadata shows -1 for the batch dim only when the model batches; config is Triton's."""
    assert http.is_server_live()
    assert http.is_server_ready()
    assert grpc.is_server_live()
    assert grpc.is_server_ready()
    assert "statistics" in http.get_server_metadata()["extensions"]
    assert "binary_tensor_data" in grpc.get_server_metadata().extensions
    batch = http.get_model_metadata("pipeline")
    assert batch["platform"] == "ensemble"
    assert batch["inputs"] == [{"name": "INPUT", "datatype": "FP32", "shape": [-1, 16]}]
    plain = grpc.get_model_metadata("counter")
    assert list(plain.inputs[0].shape) == [1]
    config = http.get_model_config("pipeline")
    assert config["max_batch_size"] == 8
    assert config["input"][0]["dims"] == [16]
    assert config["response_cache"]["enable"] is True
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["preprocess", "classify", "segment"]
    grpc_config = grpc.get_model_config("repeat").config
    assert grpc_config.model_transaction_policy.decoupled
    assert http.is_model_ready("pipeline")
    assert grpc.is_model_ready("pipeline", "1")
    assert not http.is_model_ready("nope")
    assert not grpc.is_model_ready("nope")
    assert not grpc.is_model_ready("pipeline", "7")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_errors_carry_triton_status_and_message(http: Any, grpc: Any, protocol: str) -> None:
    """Unknown model: 404/NOT_FOUND; bad shape: 400/INVALID_ARGUMENT; a model that raises:
    500/INTERNAL with its message; the server keeps serving afterwards."""
    module, client = (httpclient, http) if protocol == "http" else (grpcclient, grpc)

    def status(error: InferenceServerException) -> str:
        return str(error.status())

    item = module.InferInput("INPUT", [1, 16], "FP32")
    item.set_data_from_numpy(np.ones((1, 16), np.float32))
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("no_such_model", [item])
    assert status(unknown.value) in ("404", "StatusCode.NOT_FOUND")
    assert "Request for unknown model: 'no_such_model' is not found" in unknown.value.message()

    wrong = module.InferInput("INPUT", [1, 15], "FP32")
    wrong.set_data_from_numpy(np.ones((1, 15), np.float32))
    with pytest.raises(InferenceServerException) as shape:
        client.infer("pipeline", [wrong])
    assert status(shape.value) in ("400", "StatusCode.INVALID_ARGUMENT")
    assert "INPUT" in shape.value.message()
    assert "15" in shape.value.message()

    dtype = module.InferInput("INPUT", [1, 16], "FP64")
    dtype.set_data_from_numpy(np.ones((1, 16), np.float64))
    with pytest.raises(InferenceServerException) as wrong_type:
        client.infer("pipeline", [dtype])
    assert status(wrong_type.value) in ("400", "StatusCode.INVALID_ARGUMENT")
    assert "FP64" in wrong_type.value.message() or "float64" in wrong_type.value.message()

    negative = module.InferInput("X", [1], "FP32")
    negative.set_data_from_numpy(np.array([-1.0], np.float32))
    with pytest.raises(InferenceServerException) as failed:
        client.infer("fragile", [negative])
    assert status(failed.value) in ("500", "StatusCode.INTERNAL")
    assert "negative input" in failed.value.message()

    fine = module.InferInput("X", [1], "FP32")
    fine.set_data_from_numpy(np.array([1.0], np.float32))
    assert client.infer("fragile", [fine]).as_numpy("Y").tolist() == [2.0]


def test_statistics_count_exactly_the_traffic(http: Any, grpc: Any) -> None:
    """After 3 successes and 1 failure of `square`, both protocols report those counts."""
    before = http.get_inference_statistics("fragile")["model_stats"][0]["inference_stats"]
    for value in (1.0, 2.0, -1.0, 3.0):
        item = grpcclient.InferInput("X", [1], "FP32")
        item.set_data_from_numpy(np.array([value], np.float32))
        with contextlib.suppress(InferenceServerException):
            grpc.infer("fragile", [item])
    after = http.get_inference_statistics("fragile")["model_stats"][0]
    assert after["inference_stats"]["success"]["count"] == before["success"]["count"] + 3
    assert after["inference_stats"]["fail"]["count"] == before["fail"]["count"] + 1
    assert after["last_inference"] > 0
    over_grpc = grpc.get_inference_statistics("fragile").model_stats[0]
    assert over_grpc.inference_stats.success.count == before["success"]["count"] + 3
    assert over_grpc.execution_count == after["execution_count"]
    every = grpc.get_inference_statistics().model_stats
    assert {s.name for s in every} >= {"pipeline", "fragile", "counter"}


def test_cache_hits_show_in_statistics(http: Any) -> None:
    """The second identical ensemble request is a cache hit (the server runs with a cache)."""
    x = np.full((1, 16), 0.25, np.float32)
    for _ in range(2):
        item = httpclient.InferInput("INPUT", [1, 16], "FP32")
        item.set_data_from_numpy(x)
        http.infer("pipeline", [item])
    stats = http.get_inference_statistics("pipeline")["model_stats"][0]["inference_stats"]
    assert stats["cache_hit"]["count"] >= 1


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sequence_of_three_requests_with_flags(http: Any, grpc: Any, protocol: str) -> None:
    """start/middle/end of a sequence give running totals and echo the sequence parameters."""
    module, client = (httpclient, http) if protocol == "http" else (grpcclient, grpc)
    sequence_id = 41 if protocol == "http" else 42
    totals = []
    for value, flags in ((3, {"sequence_start": True}), (4, {}), (5, {"sequence_end": True})):
        item = module.InferInput("X", [1], "INT32")
        item.set_data_from_numpy(np.array([value], np.int32))
        result = client.infer("counter", [item], sequence_id=sequence_id, **flags)
        totals.append(int(result.as_numpy("TOTAL")[0]))
        response = (
            result.get_response(as_json=True) if protocol == "grpc" else result.get_response()
        )
        parameters = response["parameters"]
        if protocol == "grpc":
            parameters = {k: next(iter(v.values())) for k, v in parameters.items()}
        assert int(parameters["sequence_id"]) == sequence_id
        assert parameters["sequence_start"] == flags.get("sequence_start", False)
        assert parameters["sequence_end"] == flags.get("sequence_end", False)
    assert totals == [3, 7, 12]
    item = module.InferInput("X", [1], "INT32")
    item.set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException) as ended:
        client.infer("counter", [item], sequence_id=sequence_id)
    assert "sequence" in ended.value.message()


def _stream(grpc: Any, requests: list[dict[str, Any]], expect: int) -> list[tuple[Any, Any]]:
    """Send ``requests`` on one ModelStreamInfer stream; collect ``expect`` callbacks."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for request in requests:
            grpc.async_stream_infer(**request)
        return [got.get(timeout=60) for _ in range(expect)]
    finally:
        grpc.stop_stream()


def test_stream_a_decoupled_ensemble(grpc: Any) -> None:
    """repeat_squares streams 0, 1, 4, 9, then the empty final response when asked for."""
    item = grpcclient.InferInput("N", [1], "INT32")
    item.set_data_from_numpy(np.array([4], np.int32))
    answers = _stream(
        grpc,
        [
            {
                "model_name": "repeat_squares",
                "inputs": [item],
                "request_id": "s1",
                "enable_empty_final_response": True,
            }
        ],
        expect=5,
    )
    assert all(error is None for _, error in answers)
    values = [int(r.as_numpy("SQUARE")[0]) for r, _ in answers[:4]]
    assert values == [0, 1, 4, 9]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in answers]
    assert finals == [False, False, False, False, True]
    assert all(r.get_response().id == "s1" for r, _ in answers)


def test_stream_errors_arrive_per_request_and_the_stream_goes_on(grpc: Any) -> None:
    """On one stream, a bad request gets its error and the good ones their answers."""
    good = grpcclient.InferInput("X", [1], "FP32")
    good.set_data_from_numpy(np.array([1.0], np.float32))
    bad = grpcclient.InferInput("X", [1], "FP32")
    bad.set_data_from_numpy(np.array([-1.0], np.float32))
    answers = _stream(
        grpc,
        [
            {"model_name": "fragile", "inputs": [bad], "request_id": "bad"},
            {"model_name": "fragile", "inputs": [good], "request_id": "good"},
            {"model_name": "no_such_model", "inputs": [good], "request_id": "lost"},
        ],
        expect=3,
    )
    errors = sorted(str(e) for _, e in answers if e is not None)
    assert len(errors) == 2
    assert any("negative input" in e for e in errors)
    assert any("Request for unknown model: 'no_such_model' is not found" in e for e in errors)
    results = [r for r, e in answers if e is None]
    assert [r.as_numpy("Y").tolist() for r in results] == [[2.0]]
    assert results[0].get_response().parameters["triton_final_response"].bool_param


def test_stream_keeps_a_sequence_in_order(grpc: Any) -> None:
    """A sequence sent on a stream without waiting runs in the order sent."""
    requests = []
    for index, value in enumerate(range(1, 21)):
        item = grpcclient.InferInput("X", [1], "INT32")
        item.set_data_from_numpy(np.array([value], np.int32))
        requests.append(
            {
                "model_name": "counter",
                "inputs": [item],
                "sequence_id": 77,
                "sequence_start": index == 0,
                "sequence_end": index == 19,
                "request_id": str(index),
            }
        )
    answers = _stream(grpc, requests, expect=20)
    assert all(error is None for _, error in answers)
    by_id = {r.get_response().id: int(r.as_numpy("TOTAL")[0]) for r, _ in answers}
    assert [by_id[str(i)] for i in range(20)] == [sum(range(1, i + 2)) for i in range(20)]


def test_many_clients_at_once_each_get_their_answer(server: Served) -> None:
    """8 threads x 25 requests over both protocols: every answer is the right one."""
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            protocol = grpcclient if seed % 2 else httpclient
            url = server.grpc if seed % 2 else server.http
            client = protocol.InferenceServerClient(url)
            rng = np.random.default_rng(seed)
            for _ in range(25):
                x = rng.standard_normal((1, 16)).astype(np.float32)
                item = protocol.InferInput("INPUT", [1, 16], "FP32")
                item.set_data_from_numpy(x)
                result = client.infer("pipeline", [item])
                np.testing.assert_allclose(result.as_numpy("SEG"), -(x * 2 + 1), rtol=1e-6)
            client.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors


def test_repository_api_refused_outside_explicit_mode(http: Any, grpc: Any) -> None:
    """In the default mode ('none') load/unload are refused with 503/UNAVAILABLE; the index
    still lists every model."""
    with pytest.raises(InferenceServerException) as refused:
        http.load_model("square")
    assert "explicit" in refused.value.message()
    assert str(refused.value.status()) == "503"
    with pytest.raises(InferenceServerException) as refused_grpc:
        grpc.unload_model("square")
    assert str(refused_grpc.value.status()) == "StatusCode.UNAVAILABLE"
    index = http.get_model_repository_index()
    assert {"name": "square", "version": "1", "state": "READY", "reason": ""} in index
    assert {m.name for m in grpc.get_model_repository_index().models} >= {"square", "pipeline"}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_decoupled_model_over_unary_infer_says_to_stream(
    http: Any, grpc: Any, protocol: str
) -> None:
    """A decoupled model through HTTP infer or unary ModelInfer: 400/INVALID_ARGUMENT that
    names the streaming RPC to use."""
    module, client = (httpclient, http) if protocol == "http" else (grpcclient, grpc)
    item = module.InferInput("X", [1], "INT32")
    item.set_data_from_numpy(np.array([2], np.int32))
    with pytest.raises(InferenceServerException) as refused:
        client.infer("repeat", [item])
    assert str(refused.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    assert "ModelStreamInfer" in refused.value.message()
