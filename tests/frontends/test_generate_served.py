"""Triton's generate extension under ``orchestrion serve``: ``/generate`` and
``/generate_stream`` (server-sent events) for a decoupled model, a plain one and a streaming
ensemble (``tests/generate_models``), with Triton's request mapping and error texts, events
sent as they are made, and a client that leaves mid-stream cancelling the model."""

from __future__ import annotations

import http.client
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrion.testing import Served, get
from support.served import MODELS, start_server

GENERATE_MODELS = MODELS.parent / "generate_models"
EVENT_STREAM = "text/event-stream; charset=utf-8"


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server(repository=GENERATE_MODELS)
    yield served
    assert served.stop() == 0, served.text()


def _post(
    served: Served, model: str, route: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, str, bytes]:
    """One request: the status, the Content-Type and the whole body."""
    connection = http.client.HTTPConnection(served.http, timeout=30)
    try:
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        connection.request("POST", f"/v2/models/{model}/{route}", data, headers or {})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


def _events(body: bytes) -> list[dict[str, Any]]:
    """The server-sent events of a whole body, each exactly ``data: <json>\\n\\n``."""
    assert body.endswith(b"\n\n") or not body, body
    parts = body.split(b"\n\n")[:-1]
    assert all(part.startswith(b"data: ") for part in parts), body
    return [json.loads(part[len(b"data: ") :]) for part in parts]


def test_generate_answers_one_json_object_with_the_request_id(server: Served) -> None:
    """``/generate`` on a decoupled model: the outputs by name (one element: the element),
    the model and its version, and the request's ``id`` when it had a non-empty one."""
    request = {"PROMPT": "hello world", "STREAM": False, "id": "42"}
    status, kind, body = _post(server, "words", "generate", request)
    assert (status, kind) == (200, "application/json"), body
    assert json.loads(body) == {
        "id": "42",
        "model_name": "words",
        "model_version": "1",
        "TEXT": "hello world",
    }
    for request in ({"PROMPT": "hi", "STREAM": False}, {"PROMPT": "hi", "STREAM": False, "id": ""}):
        status, _, body = _post(server, "words", "generate", request)
        assert status == 200
        assert "id" not in json.loads(body)


def test_generate_stream_sends_one_event_per_response(server: Served) -> None:
    """Each word is one ``data:`` event; the final flag that comes alone adds none."""
    request = {"PROMPT": ["one two three"], "STREAM": True}
    status, kind, body = _post(server, "words", "generate_stream", request)
    assert (status, kind) == (200, EVENT_STREAM), body
    assert [event["TEXT"] for event in _events(body)] == ["one", "two", "three"]


def test_members_map_to_inputs_and_parameters_nested_ones_too(server: Served) -> None:
    """A list becomes an input of the model's dims (``LIMIT``: [1, -1]); members that name
    no input are request parameters, at the top level or inside ``parameters``."""
    request = {
        "PROMPT": "a b c d",
        "STREAM": True,
        "LIMIT": [2, 99],
        "parameters": {"ROUNDS": 2},
    }
    status, _, body = _post(server, "words", "generate_stream", request)
    assert status == 200, body
    assert [event["TEXT"] for event in _events(body)] == ["a", "b", "a", "b"]
    request = {"PROMPT": "a b", "STREAM": True, "ROUNDS": 3}
    assert len(_events(_post(server, "words", "generate_stream", request)[2])) == 6


def test_events_leave_as_the_model_makes_them(server: Served) -> None:
    """With 0.4 s between responses, each event arrives about 0.4 s after the one before:
    nothing waits for the end of the stream."""
    connection = http.client.HTTPConnection(server.http, timeout=30)
    try:
        body = {"PROMPT": "x y z", "STREAM": True, "PAUSE": 0.4}
        connection.request("POST", "/v2/models/words/generate_stream", json.dumps(body))
        response = connection.getresponse()
        assert response.status == 200
        arrivals = []
        for _ in range(3):
            line = response.readline()
            assert line.startswith(b"data: "), line
            arrivals.append(time.monotonic())
            assert response.readline() == b"\n"
        assert response.read() == b""
    finally:
        connection.close()
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert all(0.25 < gap < 2.0 for gap in gaps), gaps


MISSING_ALL = "expected number of inputs between 2 and 3 but got 0 inputs for model 'words'"
MISSING_ONE = "expected number of inputs between 2 and 3 but got 1 inputs for model 'words'"
NOT_STRING = "attempt to access JSON non-string as string"
NOT_BOOL = "attempt to access JSON non-boolean as boolean"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({}, 400, MISSING_ALL),
        ({"other": 1}, 400, MISSING_ALL),
        ({"PROMPT": "x"}, 400, MISSING_ONE),
        ({"STREAM": False, "other": "x"}, 400, MISSING_ONE),
        ({"PROMPT": 123, "STREAM": False}, 400, NOT_STRING),
        ({"PROMPT": "x", "STREAM": "false"}, 400, NOT_BOOL),
        ({"PROMPT": True, "STREAM": 123}, 400, NOT_STRING),  # members are read in order
        ({"STREAM": 123, "PROMPT": True}, 400, NOT_BOOL),
        ({"PROMPT": {"user": "x"}, "STREAM": False}, 400, NOT_STRING),
        ({"PROMPT": "x", "STREAM": False, "LIMIT": [1.5]}, 400, "non-signed-integer"),
        (
            '{"PROMPT": "x", "STREAM": false, "PROMPT": "y"}',
            400,
            "input 'PROMPT' already exists in request",
        ),
        (
            '{"PROMPT": "x", "STREAM": false, "STREAM": true, "PROMPT": "y"}',
            400,
            "input 'STREAM' already exists in request",
        ),
        (
            {"PROMPT": "x", "STREAM": False, "P": {"a": 1}},
            400,
            "parameter 'P' has invalid type. It should be either 'int', 'bool', or 'string'.",
        ),
        (
            {"PROMPT": "x", "STREAM": False, "parameters": 1},
            400,
            "Expected JSON object for keyword: 'parameters'",
        ),
        (
            {"PROMPT": "x", "STREAM": False, "parameters": {"n": {"m": 1}}},
            400,
            "Converting keyword: 'parameters': parameter 'n' has invalid type.",
        ),
        (
            {"PROMPT": ["x", "y"], "STREAM": False},
            400,
            "The schema can not convert input 'PROMPT' to tensor with proper shape",
        ),
        ({"PROMPT": "x", "STREAM": False, "id": 7}, 400, "Unable to parse 'id'"),
        ('{"PROMPT": ', 400, "failed to parse the request JSON"),
        ("[1, 2]", 400, "failed to parse the request JSON buffer: not an object"),
    ],
)
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_a_refused_request_is_a_json_error_on_both_routes(
    server: Served, route: str, body: Any, status: int, message: str
) -> None:
    """Errors found before the model runs: Triton's status and words, as JSON (never an
    event stream), on both routes."""
    got, kind, answer = _post(server, "words", route, body)
    assert (got, kind) == (status, "application/json"), answer
    assert message in json.loads(answer)["error"]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_unknown_model_wrong_method_and_compressed_body(server: Served, route: str) -> None:
    """404 for an unknown model, 405 for a GET, 400 for a compressed body."""
    assert _post(server, "nothing_here", route, {})[0] == 404
    status, _ = get(server.http, f"/v2/models/words/{route}")
    assert status == 405
    status, _, body = _post(server, "words", route, b"x", {"Content-Encoding": "gzip"})
    assert status == 400
    assert "only 'identity' is supported" in json.loads(body)["error"]


def test_an_error_as_the_first_response_sets_the_status(server: Served) -> None:
    """No word, then the model's error: the stream's status is the error's (500, Triton's
    default code), and its one event holds the error."""
    request = {"PROMPT": "", "STREAM": True, "BREAK": True}
    status, kind, body = _post(server, "words", "generate_stream", request)
    assert (status, kind) == (500, EVENT_STREAM), body
    assert _events(body) == [{"error": "the words ran out"}]


def test_an_error_after_the_first_response_is_the_last_event(server: Served) -> None:
    """One word, then the model's error: 200, the word, then the error as an event."""
    request = {"PROMPT": "only", "STREAM": True, "BREAK": True}
    status, _, body = _post(server, "words", "generate_stream", request)
    assert status == 200, body
    assert [e.get("TEXT", e.get("error")) for e in _events(body)] == ["only", "the words ran out"]


@pytest.mark.parametrize("prompt", ["", "two words"], ids=["none", "two"])
def test_generate_wants_exactly_one_response(server: Served, prompt: str) -> None:
    """``/generate`` on a stream of zero or two responses: refused, pointing to
    ``/generate_stream``; the stream route serves both."""
    request = {"PROMPT": prompt, "STREAM": True}
    status, kind, body = _post(server, "words", "generate", request)
    assert (status, kind) == (400, "application/json")
    assert "generate expects model to produce exactly 1 response" in json.loads(body)["error"]
    status, _, body = _post(server, "words", "generate_stream", request)
    assert status == 200
    assert len(_events(body)) == len(prompt.split())


def test_an_output_with_no_element_is_an_empty_list(server: Served) -> None:
    """An output of shape [1, 0] (an LLM that ends at once) is ``[]``."""
    request = {"PROMPT": "x", "STREAM": False, "NOTHING": True}
    status, _, body = _post(server, "words", "generate", request)
    assert status == 200, body
    assert json.loads(body)["TEXT"] == []


def test_a_plain_model_answers_both_routes_with_its_response_parameters(server: Served) -> None:
    """A model that is not decoupled: one object on ``/generate``, one event on
    ``/generate_stream``; its response parameters are members of the object."""
    expected = {"model_name": "shout", "model_version": "1", "LOUD": "HEY", "length": 3}
    status, _, body = _post(server, "shout", "generate", {"TEXT": "hey"})
    assert (status, json.loads(body)) == (200, expected)
    status, _, body = _post(server, "shout", "generate_stream", {"TEXT": ["hey"]})
    assert (status, _events(body)) == (200, [expected])


def test_a_streaming_ensemble_streams_each_step_response(server: Served) -> None:
    """``spoken`` (words, then shout on each): one event per word, upper-cased, named as the
    ensemble."""
    request = {"PROMPT": "quiet little words", "STREAM": True}
    status, _, body = _post(server, "spoken", "generate_stream", request)
    assert status == 200, body
    events = _events(body)
    assert [event["LOUD"] for event in events] == ["QUIET", "LITTLE", "WORDS"]
    assert {event["model_name"] for event in events} == {"spoken"}


def test_closing_the_connection_mid_stream_cancels_the_model(server: Served) -> None:
    """A client that reads one event and leaves: the model sees its request cancelled and
    stops (its log line), and the server serves on."""
    connection = http.client.HTTPConnection(server.http, timeout=30)
    try:
        body = {"PROMPT": "w " * 50, "STREAM": True, "PAUSE": 0.1}
        connection.request("POST", "/v2/models/words/generate_stream", json.dumps(body))
        response = connection.getresponse()
        assert response.readline().startswith(b"data: ")
    finally:
        connection.close()
    deadline = time.monotonic() + 10
    while "words: cancelled" not in server.text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "words: cancelled" in server.text()
    assert get(server.http, "/v2/health/live")[0] == 200


def test_input_size_limits_count_the_tensors_as_well_as_the_body() -> None:
    """``--http-max-input-size``: a body over it is refused (413, Triton's words), and so
    is a smaller body whose JSON numbers make tensors over it (1,500 INT32: 6,000 bytes;
    before them, PROMPT's 5 bytes as serialized and STREAM's 1)."""
    served = start_server("--http-max-input-size", "4096", repository=GENERATE_MODELS)
    try:
        request = {"PROMPT": "x" * 5000, "STREAM": False}
        status, _, body = _post(served, "words", "generate", request)
        assert status == 413
        assert " bytes exceeds the maximum allowed input size of 4096" in body.decode()
        request = {"PROMPT": "x", "STREAM": False, "LIMIT": [1] * 1500}
        compact = json.dumps(request, separators=(",", ":"))
        assert len(compact) < 4096
        status, _, body = _post(served, "words", "generate", compact)
        assert status == 400
        assert json.loads(body)["error"] == (
            "request size of 6 bytes with input 'LIMIT' of size 6000 bytes exceeds the "
            "maximum allowed input size of 4096. Use --http-max-input-size to increase the "
            "limit."
        )
    finally:
        assert served.stop() == 0, served.text()
