"""Bad requests get a clear error, nothing runs, and the server keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

import orchestrion
from orchestrion.testing import ensemble, model, step, tensor


def models() -> list[orchestrion.Model]:
    def fragile(X):
        if float(X.sum()) > 100:
            raise ZeroDivisionError("sum too large for this model")
        return {"Y": X + 1}

    return [
        model(
            "batched",
            lambda X: {"Y": X * 2},
            [tensor("X", dims=(4,))],
            [tensor("Y", dims=(4,))],
            max_batch_size=8,
        ),
        model("fragile", fragile, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))], jit=False),
        model(
            "wildcard",
            lambda X: {"Y": X},
            [tensor("X", dims=(-1, 2))],
            [tensor("Y", dims=(-1, 2))],
        ),
        model(
            "wrong_dtype",
            lambda X: {"Y": X.astype(np.int32)},
            [tensor("X", dims=(4,))],
            [tensor("Y", dims=(4,))],
            jit=False,
        ),
        model(
            "unknown_out",
            lambda X: {"Z": X},
            [tensor("X", dims=(4,))],
            [tensor("Y", dims=(4,))],
            jit=False,
        ),
        model(
            "not_a_dict", lambda X: X, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))], jit=False
        ),
        model(
            "bad_shape",
            lambda X: {"Y": X[:2]},
            [tensor("X", dims=(4,))],
            [tensor("Y", dims=(4,))],
            jit=False,
        ),
        ensemble(
            "pipe",
            [tensor("IN", dims=(4,))],
            [tensor("OUT", dims=(4,))],
            [step("fragile", {"X": "IN"}, {"Y": "OUT"})],
        ),
    ]


GOOD = np.ones((2, 4), dtype=np.float32)


async def _still_serving(server: orchestrion.AsyncServer) -> None:
    out = await server.infer("batched", {"X": GOOD})
    np.testing.assert_array_equal(out.outputs["Y"], GOOD * 2)


@pytest.mark.parametrize(
    ("name", "inputs", "kwargs", "error", "match"),
    [
        (
            "nope",
            {"X": GOOD},
            {},
            orchestrion.ModelNotFoundError,
            r"^Request for unknown model: 'nope' is not found$",
        ),
        (
            "batched",
            {"X": GOOD},
            {"model_version": 7},
            orchestrion.ModelNotFoundError,
            r"^Request for unknown model: '[a-z_]+' version 7 is not found$",
        ),
        ("batched", {}, {}, orchestrion.InvalidRequestError, "missing required input 'X'"),
        (
            "batched",
            {"X": GOOD, "EXTRA": GOOD},
            {},
            orchestrion.InvalidRequestError,
            "unexpected inputs 'EXTRA'",
        ),
        (
            "batched",
            {"X": GOOD.astype(np.float64)},
            {},
            orchestrion.InvalidRequestError,
            "input 'X' has data type FP64, expected FP32",
        ),
        (
            "batched",
            {"X": np.ones((2, 5), np.float32)},
            {},
            orchestrion.InvalidRequestError,
            r"input 'X' has shape \[2, 5\], expected \[-1,4\]",
        ),
        (
            "batched",
            {"X": np.ones(4, np.float32)},
            {},
            orchestrion.InvalidRequestError,
            "has shape",
        ),
        (
            "batched",
            {"X": np.ones((9, 4), np.float32)},
            {},
            orchestrion.InvalidRequestError,
            "batch size 9, expected 1 to 8",
        ),
        (
            "batched",
            {"X": np.ones((0, 4), np.float32)},
            {},
            orchestrion.InvalidRequestError,
            "batch size 0",
        ),
        (
            "batched",
            {"X": GOOD},
            {"outputs": ["Q"]},
            orchestrion.InvalidRequestError,
            "requested unknown outputs 'Q'",
        ),
        (
            "wildcard",
            {"X": np.ones((3, 3), np.float32)},
            {},
            orchestrion.InvalidRequestError,
            r"expected \[-1,2\]",
        ),
        (
            "pipe",
            {"IN": np.array(["a", "b", "c", "d"])},
            {},
            orchestrion.InvalidRequestError,
            "has data type BYTES, expected FP32",
        ),
    ],
)
async def test_bad_request_is_rejected_before_running(name, inputs, kwargs, error, match) -> None:
    """Unknown models or versions and wrong inputs are the caller's fault and run nothing."""
    async with orchestrion.open_server(models=models()) as server:
        with pytest.raises(error, match=match):
            await server.infer(name, inputs, **kwargs)
        assert all(s.execution_count == 0 for s in server.model_statistics())
        await _still_serving(server)


async def test_model_that_raises_names_itself_and_keeps_serving() -> None:
    """A model's exception becomes an InferenceError naming the model and keeping the message."""
    async with orchestrion.open_server(models=models()) as server:
        big = np.full(4, 100, np.float32)
        with pytest.raises(orchestrion.InferenceError) as info:
            await server.infer("fragile", {"X": big})
        assert "model 'fragile' (version 1) failed: ZeroDivisionError: sum too large" in str(
            info.value
        )
        assert isinstance(info.value.__cause__, ZeroDivisionError)
        with pytest.raises(
            orchestrion.InferenceError, match="^in ensemble 'pipe', step\\[0\\]: model 'fragile'"
        ):
            await server.infer("pipe", {"IN": big})
        out = await server.infer("pipe", {"IN": np.zeros(4, np.float32)})
        assert out.outputs["OUT"].tolist() == [1.0] * 4
        stats = server.model_statistics("fragile")[0]
        assert (stats.inference_stats.success.count, stats.inference_stats.fail.count) == (1, 2)
        assert stats.execution_count == 3


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("wrong_dtype", "output 'Y' has data type INT32, expected FP32"),
        ("unknown_out", "unknown output 'Z'"),
        ("not_a_dict", "must return a dict of outputs, got ndarray"),
        ("bad_shape", r"output 'Y' has shape \[2\], expected \[4\]"),
    ],
)
async def test_model_returning_a_bad_result_is_an_error(name: str, match: str) -> None:
    """Outputs are checked against the config: the model is blamed, the server keeps serving."""
    async with orchestrion.open_server(models=models()) as server:
        with pytest.raises(orchestrion.InferenceError, match=match) as info:
            await server.infer(name, {"X": np.zeros(4, np.float32)})
        assert f"model '{name}'" in str(info.value)
        await _still_serving(server)


async def test_list_inputs_are_accepted_when_the_dtype_matches() -> None:
    """Plain Python lists become arrays; BYTES accepts str and bytes."""
    bytes_model = model(
        "echo",
        lambda S: {"T": S},
        [tensor("S", "BYTES", dims=(2,))],
        [tensor("T", "BYTES", dims=(2,))],
        jit=False,
    )
    async with orchestrion.open_server(models=[bytes_model]) as server:
        out = await server.infer("echo", {"S": ["héllo", b"\xff"]})
    assert out.outputs["T"].tolist() == ["héllo".encode(), b"\xff"]


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
async def test_timeout_must_be_positive(seconds: float) -> None:
    """A zero, negative or NaN timeout is the caller's mistake."""
    async with orchestrion.open_server(models=models()) as server:
        with pytest.raises(orchestrion.InvalidRequestError, match="timeout must be a positive"):
            await server.infer("batched", {"X": GOOD}, timeout=seconds)
        await _still_serving(server)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"inputs": GOOD}, "inputs must be a mapping"),
        ({"outputs": "Y"}, "outputs must be a list of output names"),
        ({"model_version": "1"}, "model_version must be an integer"),
        ({"timeout": "1"}, "timeout must be a positive number"),
        ({"parameters": {"a": [1, 2]}}, r"parameters\['a'\] must be a str, int, float or bool"),
        ({"priority": -1}, "priority must be a non-negative integer"),
        ({"request_id": 5}, "request_id must be a string"),
    ],
)
async def test_arguments_of_the_wrong_kind_are_named(kwargs: dict, argument: str) -> None:
    """A mistaken argument of infer is an InvalidRequestError naming the argument."""
    async with orchestrion.open_server(models=models()) as server:
        call = {"inputs": {"X": GOOD}, **kwargs}
        with pytest.raises(orchestrion.InvalidRequestError, match=argument):
            await server.infer("batched", call.pop("inputs"), **call)
        await _still_serving(server)


async def test_explicitly_requested_output_left_out_by_a_model_is_left_out() -> None:
    """A model that leaves out an output the client named answers without it, as Triton's
    python backend does; an empty list means all."""
    partial = model(
        "partial",
        lambda X: {"A": X},
        [tensor("X", dims=(4,))],
        [tensor("A", dims=(4,)), tensor("B", dims=(4,))],
        jit=False,
    )
    async with orchestrion.open_server(models=[partial]) as server:
        x = np.zeros(4, np.float32)
        assert set((await server.infer("partial", {"X": x}, outputs=[])).outputs) == {"A"}
        assert set((await server.infer("partial", {"X": x}, outputs=["A"])).outputs) == {"A"}
        assert set((await server.infer("partial", {"X": x}, outputs=["A", "B"])).outputs) == {"A"}
        assert (await server.infer("partial", {"X": x}, outputs=["B"])).outputs == {}


async def test_a_late_answer_of_uninterruptible_work_is_a_timeout() -> None:
    """A synchronous execute that finishes after the deadline still yields a timeout."""
    import time

    def slow(X):
        time.sleep(0.05)
        return {"Y": X}

    definition = model("slow", slow, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))], jit=False)
    async with orchestrion.open_server(models=[definition]) as server:
        with pytest.raises(orchestrion.InferenceTimeoutError):
            await server.infer("slow", {"X": np.zeros(4, np.float32)}, timeout=0.01)
        await server.infer("slow", {"X": np.zeros(4, np.float32)}, timeout=5)


async def test_plain_python_models_cannot_write_into_shared_inputs() -> None:
    """Inputs are read-only for plain models: a write fails that model, nobody's data changes."""

    def vandal(X):
        X *= 0
        return {"Y": X}

    models_ = [
        model("vandal", vandal, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))], jit=False),
        model("twice", lambda X: {"Y": X * 2}, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))]),
        ensemble(
            "both",
            [tensor("IN", dims=(4,))],
            [tensor("A", dims=(4,)), tensor("B", dims=(4,))],
            [step("twice", {"X": "IN"}, {"Y": "A"}), step("vandal", {"X": "IN"}, {"Y": "B"})],
        ),
    ]
    x = np.ones(4, np.float32)
    async with orchestrion.open_server(models=models_) as server:
        with pytest.raises(orchestrion.InferenceError, match="read-only"):
            await server.infer("both", {"IN": x})
        out = await server.infer("both", {"IN": x}, outputs=["A"])
    assert x.tolist() == [1.0] * 4
    assert out.outputs["A"].tolist() == [2.0] * 4


async def test_plain_python_models_may_read_the_request_metadata() -> None:
    """execute(X, request) sees the request's parameters and ids (JIT = False models)."""

    def scaled(X, request):
        return {"Y": X * float(request.parameters["scale"])}

    definition = model(
        "scaled", scaled, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))], jit=False
    )
    async with orchestrion.open_server(models=[definition]) as server:
        out = await server.infer("scaled", {"X": np.ones(4, np.float32)}, parameters={"scale": 3})
    assert out.outputs["Y"].tolist() == [3.0] * 4
