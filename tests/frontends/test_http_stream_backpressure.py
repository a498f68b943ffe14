"""A streamed HTTP answer (``/generate_stream``) holds its producer back: a streaming
ensemble served to a client that stops reading makes only what the connection's buffers and
the front end's few credits hold, then resumes when the client reads, with every event in
order. Both front ends, in-process (the test counts what the model made)."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import numpy as np
import pytest
import trio

from orchestrion.testing import decoupled, ensemble, model, step, tensor
from support.served import front_ends

SIZE = 16384
"""Elements of each response: about 80 KiB of JSON per event."""
RESPONSES = 400
"""What the model would make at once if nothing held it back (about 32 MiB of events)."""
HELD = 120
"""At most this many made while the client does not read: the kernel's socket buffers
(up to 4 MiB for the server's send side by default: about 50 events), the client's 32 KiB,
the front end's credits and the ensemble's steps."""


def _models(made: list[int]) -> list[Any]:
    async def tokens(X: Any) -> Any:
        for index in range(RESPONSES):
            made.append(index)
            yield {"Y": np.full(SIZE, index, np.float32)}
            await trio.lowlevel.checkpoint()

    return [
        decoupled("tokens", tokens, dims=(SIZE,)),
        model(
            "ahead",
            lambda X: {"Y": X + 0.5},
            [tensor("X", dims=(SIZE,))],
            [tensor("Y", dims=(SIZE,))],
            jit=False,
        ),
        ensemble(
            "stream",
            [tensor("IN", dims=(SIZE,))],
            [tensor("OUT", dims=(SIZE,))],
            [step("tokens", {"X": "IN"}, {"Y": "mid"}), step("ahead", {"X": "mid"}, {"Y": "OUT"})],
        ),
    ]


async def _read_some(sock: trio.socket.SocketType, into: bytearray, limit: int) -> None:
    while len(into) < limit:
        data = await sock.recv(65536)
        assert data, "the stream ended early"
        into += data


@pytest.mark.parametrize("frontend", ["native", "python"])
async def test_a_slow_reader_holds_a_streaming_ensemble_back(frontend: str) -> None:
    made: list[int] = []
    async with front_ends(models=_models(made), frontend=frontend) as (server, address, _):
        host, port = address.rsplit(":", 1)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
        await sock.connect((host, int(port)))
        body = json.dumps({"IN": [0.0] * SIZE}).encode()
        await sock.send(
            b"POST /v2/models/stream/generate_stream HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        received = bytearray()
        with trio.fail_after(30):
            await _read_some(sock, received, 4 * SIZE)  # the first events
            await trio.sleep(1.5)  # the client stops reading
            held = len(made)
            await trio.sleep(0.5)
            assert len(made) == held  # the producer waits
            assert held < HELD, held
            while not received.endswith(b"\r\n0\r\n\r\n"):  # then reads it all
                data = await sock.recv(1 << 20)
                assert data, "the stream ended early"
                received += data
        sock.close()
        events = re.findall(rb"data: (\{.*?\})\n\n", bytes(received))
        assert len(events) == RESPONSES == len(made)
        firsts = [json.loads(event)["OUT"][0] for event in events]
        assert firsts == [index + 0.5 for index in range(RESPONSES)]
        assert b'"error"' not in received
        await trio.lowlevel.checkpoint()
        assert server.model_statistics("tokens")[0].pending_request_count == 0
