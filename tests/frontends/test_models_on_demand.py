"""Models loaded on first use and unloaded least recently used first under a budget
(`OnDemand`, ``orchestrion serve --model-load-on-demand``): each answer right, never more
loaded than the budget, concurrent first requests sharing one load, a model in use (or an
ensemble's step while the ensemble is loaded) never unloaded, and the flags' rules. The
repositories are written by the tests: plain Python models ``add<k>`` (Y = X + k, after
DELAY seconds)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from orchestrion import AsyncServer, open_server
from orchestrion.frontends._control import ModelControl, ModelControlMode
from orchestrion.frontends._on_demand import OnDemand, open_on_demand
from orchestrion.frontends._serve import ServeOptions, serve
from orchestrion.frontends._wire_infer import WireInfer
from orchestrion.protocols import (
    ConfigError,
    ModelControlError,
    ModelNotFoundError,
    RequestOptions,
    WireRequest,
)
from orchestrion.testing import get
from support.served import start_server

_CONFIG = """name: "{name}"
max_batch_size: 0
input [
  {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }},
  {{ name: "DELAY" data_type: TYPE_FP32 dims: [ 1 ] }}
]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
"""
_MODEL = """import trio

JIT = False


async def execute(X, DELAY):
    await trio.sleep(float(DELAY[0]))
    return {{"Y": X + {k}}}
"""
_ENSEMBLE = """name: "both"
platform: "ensemble"
max_batch_size: 0
input [
  { name: "X" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "DELAY" data_type: TYPE_FP32 dims: [ 1 ] }
]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "add1" model_version: -1
    input_map { key: "X" value: "X" } input_map { key: "DELAY" value: "DELAY" }
    output_map { key: "Y" value: "mid" } },
  { model_name: "add2" model_version: -1
    input_map { key: "X" value: "mid" } input_map { key: "DELAY" value: "DELAY" }
    output_map { key: "Y" value: "Y" } }
] }
"""


def _repository(
    root: Path,
    count: int,
    *,
    ensemble: bool = False,
    weights: int = 0,
    slow_import: float = 0.0,
) -> Path:
    """``add0`` ... plain models; ``both`` (add1 then add2); ``slow_import``: add1's code
    takes that long to import (a slow load)."""
    for k in range(count):
        folder = root / f"add{k}"
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(_CONFIG.format(name=f"add{k}"))
        code = _MODEL.format(k=k)
        if k == 1 and slow_import:
            code = f"import time\n\ntime.sleep({slow_import})\n" + code
        (folder / "1" / "model.py").write_text(code)
        if weights:
            (folder / "1" / "weights.bin").write_bytes(b"\0" * weights)
    if ensemble:
        (root / "both" / "1").mkdir(parents=True)
        (root / "both" / "config.pbtxt").write_text(_ENSEMBLE)
    return root


@contextlib.asynccontextmanager
async def _on_demand(root: Path, **limits: Any) -> AsyncIterator[tuple[AsyncServer, OnDemand]]:
    async with open_server(root, load_models=[]) as server:
        control = ModelControl(server, mode=ModelControlMode.EXPLICIT)
        async with open_on_demand(server, control, **limits) as on_demand:
            yield server, on_demand


async def _infer(wire: WireInfer, name: str, x: float, delay: float = 0.0) -> float:
    request = WireRequest(
        model_name=name,
        inputs={"X": np.array([x], np.float32), "DELAY": np.array([delay], np.float32)},
        options=RequestOptions(),
    )
    async with wire.holding(name):  # as the front ends hold a request's model
        response = await wire.infer(request)
    return float(response.outputs["Y"][0])


async def _watch(server: AsyncServer, limit: int, seen: list[int]) -> None:
    """Record how many models are loaded, every millisecond (until cancelled)."""
    while True:
        seen.append(len(server.model_names()))
        assert seen[-1] <= limit, server.model_names()
        await trio.sleep(0.001)


async def test_requests_load_models_and_the_least_recently_used_go(tmp_path: Path) -> None:
    async with _on_demand(_repository(tmp_path, 6), max_models=3) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        seen: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch, server, 3, seen)
            for k in [0, 1, 2, 0, 3, 4, 0, 5]:
                assert await _infer(wire, f"add{k}", 10.0) == 10.0 + k
            nursery.cancel_scope.cancel()
        # add0 was used again each time, so the least recently used others went instead.
        assert sorted(server.model_names()) == ["add0", "add4", "add5"]
        assert (on_demand.loads, on_demand.evictions) == (6, 3)
        assert max(seen) == 3


async def test_concurrent_first_requests_share_one_load(tmp_path: Path) -> None:
    async with _on_demand(_repository(tmp_path, 2), max_models=1) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        answers: list[float] = []

        async def one(x: float) -> None:
            answers.append(await _infer(wire, "add1", x))

        async with trio.open_nursery() as nursery:
            for x in range(10):
                nursery.start_soon(one, float(x))
        assert sorted(answers) == [x + 1.0 for x in range(10)]
        assert on_demand.loads == 1


async def test_a_model_in_use_is_not_unloaded(tmp_path: Path) -> None:
    """With room for 2: add0's slow request holds it while add1, add2 and add3 take turns in
    the other place; the slow request then answers right."""
    async with _on_demand(_repository(tmp_path, 4), max_models=2) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        slow: list[float] = []

        async def hold() -> None:
            slow.append(await _infer(wire, "add0", 1.0, delay=0.5))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold)
            await trio.sleep(0.1)
            for k in (1, 2, 3):
                assert await _infer(wire, f"add{k}", 1.0) == 1.0 + k
                assert "add0" in server.model_names()
        assert slow == [1.0]
        assert on_demand.evictions == 2


async def test_a_load_waits_for_a_model_to_come_free(tmp_path: Path) -> None:
    """Room for 1, held by a slow request: the next model loads once that one ends."""
    async with _on_demand(_repository(tmp_path, 2), max_models=1) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_infer, wire, "add0", 0.0, 0.3)
            await trio.sleep(0.05)
            started = trio.current_time()
            assert await _infer(wire, "add1", 0.0) == 1.0
            assert trio.current_time() - started > 0.2
        assert server.model_names() == ["add1"]


async def test_an_ensemble_keeps_its_steps_and_counts_them(tmp_path: Path) -> None:
    """``both`` (add1 then add2) needs 3 places: with room for 3 it loads whole; add0 then
    makes it go (its steps with it, as nothing else uses them); with room for 2 it cannot
    load at all."""
    root = _repository(tmp_path, 3, ensemble=True)
    async with _on_demand(root, max_models=3) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        assert await _infer(wire, "both", 1.0) == 4.0
        assert sorted(server.model_names()) == ["add1", "add2", "both"]
        assert on_demand._victim(set()) == "both"  # its steps are held while it is loaded
        assert await _infer(wire, "add0", 1.0) == 1.0
        assert len(server.model_names()) <= 3
        assert "both" not in server.model_names()
    async with _on_demand(root, max_models=2) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        with pytest.raises(ModelControlError, match=r"needs 3 models loaded at once"):
            await _infer(wire, "both", 1.0)


async def test_an_ensemble_keeps_its_steps_that_are_loaded_already(tmp_path: Path) -> None:
    """``both`` needs add1 and add2, loaded already but the least recently used: making
    room for ``both`` unloads add3, never a step the ensemble is about to use."""
    root = _repository(tmp_path, 4, ensemble=True)
    async with _on_demand(root, max_models=3) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        for k in (1, 3, 2):
            await _infer(wire, f"add{k}", 0.0)
        assert await _infer(wire, "both", 1.0) == 4.0
        assert sorted(server.model_names()) == ["add1", "add2", "both"]


async def test_a_request_that_leaves_does_not_cancel_the_shared_load(tmp_path: Path) -> None:
    """The first request for add1 (whose code takes 0.5 s to import) is cancelled while it
    loads: the second request, waiting for the same load, gets its answer."""
    root = _repository(tmp_path, 2, slow_import=0.5)
    async with _on_demand(root, max_models=2) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        answers: list[float] = []

        async def second() -> None:
            answers.append(await _infer(wire, "add1", 1.0))

        async with trio.open_nursery() as nursery:
            with trio.move_on_after(0.2):
                nursery.start_soon(second)
                await _infer(wire, "add1", 0.0)
        assert answers == [2.0]
        assert on_demand.loads == 1


async def test_a_step_asked_for_while_its_ensemble_loads_is_not_loaded_again(
    tmp_path: Path,
) -> None:
    """A request for add1 while ``both`` (add1 then add2) loads waits for that load and
    answers; nothing is loaded twice or unloaded."""
    root = _repository(tmp_path, 3, ensemble=True, slow_import=0.3)
    async with _on_demand(root, max_models=3) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        answers: list[float] = []

        async def step() -> None:
            await trio.sleep(0.1)
            answers.append(await _infer(wire, "add1", 1.0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(step)
            answers.append(await _infer(wire, "both", 1.0))
        assert sorted(answers) == [2.0, 4.0]
        assert sorted(server.model_names()) == ["add1", "add2", "both"]
        assert on_demand.evictions == 0


async def test_models_loaded_through_the_api_count_and_can_go(tmp_path: Path) -> None:
    """add0, loaded through model control (the load API), counts against the limit, with
    its bytes, and is unloaded for add1 at once (it is the least recently used)."""
    root = _repository(tmp_path, 2, weights=50_000)
    async with _on_demand(root, max_models=1) as (server, on_demand):
        await on_demand.control.load("add0")
        wire = WireInfer(server, on_demand=on_demand)
        with trio.fail_after(5):
            assert await _infer(wire, "add1", 0.0) == 1.0
        assert server.model_names() == ["add1"]
        loaded = {f.name: f.samples[0].value for f in on_demand.metric_families()}
        assert loaded["orchestrion_models_loaded_bytes"] > 50_000


async def test_the_memory_limit_counts_the_files(tmp_path: Path) -> None:
    """Models of 100 kB of files each, a limit of 250 kB: two at a time."""
    root = _repository(tmp_path, 4, weights=100_000)
    async with _on_demand(root, max_bytes=250_000) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        for k in range(4):
            assert await _infer(wire, f"add{k}", 0.0) == float(k)
            assert len(server.model_names()) <= 2
        assert on_demand.evictions == 2


async def test_an_unknown_model_is_still_not_found(tmp_path: Path) -> None:
    async with _on_demand(_repository(tmp_path, 1), max_models=1) as (server, on_demand):
        wire = WireInfer(server, on_demand=on_demand)
        with pytest.raises(ModelNotFoundError):
            await _infer(wire, "nothing", 0.0)
        assert on_demand.loads == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_count_limit": 3}, "need --model-load-on-demand"),
        (
            {"model_load_on_demand": True, "model_control_mode": ModelControlMode.POLL},
            "cannot follow the repository",
        ),
        ({"model_load_on_demand": True, "model_count_limit": 0}, "must be >= 1"),
    ],
)
async def test_the_flags_rules(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    options = ServeOptions(
        model_repository=_repository(tmp_path, 1),
        http_port=0,
        grpc_port=0,
        metrics_port=None,
        **fields,
    )
    with pytest.raises(ConfigError, match=message):
        await serve(options)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def test_twenty_models_served_with_room_for_three(tmp_path: Path) -> None:
    """``orchestrion serve --model-load-on-demand --model-count-limit 3`` on 20 models: a
    request to each in turn, over HTTP and gRPC (tritonclient, metadata first as its
    examples do), each answer right, never more than 3 loaded (the metrics and the
    repository index after each), every load and eviction counted."""
    served = start_server(
        "--model-load-on-demand",
        "--model-count-limit",
        "3",
        repository=_repository(tmp_path, 20),
    )
    try:
        http = httpclient.InferenceServerClient(served.http)
        grpc = grpcclient.InferenceServerClient(served.grpc)
        for k in range(20):
            module, client = (httpclient, http) if k % 2 else (grpcclient, grpc)
            assert client.get_model_metadata(f"add{k}") is not None
            inputs = [module.InferInput("X", [1], "FP32"), module.InferInput("DELAY", [1], "FP32")]
            inputs[0].set_data_from_numpy(np.array([100.0], np.float32))
            inputs[1].set_data_from_numpy(np.array([0.0], np.float32))
            result = client.infer(f"add{k}", inputs)
            assert result.as_numpy("Y").tolist() == [100.0 + k]
            assert _metric(_scrape(served), "orchestrion_models_loaded") <= 3
            ready = [m for m in http.get_model_repository_index() if m.get("state") == "READY"]
            assert len(ready) <= 3, ready
        http.close()
        grpc.close()
        text = _scrape(served)
        assert _metric(text, "orchestrion_models_loaded") == 3
        assert _metric(text, "orchestrion_model_loads_total") == 20
        assert _metric(text, "orchestrion_model_evictions_total") == 17
        assert _metric(text, "orchestrion_model_load_seconds_total") > 0
    finally:
        assert served.stop() == 0, served.text()


def _scrape(served: Any) -> str:
    status, body = get(served.metrics, "/metrics")
    assert status == 200
    return body.decode()
