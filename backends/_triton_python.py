"""Triton's python backend: a ``model.py`` with ``class TritonPythonModel``, run unchanged.

How this works. Each instance of ``instance_group`` is one object of the model's class, made
and ``initialize``d (with Triton's ``args``) at load, ``finalize``d at unload. One execution
is one call of ``execute(requests)``: the requests a batch holds (several only with dynamic
batching: `Capabilities.request_lists`, so each request keeps its own inputs, metadata and
answer) or the one request of an unbatched model. A synchronous ``execute`` runs in a worker
thread, always: model code may block on BLS calls or senders, which wait on the event loop
(a thread hop costs 50-100 µs; Triton's separate stub process costs more, see
docs/guide.md). An ``async def execute`` runs on an asyncio loop the backend owns (one thread
per loaded model version, as Triton runs one loop per stub), awaited from trio without a
thread. Either way the call runs under an `Execution` (BLS, ``_triton_calls.py``) in a trio
nursery of its own.

Answers: ``execute`` returns one ``InferenceResponse`` per request (an error one fails that
request alone), or None and sends each request's one response through its sender. A
decoupled model's requests each open a `PushedStream` whose execution runs in a task of the
backend's nursery (`Backend.run`); see ``_triton_answers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio

from ..protocols import (
    CustomMetricFamily,
    InferenceError,
    InferRequest,
    InstanceKind,
    ModelLoadError,
    ServerClosedError,
    Tensors,
    TritonClass,
    apply_reshape,
    model_facing,
    ungrouped,
)
from ._base import Backend, Capabilities, LoadedInstance, ServerCalls
from ._code_files import forget_code
from ._function import devices, on_host, placement_problems
from ._triton_answers import Answer, Declared, never
from ._triton_api import InferenceResponse, TritonModelException
from ._triton_calls import (
    Execution,
    bls_only,
    cancelled_here,
    code_places,
    serving,
    waits_on_server,
)
from ._triton_config import initialize_args, instance_names, stub_name_problem
from ._triton_decoupled_batches import DecoupledBatches
from ._triton_metrics import MetricStore, ModelScope, enter_scope, leave_scope
from ._triton_readiness import Readiness
from ._triton_requests import InferenceRequest, InferenceResponseSender, ModelSetup, setting_up
from ._triton_rescheduling import not_reschedulable, run_iterations
from ._triton_streams import PushedStream

if TYPE_CHECKING:
    from ..protocols import Model

_log = logging.getLogger("orchestrion")


@attrs.define(eq=False)
class TritonInstance:
    """One instance: the model's object, and the lock that runs its executions one at a
    time (a decoupled model's synchronous ones; the runner does it for models that are not
    decoupled, and a decoupled ``async def execute`` runs concurrently, as Triton's)."""

    model: Any
    name: str
    """Triton's name of the instance: ``<group name>_<index>`` (``add_sub_0_0``)."""
    lock: trio.Lock = attrs.field(factory=trio.Lock)


class TritonPythonBackend(Backend):
    """A ``TritonPythonModel`` class: ``initialize(args)``, ``execute(requests)``,
    ``finalize()``."""

    def __init__(self, model: Model, calls: ServerCalls | None) -> None:
        code = model.code
        assert isinstance(code, TritonClass)
        self.model = model
        self.config = config = model.config
        self._class: type = code.model_class
        self._calls = calls
        self._async = inspect.iscoroutinefunction(getattr(self._class, "execute", None))
        decoupled = config.decoupled
        stateful = config.stateful
        batching = (
            (config.dynamic_batching is not None or stateful)
            and config.max_batch_size > 0
            and not decoupled
        )
        waits = waits_on_server(model)
        through_portal = waits and not decoupled and not self._async and bls_only(model)
        self.capabilities = Capabilities(
            is_async=self._async,
            streaming=decoupled,
            stateful=stateful,
            sequence_tensors=stateful,
            batching=batching,
            thread_safe=True,
            compiles=False,
            takes_request=True,
            traceable=False,
            request_lists=batching,
            pushes=decoupled,
            may_run_inline=not decoupled and (not waits or through_portal),
            waits_through_portal=through_portal,
            output_shapes_as_given=True,
        )
        self.variable_shapes = True
        self._facing = facing = model_facing(config)
        """What the model's code sees: also its sequence batcher's control and state
        tensors (``initialize`` still gets the config as written)."""
        self.declared = Declared.of(facing)
        """What the config declares of the outputs (and of the state outputs)."""
        self.metrics = MetricStore()
        self.batches = DecoupledBatches.of(self)
        directory = model_folder(model)
        self._scope = ModelScope(model.name, model.version, self.metrics, str(directory or ""))
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readiness = Readiness(model.name, lambda: self._loop)
        self._instances: list[LoadedInstance] = []

    # -- loading and unloading -------------------------------------------------------------

    def _in_scope(self, fn: Callable[..., Any], *args: Any) -> Any:
        token = enter_scope(self._scope)
        try:
            return fn(*args)
        except SystemExit as exc:  # the model's error, never the server's end
            raise TritonModelException(f"{fn.__name__} raised SystemExit({exc.code!r})") from exc
        finally:
            leave_scope(token)

    def load(self) -> list[LoadedInstance]:
        """One object of the model's class per instance, ``initialize``d with Triton's
        ``args`` (runs in a worker thread).

        Raises:
            ModelLoadError: making or initialising an instance failed (the file named).
        """
        config = self.config
        source = self.model.source
        version_folder = model_folder(self.model)
        folder = version_folder.parent if version_folder is not None else None
        kinds = instance_names(config)
        made: list[LoadedInstance] = []
        try:
            placed = zip(kinds, devices(self.model), strict=False)
            for index, ((kind, name), device) in enumerate(placed):
                device_id = getattr(device, "id", 0) if kind is InstanceKind.KIND_GPU else 0
                instance = TritonInstance(self._in_scope(self._class), name)
                initialize = getattr(instance.model, "initialize", None)
                if initialize is not None:
                    version = self.model.version
                    args = initialize_args(config, version, folder, kind, device_id, name)
                    with setting_up(ModelSetup(self.model.name, self._calls)):
                        self._in_scope(initialize, args)
                made.append(LoadedInstance(index=index, device=device, params=instance))
        except Exception as exc:
            self._instances = made
            self.close_instances()
            raise ModelLoadError(
                f"{source} (model '{self.model.name}'): initialize failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._instances = made
        return made

    def close_instances(self) -> None:
        """``finalize`` every instance (errors logged: an unload still completes)."""
        for loaded in self._instances:
            finalize = getattr(loaded.params.model, "finalize", None)
            if finalize is None:
                continue
            try:
                self._in_scope(finalize)
            except Exception:
                _log.exception("model '%s': finalize raised", self.model.name)
        self._instances = []
        forget_code(self._class)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The asyncio loop of an async model and the tasks of decoupled executions, until
        the instances have ended; then ``finalize`` (in a worker thread)."""
        thread: threading.Thread | None = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                if self._async:
                    self._loop = asyncio.new_event_loop()
                    thread = threading.Thread(
                        target=self._loop.run_forever,
                        name=f"orchestrion model {self.model.name} asyncio loop",
                        daemon=True,
                    )
                    thread.start()
                standing = Execution(self.model.name, self._calls, self._token, nursery)
                with serving(code_places(self.model.source, self._class), standing):
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.close_instances)
                if thread is not None and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._loop.stop)
                    await trio.to_thread.run_sync(thread.join)
                    self._loop.close()

    def custom_metrics(self) -> list[CustomMetricFamily]:
        """The metric families the model's code made (``pb_utils.MetricFamily``)."""
        return self.metrics.snapshot()

    async def ready(self) -> bool:
        """Every instance's ``is_ready()`` answers True in time (see ``_triton_readiness``);
        not ready once unloading."""
        if self._nursery is None:
            return False
        instances = [(i.params.model, i.params.name) for i in self._instances]
        return await self._readiness.check(self._nursery, instances)

    # -- one execution ---------------------------------------------------------------------

    def signature(self, inputs: Tensors) -> Hashable | None:
        """Python compiles nothing."""
        return None

    def arguments(
        self, request: InferRequest, state: Any, instance: LoadedInstance
    ) -> Mapping[str, Any]:
        """The request itself (the model's code reads it through ``pb_utils``)."""
        return {"request": request}

    def execute(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        """``execute([request])``, here (a worker thread, or inline where the config asks):
        its one answer (raised when it is an error)."""
        (outcome,) = self.execute_requests(instance, [arguments["request"]])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome, None

    async def execute_async(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        """`execute` for an ``async def execute`` (on the model's asyncio loop)."""
        (outcome,) = await self.execute_requests_async(instance, [arguments["request"]])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome, None

    def _prepared(
        self, requests: list[InferRequest]
    ) -> tuple[list[Answer], list[InferenceRequest]]:
        declared = self.declared
        answers = [Answer(self._token, declared) for _ in requests]
        received = [
            self.received(r, InferenceResponseSender(a.deliver, never))
            for r, a in zip(requests, answers, strict=True)
        ]
        return answers, received

    def execute_requests(
        self, instance: LoadedInstance, requests: list[InferRequest]
    ) -> list[Mapping[str, Any] | Exception]:
        """``execute(requests)`` here (again for those it reschedules, see
        ``_triton_rescheduling``): each request's outputs, or the error answering it."""
        answers, received = self._prepared(requests)
        return run_iterations(self, instance, requests, answers, received)

    async def execute_requests_async(
        self, instance: LoadedInstance, requests: list[InferRequest]
    ) -> list[Mapping[str, Any] | Exception]:
        """`execute_requests` for an ``async def execute``."""
        answers, received = self._prepared(requests)
        try:
            result = await self.call_async(instance, received, requests[0])
        except Exception as exc:
            failure = self.failed(instance, exc)  # a response already sent stays the answer
            return [failure if a.response is None else a.outcome() for a in answers]
        if any(r.rescheduled for r in received):
            return [not_reschedulable(self.model.name, async_execute=True)] * len(requests)
        if result is None:
            for answer in answers:
                await answer.trio_done.wait()
            return [a.outcome() for a in answers]
        outcomes = self.returned(result, answers)
        for each in outcomes:
            if isinstance(each, Answer):  # its response comes through its sender
                await each.trio_done.wait()
        return [o.outcome() if isinstance(o, Answer) else o for o in outcomes]

    def failed(self, instance: LoadedInstance, exc: Exception) -> InferenceError:
        """``execute`` raised: the error of each of its requests, in Triton's words (and in
        the log, with the traceback)."""
        message = (
            f"Failed to process the request(s) for model '{instance.params.name}', "
            f"message: {type(exc).__name__}: {exc}"
        )
        _log.error("%s", message, exc_info=exc)
        failure = InferenceError(message, model_name=self.model.name)
        failure.__cause__ = exc
        return failure

    def returned(
        self, result: Any, answers: Sequence[Answer]
    ) -> list[Mapping[str, Any] | Exception | Answer]:
        """Per request: its outputs or error, or its `Answer` where the list holds None."""
        if not isinstance(result, list | tuple) or len(result) != len(answers):
            count = len(result) if isinstance(result, list | tuple) else type(result).__name__
            problem = TritonModelException(
                f"execute returned {count} for {len(answers)} requests: it must return a list "
                "of pb_utils.InferenceResponse, one per request (or None, and answer through "
                "each request's response sender)"
            )
            return [problem] * len(answers)
        outcomes: list[Mapping[str, Any] | Exception | Answer] = []
        for item, answer in zip(result, answers, strict=True):
            if answer.response is not None:  # sent: what it returns is dropped, as Triton's
                outcomes.append(answer.outcome())
            elif item is None:
                outcomes.append(answer)
            elif isinstance(item, InferenceResponse):
                outcomes.append(self.declared.outputs_of(item))
            else:
                outcomes.append(
                    TritonModelException(
                        f"execute returned {type(item).__name__} for a request, not a "
                        "pb_utils.InferenceResponse"
                    )
                )
        return outcomes

    def received(self, request: InferRequest, sender: InferenceResponseSender) -> InferenceRequest:
        """``request`` as the model's code receives it."""
        config = self._facing
        inputs: dict[str, Any] = {}
        for tensor in config.input:
            value = request.inputs.get(tensor.name)
            if value is not None:
                if not isinstance(value, np.ndarray):  # a jitted step's output, on its device
                    value = on_host(value)
                view = apply_reshape(tensor, value, config.max_batch_size).view()
                view.flags.writeable = False
                inputs[tensor.name] = view
        wanted = request.requested_outputs
        outputs = [t.name for t in config.output if wanted is None or t.name in wanted]
        return InferenceRequest.received(request, inputs, outputs, sender, cancelled_here)

    def _execution(self, nursery: trio.Nursery, parent: InferRequest) -> Execution:
        return Execution(
            model_name=self.model.name,
            calls=self._calls,
            token=self._token,
            nursery=nursery,
            parent=parent,
        )

    def call(
        self, instance: LoadedInstance, requests: list[InferenceRequest], parent: InferRequest
    ) -> Any:
        """One call of a synchronous ``execute``, in this thread; the BLS streams it leaves
        unfinished are cancelled when it returns."""
        nursery = self._nursery
        if nursery is None:
            raise ServerClosedError(f"model '{self.model.name}' is being unloaded")
        execution = self._execution(nursery, parent)
        context = execution.context()
        context.run(enter_scope, self._scope)
        try:
            return context.run(instance.params.model.execute, requests)
        except SystemExit as exc:  # the model's error, never the server's end
            raise TritonModelException(f"execute raised SystemExit({exc.code!r})") from exc
        finally:
            execution.finish()
            instance.waited_ns = execution.waited_ns

    async def call_async(
        self, instance: LoadedInstance, requests: list[InferenceRequest], parent: InferRequest
    ) -> Any:
        """One call of an ``async def execute`` on the model's asyncio loop, in a nursery of
        its own (its ``async_exec`` calls run there)."""
        async with ungrouped(trio.open_nursery()) as nursery:
            execution = self._execution(nursery, parent)
            context = execution.context()
            context.run(enter_scope, self._scope)
            try:
                return await self._on_loop(context, instance.params.model.execute(requests))
            finally:
                nursery.cancel_scope.cancel()  # what the model left running (a BLS stream)

    async def _on_loop(self, context: contextvars.Context, coroutine: Any) -> Any:
        """Run an async ``execute``'s coroutine on the model's asyncio loop; cancelling
        the waiting trio task cancels the coroutine (and waits until it has ended)."""
        loop = self._loop
        if loop is None:
            coroutine.close()
            raise ServerClosedError(f"model '{self.model.name}' is being unloaded")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future = context.run(asyncio.run_coroutine_threadsafe, coroutine, loop)

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(wake)
        try:
            await done.wait()
        finally:
            if not future.done():
                future.cancel()
                with trio.CancelScope(shield=True):
                    await done.wait()
        return future.result()

    # -- decoupled models ------------------------------------------------------------------

    def open_stream(self, instance: LoadedInstance, arguments: Mapping[str, Any]) -> Any:
        """The responses the model's senders push for one request."""
        return PushedStream(self, instance, arguments["request"])

    def spawn(self, fn: Callable[[], Any]) -> None:
        """Start ``fn`` in the backend's nursery.

        Raises:
            ServerClosedError: the model is being unloaded.
        """
        if self._nursery is None:
            raise ServerClosedError(f"model '{self.model.name}' is being unloaded")
        self._nursery.start_soon(fn)


def model_folder(model: Model) -> Path | None:
    """The version folder of ``model`` (given, or the folder of its ``model.py``; None: a
    class made in Python)."""
    if model.directory is not None:
        return model.directory
    return Path(model.source).parent if model.source.endswith(".py") else None


def triton_problems(model: Model, where: str, in_config: str) -> list[str]:
    """Why ``model``'s class cannot run as a Triton python model (empty: it can)."""
    cls = model.code.model_class if isinstance(model.code, TritonClass) else None
    errors = placement_problems(model, in_config)
    execute = getattr(cls, "execute", None)
    if not callable(execute):
        return [*errors, f"{where}: class TritonPythonModel defines no execute(self, requests)"]
    if inspect.isgeneratorfunction(execute) or inspect.isasyncgenfunction(execute):
        errors.append(
            f"{where}: TritonPythonModel.execute is a generator; a decoupled model sends its "
            "responses through request.get_response_sender()"
        )
    if model.config.decoupled and model.config.stateful:
        errors.append(f"{in_config}: a decoupled model cannot also be stateful")
    problem = stub_name_problem(model.config, in_config, auto_complete=False)
    return [*errors, problem] if problem else errors
