"""`RequestOptions`: one definition of a request's fields, taken as keywords or as an object."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np
import pytest

import orchestrion
from orchestrion import InvalidRequestError, RequestOptions
from orchestrion.protocols import new_request
from orchestrion.protocols._kserve_http import decode_http_request
from orchestrion.testing import model, tensor


def _echo() -> orchestrion.Model:
    def echo(X: Any, request: Any) -> dict[str, Any]:
        seen = {
            "id": request.request_id,
            "parameters": dict(request.parameters),
            "priority": request.priority,
            "timeout": request.timeout,
            "sequence": [request.sequence_id, request.sequence_start, request.sequence_end],
        }
        return {"INFO": np.array([json.dumps(seen).encode()], dtype=object)}

    return model(
        "echo", echo, [tensor("X", dims=(1,))], [tensor("INFO", "BYTES", dims=(1,))], jit=False
    )


def _seen(response: orchestrion.InferResponse) -> dict[str, Any]:
    seen: dict[str, Any] = json.loads(response.outputs["INFO"][0])
    return seen


async def test_options_and_keywords_make_the_same_request() -> None:
    """``options=`` gives the model what the same keywords give; keywords override it."""
    x = np.zeros(1, np.float32)
    fields: dict[str, Any] = {
        "request_id": "r",
        "parameters": {"tenant": "t"},
        "priority": 2,
        "timeout": 30,
        "sequence_id": 7,
        "sequence_start": True,
    }
    async with orchestrion.open_server(models=[_echo()]) as server:
        by_keywords = _seen(await server.infer("echo", {"X": x}, **fields))
        options = RequestOptions(**fields)
        assert _seen(await server.infer("echo", {"X": x}, options=options)) == by_keywords
        overridden = await server.infer("echo", {"X": x}, options=options, priority=5)
    assert by_keywords == {
        "id": "r",
        "parameters": {"tenant": "t"},
        "priority": 2,
        "timeout": 30.0,
        "sequence": [7, True, False],
    }
    assert _seen(overridden)["priority"] == 5
    assert options.priority == 2  # frozen: the caller's options are not changed


def test_fields_are_checked_once_whichever_way_in() -> None:
    """Construction checks each field (the embedding API's messages); the outputs and request
    id take their normal form."""
    with pytest.raises(InvalidRequestError, match="priority must be a non-negative integer"):
        RequestOptions(priority=-1)
    with pytest.raises(InvalidRequestError, match="outputs must be a list of output names"):
        RequestOptions(outputs="Y")  # type: ignore[arg-type]
    options = RequestOptions(outputs=["A", "A"], request_id=None)
    assert (options.outputs, options.request_id) == (frozenset({"A"}), "")
    assert RequestOptions(outputs=[]).outputs is None
    with pytest.raises(InvalidRequestError, match="timeout must be a positive"):
        attrs.evolve(options, timeout=0)


def test_arguments_are_checked_in_their_order() -> None:
    """Unknown keywords first (as Python does), then the model name and inputs, then the
    fields; the request holds the options, whose parameters nobody can change."""
    with pytest.raises(TypeError, match=r"AsyncServer.infer\(\) got an unexpected keyword"):
        new_request("", {}, None, {"bogus": 1}, caller="AsyncServer.infer")
    with pytest.raises(InvalidRequestError, match="model_name must be"):
        new_request("", {}, None, {"priority": -1})
    with pytest.raises(InvalidRequestError, match="options must be a RequestOptions"):
        new_request("m", {}, {"priority": 1})  # type: ignore[arg-type]
    given = {"a": 1}
    options = RequestOptions(parameters=given, timeout=2)
    given["a"] = 2  # the caller's dict was copied
    request, used = new_request("m", {}, options)
    assert used is options
    assert request.options is options
    assert request.parameters == {"a": 1}
    with pytest.raises(TypeError):
        request.parameters["a"] = 3  # type: ignore[index]
    derived = request.derive(model_name="s", model_version=1, inputs={}, requested_outputs=None)
    assert derived.options is options
    held = {"a": 1}
    proxied = RequestOptions(parameters=MappingProxyType(held))
    held["a"] = 2  # a read-only view the caller made is copied too
    assert proxied.parameters == {"a": 1}
    with pytest.raises(InvalidRequestError, match=r"parameters\['b'\] must be a str"):
        RequestOptions(parameters=MappingProxyType({"b": [1]}))  # and checked
    assert request.timeout == 2.0
    assert isinstance(request.timeout, float)


async def test_stream_infer_takes_no_timeout() -> None:
    """As before, ``timeout=`` is no keyword of stream_infer; options with one are refused."""
    async with orchestrion.open_server(models=[_echo()]) as server:
        x = {"X": np.zeros(1, np.float32)}
        with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
            async for _ in server.stream_infer("echo", x, timeout=1):
                pass
        with pytest.raises(InvalidRequestError, match="takes no timeout"):
            async for _ in server.stream_infer("echo", x, options=RequestOptions(timeout=1)):
                pass
        responses = [r async for r in server.stream_infer("echo", x, request_id="s")]
    assert [_seen(r)["id"] for r in responses] == ["s"]


def test_blocking_server_refuses_unknown_keywords_at_once() -> None:
    """The blocking facade names itself, even before the server is open."""
    with pytest.raises(TypeError, match=r"Server.infer\(\) got an unexpected keyword"):
        orchestrion.Server().infer("m", {}, bogus=1)


def test_http_decoder_reads_into_request_options() -> None:
    """The wire's version, outputs, id and reserved parameters land in the options."""
    body = json.dumps(
        {
            "id": "w",
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1.0]}],
            "outputs": [{"name": "Y"}],
            "parameters": {"priority": 3, "timeout": 250000, "custom": 1},
        }
    ).encode()
    wire = decode_http_request("m", "2", body, None)
    assert wire.options == RequestOptions(
        model_version=2,
        outputs=["Y"],
        request_id="w",
        parameters={"custom": 1},
        priority=3,
        timeout=0.25,
    )
