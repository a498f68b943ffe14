"""64-bit tensors in jitted models: INT64 token ids, UINT64 and FP64 are exact, with JAX's
64-bit types on for that model's calls only; every other model keeps JAX's 32-bit default,
and nothing changes the process-wide flag."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trio

import orchestrion
from orchestrion.testing import ensemble, inside, model, step, tensor

BIG = np.array([2**40 + 1, 2**53 + 3, -(2**62), 7], np.int64)


def _token_ids() -> orchestrion.Model:
    """A jitted INT64 model: ids shifted by 2**33 and doubled (past 32 bits both ways)."""
    return model(
        "ids",
        lambda X: {"Y": (X + 2**33) * 2},
        [tensor("X", "INT64", (4,))],
        [tensor("Y", "INT64", (4,))],
        parameters={"execution": "thread"},
    )


def _fp32() -> orchestrion.Model:
    """A jitted FP32 model that would change type if 64-bit were on for it: a float
    constant made inside the trace is float64 under x64, and the output check refuses
    FP64 where the config says FP32."""
    return model(
        "narrow",
        lambda X: {"Y": X + jnp.asarray(0.5)},
        [tensor("X", "FP32", (4,))],
        [tensor("Y", "FP32", (4,))],
        parameters={"execution": "thread"},
    )


async def test_int64_token_ids_are_exact_without_a_global_flag() -> None:
    """A jitted INT64 model computes past 32 bits exactly, and the process flag stays off."""
    assert not jax.config.read("jax_enable_x64")
    async with orchestrion.open_server(models=[_token_ids()]) as server:
        out = (await server.infer("ids", {"X": BIG})).outputs["Y"]
    assert out.dtype == np.int64
    assert out.tolist() == [(int(v) + 2**33) * 2 for v in BIG]
    assert not jax.config.read("jax_enable_x64")


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        ("UINT64", np.array([2**64 - 1, 2**63, 1, 0], np.uint64)),
        ("FP64", np.array([1 + 2**-40, 1e300, -1e-300, 0.1], np.float64)),
    ],
)
async def test_uint64_and_fp64_survive_a_jitted_model_bit_for_bit(dtype: str, values: Any) -> None:
    """A jitted identity keeps every bit of UINT64 and FP64 values (32 bits would not)."""
    identity = model(
        "same", lambda X: {"Y": X}, [tensor("X", dtype, (4,))], [tensor("Y", dtype, (4,))]
    )
    async with orchestrion.open_server(models=[identity]) as server:
        out = (await server.infer("same", {"X": values})).outputs["Y"]
    assert out.dtype == values.dtype
    assert out.tobytes() == values.tobytes()


async def test_an_fp32_model_beside_it_still_computes_in_32_bits() -> None:
    """The INT64 and the FP32 model run at the same time in worker threads: the FP32 one
    never sees 64-bit types (its output stays FP32), the INT64 one stays exact."""
    x32 = np.arange(4, dtype=np.float32)
    async with orchestrion.open_server(models=[_token_ids(), _fp32()]) as server:

        async def ids() -> None:
            for _ in range(50):
                out = (await server.infer("ids", {"X": BIG})).outputs["Y"]
                assert out.tolist() == [(int(v) + 2**33) * 2 for v in BIG]

        async def narrow() -> None:
            for _ in range(50):
                out = (await server.infer("narrow", {"X": x32})).outputs["Y"]
                assert out.dtype == np.float32
                assert out.tolist() == (x32 + 0.5).tolist()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ids)
            nursery.start_soon(narrow)


async def test_64_bit_steps_run_in_an_ensemble_unfused() -> None:
    """An ensemble of two INT64 steps: exact, through the scheduler (a 64-bit model is not
    traced into the fused call)."""
    first = model(
        "first",
        lambda X: {"Y": X + 2**33},
        [tensor("X", "INT64", (4,))],
        [tensor("Y", "INT64", (4,))],
    )
    second = model(
        "second", lambda X: {"Y": X * 3}, [tensor("X", "INT64", (4,))], [tensor("Y", "INT64", (4,))]
    )
    both = ensemble(
        "both",
        [tensor("IN", "INT64", (4,))],
        [tensor("OUT", "INT64", (4,))],
        [step("first", {"X": "IN"}, {"Y": "mid"}), step("second", {"X": "mid"}, {"Y": "OUT"})],
    )
    async with orchestrion.open_server(models=[first, second, both]) as server:
        out = (await server.infer("both", {"IN": BIG})).outputs["OUT"]
        assert inside(server).runner("first").capabilities.traceable is False
    assert out.tolist() == ((BIG + np.int64(2**33)) * np.int64(3)).tolist()  # int64 wraps


async def test_an_int64_models_params_keep_64_bits() -> None:
    """What initialize returns is placed on the device with 64-bit types on: an INT64 table
    past 32 bits is exact inside execute."""
    table = np.array([2**40, 2**41, 2**42, 2**43], np.int64)
    lookup = model(
        "lookup",
        lambda params, X: {"Y": params["table"][X]},
        [tensor("X", "INT32", (2,))],
        [tensor("Y", "INT64", (2,))],
        initialize=lambda config: {"table": table},
    )
    async with orchestrion.open_server(models=[lookup]) as server:
        out = (await server.infer("lookup", {"X": np.array([3, 0], np.int32)})).outputs["Y"]
    assert out.tolist() == [2**43, 2**40]
