"""The response cache against clients and deploys that could make it lie: a hit carries only
the hitting request's own metadata, and no answer outlives the code or config that made it
(a reload, a composing model's reload, replicas of other revisions sharing one Redis)."""

from __future__ import annotations

import json
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis as redis_client
import tritonclient.grpc as grpcclient

from orchestrion.testing import RedisServer, Served, post
from support.reliability_report import record
from support.served import cache_hits, pipeline_body, start_server

_ALICE = "alice-session-7f3a9c"


@pytest.fixture(params=["local", "redis"])
def cache_flags(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """The flags of a server with a local cache, or with a fresh Redis."""
    if request.param == "local":
        yield ["--cache-config=local,size=1048576"]
        return
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        yield [f"--cache-config={value}" for value in redis.cache_config]
    finally:
        redis.stop()


def test_a_hit_carries_only_the_hitting_requests_parameters(cache_flags: list[str]) -> None:
    """Client A's sequence id is stored with nothing: B, asking the same over HTTP and gRPC,
    is answered from the cache with no parameters (or its own), and an id past uint64 is a
    400 that poisons nothing."""
    served = start_server(*cache_flags)
    leaks: list[str] = []
    try:
        status, body = post(
            served.http,
            "/v2/models/pipeline/infer",
            pipeline_body(3.0, sequence_id=_ALICE, sequence_start=True),
        )
        assert status == 200, body
        assert json.loads(body)["parameters"]["sequence_id"] == _ALICE
        before = cache_hits(served, "pipeline")
        status, body = post(served.http, "/v2/models/pipeline/infer", pipeline_body(3.0))
        assert status == 200, body
        if _ALICE.encode() in body or "parameters" in json.loads(body):
            leaks.append(f"HTTP: {body[:200]!r}")
        status, body = post(
            served.http, "/v2/models/pipeline/infer", pipeline_body(3.0, sequence_id="bob")
        )
        assert json.loads(body)["parameters"]["sequence_id"] == "bob"
        client = grpcclient.InferenceServerClient(served.grpc)
        try:
            tensor = grpcclient.InferInput("INPUT", [1, 16], "FP32")
            tensor.set_data_from_numpy(np.full((1, 16), 3.0, np.float32))
            answer = client.infer("pipeline", [tensor]).get_response()
            if _ALICE in str(answer) or answer.parameters:
                leaks.append(f"gRPC: {answer.parameters}")
            hits = cache_hits(served, "pipeline") - before
            # Ids Triton cannot hold are refused, and cannot break later gRPC answers.
            refused = [
                post(
                    served.http,
                    "/v2/models/pipeline/infer",
                    pipeline_body(5.0).replace(
                        b"]}]}", b']}],"parameters":{"sequence_id":' + str(big).encode() + b"}}"
                    ),
                )[0]
                for big in (2**64, 10**400)
            ]
            tensor.set_data_from_numpy(np.full((1, 16), 5.0, np.float32))
            client.infer("pipeline", [tensor])  # raises if the entry was poisoned
        finally:
            client.close()
    finally:
        served.stop()
    assert leaks == []
    assert hits == 3
    assert refused == [400, 400]
    which = "Redis" if "redis" in cache_flags[0] else "a local cache"
    record(
        "Security",
        f"Client A's sequence_id stored by a cached ensemble ({which}); client B asks the "
        "same with no parameters (HTTP, gRPC) and with its own id; ids of 2**64 and 10**400",
        "1 miss, 3 hits, 2 oversized ids, 1 gRPC request after them",
        "the hits carry no parameters (or B's own id), never A's; the oversized ids a 400; "
        "gRPC answered right after them",
    )


_SCALED = """# Y = X * K: a cached model whose code changes between loads.
name: "scaled"
max_batch_size: 0
response_cache { enable: true }
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
_STEP = _SCALED.replace('"scaled"', '"step"').replace("response_cache { enable: true }\n", "")
_ENSEMBLE = """# A cached ensemble over the uncached step.
name: "scaled_pipeline"
platform: "ensemble"
max_batch_size: 0
response_cache { enable: true }
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [ { model_name: "step" input_map { key: "X" value: "X" }
           output_map { key: "Y" value: "Y" } } ]
}
"""


def _write_repository(root: Path, factor: float) -> Path:
    for name, config in (("scaled", _SCALED), ("step", _STEP), ("scaled_pipeline", _ENSEMBLE)):
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(config)
    for name in ("scaled", "step"):
        _set_factor(root, name, factor)
    return root


def _set_factor(root: Path, name: str, factor: float) -> None:
    (root / name / "1" / "model.py").write_text(
        f"K = {factor}\n\n\ndef execute(X):\n    return {{'Y': X * K}}\n"
    )


def _scaled(served: Served, model: str, x: float) -> float:
    body = json.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [x]}]}
    ).encode()
    status, answer = post(served.http, f"/v2/models/{model}/infer", body)
    assert status == 200, answer
    return float(json.loads(answer)["outputs"][0]["data"][0])


def _answers(served: Served) -> dict[str, float]:
    return {m: _scaled(served, m, 1.0) for m in ("scaled", "scaled_pipeline")}


def test_no_answer_outlives_a_reload(cache_flags: list[str], tmp_path: Path) -> None:
    """K goes from 10 to 20 and the models are reloaded (the load API; then the repository
    poller): X=1, cached before, gives 20 from the model and from the cached ensemble over
    the reloaded step, never the old 10."""
    root = _write_repository(tmp_path / "models", 10.0)
    stale: list[str] = []
    explicit = start_server(
        *cache_flags,
        "--model-control-mode=explicit",
        "--load-model=scaled",
        "--load-model=scaled_pipeline",
        repository=root,
    )
    try:
        assert _answers(explicit) == {"scaled": 10.0, "scaled_pipeline": 10.0}
        assert _answers(explicit) == {"scaled": 10.0, "scaled_pipeline": 10.0}  # hits
        hits = cache_hits(explicit, "scaled") + cache_hits(explicit, "scaled_pipeline")
        for name in ("scaled", "step"):
            _set_factor(root, name, 20.0)
        # The ensemble's composing model alone: the ensemble's entries must go with it.
        for name in ("scaled", "step"):
            status, body = post(explicit.http, f"/v2/repository/models/{name}/load", b"")
            assert status == 200, body
        after = _answers(explicit)
        if after != {"scaled": 20.0, "scaled_pipeline": 20.0}:
            stale.append(f"explicit: {after}")
        assert _scaled(explicit, "scaled", 2.0) == 40.0
    finally:
        explicit.stop()
    for name in ("scaled", "step"):
        _set_factor(root, name, 10.0)
    polled = start_server(
        *cache_flags, "--model-control-mode=poll", "--repository-poll-secs=1", repository=root
    )
    try:
        first = _answers(polled)  # from Redis: the files are as the first server's were
        for name in ("scaled", "step"):
            _set_factor(root, name, 30.0)
        deadline, x = time.monotonic() + 60, 100.0
        while _scaled(polled, "step", x) != 30.0 * x:  # a fresh input: the poller's reload
            assert time.monotonic() < deadline, "the poller never reloaded the step"
            time.sleep(0.2)
            x += 1
        while _scaled(polled, "scaled", x) != 30.0 * x:
            assert time.monotonic() < deadline, "the poller never reloaded 'scaled'"
            time.sleep(0.2)
            x += 1
        after = _answers(polled)
        if after != {"scaled": 30.0, "scaled_pipeline": 30.0}:
            stale.append(f"poll: {after}")
    finally:
        polled.stop()
    assert first == {"scaled": 10.0, "scaled_pipeline": 10.0}
    assert hits == 2
    assert stale == []
    which = "Redis" if "redis" in cache_flags[0] else "a local cache"
    record(
        "Faults",
        f"A cached model and a cached ensemble over an uncached step ({which}); the code "
        "changes (K 10 -> 20, then 30) and is reloaded by the load API, then by the poller",
        "2 reloads of 2 models, each after the old answers were cached",
        "after each reload X=1 gave the new code's answer from the model and from the "
        "ensemble (its step's reload is in its key); never the old entry",
    )


def test_replicas_of_other_revisions_never_share_entries(tmp_path: Path) -> None:
    """Two servers on one Redis during a rolling deploy (K=10 and K=20 in their model
    files): each answers with its own code; a third with the first one's files shares the
    first one's entries."""
    redis = RedisServer(tmp_path)
    redis.start()
    flags = [f"--cache-config={value}" for value in redis.cache_config]
    old = _write_repository(tmp_path / "old", 10.0)
    new = _write_repository(tmp_path / "new", 20.0)
    same = shutil.copytree(old, tmp_path / "same")
    servers = [start_server(*flags, repository=r) for r in (old, new, same)]
    try:
        got, store = [], redis_client.Redis(port=redis.port)
        for index, served in enumerate(servers[:2]):
            got.append(_answers(served))
            deadline = time.monotonic() + 30
            while store.dbsize() < 2 * (index + 1):  # the inserts reach Redis in batches
                assert time.monotonic() < deadline, "the entries never reached Redis"
                time.sleep(0.02)
        got.append(_answers(servers[2]))
        store.close()
        shared = cache_hits(servers[2], "scaled") + cache_hits(servers[2], "scaled_pipeline")
        crossed = cache_hits(servers[1], "scaled") + cache_hits(servers[1], "scaled_pipeline")
    finally:
        for served in servers:
            served.stop()
        redis.stop()
    assert got[0] == {"scaled": 10.0, "scaled_pipeline": 10.0}
    assert got[1] == {"scaled": 20.0, "scaled_pipeline": 20.0}
    assert got[2] == got[0]
    assert (crossed, shared) == (0, 2)
    record(
        "Faults",
        "A rolling deploy: servers running K=10 and K=20 (and a third with the first one's "
        "files) share one Redis",
        "3 servers, 2 cached models each",
        "each answered with its own code (no hit across revisions); the identical deploy hit "
        "the first one's entries",
    )


def test_a_forged_entrys_parameters_never_reach_a_client(tmp_path: Path) -> None:
    """A writer with access to Redis adds response parameters (another client's sequence id)
    to a stored entry's header: the hit is served with the hitting request's own parameters
    (none), since entries carry outputs only."""
    redis = RedisServer(tmp_path)
    redis.start()
    served = start_server(*[f"--cache-config={value}" for value in redis.cache_config])
    store = redis_client.Redis(port=redis.port)
    try:
        status, _ = post(served.http, "/v2/models/pipeline/infer", pipeline_body(9.0))
        assert status == 200
        deadline = time.monotonic() + 30
        while not (keys := store.keys("*")):
            assert time.monotonic() < deadline, "the entry never reached Redis"
            time.sleep(0.02)
        (key,) = keys
        value = store.get(key)
        assert value is not None
        (length,) = struct.unpack_from("<I", value, 8)
        header = json.loads(value[12 : 12 + length])
        header["parameters"] = {"sequence_id": _ALICE, "sequence_start": True}
        forged = json.dumps(header, separators=(",", ":")).encode()
        store.set(key, value[:8] + struct.pack("<I", len(forged)) + forged + value[12 + length :])
        before = cache_hits(served, "pipeline")
        status, body = post(served.http, "/v2/models/pipeline/infer", pipeline_body(9.0))
        hits = cache_hits(served, "pipeline") - before
    finally:
        store.close()
        served.stop()
        redis.stop()
    assert status == 200, body
    assert hits == 1
    assert "parameters" not in json.loads(body), body[:300]
    record(
        "Security",
        "A stored Redis entry's header given response parameters (another client's "
        "sequence_id) by a writer with access to Redis",
        "1 forged entry, 1 hit",
        "the hit answered right with no parameters: entries carry outputs only",
    )
