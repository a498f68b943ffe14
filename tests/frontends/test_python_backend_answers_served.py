"""What a python-backend model says besides its outputs, under ``orchestrion serve`` through
Triton's own clients, as Triton's QA of the python backend checks it (``qa/L0_backend_python``
``parameters`` and ``lifecycle``): response parameters (plain, decoupled, read back through
BLS), error responses under Triton's error codes, an ``execute`` that raises, the
``triton_grpc_error`` stream header, and the ``args`` of ``initialize``.

The models are in ``tests/python_backend_answers``.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served, get
from support.served import start_server

REPOSITORY = Path(__file__).resolve().parents[1] / "python_backend_answers"


@pytest.fixture(scope="module")
def drain_flag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file whose existence makes the model ``draining`` not ready."""
    return tmp_path_factory.mktemp("drain") / "draining"


@pytest.fixture(scope="module")
def server(drain_flag: Path) -> Iterator[Served]:
    served = start_server(
        repository=REPOSITORY, env={"ORCHESTRION_TEST_DRAIN_FLAG": str(drain_flag)}
    )
    yield served
    assert served.stop() == 0, served.text()


def _text(module: Any, name: str, value: str) -> Any:
    item = module.InferInput(name, [1], "BYTES")
    item.set_data_from_numpy(np.array([value.encode()], dtype=object))
    return item


def _refusals(
    server: Served, model: str, name: str, value: str
) -> tuple[InferenceServerException, InferenceServerException]:
    """The errors a request of ``model`` with the BYTES input ``name`` gets over gRPC and
    over HTTP (each must fail)."""
    errors = []
    for module, address in ((grpcclient, server.grpc), (httpclient, server.http)):
        with (
            module.InferenceServerClient(address) as client,
            pytest.raises(InferenceServerException) as caught,
        ):
            client.infer(model, [_text(module, name, value)])
        errors.append(caught.value)
    return errors[0], errors[1]


def _grpc_parameters(result: Any) -> dict[str, Any]:
    """A gRPC response's parameters as Python values (the field each one set)."""
    found: dict[str, Any] = {}
    for key, value in result.get_response().parameters.items():
        found[key] = getattr(value, value.WhichOneof("parameter_choice"))
    return found


PARAMETERS = [
    {},
    {"one": False},
    {"bool": True, "str": "Hello World!", "int": 1024},
    {"a": "1", "b": "2", "c": 3, "d": False, "e": -5, "f": ""},
]


@pytest.mark.parametrize("parameters", PARAMETERS, ids=["empty", "one", "three", "six"])
def test_response_parameters_reach_grpc_and_http_clients(
    server: Served, parameters: dict[str, Any]
) -> None:
    """``InferenceResponse(..., parameters=...)``: bool, int and str values reach a gRPC
    client in their own fields and an HTTP client in the response's JSON ``parameters``."""
    text = json.dumps(parameters)
    with grpcclient.InferenceServerClient(server.grpc) as client:
        result = client.infer("params", [_text(grpcclient, "PARAMETERS", text)])
    assert _grpc_parameters(result) == parameters
    assert result.as_numpy("OUT")[0].decode() == text
    with httpclient.InferenceServerClient(server.http) as client:
        answer = client.infer("params", [_text(httpclient, "PARAMETERS", text)])
    assert answer.get_response().get("parameters", {}) == parameters


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ([], "Expect dict, got <class 'list'>"),
        ({"1": "an int key"}, "Expect parameters keys to have type str, found type <class 'int'>"),
        (
            {"int": 2, "float": 0.5},
            "Expect parameters values to have type bool/int/str, found type <class 'float'>",
        ),
        (
            {"bool": True, "null": None},
            "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>",
        ),
        (
            {"str": "", "list": ["nested"]},
            "Expect parameters values to have type bool/int/str, found type <class 'list'>",
        ),
    ],
    ids=["list", "int-key", "float", "null", "nested"],
)
def test_parameters_triton_refuses_are_refused_in_its_words(
    server: Served, parameters: Any, message: str
) -> None:
    """Triton's checks of response parameters, their texts word for word: the model sees
    the refusal and answers with it (INVALID_ARG: gRPC's INVALID_ARGUMENT, HTTP 400)."""
    grpc_error, http_error = _refusals(server, "params", "PARAMETERS", json.dumps(parameters))
    assert str(grpc_error) == f"[StatusCode.INVALID_ARGUMENT] {message}"
    assert http_error.status() == "400"
    assert http_error.message() == message


def test_each_response_of_a_decoupled_model_carries_its_own_parameters(server: Served) -> None:
    """A decoupled model's responses over a gRPC stream: each with the parameters it was
    sent with, and ``triton_final_response`` false (the final flag comes alone)."""
    sent = [{"bool": False, "int": 2048}, {"str": "Hello World!"}, {}]
    received: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: received.put((result, error)))
        client.async_stream_infer(
            "params_stream", [_text(grpcclient, "PARAMETERS", json.dumps(sent))]
        )
        client.stop_stream()
    got = [received.get(timeout=10) for _ in sent]
    assert received.empty()
    for (result, error), parameters in zip(got, sent, strict=True):
        assert error is None
        assert _grpc_parameters(result) == {**parameters, "triton_final_response": False}
        assert result.as_numpy("OUT")[0].decode() == json.dumps(parameters)


def test_a_response_sent_with_the_final_flag_is_the_streams_last(server: Served) -> None:
    """The final flag sent with a response: that response says ``triton_final_response``
    true, and no empty final response follows, even when the client asks for one (as
    Triton's); a final flag sent alone gives the empty one asked for."""
    with_final = [{"int": 1}, {"with_final": True}]
    alone = [{"int": 2}]
    received: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: received.put((result, error)))
        for sent, request_id in ((with_final, "with"), (alone, "alone")):
            client.async_stream_infer(
                "params_stream",
                [_text(grpcclient, "PARAMETERS", json.dumps(sent))],
                request_id=request_id,
                enable_empty_final_response=True,
            )
        client.stop_stream()
    got = [received.get(timeout=10) for _ in range(4)]
    assert received.empty()
    assert all(error is None for _, error in got)
    finals = {
        (r.get_response().id, r.get_response().parameters["triton_final_response"].bool_param)
        for r, _ in got
    }
    assert finals == {("with", False), ("with", True), ("alone", False), ("alone", True)}
    empty = [r.get_response().id for r, _ in got if not r.get_response().outputs]
    assert empty == ["alone"]


def test_a_bls_caller_reads_its_callees_response_parameters(server: Served) -> None:
    """``response.parameters()`` of a BLS call's response, plain and decoupled: the
    parameters the callee set, as JSON text."""
    plain = {"bool": False, "int": 2048, "str": "Hello World!"}
    streamed = [{}, {"bool": True, "int": 10000}, {"str": "?"}]
    inputs = [
        _text(grpcclient, "PARAMETERS", json.dumps(plain)),
        _text(grpcclient, "STREAM_PARAMETERS", json.dumps(streamed)),
    ]
    with grpcclient.InferenceServerClient(server.grpc) as client:
        result = client.infer("params_bls", inputs)
    seen = json.loads(result.as_numpy("OUT")[0])
    assert seen == {"plain": plain, "stream": streamed}


CODES = [
    ("UNKNOWN", "UNKNOWN", 400),
    ("INTERNAL", "INTERNAL", 500),
    ("NOT_FOUND", "NOT_FOUND", 404),
    ("INVALID_ARG", "INVALID_ARGUMENT", 400),
    ("UNAVAILABLE", "UNAVAILABLE", 503),
    ("UNSUPPORTED", "UNIMPLEMENTED", 501),
    ("ALREADY_EXISTS", "ALREADY_EXISTS", 400),
    ("CANCELLED", "CANCELLED", 400),
]


@pytest.mark.parametrize(("code", "grpc_status", "http_status"), CODES, ids=[c[0] for c in CODES])
def test_an_error_response_reaches_the_client_under_its_code(
    server: Served, code: str, grpc_status: str, http_status: int
) -> None:
    """``pb_utils.TritonError(message, code)``: the client sees the model's message as it
    wrote it, with the gRPC status and HTTP status Triton gives that code."""
    grpc_error, http_error = _refusals(server, "coded", "CODE", code)
    assert str(grpc_error) == f"[StatusCode.{grpc_status}] the code is {code}"
    assert (http_error.status(), http_error.message()) == (
        str(http_status),
        f"the code is {code}",
    )


def test_an_ensemble_passes_its_steps_error_code_on(server: Served) -> None:
    """A step's error response, through an ensemble: the step's code, the step named."""
    with (
        grpcclient.InferenceServerClient(server.grpc) as client,
        pytest.raises(InferenceServerException) as caught,
    ):
        client.infer("coded_pipeline", [_text(grpcclient, "CODE", "NOT_FOUND")])
    assert str(caught.value) == (
        "[StatusCode.NOT_FOUND] in ensemble 'coded_pipeline', step[0]: model 'coded': "
        "the code is NOT_FOUND"
    )


def test_an_error_without_a_code_is_internal(server: Served) -> None:
    """``TritonError(message)``: INTERNAL, as Triton's default."""
    with (
        grpcclient.InferenceServerClient(server.grpc) as client,
        pytest.raises(InferenceServerException) as caught,
    ):
        client.infer("coded", [_text(grpcclient, "CODE", "(none)")])
    assert str(caught.value) == "[StatusCode.INTERNAL] no such code: (none)"


def _failures(server: Served, model: str) -> str:
    line = f'nv_inference_request_failure{{model="{model}",reason="BACKEND",version="1"}} '
    text = get(server.metrics, "/metrics")[1].decode()
    return next(row for row in text.splitlines() if row.startswith(line)).removeprefix(line)


def test_an_execute_that_raises_is_answered_in_tritons_words_and_counted(server: Served) -> None:
    """``execute`` raised: every request of the call gets Triton's text (the instance named,
    then the exception), a failure counted as BACKEND under Triton's label order, and the
    model serves on."""
    before = float(_failures(server, "raising"))
    value = httpclient.InferInput("IN", [1], "FP32")
    value.set_data_from_numpy(np.ones(1, np.float32))
    with httpclient.InferenceServerClient(server.http) as client:
        for _ in range(2):
            with pytest.raises(InferenceServerException) as raised:
                client.infer("raising", [value])
            assert raised.value.status() == "500"
            assert raised.value.message() == (
                "Failed to process the request(s) for model 'raising_0_0', "
                "message: NameError: name 'undefined_name' is not defined"
            )
    assert float(_failures(server, "raising")) == before + 2


def _stream_of_four(server: Served, headers: dict[str, str] | None) -> list[Any]:
    """Four requests of every_other on one stream, each sent once the previous answered;
    what the callback got (results and errors), until the stream ends."""
    received: queue.Queue[Any] = queue.Queue()
    got: list[Any] = []
    with grpcclient.InferenceServerClient(server.grpc) as client:
        client.start_stream(
            callback=lambda result, error: received.put(error or result), headers=headers
        )
        for n in range(4):
            value = grpcclient.InferInput("IN", [1], "FP32")
            value.set_data_from_numpy(np.array([n], np.float32))
            try:
                client.async_stream_infer("every_other", [value])
            except InferenceServerException:
                break  # the stream has ended
            got.append(received.get(timeout=10))
            if isinstance(got[-1], InferenceServerException) and headers:
                break
        client.stop_stream()
    return got


def test_triton_grpc_error_ends_a_stream_with_its_first_errors_status(server: Served) -> None:
    """With the ``triton_grpc_error: true`` header, a stream's first failed request ends
    the stream with that error's gRPC status and message; without it, the error travels
    in the stream as one response's message and the stream goes on."""
    ended = _stream_of_four(server, {"triton_grpc_error": "true"})
    assert len(ended) == 2
    assert ended[0].as_numpy("OUT").tolist() == [0.0]
    error = ended[1]
    assert isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.INTERNAL"
    assert "fails" in error.message()
    plain = _stream_of_four(server, None)
    assert [isinstance(r, InferenceServerException) for r in plain] == [False, True, False, True]
    assert plain[2].as_numpy("OUT").tolist() == [2.0]


def test_initialize_receives_tritons_args(server: Served) -> None:
    """``initialize(args)`` as Triton gives it: the kind as ``CPU``, the instance's name
    ``<group name>_<index>`` (a group without a name is ``<model>_<group index>``), the
    model's own folder as ``model_repository``, every value a string."""
    names = {"pair_0", "pair_1", "instance_args_1_0"}
    with grpcclient.InferenceServerClient(server.grpc) as client:
        value = grpcclient.InferInput("IN", [1], "FP32")
        value.set_data_from_numpy(np.ones(1, np.float32))
        args = json.loads(client.infer("instance_args", [value]).as_numpy("OUT")[0])
    assert args.pop("model_instance_name") in names
    assert args == {
        "model_instance_kind": "CPU",
        "model_instance_device_id": "0",
        "model_repository": str(REPOSITORY / "instance_args"),
        "model_version": "1",
        "model_name": "instance_args",
    }


def _ready(server: Served, model: str) -> tuple[int, bool]:
    """The model's readiness: HTTP's status and gRPC's answer."""
    with grpcclient.InferenceServerClient(server.grpc) as client:
        return get(server.http, f"/v2/models/{model}/ready")[0], client.is_model_ready(model)


def test_a_models_is_ready_decides_what_the_readiness_endpoints_answer(
    server: Served, drain_flag: Path
) -> None:
    """``is_ready()`` in the model (python_backend's README: a graceful drain): the model's
    HTTP and gRPC readiness follow its answer, the server stays ready, and the model serves
    requests while not ready."""
    assert _ready(server, "draining") == (200, True)
    drain_flag.touch()
    try:
        assert _ready(server, "draining") == (400, False)
        assert get(server.http, "/v2/health/ready")[0] == 200
        value = httpclient.InferInput("IN", [1], "FP32")
        value.set_data_from_numpy(np.array([7], np.float32))
        with httpclient.InferenceServerClient(server.http) as client:
            assert client.infer("draining", [value]).as_numpy("OUT").tolist() == [7.0]
    finally:
        drain_flag.unlink()
    assert _ready(server, "draining") == (200, True)


def _rounds_in_order(server: Served, rounds: int, size: int) -> list[list[Any]]:
    """``rounds`` rounds of ``size`` requests of in_order on one stream, the values counted
    on from 0; per round, what the client read (a value, or an error's message)."""
    received: queue.Queue[Any] = queue.Queue()
    read: list[list[Any]] = []
    with grpcclient.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: received.put(error or result))
        for first in range(0, rounds * size, size):
            for n in range(first, first + size):
                value = grpcclient.InferInput("IN", [1, 1], "FP32")
                value.set_data_from_numpy(np.array([[n]], np.float32))
                client.async_stream_infer("in_order", [value])
            answers = [received.get(timeout=30) for _ in range(size)]
            read.append(
                [
                    a.message() if isinstance(a, InferenceServerException) else a.as_numpy("OUT")
                    for a in answers
                ]
            )
        client.stop_stream()
    return read


def test_a_streams_client_reads_responses_in_the_order_the_model_sent_them(
    server: Served,
) -> None:
    """As Triton's stub does (one queue for every response): responses that a decoupled
    model sends from several threads, for several requests of one stream (batched), reach
    Triton's client in the order ``send`` was called, error responses in their place. The
    model starts its threads last-first and sends request n's response only after n-1's.
    (test_stream_response_order.py holds the stream's credits back so that the requests'
    tasks become ready together, which this client, reading fast, rarely makes happen.)"""
    rounds, size = 6, 8
    read = _rounds_in_order(server, rounds, size)
    for r, answers in enumerate(read):
        expected = [
            f"request {n} fails" if n % 3 == 0 else [[float(n)]]
            for n in range(r * size, (r + 1) * size)
        ]
        got = [a if isinstance(a, str) else a.tolist() for a in answers]
        assert got == expected, f"round {r}"


def test_a_streams_request_goes_on_after_an_error_response(server: Served) -> None:
    """As in Triton, an error response of a decoupled model ends nothing: the client reads
    it in its place among the request's responses, and the responses the model sends after
    it, up to the final flag (here an empty final response)."""
    received: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: received.put(error or result))
        value = grpcclient.InferInput("IN", [1], "INT32")
        value.set_data_from_numpy(np.array([1], np.int32))
        client.async_stream_infer(
            "error_midway", [value], request_id="r", enable_empty_final_response=True
        )
        got = [received.get(timeout=10) for _ in range(4)]
        client.stop_stream()
    assert received.empty(), received.get()
    first, error, third, final = got
    assert first.as_numpy("OUT").tolist() == [0]
    assert isinstance(error, InferenceServerException)
    assert error.message() == "response 1 fails"  # in the stream: a message, no status
    assert third.as_numpy("OUT").tolist() == [2]
    response = final.get_response()
    assert response.id == "r"
    assert response.parameters["triton_final_response"].bool_param
    assert not response.outputs
