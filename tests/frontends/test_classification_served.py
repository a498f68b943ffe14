"""Triton's classification extension through `orchestrion serve`, with tritonclient: an output
asked for with ``class_count`` comes back as its top classes, ``"score:index[:label]"``, per
batch item for a batching model and as a whole for the others, labels from the output's
``label_filename`` (tests/kserve_models/simple/labels.txt names classes 0-11 only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served
from support.served import start_server

PROTOCOLS = ["http-json", "http-binary", "grpc"]


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server()
    yield served
    assert served.stop() == 0, served.text()


def _client(server: Served, protocol: str) -> tuple[Any, Any]:
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(server.grpc)
    return httpclient, httpclient.InferenceServerClient(server.http)


def _requested(module: Any, name: str, count: int, protocol: str) -> Any:
    if module is httpclient:
        return module.InferRequestedOutput(
            name, binary_data=protocol == "http-binary", class_count=count
        )
    return module.InferRequestedOutput(name, class_count=count)


def _texts(array: np.ndarray[Any, Any]) -> list[Any]:
    return np.vectorize(lambda v: v.decode() if isinstance(v, bytes) else v, otypes=[object])(
        array
    ).tolist()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_batch_gets_its_top_classes_per_item_with_labels(server: Served, protocol: str) -> None:
    """``simple`` (INT32, batching, labelled) with a batch of two: the three highest sums of
    each item, highest first, labelled where labels.txt has a line for the index."""
    module, client = _client(server, protocol)
    a = np.array([np.arange(16), np.arange(16)[::-1]], dtype=np.int32)
    b = np.zeros((2, 16), dtype=np.int32)
    b[1, 13] = 100
    inputs = [
        module.InferInput("INPUT0", [2, 16], "INT32"),
        module.InferInput("INPUT1", [2, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    outputs = [_requested(module, "OUTPUT0", 3, protocol), module.InferRequestedOutput("OUTPUT1")]
    result = client.infer("simple", inputs, outputs=outputs)
    assert _texts(result.as_numpy("OUTPUT0")) == [
        ["15:15", "14:14", "13:13"],
        ["102:13", "15:0:class-0", "14:1:class-1"],
    ]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)  # untouched
    client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_float_scores_are_written_as_triton_writes_them(server: Served, protocol: str) -> None:
    """``classify`` (FP32, no labels): six decimals, as C's %f; more classes asked than
    the output has gives them all."""
    module, client = _client(server, protocol)
    x = np.zeros((1, 16), dtype=np.float32)
    x[0, :8] = 0.125
    x[0, 8:] = 0.5
    item = module.InferInput("X", [1, 16], "FP32")
    item.set_data_from_numpy(x)
    result = client.infer("classify", [item], outputs=[_requested(module, "CLASS", 5, protocol)])
    assert _texts(result.as_numpy("CLASS")) == [["4.000000:1", "1.000000:0"]]
    output = result.get_output("CLASS")
    described = (
        (output["datatype"], output["shape"])
        if module is httpclient
        else (
            output.datatype,
            list(output.shape),
        )
    )
    assert described == ("BYTES", [1, 2])
    client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_model_that_does_not_batch_is_classified_as_a_whole(
    server: Served, protocol: str
) -> None:
    """``identity_plain`` (no batching): the whole [2, 3] tensor is one set of six classes;
    ties keep the lower index first."""
    module, client = _client(server, protocol)
    x = np.array([[5, 1, 9], [9, 0, 3]], dtype=np.int64)
    item = module.InferInput("IN_INT64", [2, 3], "INT64")
    item.set_data_from_numpy(x)
    result = client.infer(
        "identity_plain", [item], outputs=[_requested(module, "OUT_INT64", 4, protocol)]
    )
    assert _texts(result.as_numpy("OUT_INT64")) == ["9:2", "9:3", "5:0", "3:5"]
    client.close()


@pytest.mark.parametrize("protocol", ["http-json", "grpc"])
def test_outputs_without_an_order_are_refused(server: Served, protocol: str) -> None:
    """BYTES and FP16 have no scores to rank: a clear error naming the output and its type."""
    module, client = _client(server, protocol)
    x = np.array([[b"a", b"b"]], dtype=object)
    item = module.InferInput("IN_BYTES", [1, 2], "BYTES")
    item.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(
            "identity_batch", [item], outputs=[_requested(module, "OUT_BYTES", 1, protocol)]
        )
    assert "class result not available for output 'OUT_BYTES' due to unsupported type 'BYTES'" in (
        str(caught.value)
    )
    client.close()


def test_classification_and_shared_memory_cannot_be_asked_together(server: Served) -> None:
    """Triton's rule and words, on both protocols."""
    for module, address in ((httpclient, server.http), (grpcclient, server.grpc)):
        client = module.InferenceServerClient(address)
        item = module.InferInput("X", [1, 16], "FP32")
        item.set_data_from_numpy(np.zeros((1, 16), np.float32))
        requested = module.InferRequestedOutput("CLASS")
        if module is httpclient:  # the client itself refuses to ask both: set them by hand
            requested._parameters.update(
                classification=2, shared_memory_region="r", shared_memory_byte_size=8
            )
        else:
            parameters = requested._output.parameters
            parameters["classification"].int64_param = 2
            parameters["shared_memory_region"].string_param = "r"
            parameters["shared_memory_byte_size"].int64_param = 8
        with pytest.raises(InferenceServerException) as caught:
            client.infer("classify", [item], outputs=[requested])
        assert "t set both 'shared_memory_region' and 'classification'" in str(caught.value)
        client.close()
