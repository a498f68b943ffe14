"""Triton's python backend through the embedding API: ``TritonPythonModel`` files of a
Triton-layout repository (tests/triton_models, each in the shape of one of Triton's
python_backend examples) and classes defined here, with BLS, response senders, dynamic
batching, sequences, auto-complete, custom metrics and errors."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import triton_python_backend_utils as pb_utils

import orchestrion
from orchestrion import ConfigError, InferenceError, InferenceTimeoutError
from orchestrion.actors._instances import SWITCH_WINDOW
from orchestrion.protocols import (
    DynamicBatching,
    InstanceGroup,
    InstanceKind,
    ModelTransactionPolicy,
    ResponseCache,
)
from orchestrion.testing import assert_idle, ensemble, inside, model, step, tensor, triton_model

REPOSITORY = Path(__file__).resolve().parents[1] / "triton_models"
A = np.array([1, 2, 3, 4], np.float32)
B = np.array([4, 3, 2, 1], np.float32)
ADD_SUB = [tensor("INPUT0", dims=(4,)), tensor("INPUT1", dims=(4,))]
ADD_SUB_OUT = [tensor("OUTPUT0", dims=(4,)), tensor("OUTPUT1", dims=(4,))]


def _repository(*names: str) -> Any:
    return orchestrion.open_server(model_repository=REPOSITORY, load_models=list(names))


async def _stream(server: orchestrion.AsyncServer, name: str, inputs: dict[str, Any]) -> list[Any]:
    async with contextlib.aclosing(server.stream_infer(name, inputs)) as responses:
        return [r.outputs async for r in responses]


# -- the model's life: initialize, instances, finalize -------------------------------------


async def test_add_sub_runs_as_in_triton() -> None:
    """add_sub (Triton's examples/add_sub) answers sum and difference, with no file changed."""
    async with _repository("add_sub") as server:
        out = (await server.infer("add_sub", {"INPUT0": A, "INPUT1": B})).outputs
        assert out["OUTPUT0"].tolist() == [5, 5, 5, 5]
        assert out["OUTPUT1"].tolist() == [-3, -1, 1, 3]
        assert out["OUTPUT0"].dtype == np.float32


async def test_initialize_gets_tritons_args_once_per_instance() -> None:
    """Each of count 2 instances is its own object, initialised once with Triton's args: all
    strings, the config as Triton's JSON (numbers as numbers, parameters as string_value)."""
    made: list[Any] = []

    class Recorder:
        def initialize(self, args: dict[str, str]) -> None:
            made.append((self, args))

        def execute(self, requests: list[Any]) -> list[Any]:
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.ones(1, np.float32))])]

    definition = triton_model(
        "recorder",
        Recorder,
        [tensor("X", dims=(1,))],
        [tensor("Y", dims=(1,))],
        instance_group=(InstanceGroup(count=2, kind=InstanceKind.KIND_CPU),),
        parameters={"custom_key": "custom_value"},
    )
    async with orchestrion.open_server(models=[definition]):
        assert len(made) == 2
        assert made[0][0] is not made[1][0]
        args = made[0][1]
        assert all(isinstance(v, str) for v in args.values())
        assert args["model_name"] == "recorder"
        assert args["model_version"] == "1"
        assert args["model_instance_kind"] == "CPU"  # Triton's words: CPU, GPU
        assert args["model_instance_device_id"] == "0"
        # Triton's instance names: <model>_<group index>_<instance index>.
        assert [a["model_instance_name"] for _, a in made] == ["recorder_0_0", "recorder_0_1"]
        assert args["model_repository"] == ""  # defined in Python: no folder
        config = json.loads(args["model_config"])
        assert config["input"][0]["dims"] == [1]
        assert config["input"][0]["data_type"] == "TYPE_FP32"
        assert config["parameters"] == {"custom_key": {"string_value": "custom_value"}}
        assert pb_utils.get_output_config_by_name(config, "Y")["name"] == "Y"


async def test_instances_have_tritons_names_and_kinds() -> None:
    """A named group's instances are ``<group>_<index>``, an unnamed group's
    ``<model>_<group index>_<index>``; the kind is Triton's word for the group's kind:
    ``MODEL`` for KIND_MODEL, ``CPU`` for KIND_CPU."""
    made: list[dict[str, str]] = []

    class Recorder:
        def initialize(self, args: dict[str, str]) -> None:
            made.append(args)

        def execute(self, requests: list[Any]) -> list[Any]:
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.ones(1, np.float32))])]

    definition = triton_model(
        "kinds",
        Recorder,
        [tensor("X", dims=(1,))],
        [tensor("Y", dims=(1,))],
        instance_group=(
            InstanceGroup(count=1, kind=InstanceKind.KIND_MODEL, name="whole"),
            InstanceGroup(count=2, kind=InstanceKind.KIND_CPU),
        ),
    )
    async with orchestrion.open_server(models=[definition]):
        named = [(a["model_instance_name"], a["model_instance_kind"]) for a in made]
        assert named == [("whole_0", "MODEL"), ("kinds_1_0", "CPU"), ("kinds_1_1", "CPU")]


async def test_an_instance_name_a_stub_cannot_have_is_refused_in_tritons_words() -> None:
    """Triton names each instance's stub process after the instance: a group name with a
    character it refuses fails the load, though the model's own name is fine."""

    class Fine:
        def execute(self, requests: list[Any]) -> list[Any]:
            return []

    definition = triton_model(
        "fine",
        Fine,
        [tensor("X", dims=(1,))],
        [tensor("Y", dims=(1,))],
        instance_group=(InstanceGroup(count=1, kind=InstanceKind.KIND_CPU, name="group;1"),),
    )
    with pytest.raises(
        ConfigError, match=r"Invalid stub name: contains invalid characters \('group;1_0'"
    ):
        async with orchestrion.open_server(models=[definition]):
            pass


async def test_finalize_runs_on_unload_and_on_shutdown() -> None:
    """finalize is called once per instance when the model is unloaded, and again for the
    reloaded model when the server stops."""
    finalized: list[int] = []

    class Finalized:
        def execute(self, requests: list[Any]) -> list[Any]:
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.ones(1, np.float32))])]

        def finalize(self) -> None:
            finalized.append(id(self))

    definition = triton_model(
        "finalized",
        Finalized,
        [tensor("X", dims=(1,))],
        [tensor("Y", dims=(1,))],
        instance_group=(InstanceGroup(count=2, kind=InstanceKind.KIND_CPU),),
    )
    async with orchestrion.open_server(models=[definition]) as server:
        await server.infer("finalized", {"X": np.ones(1, np.float32)})
        assert finalized == []
        await server.unload_model("finalized")
        with trio.fail_after(10):  # unloading returns at once; the model ends once idle
            while len(set(finalized)) < 2:  # noqa: ASYNC110 (nothing to wait on here)
                await trio.sleep(0.01)
        await server.load_model(definition)
    assert len(set(finalized)) == 4


async def test_a_failing_initialize_is_a_load_error_naming_the_model() -> None:
    """initialize raising TritonModelException fails the load with the model and the
    message named; the instances made before it are finalised."""
    finalized: list[int] = []

    class Broken:
        count = 0

        def initialize(self, args: dict[str, str]) -> None:
            Broken.count += 1
            if Broken.count == 2:
                raise pb_utils.TritonModelException("no weights")

        def execute(self, requests: list[Any]) -> list[Any]:
            return []

        def finalize(self) -> None:
            finalized.append(1)

    definition = triton_model(
        "broken",
        Broken,
        [tensor("X", dims=(1,))],
        [tensor("Y", dims=(1,))],
        instance_group=(InstanceGroup(count=2, kind=InstanceKind.KIND_CPU),),
    )
    with pytest.raises(orchestrion.ModelLoadError, match="broken.*no weights"):
        async with orchestrion.open_server(models=[definition]):
            pass
    assert finalized == [1]


# -- execute(requests): batches and errors -------------------------------------------------


async def test_dynamic_batching_hands_execute_several_requests_each_answered_alone() -> None:
    """batched (add_sub under dynamic batching): concurrent requests reach execute together,
    each keeps its own inputs and answer, and the one with a negative input fails alone."""
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        a = np.full((1, 4), -1.0 if i == 5 else float(i), np.float32)
        try:
            out = await server.infer(
                "batched", {"INPUT0": a, "INPUT1": np.ones((1, 4), np.float32)}
            )
            results[i] = out.outputs
        except InferenceError as exc:
            results[i] = exc

    async with _repository("batched") as server:
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        stats = server.model_statistics("batched")[0]
    error = results.pop(5)
    # The model's own error: its words as it wrote them (as Triton shows them), its model named.
    assert isinstance(error, orchestrion.ModelReportedError)
    assert (str(error), error.model_name, error.code) == (
        "INPUT0 must not be negative",
        "batched",
        "INVALID_ARG",
    )
    for i, out in results.items():
        assert out["OUTPUT0"].tolist() == [[i + 1.0] * 4]
    assert max(int(out["REQUESTS"][0, 0]) for out in results.values()) > 1
    assert stats.execution_count < 8  # several requests per execute
    assert stats.inference_count == 7  # the failed one counts as a failure
    assert stats.failures_by_reason == {"BACKEND": 1}


@pytest.mark.parametrize(
    ("mode", "message", "detail"),
    [
        # Triton's words for an execute that raised: the instance named.
        (
            1,
            "Failed to process the request(s) for model 'errors_0_0', "
            "message: TritonModelException: mode 1 raises",
            "",
        ),
        (2, "mode 2 is an error response", ""),  # the model's own words, as Triton's
        (3, "model 'errors' (version 1) returned a bad result: ", "FP64, expected INT32"),
        (5, "model 'errors' (version 1) failed: ", "execute returned 0 for 1 requests"),
        (6, "model 'errors' (version 1) failed: ", "execute returned str for a request"),
    ],
)
async def test_a_wrong_answer_is_an_error_naming_the_model_and_the_model_serves_on(
    mode: int, message: str, detail: str
) -> None:
    """errors: raising, an error response, an output whose values do not fit its type, the
    wrong number of responses, something not a response: each a clear error naming the
    model (its instance where Triton does; an error response as the model wrote it); the
    next request is answered. (An output of another shape than its dims passes on as
    given, as Triton passes it: see the next test.)"""
    async with _repository("errors") as server:
        with pytest.raises(InferenceError) as caught:
            await server.infer("errors", {"MODE": np.array([mode], np.int32)})
        assert str(caught.value).startswith(message)
        assert detail in str(caught.value)
        assert caught.value.model_name == "errors"
        out = await server.infer("errors", {"MODE": np.array([0], np.int32)})
        assert out.outputs["OUT"].tolist() == [0]


async def test_an_output_of_another_shape_passes_on_as_given() -> None:
    """errors mode 4 answers OUT [1, 2] where its config says [1]: the client gets [1, 2],
    as from Triton (which checks no output shape of a python model)."""
    async with _repository("errors") as server:
        out = await server.infer("errors", {"MODE": np.array([4], np.int32)})
    assert out.outputs["OUT"].tolist() == [1, 2]


@pytest.mark.parametrize(
    ("rows", "answer", "dims"),
    [
        (1, [7], (1,)),  # Triton's QA is_ready_fn_returns_true_decoupled, io's text_output
        (4, [7, 7, 7, 7], (1,)),  # Triton's QA async_execute_decouple
        (2, [7], (1,)),  # one value for two rows: Triton's QA init_args
        (1, [[7, 7, 7]], (3,)),  # already in shape
    ],
)
async def test_a_batching_models_output_keeps_the_shape_it_gave(
    rows: int, answer: list[Any], dims: tuple[int, ...]
) -> None:
    """A batching model's output passes on in the shape its code gave, as Triton passes a
    python model's (``[4]`` for 4 rows of dims ``[1]``, ``[1]`` for one row)."""

    class Unbatched:
        def execute(self, requests: list[Any]) -> list[Any]:
            value = np.array(answer, np.float32)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", value)]) for _ in requests]

    outputs = [tensor("Y", dims=dims)]
    definition = triton_model(
        "unbatched", Unbatched, [tensor("X", dims=(1,))], outputs, max_batch_size=4
    )
    async with orchestrion.open_server(models=[definition]) as server:
        x = np.ones((rows, 1), np.float32)
        out = (await server.infer("unbatched", {"X": x})).outputs["Y"]
    assert out.shape == np.array(answer).shape
    assert (out == 7).all()


async def test_an_output_is_given_in_its_declared_type_when_its_values_fit() -> None:
    """np.array([0]) is INT64 for a TYPE_INT32 output (as Triton's bls_decoupled example
    writes it): the client gets INT32, the values exact."""

    class Wide:
        def execute(self, requests: list[Any]) -> list[Any]:
            value = np.array([2**31 - 1])
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", value)])]

    definition = triton_model("wide", Wide, [tensor("X", dims=(1,))], [tensor("Y", "INT32", (1,))])
    async with orchestrion.open_server(models=[definition]) as server:
        out = (await server.infer("wide", {"X": np.ones(1, np.float32)})).outputs["Y"]
    assert out.dtype == np.int32
    assert out.tolist() == [2**31 - 1]


async def test_execute_may_answer_through_each_requests_sender() -> None:
    """A model that is not decoupled may return None and send each request's one response
    with the final flag through its sender, from another thread, after execute returned."""

    class Later:
        def execute(self, requests: list[Any]) -> None:
            def answer(request: Any) -> None:
                time.sleep(0.05)
                x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
                response = pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)])
                request.get_response_sender().send(
                    response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                )

            for request in requests:
                threading.Thread(target=answer, args=(request,)).start()

    definition = triton_model("later", Later, [tensor("X", dims=(2,))], [tensor("Y", dims=(2,))])
    async with orchestrion.open_server(models=[definition]) as server:
        out = await server.infer("later", {"X": np.array([1, 2], np.float32)})
    assert out.outputs["Y"].tolist() == [2, 4]


# -- decoupled models ------------------------------------------------------------------------


async def test_a_decoupled_model_sends_from_a_thread_of_its_own() -> None:
    """square (Triton's examples/decoupled): n responses sent by the model's thread, then
    the final flag; n = 0 gives none."""
    async with _repository("square") as server:
        three = await _stream(server, "square", {"IN": np.array([3], np.int32)})
        none = await _stream(server, "square", {"IN": np.array([0], np.int32)})
    assert [r["OUT"].tolist() for r in three] == [[3], [3], [3]]
    assert none == []


async def test_a_reader_that_stops_reading_stops_the_sender() -> None:
    """A decoupled model's send waits while its reader holds the previous response (nothing
    is buffered); when the reader leaves, sends are dropped, the sender sees the
    cancellation and the model's thread ends."""
    sent: list[int] = []
    ended = threading.Event()

    class Flood:
        def execute(self, requests: list[Any]) -> None:
            sender = requests[0].get_response_sender()

            def flood() -> None:
                for i in range(100_000):
                    if sender.is_cancelled():
                        break
                    sender.send(
                        pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([i], np.int32))])
                    )
                    sent.append(i)
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                ended.set()

            threading.Thread(target=flood).start()

    definition = triton_model(
        "flood",
        Flood,
        [tensor("X", dims=(1,))],
        [tensor("Y", "INT32", (1,))],
        model_transaction_policy=ModelTransactionPolicy(decoupled=True),
    )
    async with orchestrion.open_server(models=[definition]) as server:
        responses = server.stream_infer("flood", {"X": np.ones(1, np.float32)})
        async with contextlib.aclosing(responses):
            first = await anext(responses)
            await trio.sleep(0.3)  # real time: the flood thread would send thousands
            held = len(sent)
        assert first.outputs["Y"].tolist() == [0]
        assert held <= 2
        assert await trio.to_thread.run_sync(ended.wait, 10)
        assert len(sent) <= held + 1


async def test_decoupled_streams_of_one_instance_interleave() -> None:
    """With one instance, a decoupled request whose thread is still sending does not hold
    the instance: the next request's execute runs and its responses arrive meanwhile."""
    async with _repository("square") as server:
        results: dict[int, list[Any]] = {}

        async def read(n: int) -> None:
            results[n] = await _stream(server, "square", {"IN": np.array([n], np.int32)})

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for n in (20, 30):
                    nursery.start_soon(read, n)
    assert [len(results[n]) for n in (20, 30)] == [20, 30]


# -- BLS -----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["add_sub", "jax_add_sub", "ensemble_add_sub"])
async def test_bls_calls_a_python_model_a_jax_model_and_an_ensemble(target: str) -> None:
    """bls (Triton's examples/bls, sync): exec() on the model named in MODEL_NAME, a python
    model, a jitted JAX model or an ensemble; the same answer from each."""
    async with _repository("bls", "add_sub", "jax_add_sub", "ensemble_add_sub") as server:
        name = np.array([target.encode()], dtype=object)
        out = (await server.infer("bls", {"MODEL_NAME": name, "INPUT0": A, "INPUT1": B})).outputs
    assert out["OUTPUT0"].tolist() == [5, 5, 5, 5]
    assert out["OUTPUT1"].tolist() == [-3, -1, 1, 3]


async def test_a_failed_bls_call_is_the_responses_error() -> None:
    """A BLS call to a model that is not loaded answers a response whose error names it (the
    model then raises it, as Triton's example does): the client's error carries it."""
    async with _repository("bls", "add_sub") as server:
        name = np.array([b"nowhere"], dtype=object)
        with pytest.raises(
            InferenceError, match="Request for unknown model: 'nowhere' is not found"
        ):
            await server.infer("bls", {"MODEL_NAME": name, "INPUT0": A, "INPUT1": B})


async def test_async_bls_gathers_calls_to_a_python_and_a_jax_model() -> None:
    """bls_async (Triton's examples/bls, async): an async execute awaits two async_exec
    calls with asyncio.gather."""
    async with _repository("bls_async", "add_sub", "jax_add_sub") as server:
        for _ in range(3):
            out = (await server.infer("bls_async", {"INPUT0": A, "INPUT1": B})).outputs
            assert out["OUTPUT0"].tolist() == [5, 5, 5, 5]
            assert out["OUTPUT1"].tolist() == [-3, -1, 1, 3]


@pytest.mark.parametrize(("name", "factor"), [("bls_decoupled", 1), ("bls_decoupled_async", 2)])
async def test_bls_reads_a_decoupled_models_responses(name: str, factor: int) -> None:
    """bls_decoupled (Triton's examples/bls_decoupled, sync and async): exec(decoupled=True)
    iterates square's responses; their sum is n * n (twice that for the async one)."""
    async with _repository(name, "square") as server:
        for n in (4, 0, 7):
            out = (await server.infer(name, {"IN": np.array([n], np.int32)})).outputs
            assert out["SUM"].tolist() == [factor * n * n]


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_the_clients_timeout_cancels_the_bls_call(asynchronous: bool) -> None:
    """A client whose request times out while the model waits on a BLS call: the called
    model's work is cancelled, the caller sees a CANCELLED error response (sync) or its
    coroutine is cancelled (async), and nothing is left running."""
    called: list[str] = []
    seen: list[Any] = []

    async def slow(X: Any) -> dict[str, Any]:
        called.append("started")
        try:
            await trio.sleep(30)
        except trio.Cancelled:
            called.append("cancelled")
            raise
        return {"Y": X}

    class Caller:
        def execute(self, requests: list[Any]) -> list[Any]:
            x = pb_utils.get_input_tensor_by_name(requests[0], "X")
            response = pb_utils.InferenceRequest(
                model_name="slow", inputs=[x], requested_output_names=["Y"]
            ).exec()
            seen.append(response.error())
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.as_numpy())])]

    class AsyncCaller:
        async def execute(self, requests: list[Any]) -> list[Any]:
            x = pb_utils.get_input_tensor_by_name(requests[0], "X")
            call = pb_utils.InferenceRequest(
                model_name="slow", inputs=[x], requested_output_names=["Y"]
            )
            response = await call.async_exec()
            seen.append(response.error())
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.as_numpy())])]

    models = [
        model("slow", slow, [tensor("X", dims=(1,))], [tensor("Y", dims=(1,))], jit=False),
        triton_model(
            "caller",
            AsyncCaller if asynchronous else Caller,
            [tensor("X", dims=(1,))],
            [tensor("Y", dims=(1,))],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        with trio.fail_after(10):
            with pytest.raises(InferenceTimeoutError):
                await server.infer("caller", {"X": np.ones(1, np.float32)}, timeout=0.3)
            while len(called) < 2 or (not asynchronous and not seen):  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert called == ["started", "cancelled"]
        if not asynchronous:
            assert seen[0].code() == pb_utils.TritonError.CANCELLED
        assert server.model_statistics("slow")[0].pending_request_count == 0
        assert server.model_statistics("caller")[0].pending_request_count == 0


# -- config: auto-complete -----------------------------------------------------------------


async def test_auto_complete_gives_a_folder_without_config_its_config() -> None:
    """auto_complete (Triton's examples/auto_complete/batch_model) in a folder with no
    config.pbtxt: its inputs, outputs, max_batch_size 4 and dynamic batcher come from
    auto_complete_config, and it serves batches."""
    async with _repository("auto_complete") as server:
        config = server.model_config("auto_complete")
        assert config.backend == "python"
        assert config.max_batch_size == 4
        assert config.dynamic_batching is not None
        assert [(t.name, t.dims) for t in config.input] == [("INPUT0", (4,)), ("INPUT1", (4,))]
        assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
        out = await server.infer("auto_complete", {"INPUT0": A[None], "INPUT1": B[None]})
        assert out.outputs["OUTPUT1"].tolist() == [[-3, -1, 1, 3]]


async def test_auto_complete_fills_in_what_a_config_left_out() -> None:
    """A config.pbtxt naming INPUT0 only: auto_complete_config adds INPUT1, the outputs,
    max_batch_size and the dynamic batcher."""
    async with _repository("auto_complete_partial") as server:
        config = server.model_config("auto_complete_partial")
        assert [(t.name, t.dims) for t in config.input] == [("INPUT0", (4,)), ("INPUT1", (4,))]
        assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
        assert config.max_batch_size == 4
        out = await server.infer("auto_complete_partial", {"INPUT0": A[None], "INPUT1": B[None]})
        assert out.outputs["OUTPUT0"].tolist() == [[5, 5, 5, 5]]


def _folder(root: Path, name: str, model_py: str, config: str | None) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(model_py)
    if config is not None:
        (root / name / "config.pbtxt").write_text(config)


async def test_auto_complete_contradicting_the_config_is_a_load_error(tmp_path: Path) -> None:
    """The config says INPUT0 has dims [8], auto_complete_config says [4]: a ConfigError
    naming the file, the tensor and both dims; no model loads."""
    source = (
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        "        config.add_input({'name': 'INPUT0', 'data_type': 'TYPE_FP32', 'dims': [4]})\n"
        "        return config\n"
        "    def execute(self, requests):\n"
        "        return []\n"
    )
    config = 'backend: "python"\ninput [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]\n'
    _folder(tmp_path, "clash", source, config)
    with pytest.raises(ConfigError) as caught:
        async with orchestrion.open_server(model_repository=tmp_path):
            pass
    message = str(caught.value)
    assert "clash/config.pbtxt" in message
    assert "INPUT0" in message
    assert "[8]" in message
    assert "[4]" in message


async def test_a_folder_without_config_needs_a_triton_model(tmp_path: Path) -> None:
    """A model.py of orchestrion's own contract in a folder without config.pbtxt: the error
    says the config is missing and what can do without one."""
    _folder(tmp_path, "plain", "def execute(X):\n    return {'Y': X}\n", None)
    with pytest.raises(ConfigError, match="config.pbtxt: missing.*TritonPythonModel"):
        async with orchestrion.open_server(model_repository=tmp_path):
            pass


# -- sequences, the cache, metrics, ensembles ----------------------------------------------


async def test_a_stateful_python_model_gets_tritons_control_inputs() -> None:
    """sequence: START, END, READY and CORRID arrive as Triton passes them (and agree with
    correlation_id() and flags()); two interleaved sequences keep their own sums."""
    async with _repository("sequence") as server:

        async def send(seq: int, x: int, start: bool = False, end: bool = False) -> Any:
            out = await server.infer(
                "sequence",
                {"X": np.array([x], np.int32)},
                sequence_id=seq,
                sequence_start=start,
                sequence_end=end,
            )
            return out.outputs["SUM"][0], out.outputs["CONTROLS"].tolist()

        assert await send(7, 1, start=True) == (1, [1, 0, 1, 7])
        assert await send(9, 100, start=True) == (100, [1, 0, 1, 9])
        assert await send(7, 2) == (3, [0, 0, 1, 7])
        assert await send(9, 5, end=True) == (105, [0, 1, 1, 9])
        assert await send(7, 3, end=True) == (6, [0, 1, 1, 7])


async def test_a_cached_python_model_runs_once_per_distinct_request() -> None:
    """With response_cache and a server cache, a repeated request is a hit: execute runs
    once; a different input runs again."""
    executed: list[int] = []

    class Counted:
        def execute(self, requests: list[Any]) -> list[Any]:
            executed.append(len(requests))
            x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)])]

    definition = triton_model(
        "counted",
        Counted,
        [tensor("X", dims=(2,))],
        [tensor("Y", dims=(2,))],
        response_cache=ResponseCache(enable=True),
    )
    async with orchestrion.open_server(
        models=[definition], cache_config="local,size=1048576"
    ) as server:
        for x in ([1, 2], [1, 2], [1, 2], [3, 4]):
            out = await server.infer("counted", {"X": np.array(x, np.float32)})
            assert out.outputs["Y"].tolist() == [x[0] + 1, x[1] + 1]
        stats = server.model_statistics("counted")[0].inference_stats
    assert executed == [1, 1]
    assert stats.cache_hit.count == 2


async def test_custom_metrics_show_on_metrics_while_the_model_is_loaded() -> None:
    """metrics (Triton's examples/custom_metrics): its counter, gauge and histogram are in
    the server's Prometheus text with their labels, and leave with the model."""
    async with _repository("metrics") as server:
        for x in (0.1, 2.0):
            await server.infer("metrics", {"INPUT0": np.full(4, x, np.float32)})
        text = server.metrics_text()
        labels = 'model="metrics",version="1"'
        assert f"custom_requests_total{{{labels}}} 2.0" in text
        assert f"custom_last_sum{{{labels}}} 8.0" in text
        assert f'custom_sum_bucket{{{labels},le="1"}} 1' in text
        assert f'custom_sum_bucket{{{labels},le="+Inf"}} 2' in text
        assert f"custom_sum_count{{{labels}}} 2" in text
        assert "# TYPE custom_sum histogram" in text
        await server.unload_model("metrics")
        assert "custom_requests_total" not in server.metrics_text()


async def test_python_and_jax_steps_mix_in_one_ensemble() -> None:
    """An ensemble of add_sub (python backend) then a jitted JAX step: the right answer,
    each step counted, and never fused (the steps are of two kinds)."""
    scale = model(
        "scale", lambda X: {"Y": X * 10}, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))]
    )
    mixed = ensemble(
        "mixed",
        [tensor("A", dims=(4,)), tensor("B", dims=(4,))],
        [tensor("OUT", dims=(4,))],
        [
            step("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "sum"}),
            step("scale", {"X": "sum"}, {"Y": "OUT"}),
        ],
    )
    async with orchestrion.open_server(
        model_repository=REPOSITORY, load_models=["add_sub"], models=[scale, mixed]
    ) as server:
        out = await server.infer("mixed", {"A": A, "B": B})
        assert out.outputs["OUT"].tolist() == [50, 50, 50, 50]
        assert server.model_statistics("add_sub")[0].inference_count == 1
        assert_idle(server, "mixed")
        # A python step beside a jitted one: neither kind of fused call takes both.
        for _ in range(3 * SWITCH_WINDOW):
            await server.infer("mixed", {"A": A, "B": B})
        assert inside(server).fusion("mixed") is None


async def test_a_decoupled_python_model_streams_through_an_ensemble() -> None:
    """square inside an ensemble: one ensemble response per response of the step."""
    streamed = ensemble(
        "streamed",
        [tensor("N", "INT32", (1,))],
        [tensor("OUT", "INT32", (1,))],
        [step("square", {"IN": "N"}, {"OUT": "OUT"})],
    )
    async with orchestrion.open_server(
        model_repository=REPOSITORY, load_models=["square"], models=[streamed]
    ) as server:
        out = await _stream(server, "streamed", {"N": np.array([2], np.int32)})
    assert [r["OUT"].tolist() for r in out] == [[2], [2]]


class _Squares:
    """Decoupled: N responses of N, then the final flag alone (Triton's square_int32)."""

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            for _ in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([n]))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _squares() -> Any:
    return triton_model(
        "squares",
        _Squares,
        [tensor("N", "INT64", (1,))],
        [tensor("Y", "INT64", (1,))],
        model_transaction_policy=ModelTransactionPolicy(decoupled=True),
    )


async def test_bls_from_a_thread_the_model_starts_after_execute_returned() -> None:
    """As Triton's stub allows (its QA's decoupled_bls_stream): a thread the model started
    itself makes a decoupled BLS call after ``execute`` returned and answers through the
    request's sender. The iterator ends with Triton's empty last response (the callee sent
    its final flag alone); initialize and finalize may not call, in Triton's words."""
    refused: list[str] = []
    threads: list[threading.Thread] = []

    class Relay:
        def initialize(self, args: dict[str, Any]) -> None:
            self._try_bls()

        def _try_bls(self) -> None:
            try:
                pb_utils.InferenceRequest(model_name="squares", inputs=[]).exec()
            except pb_utils.TritonModelException as exc:
                refused.append(str(exc))

        def execute(self, requests: list[Any]) -> None:
            for request in requests:
                n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy()
                thread = threading.Thread(
                    target=self.relay, args=(request.get_response_sender(), n)
                )
                threads.append(thread)
                thread.start()

        def relay(self, sender: Any, n: np.ndarray) -> None:
            call = pb_utils.InferenceRequest(
                model_name="squares", inputs=[pb_utils.Tensor("N", n)], requested_output_names=["Y"]
            )
            responses = list(call.exec(decoupled=True))
            empty = [r for r in responses if not r.output_tensors()]
            seen = np.array([len(responses), len(empty)])
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("COUNTS", seen)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        def finalize(self) -> None:
            self._try_bls()

    relay = triton_model(
        "relay",
        Relay,
        [tensor("N", "INT64", (1,))],
        [tensor("COUNTS", "INT64", (2,))],
        model_transaction_policy=ModelTransactionPolicy(decoupled=True),
    )
    async with orchestrion.open_server(models=[_squares(), relay]) as server:
        for n in (3, 0):
            out = await _stream(server, "relay", {"N": np.array([n])})
            assert [o["COUNTS"].tolist() for o in out] == [[n + 1, 1]]
    for thread in threads:
        thread.join(10)
    said = "BLS is only supported during the 'execute' function."
    assert len(refused) == 2
    assert all(text.startswith(said) for text in refused)


async def test_a_response_iterators_cancel_asks_and_the_model_decides() -> None:
    """``ResponseIterator.cancel()`` is Triton's: the callee sees ``is_cancelled()`` and
    ends with a CANCELLED error (which keeps its code); one that ignores it goes on sending,
    and the caller still reads what it sends."""

    class Until:
        def execute(self, requests: list[Any]) -> None:
            request = requests[0]
            ignore = bool(pb_utils.get_input_tensor_by_name(request, "IGNORE").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(20):
                if not ignore and request.is_cancelled():
                    error = pb_utils.TritonError("cancelled here", pb_utils.TritonError.CANCELLED)
                    sender.send(pb_utils.InferenceResponse(error=error), flags=_FINAL)
                    return
                one = pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([1]))])
                sender.send(one, flags=_FINAL if i == 19 else 0)
                time.sleep(0.01)

    class Summer:
        def execute(self, requests: list[Any]) -> list[Any]:
            ignore = pb_utils.get_input_tensor_by_name(requests[0], "IGNORE")
            call = pb_utils.InferenceRequest(
                model_name="until", inputs=[ignore], requested_output_names=["Y"]
            )
            total, codes = 0, []
            stream = call.exec(decoupled=True)
            for response in stream:
                if response.has_error():
                    codes.append(response.error().code())
                    break
                total += int(response.output_tensors()[0].as_numpy()[0])
                if total == 5:
                    stream.cancel()
            out = np.array([total, codes[0] if codes else -1])
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)])]

    flag = [tensor("IGNORE", "BOOL", (1,))]
    until = triton_model(
        "until",
        Until,
        flag,
        [tensor("Y", "INT64", (1,))],
        model_transaction_policy=ModelTransactionPolicy(decoupled=True),
    )
    summer = triton_model("summer", Summer, flag, [tensor("OUT", "INT64", (2,))])
    async with orchestrion.open_server(models=[until, summer]) as server:
        honoured = await server.infer("summer", {"IGNORE": np.array([False])})
        ignored = await server.infer("summer", {"IGNORE": np.array([True])})
    assert honoured.outputs["OUT"].tolist() == [5, pb_utils.TritonError.CANCELLED]
    # the final flag came with the last data response: no empty response after it
    assert ignored.outputs["OUT"].tolist() == [20, -1]


_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


async def test_a_model_that_never_calls_the_server_comes_inline() -> None:
    """add_sub's code names no BLS call or sender: measured like any plain-Python model, it
    starts in a worker thread and comes inline once a window of calls proves short. (A BLS
    model may come inline too, waiting through a portal: test_bls_on_the_event_loop.py.)"""
    async with _repository("add_sub", "bls") as server:
        add_sub = inside(server).runner("add_sub")
        bls = inside(server).runner("bls")
        assert add_sub.capabilities.may_run_inline
        assert not add_sub.capabilities.waits_through_portal
        assert bls.capabilities.waits_through_portal
        assert not add_sub.instances[0].inline  # unmeasured: starts in a thread
        # A busy machine can make every call of a window slow: at most 25 windows.
        for _ in range(25 * SWITCH_WINDOW):
            await server.infer("add_sub", {"INPUT0": A, "INPUT1": B})
            if any(i.inline for i in add_sub.instances):
                break
        # Once one instance is inline and idle, requests run there (the others stay put).
        assert any(i.inline for i in add_sub.instances)


class _Echo:
    pause = 0.0

    def execute(self, requests: list[Any]) -> list[Any]:
        if self.pause:
            time.sleep(self.pause)
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]


class _SlowEcho(_Echo):
    pause = 0.002


def _echo(name: str, cls: type) -> Any:
    return triton_model(
        name,
        cls,
        [tensor("X", dims=(1,))],
        [tensor("Y", dims=(1,))],
        max_batch_size=4,
        dynamic_batching=DynamicBatching(),
    )


async def test_a_dynamically_batched_model_is_judged_by_its_own_time_not_the_hop() -> None:
    """A python-backend model under dynamic batching (executions handed lists of requests)
    is timed in its worker thread: the hop there and back (100-300 µs here) is not the
    model's time, so a short model comes inline after a window of calls, as an unbatched
    one does."""
    async with orchestrion.open_server(models=[_echo("echo", _Echo)]) as server:
        echo = inside(server).runner("echo")
        assert not echo.instances[0].inline  # unmeasured: starts in a thread
        one = np.ones((1, 1), np.float32)
        for _ in range(25 * SWITCH_WINDOW):  # a busy machine can slow a whole window
            await server.infer("echo", {"X": one})
            if echo.instances[0].inline:
                break
        assert echo.instances[0].inline
        for _ in range(SWITCH_WINDOW):
            out = await server.infer("echo", {"X": one})
            assert out.outputs["Y"].tolist() == [[1.0]]


async def test_a_slow_dynamically_batched_model_stays_in_its_thread() -> None:
    """A python-backend model under dynamic batching that sleeps 2 ms per execution (a
    blocking call the event loop must not wait on) stays in a worker thread."""
    definition = _echo("sleepy_batched", _SlowEcho)
    async with orchestrion.open_server(models=[definition]) as server:
        runner = inside(server).runner("sleepy_batched")
        for _ in range(3 * SWITCH_WINDOW):
            await server.infer("sleepy_batched", {"X": np.ones((1, 1), np.float32)})
        assert not runner.instances[0].inline
