"""The mixed load of the reliability tests and bench/soak.py: request ``index`` (its model,
inputs and expected answer), how to send it over HTTP, and how to check the answer.

The models are those of the tests' repository (tests/kserve_models): ``pipeline`` (a cached
ensemble: ``x * 2 + 1``, then two sums and a negation), ``fragile`` (fails on negative
inputs), ``square`` and ``identity_batch``."""

from __future__ import annotations

import http.client
import json
from typing import Any

import numpy as np
from tritonclient.utils import InferenceServerException

from orchestrion import AsyncServer, DataType, InferenceError
from orchestrion.testing._builders import assert_idle


def case(index: int) -> tuple[str, dict[str, np.ndarray[Any, Any]], Any]:
    """Request ``index``: model, inputs and the expected outputs (or the expected error)."""
    kind = index % 4
    rng = np.random.default_rng(index % 50)  # inputs repeat: the pipeline's cache gets hits
    if kind == 0:
        x = rng.standard_normal((1, 16)).astype(np.float32)
        pre = x * 2 + 1
        expected = {"CLASS": np.stack([pre[:, :8].sum(1), pre[:, 8:].sum(1)], 1), "SEG": -pre}
        return "pipeline", {"INPUT": x}, expected
    if kind == 1:
        value = np.array([float(index % 7) - 2.0], np.float32)  # negative: the model fails
        outcome: Any = InferenceError if value[0] < 0 else {"Y": value + 1}
        return "fragile", {"X": value}, outcome
    if kind == 2:
        y = np.array([index % 1000], np.int32)
        return "square", {"Y": y}, {"Z": y * y}
    x = rng.integers(-100, 100, size=(2, 3)).astype(np.int64)
    return "identity_batch", {"IN_INT64": x}, {"OUT_INT64": x}


def check(index: int, outcome: Any) -> None:
    """Assert that ``outcome`` is the right answer (or the right error) to request ``index``."""
    _, _, expected = case(index)
    if expected is InferenceError:
        assert isinstance(outcome, InferenceError | InferenceServerException), (index, outcome)
        return
    assert isinstance(outcome, dict), (index, outcome)
    assert outcome.keys() == expected.keys(), (index, outcome.keys())
    for name, want in expected.items():
        np.testing.assert_allclose(outcome[name], want, rtol=1e-5, err_msg=f"{index} {name}")


async def embedding_round(
    server: AsyncServer, requests: int, concurrency: int = 128
) -> dict[int, Any]:
    """Requests 0 to ``requests - 1`` through the embedding API, ``concurrency`` at a time:
    each index's outputs, or its `InferenceError`. Each index is answered once."""
    import trio

    answers: dict[int, Any] = {}
    todo = iter(range(requests))

    async def client() -> None:
        for index in todo:
            model, inputs, _ = case(index)
            assert index not in answers
            try:
                answers[index] = dict((await server.infer(model, inputs)).outputs)
            except InferenceError as exc:
                answers[index] = exc

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    assert sorted(answers) == list(range(requests))
    return answers


def at_rest(server: AsyncServer) -> None:
    """Every count, step, slot and queue of the server (and its cache actor) at rest."""
    assert_idle(server, "pipeline")
    cache = server.cache_statistics()
    assert cache is not None
    assert cache.queue_depth == 0


def grpc_inputs(index: int) -> tuple[str, list[Any]]:
    """Request ``index`` for tritonclient.grpc: its model and its inputs."""
    import tritonclient.grpc as grpcclient

    model, inputs, _ = case(index)
    items = []
    for name, value in inputs.items():
        item = grpcclient.InferInput(
            name, list(value.shape), DataType.from_numpy(value.dtype).value
        )
        item.set_data_from_numpy(value)
        items.append(item)
    return model, items


def http_call(address: str, index: int, connection: http.client.HTTPConnection) -> Any:
    """Request ``index`` over HTTP with binary tensors: its outputs, or its error."""
    model, inputs, _ = case(index)
    header = {
        "inputs": [
            {
                "name": name,
                "datatype": DataType.from_numpy(v.dtype).value,
                "shape": list(v.shape),
                "parameters": {"binary_data_size": v.nbytes},
            }
            for name, v in inputs.items()
        ],
        "parameters": {"binary_data_output": True},
    }
    head = json.dumps(header).encode()
    body = head + b"".join(v.tobytes() for v in inputs.values())
    connection.request(
        "POST",
        f"/v2/models/{model}/infer",
        body,
        {"Inference-Header-Content-Length": str(len(head))},
    )
    response = connection.getresponse()
    data = response.read()
    if response.status != 200:
        return InferenceServerException(json.loads(data)["error"], status=str(response.status))
    length = int(response.getheader("Inference-Header-Content-Length") or "")
    document = json.loads(data[:length])
    outputs, offset = {}, length
    for output in document["outputs"]:
        size = output["parameters"]["binary_data_size"]
        dtype = DataType(output["datatype"]).numpy_dtype
        outputs[output["name"]] = np.frombuffer(data[offset : offset + size], dtype).reshape(
            output["shape"]
        )
        offset += size
    return outputs
