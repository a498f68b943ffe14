"""A composing model that leaves an output out of its answer, through the embedding API: the
answers Triton gives (found by running Triton 2.51 on the shapes of tests/left_out_models).

An ensemble output left out is left out of the response, whether the client named it or
not; a left-out tensor that feeds a later step's optional input lets that step run without
it; one that feeds a required input makes that step's request refused (a
`StepRefusedError`), unless pruning leaves that step out. The same for python-backend,
plain-Python and jitted composing models, on the scheduler's path, fused and streamed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

import orchestrion
from orchestrion import InferenceError, StepRefusedError
from orchestrion.protocols import ModelTransactionPolicy
from orchestrion.testing import ensemble, model, settled, step, tensor, with_fusion

REPOSITORY = Path(__file__).resolve().parents[1] / "left_out_models"
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.ones((1, 16), np.int32)
INPUTS = {"INPUT0": A, "INPUT1": B}


@contextlib.asynccontextmanager
async def _repository(*names: str) -> AsyncIterator[orchestrion.AsyncServer]:
    async with orchestrion.open_server(
        model_repository=REPOSITORY, load_models=list(names)
    ) as server:
        yield server


@pytest.mark.parametrize(
    "outputs", [None, [], ["OUTPUT0", "OUTPUT1"], ["OUTPUT0"], ["OUTPUT1"]], ids=str
)
async def test_an_ensemble_output_left_out_is_missing_from_the_answer(
    outputs: list[str] | None,
) -> None:
    """Triton's ensemble_partial_add_sub: OUTPUT1 is never in the response, whether the
    client names it or not; OUTPUT0 is there whenever asked for (none named: all)."""
    async with _repository("ensemble_partial_add_sub") as server:
        response = await server.infer("ensemble_partial_add_sub", INPUTS, outputs=outputs)
    expected = {"OUTPUT0"} if outputs != ["OUTPUT1"] else set()
    assert set(response.outputs) == expected
    if expected:  # intermediate_1 = INPUT1 - INPUT1 = 0: OUTPUT0 = INPUT0
        assert response.outputs["OUTPUT0"].tolist() == A.tolist()


@pytest.mark.parametrize("name", ["partial_add_sub", "jax_partial"])
async def test_a_model_asked_directly_answers_without_the_output_it_left_out(name: str) -> None:
    """Asked directly, a python-backend or jitted model that leaves OUTPUT1 out answers
    without it, also when the client names it (as Triton's python backend does)."""
    async with _repository(name) as server:
        for outputs, expected in (
            (None, {"OUTPUT0"}),
            (["OUTPUT0", "OUTPUT1"], {"OUTPUT0"}),
            (["OUTPUT1"], set()),
        ):
            response = await server.infer(name, INPUTS, outputs=outputs)
            assert set(response.outputs) == expected, outputs
        assert response.model_name == name


@pytest.mark.parametrize("outputs", [None, ["OUT0", "OUT1"], ["OUT1"]], ids=str)
async def test_a_left_out_tensor_that_a_later_step_requires_is_refused(
    outputs: list[str] | None,
) -> None:
    """identity requires mid, which partial_add_sub left out: the request fails with the
    step's refusal (Triton: INVALID_ARG), naming the input and who left the tensor out;
    nothing of it reaches identity, which counts one refused request."""
    async with _repository("ensemble_left_out_required") as server:
        with pytest.raises(StepRefusedError) as refused:
            await server.infer("ensemble_left_out_required", INPUTS, outputs=outputs)
        message = str(refused.value)
        assert message.startswith("in ensemble 'ensemble_left_out_required', step[1]: ")
        assert "model 'identity'" in message
        assert "missing required input 'INPUT0'" in message
        assert message.endswith(
            "(tensor 'mid': step[0]'s model 'partial_add_sub' left its output 'OUTPUT1' out)"
        )
        assert isinstance(refused.value, InferenceError)
        assert refused.value.model_name == "identity"
        identity = server.model_statistics("identity")[0]
        assert identity.execution_count == 0
        assert identity.inference_stats.fail.count == 1
        ensemble_stats = server.model_statistics("ensemble_left_out_required")[0]
        assert ensemble_stats.inference_stats.fail.count == 1


async def test_pruning_leaves_out_the_step_that_would_be_refused() -> None:
    """Asking only for OUT0 prunes identity: the answer is OUT0 alone, as in Triton."""
    async with _repository("ensemble_left_out_required") as server:
        response = await server.infer("ensemble_left_out_required", INPUTS, outputs=["OUT0"])
        assert set(response.outputs) == {"OUT0"}
        assert response.outputs["OUT0"].tolist() == (A + B).tolist()
        assert server.model_statistics("identity")[0].inference_stats.fail.count == 0


async def test_a_left_out_tensor_that_a_later_step_may_go_without_is_not_passed() -> None:
    """optional_add's INPUT1 is optional: it runs without the b partial_add_sub left out
    (PRESENT = 0, OUT = INPUT0 + INPUT1)."""
    async with _repository("ensemble_left_out_optional") as server:
        response = await server.infer("ensemble_left_out_optional", INPUTS)
        assert set(response.outputs) == {"OUT", "PRESENT"}
        assert response.outputs["OUT"].tolist() == (A + B).tolist()
        assert response.outputs["PRESENT"].tolist() == np.zeros_like(A).tolist()


@pytest.mark.parametrize("fusion", ["on", "off", "xla"])
async def test_a_jitted_model_that_leaves_an_output_out_fused_or_not(fusion: str) -> None:
    """jax_partial's ensemble answers OUTPUT0 alone on every path: the scheduler's, the
    fused steps and the fused XLA call (once its signature is compiled)."""
    int32 = [tensor("INPUT0", "INT32"), tensor("INPUT1", "INT32")]
    outs = [tensor("OUTPUT0", "INT32"), tensor("OUTPUT1", "INT32")]
    jax_partial = model(
        "jax_partial",
        lambda INPUT0, INPUT1: {"OUTPUT0": INPUT0 + INPUT1},
        int32,
        outs,
        max_batch_size=8,
        parameters={"execution": "inline"},  # fusion only fuses inline steps
    )
    wiring = {"INPUT0": "INPUT0", "INPUT1": "INPUT1"}
    pipe = ensemble(
        "pipe",
        int32,
        outs,
        [step("jax_partial", wiring, {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"})],
        max_batch_size=8,
    )
    async with orchestrion.open_server(models=[jax_partial, with_fusion(pipe, fusion)]) as server:
        answers = []
        for _ in range(10):  # bounded: mode "xla" compiles a new signature meanwhile
            for outputs in (None, ["OUTPUT0", "OUTPUT1"], ["OUTPUT1"]):
                response = await server.infer("pipe", INPUTS, outputs=outputs)
                answers.append((outputs, sorted(response.outputs)))
            if fusion == "off" or await settled(server):
                break
        assert await settled(server) is (fusion != "off")
        response = await server.infer("pipe", INPUTS)  # fused, but with "off"
        assert sorted(response.outputs) == ["OUTPUT0"]
        assert response.outputs["OUTPUT0"].tolist() == (A + B).tolist()
    for outputs, names in answers:
        assert names == ([] if outputs == ["OUTPUT1"] else ["OUTPUT0"]), outputs


async def test_a_nested_ensemble_passes_on_what_it_left_out() -> None:
    """An ensemble whose step is ensemble_partial_add_sub: that step leaves OUTPUT1 out in
    turn, so a step that requires it is refused, naming the nested ensemble."""
    outer = ensemble(
        "outer",
        [tensor("IN0", "INT32"), tensor("IN1", "INT32")],
        [tensor("SUM", "INT32"), tensor("OUT", "INT32")],
        [
            step(
                "ensemble_partial_add_sub",
                {"INPUT0": "IN0", "INPUT1": "IN1"},
                {"OUTPUT0": "SUM", "OUTPUT1": "diff"},
            ),
            step("identity", {"INPUT0": "diff"}, {"OUTPUT0": "OUT"}),
        ],
        max_batch_size=8,
    )
    async with orchestrion.open_server(
        REPOSITORY, [outer], load_models=["ensemble_partial_add_sub", "identity"]
    ) as server:
        with pytest.raises(StepRefusedError) as refused:
            await server.infer("outer", {"IN0": A, "IN1": B})
        assert "(tensor 'diff': step[0]'s model 'ensemble_partial_add_sub' left its output" in str(
            refused.value
        )
        response = await server.infer("outer", {"IN0": A, "IN1": B}, outputs=["SUM"])
        assert response.outputs["SUM"].tolist() == A.tolist()


def _every_other(X: Any) -> Iterator[dict[str, Any]]:
    """Three responses; the second leaves Z out."""
    for i in range(3):
        yield {"Y": X + i} if i == 1 else {"Y": X + i, "Z": X - i}


def _streamed_pipe(*, z_required: bool) -> list[orchestrion.Model]:
    """gen (decoupled: Y and, but in its second response, Z) then take (A, and Z: required
    or optional) whose O = A (+ Z); the ensemble answers Y, Z and O per response."""
    gen = model("gen", _every_other, [tensor("X")], [tensor("Y"), tensor("Z")], jit=False)
    policy = ModelTransactionPolicy(decoupled=True)
    gen = attrs.evolve(gen, config=attrs.evolve(gen.config, model_transaction_policy=policy))
    take = model(
        "take",
        lambda A, Z=None: {"O": A if Z is None else A + Z},
        [tensor("A"), tensor("Z", optional=not z_required)],
        [tensor("O")],
        jit=False,
    )
    pipe = ensemble(
        "pipe",
        [tensor("IN")],
        [tensor("Y"), tensor("Z"), tensor("O")],
        [
            step("gen", {"X": "IN"}, {"Y": "Y", "Z": "Z"}),
            step("take", {"A": "Y", "Z": "Z"}, {"O": "O"}),
        ],
    )
    return [gen, take, pipe]


async def _stream(server: orchestrion.AsyncServer, into: list[dict[str, Any]]) -> None:
    """Read pipe's stream for IN = 0 into ``into``, response by response."""
    x = np.zeros(16, np.float32)
    async with contextlib.aclosing(server.stream_infer("pipe", {"IN": x})) as responses:
        async for response in responses:
            into.append(response.outputs)


async def test_a_decoupled_step_that_leaves_an_output_out_of_one_response() -> None:
    """Streamed, per iteration: the response of the iteration without Z has no Z, and the
    next step ran without it (O = Y)."""
    answers: list[dict[str, Any]] = []
    async with orchestrion.open_server(models=_streamed_pipe(z_required=False)) as server:
        await _stream(server, answers)
    assert [sorted(a) for a in answers] == [["O", "Y", "Z"], ["O", "Y"], ["O", "Y", "Z"]]
    assert [float(a["O"][0]) for a in answers] == [0.0, 1.0, 0.0]


async def test_a_decoupled_step_whose_left_out_output_is_required_downstream() -> None:
    """The iteration without Z is refused at take, after the first iteration's response."""
    answers: list[dict[str, Any]] = []
    async with orchestrion.open_server(models=_streamed_pipe(z_required=True)) as server:
        with pytest.raises(StepRefusedError) as refused:
            await _stream(server, answers)
    assert [sorted(a) for a in answers] == [["O", "Y", "Z"]]
    assert "missing required input 'Z'" in str(refused.value)
    assert "(tensor 'Z': step[0]'s model 'gen' left its output 'Z' out)" in str(refused.value)
