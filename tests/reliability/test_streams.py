"""gRPC streams and sequences against a hostile or careless client: order across a sequence's
end and restart, sequence ids at the edge of uint64, a stop while a stream is open, a client
that never reads, and a stream that names a new sequence id in every request."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from orchestrion.testing import Served, get, post, rss_kib
from support.reliability_report import SIZE, record
from support.served import start_server

_STOP = object()


def _request(model: str, name: str, value: Any, dtype: str = "INT32", **parameters: Any) -> Any:
    """A ModelInferRequest with one input ``name`` = [value] in raw contents."""
    message = service_pb2.ModelInferRequest(model_name=model)
    tensor = message.inputs.add()
    tensor.name, tensor.datatype = name, dtype
    tensor.shape.append(1)
    array = np.array([value], {"INT32": np.int32, "FP32": np.float32}[dtype])
    message.raw_input_contents.append(array.tobytes())
    for key, item in parameters.items():
        target = message.parameters[key]
        if isinstance(item, bool):
            target.bool_param = item
        elif isinstance(item, int) and item >= 2**63:
            target.uint64_param = item
        elif isinstance(item, int):
            target.int64_param = item
        else:
            target.string_param = str(item)
    return message


def _output(response: Any, dtype: Any = np.int32) -> int:
    return int(np.frombuffer(response.raw_output_contents[0], dtype)[0])


def _sequence(sequence_id: int | str, value: int, *, start: bool = False, end: bool = False) -> Any:
    return _request(
        "counter", "X", value, sequence_id=sequence_id, sequence_start=start, sequence_end=end
    )


class _Stream:
    """One ModelStreamInfer call fed from a queue, read on demand."""

    def __init__(self, served: Served) -> None:
        self.channel = grpc.insecure_channel(served.grpc)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.call = self.stub.ModelStreamInfer(self._requests(), timeout=300)

    def _requests(self) -> Iterator[Any]:
        while (item := self.outbox.get(timeout=300)) is not _STOP:
            yield item

    def send(self, *messages: Any) -> None:
        for message in messages:
            self.outbox.put(message)

    def read(self, count: int) -> list[Any]:
        return [next(self.call) for _ in range(count)]

    def close(self) -> None:
        self.outbox.put(_STOP)
        self.call.cancel()
        self.channel.close()


def _cpu_seconds(served: Served) -> float:
    with open(f"/proc/{served.process.pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    server = start_server("--exit-timeout-secs=10")
    try:
        yield server
    finally:
        server.stop()


_SLOW_COUNTER = """# A running total per sequence that takes 20 ms a request (in a worker thread).
name: "slow_counter"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOTAL" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { max_sequence_idle_microseconds: 60000000 }
parameters { key: "execution" value: { string_value: "thread" } }
"""
_SLOW_CODE = """import time

import numpy as np

JIT = False


def initial_state(config):
    return np.zeros(1, np.int32)


def execute(state, X):
    time.sleep(0.02)
    total = state + X
    return {"TOTAL": total}, total
"""


def test_a_sequence_keeps_its_order_across_end_and_restart(tmp_path: Path) -> None:
    """On one stream, a sequence that ends and starts again with the same id runs in the order
    sent: the restarted sequence never overtakes the requests of the one that ended, even
    when the model is slower than the client."""
    (tmp_path / "slow_counter" / "1").mkdir(parents=True)
    (tmp_path / "slow_counter" / "config.pbtxt").write_text(_SLOW_COUNTER)
    (tmp_path / "slow_counter" / "1" / "model.py").write_text(_SLOW_CODE)
    served = start_server(repository=tmp_path)
    stream = _Stream(served)
    rounds, mismatched = 10, []
    try:
        for round_ in range(rounds):
            sequence_id = 500 + round_
            plan = [(1, True, False), (1, False, False), (1, False, True)]
            plan += [(100, True, False), (1, False, True)]
            stream.send(
                *(
                    _request(
                        "slow_counter",
                        "X",
                        v,
                        sequence_id=sequence_id,
                        sequence_start=start,
                        sequence_end=end,
                    )
                    for v, start, end in plan
                )
            )
            answers = stream.read(len(plan))
            errors = [a.error_message for a in answers if a.error_message]
            totals = [_output(a.infer_response) for a in answers if not a.error_message]
            if errors or totals != [1, 2, 3, 100, 101]:
                mismatched.append((sequence_id, totals, errors))
    finally:
        stream.close()
        served.stop()
    assert mismatched == []
    record(
        "Bad input",
        "One stream: a sequence's start, request, end, then a new start and end with the same "
        "id, sent without waiting, to a model slower than the client (20 ms a request)",
        f"{rounds} rounds of 5 requests",
        "each round's totals 1, 2, 3, 100, 101 in the order sent; no 'sequence has ended'",
    )


def test_sequence_ids_past_int64_are_served_or_refused_never_half(served: Served) -> None:
    """A gRPC sequence id of 2**63 and more (uint64) is served with its state kept and echoed
    back; ids past uint64 (HTTP's JSON can say them) are a 400 before anything runs."""
    channel = grpc.insecure_channel(served.grpc)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    tried = 0
    try:
        for sequence_id in (2**63, 2**63 + 7, 2**64 - 1):
            first = stub.ModelInfer(_sequence(sequence_id, 1, start=True), timeout=30)
            second = stub.ModelInfer(_sequence(sequence_id, 2, end=True), timeout=30)
            tried += 2
            assert (_output(first), _output(second)) == (1, 3)
            assert second.parameters["sequence_id"].uint64_param == sequence_id
        refused = []
        for sequence_id in (2**64, 10**400, -1):
            body = (
                '{"inputs":[{"name":"X","datatype":"INT32","shape":[1],"data":[5]}],'
                f'"parameters":{{"sequence_id":{sequence_id},"sequence_start":true}}}}'
            )
            status, answer = post(served.http, "/v2/models/counter/infer", body.encode())
            tried += 1
            refused.append((status, b"sequence_id" in answer))
        assert refused == [(400, True)] * 3
        # Nothing of the refused requests ran: sequence 2**64 - 1 starts afresh with 4.
        fresh = stub.ModelInfer(_sequence(2**64 - 1, 4, start=True, end=True), timeout=30)
        assert _output(fresh) == 4
    finally:
        channel.close()
    record(
        "Bad input",
        "Sequence ids 2**63, 2**63+7 and 2**64-1 over gRPC (uint64_param); 2**64, 10**400 and "
        "-1 over HTTP",
        f"{tried + 1} requests",
        "the uint64 ids served, their state kept and echoed as uint64_param; the others a 400 "
        "naming sequence_id, before the model ran",
    )


class _StallingProxy:
    """A loopback TCP proxy in front of the server that can stop reading the server's bytes:
    what a client that never reads does to the server (its socket buffers and the HTTP/2
    window fill up; gRPC's own client library would keep reading into its memory)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.reading = threading.Event()
        self.reading.set()
        self.closed = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        self.listener.settimeout(30)
        client, _ = self.listener.accept()
        # A small receive buffer (set before connecting, so the TCP window stays small): the
        # server's side fills in seconds, not after megabytes, even on a loaded machine.
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
        server.settimeout(30)
        server.connect(self.upstream)
        for source, target, gate in ((client, server, None), (server, client, self.reading)):
            thread = threading.Thread(target=self._pump, args=(source, target, gate), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _pump(self, source: socket.socket, target: socket.socket, gate: Any) -> None:
        source.settimeout(0.1)
        deadline = time.monotonic() + 300
        while not self.closed.is_set() and time.monotonic() < deadline:
            if gate is not None and not gate.is_set():
                gate.wait(0.1)
                continue
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                target.sendall(data)
            except OSError:  # the other side closed first (the test is ending)
                return

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


_WIDE_REPEAT = """# Decoupled: X[0] responses, the i-th a 4 KiB tensor whose first element is i.
name: "wide_repeat"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1024 ] } ]
model_transaction_policy { decoupled: true }
"""
_WIDE_REPEAT_CODE = """import numpy as np

JIT = False


def execute(X):
    for i in range(int(X[0])):
        yield {"Y": np.full(1024, i, np.int32)}
"""


def test_a_client_that_never_reads_stops_the_streams_producers(tmp_path: Path) -> None:
    """A decoupled request for 2**31-1 responses on a stream whose client stops reading:
    the server's producer stops at a bounded buffer (memory and CPU flat) and goes on, in
    order, when the client reads again. The responses are 4 KiB each, so the socket buffers
    and the HTTP/2 window (megabytes) fill in a few thousand responses, quickly even on a
    loaded machine."""
    (tmp_path / "wide_repeat" / "1").mkdir(parents=True)
    (tmp_path / "wide_repeat" / "config.pbtxt").write_text(_WIDE_REPEAT)
    (tmp_path / "wide_repeat" / "1" / "model.py").write_text(_WIDE_REPEAT_CODE)
    served = start_server(repository=tmp_path)
    proxy = _StallingProxy(served.grpc)
    stream = _Stream(Served(served.process, grpc=proxy.address))
    try:
        stream.send(_request("wide_repeat", "X", 2**31 - 1))
        assert _output(stream.read(1)[0].infer_response) == 0
        proxy.reading.clear()
        rss_before, paused = rss_kib(served.process.pid), time.monotonic()
        # The socket buffers and the HTTP/2 window fill first (megabytes of small
        # responses); then the producer must stop: a full second with (almost) no CPU.
        cpu, idle_at = _cpu_seconds(served), None
        while idle_at is None and time.monotonic() - paused < 90:
            time.sleep(1.0)
            cpu, busy = _cpu_seconds(served), _cpu_seconds(served) - cpu
            if busy < 0.1:
                idle_at = time.monotonic() - paused
        grown_kib = rss_kib(served.process.pid) - rss_before
        time.sleep(2.0)  # still stopped, and still holding
        held_kib = rss_kib(served.process.pid) - rss_before
        proxy.reading.set()
        values = [_output(r.infer_response) for r in stream.read(20000)]
    finally:
        stream.close()
        proxy.close()
        served.stop()
    assert values == list(range(1, 20001))
    assert idle_at is not None, f"the producer never stopped (RSS {grown_kib:+} KiB in 90 s)"
    assert held_kib < 16 * 1024, f"RSS grew {held_kib} KiB while nobody read"
    record(
        "Load",
        "A decoupled request for 2**31-1 responses on a stream whose client stops reading (a "
        "proxy that stops taking the server's bytes)",
        "until the producer stops, 2 s more, then 20,000 responses read",
        f"the producer stopped {idle_at:.0f} s after the client did (once the socket buffers "
        f"and HTTP/2 window were full), RSS {held_kib / 1024:+.1f} MiB in all; then every "
        "response, in order",
    )


def test_a_stream_of_new_sequence_ids_holds_no_memory_for_idle_ones(served: Served) -> None:
    """One long-lived stream naming a new sequence id in every request: each id's lane goes
    once its requests are answered, so memory stays flat however many ids pass."""
    stream = _Stream(served)
    count, batch = SIZE * 5, 500
    try:

        def round_(first: int) -> None:
            stream.send(
                *(
                    _request("sleepy", "DELAY", 0.0, "FP32", sequence_id=f"s{first + i}")
                    for i in range(batch)
                )
            )
            answers = stream.read(batch)
            assert all(not a.error_message for a in answers), answers[0].error_message

        for warm in range(0, 2 * batch, batch):
            round_(-warm - batch)
        before = rss_kib(served.process.pid)
        for first in range(0, count, batch):
            round_(first)
        grown_kib = rss_kib(served.process.pid) - before
    finally:
        stream.close()
    assert grown_kib < 20 * 1024, f"RSS grew {grown_kib} KiB over {count} sequence ids"
    record(
        "Load",
        "One stream naming a new sequence id (a string) in every request, for a model that is "
        "not stateful",
        f"{count:,} ids on one stream",
        f"RSS {grown_kib / 1024:+.1f} MiB across them (lanes freed once answered)",
    )


def test_sigterm_refuses_what_a_stream_sends_after_it() -> None:
    """SIGTERM with a stream open and a slow request on it: the slow request is answered,
    every request sent after the signal gets a refusal (an error response, or the stream's
    UNAVAILABLE status for those still in transit), and none is silently dropped."""
    server = start_server("--exit-timeout-secs=20")
    stream = _Stream(server)
    outcomes: list[Any] = []

    def drain() -> None:
        try:
            for answer in stream.call:
                outcomes.append(answer)
        except grpc.RpcError as exc:
            outcomes.append(exc)

    reader = threading.Thread(target=drain)
    reader.start()
    later = 20
    try:
        stream.send(_request("sleepy", "DELAY", 1.5, "FP32"))
        deadline = time.monotonic() + 30
        while "sleepy" not in _pending_models(server):
            assert time.monotonic() < deadline, "the slow request never started"
            time.sleep(0.02)
        server.process.send_signal(15)
        for _ in range(later):
            stream.send(_request("sleepy", "DELAY", 0.0, "FP32"))
            time.sleep(0.02)
        reader.join(60)
        assert not reader.is_alive()
        code = server.process.wait(60)  # the one SIGTERM above (a second one would be abrupt)
        server.stop()
    finally:
        stream.close()
        if server.process.poll() is None:
            server.process.kill()
    answered = [o for o in outcomes if not isinstance(o, grpc.RpcError) and not o.error_message]
    refused = [o for o in outcomes if not isinstance(o, grpc.RpcError) and o.error_message]
    status = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    assert answered, (outcomes, server.text()[-3000:])
    slow = np.frombuffer(answered[0].infer_response.raw_output_contents[0], np.float32)
    assert slow.tolist() == [1.5]
    assert all("shutting down" in o.error_message for o in refused)
    assert len(status) == 1, status
    assert status[0].code() == grpc.StatusCode.UNAVAILABLE, status
    assert len(answered) + len(refused) <= 1 + later
    assert code == 0
    record(
        "Faults",
        "SIGTERM with a stream open: a slow request on it, then 20 more requests sent after "
        "the signal",
        f"1 slow + {later} later requests",
        f"the slow one answered; {len(refused)} refused with an error response, "
        f"{later - len(refused) - len(answered) + 1} covered by the stream's UNAVAILABLE "
        "status; none answered with silence; exit code 0",
    )


def _pending_models(served: Served) -> set[str]:
    _, body = get(served.metrics, "/metrics")
    found = set()
    for line in body.decode().splitlines():
        if line.startswith("nv_inference_pending_request_count{") and float(line.split()[-1]):
            found.add(line.split('model="', 1)[1].split('"', 1)[0])
    return found
