"""An ensemble's tensors between jitted steps stay on their device: no host round trip, in the
fused step loop, the fused XLA call, the scheduler, a fan-out/fan-in graph and a batched
ensemble. Proven on the CPU with JAX's transfer guard: the client's inputs are put on the
device first, then every host-to-device transfer is refused while the pipeline runs, so a
step whose outputs went through numpy (``np.asarray`` then a jitted call) fails the request.
(On a CPU, JAX copies nothing device-to-host: the guard that catches a round trip there is
the one on its way back.) Answers are compared bit for bit with a plain numpy reference, and
what reaches the client is numpy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import jax
import numpy as np
import pytest
import trio

import orchestrion
from orchestrion.backends import _rows
from orchestrion.protocols import DynamicBatching
from orchestrion.testing import ensemble, fused, infer_until_fused, model, step, tensor, with_fusion

X = np.linspace(-1, 1, 16, dtype=np.float32)


@contextlib.contextmanager
def no_host_to_device() -> Iterator[None]:
    """Refuse implicit host-to-device transfers in every thread while the block runs."""
    jax.config.update("jax_transfer_guard_host_to_device", "disallow")
    try:
        yield
    finally:
        jax.config.update("jax_transfer_guard_host_to_device", "allow")


def test_the_guard_catches_a_round_trip() -> None:
    """The guard works on this machine: a jitted call on numpy made from a device array
    (the round trip these tests rule out) is refused; on the device array it runs."""
    double = jax.jit(lambda a: a * 2)
    on_device = double(jax.device_put(X))
    with no_host_to_device():
        double(on_device)
        with pytest.raises(Exception, match="[Dd]isallowed host-to-device"):
            double(np.asarray(on_device))


def _step(name: str, fn: Any, **kw: Any) -> orchestrion.Model:
    return model(name, fn, [tensor("X")], [tensor("Y")], parameters={"execution": "inline"}, **kw)


def _chain(fusion: str) -> list[orchestrion.Model]:
    return [
        _step("a", lambda X: {"Y": X * 3 + 1}),
        _step("b", lambda X: {"Y": X * X - 2}),
        _step("c", lambda X: {"Y": X / 4}),
        with_fusion(
            ensemble(
                "pipe",
                [tensor("IN")],
                [tensor("OUT")],
                [
                    step("a", {"X": "IN"}, {"Y": "t1"}),
                    step("b", {"X": "t1"}, {"Y": "t2"}),
                    step("c", {"X": "t2"}, {"Y": "OUT"}),
                ],
            ),
            fusion,
        ),
    ]


def _chain_reference(x: np.ndarray) -> np.ndarray:
    t1 = x * np.float32(3) + np.float32(1)
    return (t1 * t1 - np.float32(2)) / np.float32(4)


@pytest.mark.parametrize("fusion", ["on", "xla", "off"])
async def test_a_chain_keeps_its_intermediates_on_the_device(fusion: str) -> None:
    """a -> b -> c with fusion on (the steps' own executables in a loop), xla (one traced
    call) and off (the scheduler's step actors): no host round trip; the client gets numpy."""
    async with orchestrion.open_server(models=_chain(fusion)) as server:
        inputs = {"IN": jax.device_put(X)}
        if fusion == "off":
            await server.infer("pipe", inputs)
        else:  # until fusion has learnt the signature (compiled, checked)
            assert await infer_until_fused(server, "pipe", inputs)
        with no_host_to_device():
            out = (await server.infer("pipe", inputs)).outputs["OUT"]
            assert fused(server) is (fusion != "off")
    assert type(out) is np.ndarray
    np.testing.assert_allclose(out, _chain_reference(X), rtol=1e-6)


@pytest.mark.parametrize("fusion", ["on", "off"])
async def test_a_fan_out_and_fan_in_stays_on_the_device(fusion: str) -> None:
    """IN -> (left, right) -> join: both branches and the join take device arrays."""
    models = [
        _step("left", lambda X: {"Y": X + 1}),
        _step("right", lambda X: {"Y": X * 2}),
        model(
            "join",
            lambda A, B: {"Y": A * B},
            [tensor("A"), tensor("B")],
            [tensor("Y")],
            parameters={"execution": "inline"},
        ),
        with_fusion(
            ensemble(
                "diamond",
                [tensor("IN")],
                [tensor("OUT")],
                [
                    step("left", {"X": "IN"}, {"Y": "l"}),
                    step("right", {"X": "IN"}, {"Y": "r"}),
                    step("join", {"A": "l", "B": "r"}, {"Y": "OUT"}),
                ],
            ),
            fusion,
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        inputs = {"IN": jax.device_put(X)}
        for _ in range(8):
            await server.infer("diamond", inputs)
        with no_host_to_device():
            out = (await server.infer("diamond", inputs)).outputs["OUT"]
    np.testing.assert_array_equal(out, (X + 1) * (X * 2))


@pytest.mark.parametrize("accelerator", [True, False], ids=["accelerator path", "cpu path"])
async def test_a_batched_ensemble_joins_and_splits_on_the_device(
    accelerator: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps with dynamic batching: concurrent requests are joined, padded and split. On an
    accelerator that happens on the device (no round trip; forced here on the CPU to prove
    it); on a CPU-only machine as numpy views of the same memory, which costs far less than
    a JAX operation: there the guard is left off, the answers must still be right."""
    monkeypatch.setattr(_rows, "ON_ACCELERATOR", accelerator)
    batching = DynamicBatching(max_queue_delay_microseconds=20_000)
    rows = [tensor("X", dims=(16,))]
    models = [
        model("scale", lambda X: {"Y": X * 5}, rows, [tensor("Y", dims=(16,))], max_batch_size=8),
        model("shift", lambda X: {"Y": X - 3}, rows, [tensor("Y", dims=(16,))], max_batch_size=8),
        ensemble(
            "batched",
            [tensor("IN", dims=(16,))],
            [tensor("OUT", dims=(16,))],
            [step("scale", {"X": "IN"}, {"Y": "mid"}), step("shift", {"X": "mid"}, {"Y": "OUT"})],
            max_batch_size=8,
        ),
    ]
    models = [m if m.config.is_ensemble else _with_batching(m, batching) for m in models]
    results: dict[int, np.ndarray] = {}
    async with orchestrion.open_server(models=models) as server:
        sources = {i: (X[None] + i).astype(np.float32) for i in range(6)}
        on_device = {i: jax.device_put(v) for i, v in sources.items()}

        async def one(i: int) -> None:
            results[i] = (await server.infer("batched", {"IN": on_device[i]})).outputs["OUT"]

        with no_host_to_device() if accelerator else contextlib.nullcontext():
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
        assert server.model_statistics("scale")[0].execution_count < 6  # batches formed
    for i, out in results.items():
        np.testing.assert_array_equal(out, sources[i] * np.float32(5) - np.float32(3))


def _with_batching(definition: orchestrion.Model, batching: DynamicBatching) -> orchestrion.Model:
    config = attrs.evolve(definition.config, dynamic_batching=batching)
    return attrs.evolve(definition, config=config)


async def test_a_plain_python_step_gets_numpy_and_its_neighbours_stay_on_the_device() -> None:
    """A plain-Python step between jitted ones receives numpy (the one place a copy to the
    host is needed) and its output goes on to the next jitted step."""
    seen: list[type] = []

    def plain(X: Any) -> dict[str, Any]:
        seen.append(type(X))
        return {"Y": X + np.float32(1)}

    models = [
        _step("first", lambda X: {"Y": X * 2}),
        model("middle", plain, [tensor("X")], [tensor("Y")], jit=False),
        _step("last", lambda X: {"Y": X * 3}),
        ensemble(
            "mixed",
            [tensor("IN")],
            [tensor("OUT")],
            [
                step("first", {"X": "IN"}, {"Y": "a"}),
                step("middle", {"X": "a"}, {"Y": "b"}),
                step("last", {"X": "b"}, {"Y": "OUT"}),
            ],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        out = (await server.infer("mixed", {"IN": X})).outputs["OUT"]
    assert seen == [np.ndarray]
    np.testing.assert_array_equal(out, (X * 2 + 1) * 3)
