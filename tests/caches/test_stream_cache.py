"""The response cache for streams (decoupled models and streaming ensembles), through the
embedding API: a whole stream is stored once it ends and replayed in order with its final
flags; a stream that fails, is left early or is too large is never stored; identical
concurrent streams run once; the Redis format carries a stream entry."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio

import orchestrion
from orchestrion.actors import _request_router
from orchestrion.protocols import (
    CacheEntry,
    InferenceError,
    cache_key,
    decode_entry,
    encode_entry,
    stream_entry,
    stream_responses,
)
from orchestrion.testing import cached, decoupled, ensemble, model, step, tensor

LOCAL = "local,size=1048576"


class Words:
    """A decoupled model: X[0] responses, response i holding X + i; counts its runs, and
    fails after its second response when X[0] is negative."""

    def __init__(self) -> None:
        self.runs = 0

    async def execute(self, X: Any) -> AsyncIterator[dict[str, Any]]:
        self.runs += 1
        count = int(abs(X[0]))
        for index in range(count):
            if X[0] < 0 and index == 2:
                raise ValueError("the words ran out")
            await trio.sleep(0.001)
            yield {"Y": X + index}


def _stream_model(words: Words, name: str = "words") -> orchestrion.Model:
    return cached(decoupled(name, words.execute, dims=(4,)))


async def _stream(server: orchestrion.AsyncServer, name: str, x: Any) -> list[Any]:
    async with contextlib.aclosing(server.stream_infer(name, {"X": x})) as responses:
        return [response async for response in responses]


async def _collect(responses: Any, into: list[Any]) -> None:
    async with contextlib.aclosing(responses) as each:
        async for response in each:
            into.append(response)


def _x(first: float) -> Any:
    return np.array([first, 1, 2, 3], np.float32)


async def test_a_stream_is_stored_whole_and_replayed_in_order_with_its_flags() -> None:
    words = Words()
    async with orchestrion.open_server(models=[_stream_model(words)], cache_config=LOCAL) as s:
        first = await _stream(s, "words", _x(3))
        again = await _stream(s, "words", _x(3))
        assert words.runs == 1
        assert len(first) == len(again) == 3
        for ran, replayed in zip(first, again, strict=True):
            assert replayed.outputs["Y"].tolist() == ran.outputs["Y"].tolist()
            assert replayed.final == ran.final
            assert (replayed.model_name, replayed.model_version) == ("words", 1)
        statistics = s.cache_statistics()
        assert statistics is not None
        assert (statistics.hits, statistics.misses, statistics.insertions) == (1, 1, 1)
        model_stats = s.model_statistics("words")[0]
        assert model_stats.inference_stats.cache_hit.count == 1
        assert model_stats.inference_stats.cache_miss.count == 1
        await _stream(s, "words", _x(2))  # other inputs: another entry
        assert words.runs == 2


async def test_a_replayed_entry_is_read_only() -> None:
    """A replayed response's arrays cannot be changed (every hit shares the entry)."""
    async with orchestrion.open_server(
        models=[_stream_model(Words())], cache_config=LOCAL
    ) as server:
        await _stream(server, "words", _x(2))
        replayed = await _stream(server, "words", _x(2))
        with pytest.raises(ValueError, match="read-only"):
            replayed[0].outputs["Y"][0] = 99


async def test_a_failed_stream_is_not_stored() -> None:
    """Two responses, then the model's error: the caller gets both and the error, and the
    next identical request runs the model again (a failure is never replayed)."""
    words = Words()
    async with orchestrion.open_server(models=[_stream_model(words)], cache_config=LOCAL) as s:
        for expected_runs in (1, 2):
            got: list[Any] = []
            with pytest.raises(InferenceError, match="the words ran out"):
                await _collect(s.stream_infer("words", {"X": _x(-4)}), got)
            assert len(got) == 2
            assert words.runs == expected_runs
        statistics = s.cache_statistics()
        assert statistics is not None
        assert statistics.insertions == 0


async def test_a_stream_left_early_is_not_stored() -> None:
    words = Words()
    async with orchestrion.open_server(models=[_stream_model(words)], cache_config=LOCAL) as s:
        async with contextlib.aclosing(s.stream_infer("words", {"X": _x(5)})) as responses:
            async for _ in responses:
                break
        assert len(await _stream(s, "words", _x(5))) == 5
        assert words.runs == 2
        assert len(await _stream(s, "words", _x(5))) == 5
        assert words.runs == 2


async def test_a_stream_over_the_limit_is_served_and_not_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_request_router, "STREAM_ENTRY_LIMIT", 40)  # 2.5 responses of 16 B
    words = Words()
    async with orchestrion.open_server(models=[_stream_model(words)], cache_config=LOCAL) as s:
        assert len(await _stream(s, "words", _x(3))) == 3
        assert len(await _stream(s, "words", _x(3))) == 3
        assert words.runs == 2
        assert len(await _stream(s, "words", _x(2))) == 2  # 32 B: stored
        assert len(await _stream(s, "words", _x(2))) == 2
        assert words.runs == 3


async def test_a_stream_read_slowly_does_not_hold_identical_requests_back() -> None:
    """A first stream whose reader stops after one response: an identical request runs and
    ends meanwhile (it does not wait for the first), and stores the stream for the next."""
    words = Words()
    async with orchestrion.open_server(models=[_stream_model(words)], cache_config=LOCAL) as s:
        async with contextlib.aclosing(s.stream_infer("words", {"X": _x(4)})) as first:
            async for _ in first:
                with trio.fail_after(5):
                    assert len(await _stream(s, "words", _x(4))) == 4
                break
        assert len(await _stream(s, "words", _x(4))) == 4
        assert words.runs == 2


async def test_a_streaming_ensemble_caches_its_whole_stream() -> None:
    """A cached ensemble over a decoupled step: the replay skips every step."""
    words = Words()
    runs: list[int] = []

    def louder(X: Any) -> dict[str, Any]:
        runs.append(1)
        return {"Y": X * 10}

    pipe = cached(
        ensemble(
            "spoken",
            [tensor("IN", dims=(4,))],
            [tensor("OUT", dims=(4,))],
            [
                step("words", {"X": "IN"}, {"Y": "mid"}),
                step("louder", {"X": "mid"}, {"Y": "OUT"}),
            ],
        )
    )
    models = [
        decoupled("words", words.execute, dims=(4,)),
        model("louder", louder, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))], jit=False),
        pipe,
    ]
    async with orchestrion.open_server(models=models, cache_config=LOCAL) as server:
        for _ in range(2):
            async with contextlib.aclosing(server.stream_infer("spoken", {"IN": _x(3)})) as rs:
                got = [response.outputs["OUT"].tolist() async for response in rs]
            assert got == [[(v + i) * 10 for v in (3, 1, 2, 3)] for i in range(3)]
        assert (words.runs, len(runs)) == (1, 3)


def test_a_stream_entry_goes_through_the_byte_format() -> None:
    """What Redis stores: a stream entry encoded and decoded keeps every response, its
    outputs and flags, in order (an empty stream too)."""
    key = cache_key("m", 1, {"X": np.zeros(2, np.float32)}, None, revision="r")
    texts = np.array([b"a", b"bc"], dtype=object)
    responses = [
        ({"Y": np.arange(3, dtype=np.float32), "T": texts}, False),
        ({}, False),
        ({"Y": np.arange(2, dtype=np.float32)}, True),
    ]
    decoded = decode_entry(encode_entry(stream_entry(key, responses)))
    replayed = stream_responses(decoded, None)
    assert replayed is not None
    assert [final for _, final in replayed] == [False, False, True]
    assert replayed[0][0]["Y"].tolist() == [0, 1, 2]
    assert replayed[0][0]["T"].tolist() == [b"a", b"bc"]
    assert replayed[1][0] == {}
    assert list(replayed[2][0]) == ["Y"]
    assert stream_responses(decode_entry(encode_entry(stream_entry(key, []))), None) == []
    only = stream_responses(decoded, frozenset({"T"}))
    assert only is not None
    assert [sorted(outputs) for outputs, _ in only] == [["T"], [], []]
    plain = CacheEntry(key=key, outputs={"Y": np.zeros(2, np.float32)})
    assert stream_responses(plain, None) is None  # not a stream's entry
