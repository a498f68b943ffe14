"""Faults injected while orchestrion serves: hanging models, disconnect and cancellation storms,
Redis killed or hung under load, SIGTERM with requests in flight. Each test checks that every
request got exactly one answer (a result or an error), that the answers are right, and that the
server is at rest and still serving afterwards."""

from __future__ import annotations

import functools
import http.client
import logging
import os
import random
import signal
import threading
import time
from typing import Any

import jax
import numpy as np
import pytest
import trio
import trio.testing
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from orchestrion import (
    AsyncServer,
    InferenceError,
    InferenceTimeoutError,
    open_server,
)
from orchestrion.actors._watchdog import TICK
from orchestrion.testing import (
    RedisServer,
    Served,
    assert_idle,
    case,
    check,
    ensemble,
    gated,
    grpc_inputs,
    http_call,
    infer_until_fused,
    infer_until_inline,
    model,
    pending,
    settled,
    step,
    tensor,
    with_fusion,
)
from support.reliability_report import SIZE, record
from support.served import cache_hits, front_ends, start_server, wait_until

X = np.arange(16, dtype=np.float32)


def _pending(server: AsyncServer, name: str) -> int:
    return sum(s.pending_request_count for s in server.model_statistics(name))


async def test_a_hanging_model_times_out_and_its_instance_recovers() -> None:
    """A model stuck in native code (a thread that cannot be interrupted) and one stuck in async
    code: the request's timeout answers the caller at once; requests queued behind the stuck
    instance are served when it comes back; the instance is not poisoned."""
    release = threading.Event()

    def stuck(X: Any) -> dict[str, Any]:
        if X[0] < 0:
            assert release.wait(60), "never released"
        return {"Y": X + 1}

    blocking = model("stuck", stuck, [tensor("X")], [tensor("Y")], jit=False, count=1)
    blocking.config.parameters["execution"] = "thread"
    forever = trio.Event()
    asleep = gated("asleep", forever, count=1)
    async with open_server(models=[blocking, asleep]) as server:
        # Uninterruptible: the caller gets its timeout, the instance stays busy until it ends.
        with pytest.raises(InferenceTimeoutError):
            await server.infer("stuck", {"X": -X - 1}, timeout=0.2)
        queued: list[Any] = []
        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(_infer_into, server, "stuck", X + i, queued)
            await wait_until(lambda: _pending(server, "stuck") == 5)
            assert queued == []  # behind the stuck execution
            release.set()
        for response in queued:
            assert isinstance(response, dict)
        assert sorted(float(r["Y"][0]) for r in queued) == [1.0, 2.0, 3.0, 4.0, 5.0]
        # Async: the timeout cancels the execution itself; the instance is free at once.
        for _ in range(3):
            with pytest.raises(InferenceTimeoutError):
                await server.infer("asleep", {"X": X}, timeout=0.05)
            assert _pending(server, "asleep") == 0
        forever.set()
        assert (await server.infer("asleep", {"X": X})).outputs["Y"].tolist() == X.tolist()
        assert (await server.infer("stuck", {"X": X})).outputs["Y"].tolist() == (X + 1).tolist()
        assert_idle(server)
        stuck_stats = server.model_statistics("stuck")[0]
        asleep_stats = server.model_statistics("asleep")[0]
    assert stuck_stats.inference_stats.success.count == 6
    assert asleep_stats.inference_stats.success.count == 1
    record(
        "Faults",
        "A model that hangs: in a worker thread (uninterruptible) and in async code",
        "1 + 3 requests with a timeout, 5 queued behind the hang",
        "each timed-out caller answered at its timeout; the queued requests and later ones "
        "served by the same instance once it came back (none lost, none poisoned)",
    )


async def test_a_model_hanging_inline_is_named_by_the_watchdog(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A synchronous model that runs inline and hangs holds the event loop: nothing can
    interrupt it, so the request's timeout only fires once it returns. The watchdog logs which
    model holds the loop and at which line, and logs again when the loop runs again."""
    caplog.set_level(logging.INFO, logger="orchestrion")

    def sometimes_slow(X: Any) -> dict[str, Any]:
        if X[0] < 0:
            time.sleep(1.6)  # stands for a hang that ends
        return {"Y": X + 1}

    inline = model("inline_hang", sometimes_slow, [tensor("X")], [tensor("Y")], jit=False)
    inline.config.parameters["execution"] = "inline"
    async with open_server(models=[inline]) as server:
        with pytest.raises(InferenceTimeoutError):
            await server.infer("inline_hang", {"X": -X - 1}, timeout=0.2)
        await trio.sleep(2 * TICK)
        response = await server.infer("inline_hang", {"X": X})
        np.testing.assert_array_equal(response.outputs["Y"], X + 1)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "held for" in errors[0]
    assert "model 'inline_hang' (version 1) running inline" in errors[0]
    assert f"{__file__}:" in errors[0]
    assert "in sometimes_slow" in errors[0]
    assert '"execution"' in errors[0]
    assert any("runs again" in r.getMessage() for r in caplog.records)
    record(
        "Faults",
        "A model that hangs while running inline on the event loop (1.6 s)",
        "1 request with a 0.2 s timeout",
        "the watchdog logged the model and the line holding the loop, then the time it was "
        "held; the late result became a timeout error; the model served the next request",
    )


async def _infer_into(server: AsyncServer, name: str, x: Any, into: list[Any]) -> None:
    response = await server.infer(name, {"X": x})
    into.append(dict(response.outputs))


async def test_disconnect_storm_cancels_the_work_and_frees_every_slot() -> None:
    """Clients that vanish mid-request (HTTP: the socket closes; gRPC: the deadline passes or
    the stream is closed mid-stream), all at once: the server cancels their work, every slot
    and queue is free afterwards, no task is left, and the next requests are served."""
    http_clients, grpc_calls, streams = 60, 30, 10
    async with front_ends() as (server, http_address, grpc_address):
        await trio.testing.wait_all_tasks_blocked(0.05)
        tasks_before = trio.lowlevel.current_statistics().tasks_living
        host, port = http_address.rsplit(":", 1)
        body = b'{"inputs":[{"name":"DELAY","datatype":"FP32","shape":[1],"data":[60.0]}]}'
        head = b"POST /v2/models/sleepy/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        sockets = []
        for _ in range(http_clients):
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(head % len(body) + body)
            sockets.append(stream)

        def grpc_clients() -> list[str]:
            client = grpcclient.InferenceServerClient(grpc_address)
            item = grpcclient.InferInput("DELAY", [1], "FP32")
            item.set_data_from_numpy(np.array([60.0], np.float32))
            statuses: list[str] = []
            done = threading.Semaphore(0)

            def finished(result: Any, error: Any) -> None:
                statuses.append(str(error.status()) if error is not None else "OK")
                done.release()

            for _ in range(grpc_calls):
                client.async_infer("sleepy", [item], callback=finished, client_timeout=1.0)
            streamed = [grpcclient.InferenceServerClient(grpc_address) for _ in range(streams)]
            for other in streamed:
                other.start_stream(callback=lambda result, error: None)
                other.async_stream_infer("sleepy", [item])
                other.async_stream_infer("repeat", [_int32_item(1000000)])
            time.sleep(0.5)
            for other in streamed:
                other.stop_stream(cancel_requests=True)
                other.close()
            for _ in range(grpc_calls):
                assert done.acquire(timeout=30)
            client.close()
            return statuses

        async with trio.open_nursery() as nursery:
            outcome: list[list[str]] = []

            async def run_grpc() -> None:
                outcome.append(await trio.to_thread.run_sync(grpc_clients))

            nursery.start_soon(run_grpc)
            await wait_until(lambda: _pending(server, "sleepy") >= http_clients)
            for stream in sockets:
                await stream.aclose()
        assert len(outcome[0]) == grpc_calls
        assert all("DEADLINE" in s for s in outcome[0]), outcome[0]
        await wait_until(lambda: _pending(server, "sleepy") == 0)
        await wait_until(lambda: _pending(server, "repeat") == 0)
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert_idle(server)
        cancelled = server.model_statistics("sleepy")[0].failures_by_reason.get("CANCELED", 0)
        # Each vanished client's request was cancelled (none ran to its end).
        assert cancelled == http_clients + grpc_calls + streams
        assert trio.lowlevel.current_statistics().tasks_living <= tasks_before + 2
        response = await server.infer("sleepy", {"DELAY": np.array([0.0], np.float32)})
        assert response.outputs["DELAY_OUT"].tolist() == [0.0]
    record(
        "Faults",
        "Clients vanishing mid-request and mid-stream, all at once",
        f"{http_clients} HTTP sockets closed, {grpc_calls} gRPC deadlines, {streams} streams "
        "closed while producing",
        "every request cancelled on the server (CANCELED counted once each); no slot, queue or "
        "task left; the next request served",
    )


def _int32_item(value: int) -> Any:
    item = grpcclient.InferInput("X", [1], "INT32")
    item.set_data_from_numpy(np.array([value], np.int32))
    return item


async def test_cancellation_storm_while_producers_are_blocked_by_backpressure() -> None:
    """Hundreds of callers blocked at an ensemble's bounded channels (max_inflight_requests 2),
    cancelled at random moments while others finish: each caller gets exactly one outcome, the
    ones not cancelled get the right answer, and every count returns to rest."""
    rounds, callers = 4, 150
    gates = [trio.Event()]

    async def wait_for_the_gate(X: Any) -> dict[str, Any]:
        await gates[-1].wait()
        return {"Y": X}

    slow = model("slow", wait_for_the_gate, [tensor("X")], [tensor("Y")], jit=False, count=2)
    fast = model("fast", lambda X: {"Y": X * 3}, [tensor("X")], [tensor("Y")], jit=False)
    pipeline = ensemble(
        "storm",
        [tensor("IN")],
        [tensor("OUT"), tensor("SIDE")],
        [
            step("fast", {"X": "IN"}, {"Y": "tripled"}),
            step("slow", {"X": "tripled"}, {"Y": "OUT"}),
            step("fast", {"X": "IN"}, {"Y": "SIDE"}),
        ],
        max_inflight_requests=2,
    )
    totals = {"answered": 0, "cancelled": 0, "timed out": 0}
    async with open_server(models=[slow, fast, pipeline]) as server:
        for seed in range(rounds):
            rng = random.Random(seed)
            outcomes: dict[int, list[str]] = {i: [] for i in range(callers)}
            gates.append(trio.Event())

            async def caller(
                index: int,
                server: AsyncServer = server,
                rng: random.Random = rng,
                outcomes: dict[int, list[str]] = outcomes,
            ) -> None:
                x = X + index
                how = rng.random()
                with trio.CancelScope() as scope:
                    if how < 0.4:  # cancelled by its owner at a random moment
                        scope.deadline = trio.current_time() + rng.uniform(0, 0.05)
                    try:
                        response = await server.infer(
                            "storm",
                            {"IN": x},
                            timeout=rng.uniform(0.01, 0.1) if how > 0.8 else None,
                        )
                    except InferenceTimeoutError:
                        outcomes[index].append("timed out")
                        return
                    np.testing.assert_array_equal(response.outputs["OUT"], x * 3)
                    np.testing.assert_array_equal(response.outputs["SIDE"], x * 3)
                    outcomes[index].append("answered")
                if scope.cancelled_caught:
                    outcomes[index].append("cancelled")

            async with trio.open_nursery() as nursery:
                for index in range(callers):
                    nursery.start_soon(caller, index)
                await trio.sleep(0.12)  # every deadline has passed; the rest wait for the gate
                gates[-1].set()
            assert all(len(o) == 1 for o in outcomes.values()), outcomes
            for (result,) in outcomes.values():
                totals[result] += 1
            await trio.testing.wait_all_tasks_blocked(0.01)
            assert_idle(server, "storm")
    assert all(totals.values()), totals
    record(
        "Faults",
        "Cancellation storms while callers are blocked by backpressure (max_inflight_requests 2)",
        f"{rounds} rounds of {callers} callers: {totals['cancelled']} cancelled, "
        f"{totals['timed out']} timed out, {totals['answered']} answered",
        "exactly one outcome per caller, right answers, every channel, slot and count at rest "
        "after each round",
    )


class NetworkLoad:
    """The mixed load of `orchestrion.testing.case` against a served process until stopped: HTTP from
    ``http_threads`` keep-alive connections (one thread each) and gRPC from one thread keeping
    ``grpc_in_flight`` calls in flight. Each request index is answered once, into `answers`
    (its outputs or its error), with its latency in `latency`."""

    def __init__(self, served: Served, http_threads: int = 6, grpc_in_flight: int = 16) -> None:
        self.served = served
        self.answers: dict[int, Any] = {}
        self.latency: dict[int, float] = {}
        self._taken = 0
        self._refused = threading.Event()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._http) for _ in range(http_threads)]
        self._threads.append(threading.Thread(target=self._grpc, args=(grpc_in_flight,)))

    def __enter__(self) -> NetworkLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(60)
        assert not any(t.is_alive() for t in self._threads), "a load thread did not finish"
        # Every index handed out got exactly one answer (_record refuses a second one).
        assert sorted(self.answers) == list(range(self._taken)), "a request went unanswered"

    def count(self) -> int:
        """Answers so far."""
        with self._lock:
            return len(self.answers)

    def wait_for(self, answers: int, limit: float = 60.0) -> None:
        """Block until at least ``answers`` answers have arrived."""
        deadline = time.monotonic() + limit
        while self.count() < answers:
            assert time.monotonic() < deadline, f"only {self.count()} of {answers} answers"
            time.sleep(0.01)

    def since(self, answers: int) -> dict[int, float]:
        """Latencies of requests sent after the first ``answers`` requests."""
        with self._lock:
            return {i: t for i, t in self.latency.items() if i >= answers}

    def taken(self) -> int:
        """Requests sent (or being sent) so far."""
        with self._lock:
            return self._taken

    def _take(self) -> int | None:
        if self._refused.is_set():
            time.sleep(0.01)  # the server is gone: do not spin
        with self._lock:
            if self._stopping.is_set():
                return None
            self._taken += 1
            return self._taken - 1

    def _record(self, index: int, outcome: Any, started: float) -> None:
        with self._lock:
            assert index not in self.answers, f"request {index} answered twice"
            self.answers[index] = outcome
            self.latency[index] = time.monotonic() - started

    def _http(self) -> None:
        connection = http.client.HTTPConnection(self.served.http, timeout=60)
        while (index := self._take()) is not None:
            started = time.monotonic()
            try:
                outcome = http_call(self.served.http, index, connection)
            except (OSError, http.client.HTTPException) as exc:
                outcome = exc
                self._refused.set()
                connection.close()
                connection = http.client.HTTPConnection(self.served.http, timeout=60)
            self._record(index, outcome, started)
        connection.close()

    def _grpc(self, in_flight: int) -> None:
        client = grpcclient.InferenceServerClient(self.served.grpc)
        slots = threading.Semaphore(in_flight)

        def answered(index: int, started: float, result: Any, error: Any) -> None:
            if error is None:
                outputs = {name: result.as_numpy(name) for name in case(index)[2]}
            elif _is_refusal(error):
                self._refused.set()
            self._record(index, error if error is not None else outputs, started)
            slots.release()

        while (index := self._take()) is not None:
            slots.acquire()
            model, items = grpc_inputs(index)
            client.async_infer(
                model,
                items,
                callback=functools.partial(answered, index, time.monotonic()),
                client_timeout=60,
            )
        for _ in range(in_flight):
            assert slots.acquire(timeout=60), "a gRPC call never completed"
        client.close()


def _wait_for_hits(served: Served, above: int, limit: float = 30.0) -> int:
    deadline = time.monotonic() + limit
    while (hits := cache_hits(served)) <= above:
        assert time.monotonic() < deadline, f"cache hits stuck at {hits}"
        time.sleep(0.05)
    return hits


def _redis_served(redis_server: RedisServer, *options: str) -> Served:
    flags = [f"--cache-config={value}" for value in (*redis_server.cache_config, *options)]
    # No tier in the front end: it would answer the load's repeats before Redis is asked,
    # and these trials are about what Redis does to the server.
    return start_server(*flags, "--exit-timeout-secs=30", "--frontend-cache-size=0")


def _check_all(load: NetworkLoad) -> None:
    for index, outcome in load.answers.items():
        check(index, outcome)


def test_redis_killed_and_restarted_twice_under_network_load(redis_server: RedisServer) -> None:
    """Redis killed (SIGKILL) twice under HTTP and gRPC load and restarted each time: no
    request fails or gets a wrong answer, hits resume after each restart, and each outage is
    logged as exactly one error."""
    served = _redis_served(redis_server, "redis,retry_interval=100")
    try:
        with NetworkLoad(served) as load:
            load.wait_for(300)
            hits = _wait_for_hits(served, 0)
            for _ in range(2):
                redis_server.kill()
                load.wait_for(load.count() + max(400, SIZE // 10))  # served uncached
                redis_server.start()  # same port, empty
                hits = _wait_for_hits(served, hits + 20)
            answered = load.count()
    finally:
        assert served.stop() == 0, served.text()
    _check_all(load)
    errors = [line for line in served.output if " ERROR " in line]
    assert len(errors) == 2, "\n".join(errors)
    assert all("redis cache unavailable" in line for line in errors), errors
    assert sum("available again" in line for line in served.output) == 2
    record(
        "Faults",
        "Redis killed (SIGKILL) under HTTP and gRPC load, then restarted; twice",
        f"{answered:,} requests, 2 outages",
        "no failed request, every answer checked against the reference, hits resumed after "
        "each restart, exactly one ERROR line per outage",
    )


def test_a_hung_redis_bounds_each_request_by_its_socket_timeout(redis_server: RedisServer) -> None:
    """Redis stopped (SIGSTOP, a hang: connections accepted, nothing answered) for 3 s under
    load: requests go on uncached, none waits out the hang, and hits resume after SIGCONT."""
    served = _redis_served(redis_server, "redis,socket_timeout=300", "redis,retry_interval=200")
    assert redis_server.process is not None
    pid = redis_server.process.pid
    hang = 3.0
    try:
        with NetworkLoad(served) as load:
            load.wait_for(300)
            hits = _wait_for_hits(served, 0)
            before = load.count()
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(hang)
                during = load.since(before)
            finally:
                os.kill(pid, signal.SIGCONT)
            _wait_for_hits(served, hits + 20)
            answered = load.count()
    finally:
        assert served.stop() == 0, served.text()
    _check_all(load)
    assert len(during) > 100, "requests did not go on while Redis hung"
    slowest = max(during.values())
    assert slowest < hang - 0.5, f"a request waited {slowest:.2f} s of a {hang} s hang"
    errors = [line for line in served.output if " ERROR " in line]
    assert len(errors) == 1, errors
    record(
        "Faults",
        "Redis hung (SIGSTOP) for 3 s under HTTP and gRPC load, socket_timeout 300 ms",
        f"{answered:,} requests, {len(during):,} of them during the hang",
        f"all answered right and uncached during the hang (slowest {slowest:.2f} s), hits "
        "resumed after SIGCONT, one ERROR line",
    )


def test_sigterm_under_load_answers_every_request() -> None:
    """SIGTERM while slow requests and a steady mixed load are in flight: the slow requests
    finish, every other request gets exactly one outcome (its answer or a refusal once the
    server stops accepting), none is left hanging, and the process exits 0."""
    served = start_server("--exit-timeout-secs=30")
    slow: list[Any] = []

    def slow_call(protocol: Any, url: str) -> None:
        client = protocol.InferenceServerClient(url)
        item = protocol.InferInput("DELAY", [1], "FP32")
        item.set_data_from_numpy(np.array([1.0], np.float32))
        try:
            slow.append(client.infer("sleepy", [item]).as_numpy("DELAY_OUT").tolist())
        except Exception as exc:
            slow.append(exc)

    pairs = [(httpclient, served.http), (grpcclient, served.grpc)] * 6
    threads = [threading.Thread(target=slow_call, args=pair) for pair in pairs]
    try:
        with NetworkLoad(served) as load:
            load.wait_for(200)
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while pending(served, "sleepy") < len(threads):
                assert time.monotonic() < deadline, "the slow requests never arrived"
                time.sleep(0.02)
            at_signal = load.taken()
            served.process.send_signal(signal.SIGTERM)
            for thread in threads:
                thread.join(60)
            assert served.process.wait(60) == 0
            load.wait_for(load.count() + 50)  # refusals, now that nothing listens
    finally:
        served.stop()
    assert slow == [[1.0]] * len(threads)
    refused = 0
    for index, outcome in load.answers.items():
        if isinstance(outcome, dict | InferenceError) or not isinstance(outcome, Exception):
            check(index, outcome)
        elif _is_refusal(outcome):
            refused += 1
        else:
            check(index, outcome)
    record(
        "Faults",
        "SIGTERM with slow requests and a steady load in flight over HTTP and gRPC",
        f"{len(threads)} slow requests, {len(load.answers):,} others ({at_signal:,} before "
        f"the signal, {refused:,} refused after)",
        "the slow requests finished; every other request got one answer or one refusal; "
        "exit code 0",
    )


def _is_refusal(error: object) -> bool:
    """How a stopping server turns a request away: the connection refused or closed, HTTP 503,
    gRPC UNAVAILABLE, or CANCELLED (grpc core's answer to a call that arrived on an open
    connection after its shutdown began, before any handler ran)."""
    if isinstance(error, OSError | http.client.HTTPException):
        return True
    status = str(getattr(error, "status", lambda: "")())
    return status in ("503", "StatusCode.UNAVAILABLE", "StatusCode.CANCELLED")


@pytest.mark.parametrize(
    ("fusion", "named"),
    [
        ("on", "model 'second' (version 1) running inline"),
        ("xla", "ensemble 'fused' running fused"),
        ("off", "model 'second' (version 1) running inline"),
    ],
)
async def test_a_step_hanging_inside_a_fused_ensemble_is_named_by_the_watchdog(
    fusion: str, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A fused ensemble calls its steps without the scheduler: a step that holds the event
    loop there is still named by the watchdog (the whole-graph call of mode "xla" names the
    ensemble)."""
    caplog.set_level(logging.INFO, logger="orchestrion")
    hold = [False]

    def maybe_hang() -> None:  # runs on the host while the jitted step executes
        if hold[0]:
            time.sleep(1.3)  # stands for a hang that ends

    def held(X: Any) -> dict[str, Any]:
        jax.debug.callback(maybe_hang)
        return {"Y": X + 1}

    # Inline by configuration: measured, a host callback can keep 'second' in a worker
    # thread on a busy machine (its fastest call of a window over 100 µs), and then the
    # ensemble never fuses. Where the step runs is not what this test is about.
    inline = {"execution": "inline"}
    first = model("first", lambda X: {"Y": X * 2}, [tensor("X")], [tensor("Y")], parameters=inline)
    second = model("second", held, [tensor("X")], [tensor("Y")], parameters=inline)
    pipe = ensemble(
        "fused",
        [tensor("IN")],
        [tensor("OUT")],
        [step("first", {"X": "IN"}, {"Y": "mid"}), step("second", {"X": "mid"}, {"Y": "OUT"})],
    )
    async with open_server(models=[first, second, with_fusion(pipe, fusion)]) as server:
        if fusion == "off":
            assert await infer_until_inline(server, "fused", {"IN": X}, "second")
            assert not await settled(server, "fused")
        else:
            assert await infer_until_fused(server, "fused", {"IN": X})
        hold[0] = True
        response = await server.infer("fused", {"IN": X})
        np.testing.assert_array_equal(response.outputs["OUT"], X * 2 + 1)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert named in errors[0], errors[0]
    who = "ensemble" if fusion == "xla" else "step's model"
    record(
        "Faults",
        f"A step that holds the event loop inside an ensemble with fusion {fusion} (1.3 s, "
        "a host callback)",
        "1 request",
        f"the watchdog named the {who}; the request was answered right",
    )
