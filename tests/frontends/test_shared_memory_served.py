"""System shared memory (Triton's extension) through `orchestrion serve`, with tritonclient's
own clients and shared memory utilities: inputs read from and outputs written into the
client's regions, over HTTP and gRPC, and every way a client can get it wrong (unknown
regions, offsets and sizes outside them, a region shrunk or removed after registering,
thousands of registrations), each a clear error, the server serving on with no descriptor
leaked.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import (
    InferenceServerException,
    serialize_byte_tensor,
    serialized_byte_size,
)

from orchestrion.testing import Served, pending, post
from support.served import start_server

from .test_triton_clients_against_serve import TYPES, _sample


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server("--max-shm-regions", "300")
    yield served
    assert served.stop() == 0, served.text()


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, server: Served) -> Iterator[Any]:
    """A tritonclient of either protocol, with no region registered before or after."""
    module = httpclient if request.param == "http" else grpcclient
    made = module.InferenceServerClient(server.http if module is httpclient else server.grpc)
    made.unregister_system_shared_memory()
    yield made
    made.unregister_system_shared_memory()
    made.close()


@pytest.fixture
def regions() -> Iterator[dict[str, Any]]:
    """Shared memory regions made by a test (by name), destroyed after it."""
    made: dict[str, Any] = {}
    yield made
    for handle in made.values():
        with contextlib.suppress(shm.SharedMemoryException):  # the test removed it itself
            shm.destroy_shared_memory_region(handle)


def _region(regions: dict[str, Any], name: str, size: int) -> tuple[Any, str]:
    key = f"/orchestrion_test_{uuid.uuid4().hex[:12]}"
    regions[name] = shm.create_shared_memory_region(name, key, size)
    return regions[name], key


def _module(client: Any) -> Any:
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def _status_names(client: Any) -> list[str]:
    status = client.get_system_shared_memory_status()
    if isinstance(status, list):
        return sorted(region["name"] for region in status)
    return sorted(status.regions)


def _descriptors(served: Served) -> int:
    """The server's open descriptors of this module's shared memory objects."""
    folder = f"/proc/{served.process.pid}/fd"
    count = 0
    for fd in os.listdir(folder):
        with contextlib.suppress(FileNotFoundError):  # closed since it was listed
            count += os.readlink(f"{folder}/{fd}").startswith("/dev/shm/orchestrion_test_")
    return count


def _simple(client: Any, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> Any:
    """``simple`` with its inputs in the request (to show the server serves on)."""
    module = _module(client)
    inputs = [
        module.InferInput("INPUT0", [1, 16], "INT32"),
        module.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return client.infer("simple", inputs)


def _shm_inputs(module: Any, region: str, size: int, offsets: tuple[int, int]) -> list[Any]:
    inputs = [
        module.InferInput("INPUT0", [1, 16], "INT32"),
        module.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    for item, offset in zip(inputs, offsets, strict=True):
        item.set_shared_memory(region, size, offset=offset)
    return inputs


def test_inputs_and_outputs_travel_through_shared_memory(
    client: Any, regions: dict[str, Any]
) -> None:
    """Both inputs from one region at two offsets, both outputs into another at two offsets:
    the response names the outputs without their data, and the region holds the results."""
    module = _module(client)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    size = a.nbytes
    ins, in_key = _region(regions, "in", 2 * size + 8)
    outs, out_key = _region(regions, "out", 2 * size + 16)
    shm.set_shared_memory_region(ins, [a], offset=8)
    shm.set_shared_memory_region(ins, [b], offset=8 + size)
    client.register_system_shared_memory("in", in_key, 2 * size, offset=8)
    client.register_system_shared_memory("out", out_key, 2 * size + 16)
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("out", size, offset=16)
    outputs[1].set_shared_memory("out", size, offset=16 + size)

    result = client.infer("simple", _shm_inputs(module, "in", size, (0, size)), outputs=outputs)

    for name in ("OUTPUT0", "OUTPUT1"):  # described, without data (as Triton answers)
        output = result.get_output(name)
        if module is httpclient:
            assert output == {"name": name, "datatype": "INT32", "shape": [1, 16]}
        else:
            assert (output.datatype, list(output.shape)) == ("INT32", [1, 16])
            assert not result.get_response().raw_output_contents[int(name[-1])]
    got0 = shm.get_contents_as_numpy(outs, np.int32, [1, 16], offset=16)
    got1 = shm.get_contents_as_numpy(outs, np.int32, [1, 16], offset=16 + size)
    np.testing.assert_array_equal(got0, a + b)
    np.testing.assert_array_equal(got1, a - b)
    assert _status_names(client) == ["in", "out"]
    client.unregister_system_shared_memory("in")
    assert _status_names(client) == ["out"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_data_type_round_trips_through_shared_memory(
    server: Served, regions: dict[str, Any], protocol: str
) -> None:
    """Every data type (BYTES with its length prefixes too) in and out through shared
    memory, bit for bit, next to a request that sends the same tensors in the body."""
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http if protocol == "http" else server.grpc)
    arrays = {t: _sample(t, (2, 3), seed) for seed, t in enumerate(TYPES)}
    inputs, outputs = [], []
    for datatype, array in arrays.items():
        serialized = serialize_byte_tensor(array) if datatype == "BYTES" else array
        size = serialized_byte_size(serialized) if datatype == "BYTES" else array.nbytes
        handle, key = _region(regions, f"in_{datatype}", size)
        shm.set_shared_memory_region(handle, [serialized])
        client.register_system_shared_memory(f"in_{datatype}", key, size)
        item = module.InferInput(f"IN_{datatype}", list(array.shape), datatype)
        item.set_shared_memory(f"in_{datatype}", size)
        inputs.append(item)
        _out_handle, out_key = _region(regions, f"out_{datatype}", size + 64)
        client.register_system_shared_memory(f"out_{datatype}", out_key, size + 64)
        requested = module.InferRequestedOutput(f"OUT_{datatype}")
        requested.set_shared_memory(f"out_{datatype}", size + 64)
        outputs.append(requested)
    try:
        client.infer("identity_batch", inputs, outputs=outputs)
        for datatype, array in arrays.items():
            handle = regions[f"out_{datatype}"]
            if datatype == "BYTES":
                got = shm.get_contents_as_numpy(handle, np.object_, list(array.shape))
                assert got.tolist() == array.tolist()
            else:
                got = shm.get_contents_as_numpy(
                    handle, np.dtype(TYPES[datatype]), list(array.shape)
                )
                assert got.tobytes() == array.tobytes(), datatype
    finally:
        client.unregister_system_shared_memory()
        client.close()


def _refused(call: Any, *texts: str) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    message = str(caught.value)
    for text in texts:
        assert text in message, message
    return message


def test_bad_registrations_are_refused_and_nothing_is_held(
    client: Any, server: Served, regions: dict[str, Any]
) -> None:
    """Registering a missing object, a key outside /dev/shm, a part past the object's end,
    a taken name or negative sizes: each a clear error; no descriptor stays open."""
    _handle, key = _region(regions, "r", 64)
    before = _descriptors(server)
    _refused(
        lambda: client.register_system_shared_memory("x", "/orchestrion_no_such_object", 8),
        "Unable to open shared memory region: '/orchestrion_no_such_object'",
    )
    for bad in ("/../etc/passwd", "/a/b", "//", "", "/.."):
        _refused(
            lambda bad=bad: client.register_system_shared_memory("x", bad, 8), "invalid shm key"
        )
    _refused(
        lambda: client.register_system_shared_memory("x", key, 60, offset=8),
        "failed to register shared memory region 'x': invalid args",
    )
    client.register_system_shared_memory("r", key, 64)
    _refused(lambda: client.register_system_shared_memory("r", key, 8), "'r' already in manager")
    assert _status_names(client) == ["r"]
    client.unregister_system_shared_memory("no_such_region")  # Triton: no error
    client.unregister_system_shared_memory("r")
    assert _descriptors(server) == before


def test_bad_places_in_requests_are_refused_and_the_server_serves_on(
    client: Any, server: Served, regions: dict[str, Any]
) -> None:
    """An unregistered region, an offset past the region, a size past its end, a size that
    does not match the tensor, an output region too small: each a clear error naming it,
    nothing written, and the next request answered."""
    module = _module(client)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    handle, key = _region(regions, "in", 128)
    out_handle, out_key = _region(regions, "out", 128)
    shm.set_shared_memory_region(handle, [a, a])
    shm.set_shared_memory_region(out_handle, [np.full(32, 7, np.int32)])
    client.register_system_shared_memory("in", key, 128)
    client.register_system_shared_memory("out", out_key, 128)
    missing = _shm_inputs(module, "nowhere", 64, (0, 0))
    _refused(
        lambda: client.infer("simple", missing), "Unable to find shared memory region: 'nowhere'"
    )
    _refused(
        lambda: client.infer("simple", _shm_inputs(module, "in", 64, (0, 128))),
        "Invalid offset for shared memory region: 'in'",
    )
    _refused(
        lambda: client.infer("simple", _shm_inputs(module, "in", 64, (0, 100))),
        "Invalid offset + byte size for shared memory region: 'in'",
    )
    _refused(
        lambda: client.infer("simple", _shm_inputs(module, "in", 60, (0, 64))),
        "unexpected total byte size 60 for input 'INPUT0', expecting 64",
    )
    small = module.InferRequestedOutput("OUTPUT0")
    small.set_shared_memory("out", 32)
    _refused(
        lambda: client.infer("simple", _shm_inputs(module, "in", 64, (0, 64)), outputs=[small]),
        "for output 'OUTPUT0' (32 bytes) should be at least 64 bytes",
    )
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [32]), 7)
    np.testing.assert_array_equal(_simple(client, a, a).as_numpy("OUTPUT0"), 2 * a)


def test_a_region_shrunk_or_removed_after_registering_is_an_error_not_a_crash(
    client: Any, server: Served, regions: dict[str, Any]
) -> None:
    """The client truncates one region and unlinks another after registering them: reading
    or writing them fails with a message saying so; the server lives and serves on."""
    module = _module(client)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    handle, key = _region(regions, "in", 128)
    shm.set_shared_memory_region(handle, [a, a])
    client.register_system_shared_memory("in", key, 128)
    _out_handle, out_key = _region(regions, "out", 128)
    client.register_system_shared_memory("out", out_key, 128)
    fd = os.open(f"/dev/shm{out_key}", os.O_RDWR)
    try:
        os.ftruncate(fd, 16)
    finally:
        os.close(fd)
    requested = module.InferRequestedOutput("OUTPUT0")
    requested.set_shared_memory("out", 64)
    _refused(
        lambda: client.infer("simple", _shm_inputs(module, "in", 64, (0, 64)), outputs=[requested]),
        "shared memory region 'out'",
        "shrank to 16 bytes",
    )
    shm.destroy_shared_memory_region(regions.pop("in"))  # shm_unlink
    _refused(
        lambda: client.infer("simple", _shm_inputs(module, "in", 64, (0, 64))),
        "shared memory region 'in'",
        "was removed",
    )
    np.testing.assert_array_equal(_simple(client, a, a).as_numpy("OUTPUT1"), 0 * a)


def test_registrations_are_bounded_and_unregistering_closes_them(
    server: Served, regions: dict[str, Any]
) -> None:
    """Thousands of registrations against a limit of 300: the first 300 hold, the rest are
    refused naming the limit; unregistering all gives every descriptor back."""
    _handle, key = _region(regions, "many", 64)
    client = httpclient.InferenceServerClient(server.http)
    client.unregister_system_shared_memory()
    before = _descriptors(server)
    refusals: list[str] = []
    try:
        for index in range(2000):
            try:
                client.register_system_shared_memory(f"many_{index}", key, 64)
            except InferenceServerException as exc:
                refusals.append(str(exc))
        assert len(refusals) == 1700
        assert all("300 regions are registered" in text for text in refusals), refusals[0]
        assert len(client.get_system_shared_memory_status()) == 300
        assert _descriptors(server) == before + 300
    finally:
        client.unregister_system_shared_memory()
    assert _descriptors(server) == before
    assert client.get_system_shared_memory_status() == []
    client.close()


def test_unregistering_a_region_in_use_waits_for_its_requests(
    server: Served, regions: dict[str, Any]
) -> None:
    """A region unregistered while a request reads from it: the request is answered from
    it, the region is gone from the status at once, and its descriptor closes afterwards."""
    handle, key = _region(regions, "delay", 4)
    shm.set_shared_memory_region(handle, [np.array([2.0], np.float32)])
    client = httpclient.InferenceServerClient(server.http)
    before = _descriptors(server)
    client.register_system_shared_memory("delay", key, 4)
    delay = httpclient.InferInput("DELAY", [1], "FP32")
    delay.set_shared_memory("delay", 4)
    answers: list[Any] = []
    grpc = grpcclient.InferenceServerClient(server.grpc)
    grpc_delay = grpcclient.InferInput("DELAY", [1], "FP32")
    grpc_delay.set_shared_memory("delay", 4)
    grpc.async_infer("sleepy", [grpc_delay], lambda result, error: answers.append((result, error)))
    deadline = time.monotonic() + 10
    while pending(server, "sleepy") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)  # until the request is in the model (it sleeps for 2 s)
    client.unregister_system_shared_memory("delay")
    assert client.get_system_shared_memory_status() == []
    assert _descriptors(server) == before + 1  # held by the request
    while not answers and time.monotonic() < deadline + 20:
        time.sleep(0.02)
    result, error = answers[0]
    assert error is None, error
    assert result.as_numpy("DELAY_OUT").tolist() == [2.0]
    grpc.close()
    deadline = time.monotonic() + 10
    while _descriptors(server) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _descriptors(server) == before
    client.close()


def test_cuda_shared_memory_is_refused_clearly_and_unregistering_it_succeeds(
    server: Served,
) -> None:
    """No CUDA shared memory: registering says so (501 / UNIMPLEMENTED); status lists none
    and unregistering all succeeds, as Triton's client scripts expect before they start."""
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    http.unregister_cuda_shared_memory()
    grpc.unregister_cuda_shared_memory()
    assert http.get_cuda_shared_memory_status() == []
    assert not grpc.get_cuda_shared_memory_status().regions
    status, body = post(
        server.http,
        "/v2/cudasharedmemory/region/r/register",
        b'{"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 8}',
    )
    assert status == 501
    assert b"CUDA shared memory is not supported" in body
    with pytest.raises(InferenceServerException) as caught:
        grpc.register_cuda_shared_memory("r", b"\0" * 64, 0, 8)
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    http.close()
    grpc.close()


def test_server_metadata_lists_the_extensions(server: Served) -> None:
    """Clients and perf_analyzer find system shared memory and classification there."""
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    wanted = {"system_shared_memory", "classification"}
    assert wanted <= set(http.get_server_metadata()["extensions"])
    assert wanted <= set(grpc.get_server_metadata().extensions)
    http.close()
    grpc.close()


def test_a_server_told_not_to_allow_shared_memory_refuses_it(regions: dict[str, Any]) -> None:
    """``--allow-client-shm=false``: Triton's words and 501; inference without it works."""
    served = start_server("--allow-client-shm=false")
    try:
        _handle, key = _region(regions, "r", 64)
        client = httpclient.InferenceServerClient(served.http)
        _refused(
            lambda: client.register_system_shared_memory("r", key, 64),
            "Client shared memory is disabled",
            "--allow-client-shm=true",
        )
        assert client.get_system_shared_memory_status() == []
        a = np.ones((1, 16), np.int32)
        np.testing.assert_array_equal(_simple(client, a, a).as_numpy("OUTPUT0"), 2 * a)
        client.close()
    finally:
        assert served.stop() == 0, served.text()
