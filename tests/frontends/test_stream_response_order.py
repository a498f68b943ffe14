"""The order of a gRPC stream's responses when a decoupled python-backend model answers
several of its requests from threads: the order the model sent them in, as Triton's stub
keeps it (every response through one queue).

The stream here is the front ends' own trio side (`Stream`) on an in-process server, its
messages collected where the front end would hand them to the client. Its credits start at
none, as when the client reads slowly: every request's response waits for a credit, and
then the credits come back all at once. Trio wakes the requests' tasks in either order, so
nothing but the stream's order keeps the model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import trio
from tritonclient.grpc import service_pb2

from orchestrion import open_server
from orchestrion.frontends._grpc_streams import END, OpenStreams, Stream
from orchestrion.frontends._wire_infer import WireInfer

REPOSITORY = Path(__file__).resolve().parents[1] / "python_backend_answers"


def _request(n: int) -> Any:
    request = service_pb2.ModelInferRequest(model_name="in_order", id=str(n))
    request.inputs.add(name="IN", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.array([[n]], np.float32).tobytes())
    return request


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


def _read(message: Any) -> str:
    """A posted stream message as the client would read it: its value or its error."""
    if message.error_message:
        return message.error_message
    raw = message.infer_response.raw_output_contents[0]
    return str(int(np.frombuffer(raw, np.float32)[0]))


async def test_responses_sent_one_after_another_are_read_in_that_order() -> None:
    rounds, size = 6, 8
    async with open_server(REPOSITORY, load_models=["in_order"]) as server:
        posted = _Posted()
        stream = Stream(
            server,
            posted.post,
            OpenStreams(),
            WireInfer(server),
            credit=trio.Semaphore(0),
        )
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.run)
                for first in range(0, rounds * size, size):
                    for n in range(first, first + size):
                        await stream.submit(_request(n), None)
                    # The model sends the round's responses (each once the one before is
                    # taken: half a second is plenty); they wait for credits, which then
                    # come back at once.
                    await trio.sleep(0.5)
                    for _ in range(size):
                        stream.credit.release()
                    await posted.count(first + size)
                await stream.close_input()
    assert posted.messages[-1] is END
    read = [_read(message) for message in posted.messages[:-1]]
    expected = [f"request {n} fails" if n % 3 == 0 else str(n) for n in range(rounds * size)]
    assert read == expected
