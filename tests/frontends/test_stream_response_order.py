"""The order of a gRPC stream's responses when a decoupled python-backend model answers
several of its requests from threads: the order the model sent them in, as Triton's stub
keeps it (every response through one queue); and that order never holds a response back for
one that will not come.

The stream here is the front ends' own trio side (`Stream`) on an in-process server, its
messages collected where the front end would hand them to the client. In the order tests its
credits start at none, as when the client reads slowly: every request's response waits for a
credit, and then the credits come back all at once. Trio wakes the requests' tasks in either
order, so nothing but the stream's order keeps the model's.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from tritonclient.grpc import service_pb2

from orchestrion import InferenceError, open_server
from orchestrion.frontends._grpc_streams import END, OpenStreams, Stream
from orchestrion.frontends._wire_infer import WireInfer

REPOSITORY = Path(__file__).resolve().parents[1] / "python_backend_answers"


class _Posted:
    """What the stream hands the client's side, in order."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self._wanted = 0
        self._enough = trio.Event()

    def post(self, message: Any) -> None:
        self.messages.append(message)
        if len(self.messages) >= self._wanted:
            self._enough.set()

    async def count(self, wanted: int) -> None:
        """Wait until ``wanted`` messages are posted."""
        self._wanted, self._enough = wanted, trio.Event()
        if len(self.messages) < wanted:
            await self._enough.wait()


@asynccontextmanager
async def _stream(credits: int) -> AsyncIterator[tuple[Stream, _Posted]]:
    """A stream on a server with in_order, chatty and error_midway, its input closed on the
    way out."""
    async with open_server(
        REPOSITORY, load_models=["in_order", "chatty", "error_midway"]
    ) as server:
        posted = _Posted()
        stream = Stream(
            server, posted.post, OpenStreams(), WireInfer(server), credit=trio.Semaphore(credits)
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.run)
            yield stream, posted
            await stream.close_input()
    assert posted.messages[-1] is END


def _request(model: str, name: str, value: np.ndarray[Any, Any], **flags: Any) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model, id=str(value.reshape(-1)[0]))
    request.inputs.add(name=name, datatype="INT32" if value.dtype == np.int32 else "FP32")
    request.inputs[0].shape.extend(value.shape)
    request.raw_input_contents.append(value.tobytes())
    for key, setting in flags.items():
        if isinstance(setting, bool):
            request.parameters[key].bool_param = setting
        else:
            request.parameters[key].int64_param = setting
    return request


def _read(message: Any) -> str:
    """A posted stream message as the client would read it: its error, ``final`` for an
    empty final response, or its value."""
    if message.error_message:
        return str(message.error_message)
    response = message.infer_response
    if not response.raw_output_contents:
        assert response.parameters["triton_final_response"].bool_param
        return "final"
    raw = response.raw_output_contents[0]
    dtype = np.float32 if response.outputs[0].datatype == "FP32" else np.int32
    return str(int(np.frombuffer(raw, dtype)[0]))


async def _until(condition: Any, what: str) -> None:
    for _ in range(1000):  # 10 s at most
        if condition():
            return
        await trio.sleep(0.01)
    raise AssertionError(f"not within 10 s: {what}")


def _expected(numbers: range, empty_final: bool, finals_last: bool) -> list[str]:
    """What the client should read for in_order's requests ``numbers``, in that order."""
    expected, finals = [], []
    for n in numbers:  # an error response ends nothing: its final flag follows
        expected.append(f"request {n} fails" if n % 3 == 0 else str(n))
        if empty_final:
            (finals if finals_last else expected).append("final")
    return expected + finals


@pytest.mark.parametrize(
    ("empty_final", "finals_last"),
    [(False, False), (True, False), (True, True)],
    ids=["plain", "empty-final", "finals-after-the-round"],
)
async def test_responses_sent_one_after_another_are_read_in_that_order(
    empty_final: bool, finals_last: bool
) -> None:
    rounds, size = 5, 8
    flags: dict[str, Any] = {"triton_enable_empty_final_response": True} if empty_final else {}
    if finals_last:
        flags["round"] = size
    async with _stream(credits=0) as (stream, posted):
        with trio.fail_after(60):
            for first in range(0, rounds * size, size):
                numbers = range(first, first + size)
                for n in numbers:
                    value = np.array([[n]], np.float32)
                    await stream.submit(_request("in_order", "IN", value, **flags), None)
                # The model sends the round's responses (each once the one before is taken)
                # and they wait: the first for a credit, the others for it (or, without an
                # order, all for credits); then the credits come back at once.
                credit = stream.credit

                def held(credit: trio.Semaphore = credit) -> bool:
                    order = stream.orders.get("in_order")
                    waiting = 0 if order is None else order.writers_waiting()
                    return credit.statistics().tasks_waiting + waiting == size

                await _until(held, "the round's responses sent")
                for _ in range(len(_expected(numbers, empty_final, finals_last))):
                    credit.release()
                await posted.count(len(_expected(range(first + size), empty_final, finals_last)))
    read = [_read(message) for message in posted.messages[:-1]]
    expected = [
        line
        for first in range(0, rounds * size, size)
        for line in _expected(range(first, first + size), empty_final, finals_last)
    ]
    assert read == expected


async def test_responses_dropped_after_their_reader_left_hold_nothing_back() -> None:
    """A request that timed out while its model's execute goes on sending (for a second,
    ignoring cancellation; the stream sends its timeout error once that execute ends): the
    responses it sends meanwhile are dropped, and a later request of the same model on the
    stream (on its other instance) is answered at once, not after that execute ends."""
    async with _stream(credits=64) as (stream, posted):
        with trio.fail_after(30):
            slow = _request("chatty", "COUNT", np.array([20], np.int32), timeout=150_000)
            await stream.submit(slow, None)
            await trio.sleep(0.4)  # timed out, and still sending
            await stream.submit(_request("chatty", "COUNT", np.array([1], np.int32)), None)
            await _until(
                lambda: (
                    any("timed out" in _read(m) for m in posted.messages)
                    and any(m.infer_response.id == "1" for m in posted.messages)
                ),
                "the timeout and the second answer",
            )
    messages = posted.messages[:-1]
    answered = [n for n, m in enumerate(messages) if m.infer_response.id == "1"]
    timed_out = [n for n, m in enumerate(messages) if "timed out" in _read(m)]
    assert len(answered) == 1, [_read(m) for m in messages]
    assert len(timed_out) == 1, [_read(m) for m in messages]
    assert answered[0] < timed_out[0], [_read(m) for m in messages]


async def test_an_error_response_ends_an_embedding_callers_stream_only() -> None:
    """``stream_infer`` from Python raises a decoupled model's error response, after the
    responses before it, and the stream ends there (its caller cannot read on after a raise);
    a gRPC stream's request goes on after it (test_python_backend_answers_served.py)."""
    async with open_server(REPOSITORY, load_models=["error_midway"]) as server:
        got: list[Any] = []

        async def read() -> None:
            responses = server.stream_infer("error_midway", {"IN": np.array([1], np.int32)})
            async with contextlib.aclosing(responses) as each:
                async for response in each:
                    assert response.error is None
                    got.append(response.outputs["OUT"].tolist())

        with pytest.raises(InferenceError, match="response 1 fails"):
            await read()
        assert got == [[0]]


async def test_a_stream_that_went_on_after_an_error_is_not_cached(tmp_path: Path) -> None:
    """A gRPC stream's request that read an error response and went on: with the response
    cache on, an identical request runs the model again (and reads the same), as a stream
    that raised would; each counts as a success, as in Triton (its execution ran)."""
    shutil.copytree(REPOSITORY / "error_midway", tmp_path / "error_midway")
    with (tmp_path / "error_midway" / "config.pbtxt").open("a") as config:
        config.write("response_cache { enable: true }\n")
    async with open_server(tmp_path, cache_config="local,size=1048576") as server:
        posted = _Posted()
        stream = Stream(server, posted.post, OpenStreams(), WireInfer(server))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.run)
            with trio.fail_after(30):
                for count in (1, 2):
                    request = _request("error_midway", "IN", np.array([1], np.int32))
                    await stream.submit(request, None)

                    def ended(count: int = count) -> bool:  # and stored, if it would be
                        (stats,) = server.model_statistics("error_midway")
                        done = stats.inference_stats.success.count
                        return done + stats.inference_stats.fail.count == count

                    await _until(ended, "the request's end")
            await stream.close_input()
        (stats,) = server.model_statistics("error_midway")
    read = [_read(message) for message in posted.messages[:-1]]
    assert read == ["0", "response 1 fails", "2"] * 2
    assert stats.inference_stats.fail.count == 0  # as Triton counts it: a request that ran
    assert stats.inference_stats.success.count == 2
    assert stats.inference_stats.cache_hit.count == 0
    assert stats.inference_stats.cache_miss.count == 2
    assert stats.execution_count == 2


def _final_flag(message: Any) -> bool:
    return bool(message.infer_response.parameters["triton_final_response"].bool_param)


async def test_error_responses_on_a_stream_say_whether_they_end_their_request() -> None:
    """As Triton's stream messages do, an error response carries ``triton_final_response``:
    false mid-stream (the request's later responses and its empty final response follow),
    true when the model sent it with its final flag (nothing follows; the stream's next
    request is answered)."""
    async with _stream(credits=64) as (stream, posted):
        with trio.fail_after(30):
            flags = {"triton_enable_empty_final_response": True}
            for value, count in ((1, 4), (2, 6), (1, 10)):
                request = _request("error_midway", "IN", np.array([value], np.int32), **flags)
                await stream.submit(request, None)
                await posted.count(count)
            await trio.sleep(0.2)  # nothing more comes
    messages = posted.messages[:-1]
    assert [_read(m) for m in messages] == [
        *("0", "response 1 fails", "2", "final"),
        *("0", "response 1 fails"),
        *("0", "response 1 fails", "2", "final"),
    ]
    assert [_final_flag(m) for m in messages] == [
        *(False, False, False, True),
        *(False, True),
        *(False, False, False, True),
    ]
