"""The interface between the runtime and a model's code, and the choice of backend.

How this works: the runner (`orchestrion.actors._runner`) holds one `Backend` per loaded
model version and never looks past it. `Backend.load` runs in a worker thread and returns
the model's instances (`LoadedInstance`), each placed on its device and, for a compiling
backend, compiled and timed for the declared shapes. `Backend.execute` runs one execution
synchronously (inline on the event loop or in a worker thread, as the runner decides),
`execute_async` one that awaits, `open_stream` a decoupled model's generator. What a backend
can do is declared in `Capabilities`, which is all the runner, the batcher, fusion and the
registry read. A new kind of model (Triton's python backend, ONNX Runtime) is a new
`Backend` here, chosen in `backend_for`. A backend whose model code calls other models (BLS)
gets the server's `ServerCalls`; one that keeps something running while it is loaded (an
asyncio loop, the tasks of streams) runs it in `Backend.run`, in the runner's nursery.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from ..protocols import CustomMetricFamily, InferRequest, InferResponse, ModelConfig, Tensors

if TYPE_CHECKING:
    pass


@attrs.frozen(kw_only=True)
class Capabilities:
    """What a backend's model code can do; the runtime decides how to run it from this."""

    is_async: bool
    """``execute`` awaits: it runs on the event loop, never in a worker thread."""
    streaming: bool
    """Decoupled: an execution yields zero or more responses (`Backend.open_stream`)."""
    stateful: bool
    """An execution takes a sequence's state and returns its new state."""
    batching: bool
    """An execution may take several requests joined on the batch dimension."""
    thread_safe: bool
    """An execution may run in a worker thread (the inline/thread policy may move it)."""
    compiles: bool
    """Executions are compiled per input shapes (`Backend.signature`): an execution for
    shapes an instance has not compiled yet runs in a worker thread."""
    takes_request: bool
    """``execute`` sees the request's metadata (a ``request`` argument)."""
    traceable: bool
    """``execute`` can be traced into an ensemble's one fused ``jax.jit`` function."""
    request_lists: bool = False
    """A batch is a list of requests that the model answers one by one (Triton's python
    backend: ``execute(requests)``), not their inputs joined on the batch dimension: the
    batcher calls `Backend.execute_requests`, and one request may fail alone."""
    pushes: bool = False
    """Decoupled, and its code pushes responses (Triton's response senders) instead of
    yielding them one step at a time: the stream holds no compute slot while it waits, and
    the backend runs each request's execution on an instance itself."""
    sequence_tensors: bool = False
    """Stateful as Triton's backends are: the sequence batcher fills each request's control
    inputs and implicit state as tensors (``orchestrion.actors._sequence_batcher``) and
    batches requests of several sequences; no state object passes through ``execute``."""
    may_run_inline: bool = True
    """Without an ``execution`` parameter, executions may be measured and run inline when
    short; False: they run in worker threads (code that may wait on the server, such as a
    Triton model's BLS calls, must never run on the event loop) unless the config's
    ``execution`` says otherwise."""
    waits_through_portal: bool = False
    """Its code may wait on the server (a Triton model's synchronous BLS calls), which it
    can do from the event loop through a greenback portal: an inline execution runs only
    in a task that holds one (`greenback.ensure_portal`), never on a synchronous fast path."""
    output_shapes_as_given: bool = False
    """Its outputs keep the shapes its code gives them, unchecked against the config's dims
    (as Triton passes a python-backend model's on); names and data types are checked."""


class ServerCalls(Protocol):
    """What a model's code may call on the server it runs in (Triton's BLS)."""

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run ``request`` on a loaded model or ensemble, as a client's request would run."""
        ...

    def stream_infer(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """A decoupled model's responses to ``request``, as they come."""
        ...

    def is_ready(self, name: str, version: int = -1) -> bool:
        """Whether ``name`` (at ``version``; -1: any) is loaded and serving."""
        ...

    async def load_model(
        self, name: str, config: str | None, files: Mapping[str, bytes] | None
    ) -> None:
        """Load (or reload) ``name``, with a config (JSON text) and files instead of the
        repository's where given, as a load request would."""
        ...

    async def unload_model(self, name: str, unload_dependents: bool) -> None:
        """Unload ``name`` (and the ensembles that use it, with ``unload_dependents``)."""
        ...


@attrs.define(eq=False)
class LoadedInstance:
    """One instance of a model as its backend loaded it."""

    index: int
    device: Any
    """Where it computes (a JAX device; None where the backend has no notion of one)."""
    params: Any = None
    """What ``initialize`` returned (placed on `device`), or None."""
    compiled: set[Hashable] = attrs.field(factory=set)
    """Input signatures (`Backend.signature`) this instance has compiled."""
    typical_ns: int | None = None
    """A warm-up execution's duration (the median of five), or None: not measured."""
    waited_ns: int = 0
    """How long its last execution waited on the server (BLS calls): not the execution's
    own time (inline, through a greenback portal, the event loop runs on meanwhile)."""

    def compiled_for(self, signature: Hashable | None) -> bool:
        """Whether an execution for ``signature`` (None: shapes fixed or irrelevant) runs
        without compiling first."""
        return signature is None or signature in self.compiled


class Backend(abc.ABC):
    """One loaded model version's code, behind the interface the runtime calls."""

    config: ModelConfig
    """The model's config."""
    capabilities: Capabilities
    """What its code can do."""
    variable_shapes: bool = False
    """Requests' input shapes may differ (so may their `signature`): an execution may have
    to compile; False: every valid request has the shapes compiled at load."""
    padded_sizes: tuple[int, ...] = ()
    """Batch sizes a batching model's executions are padded to (all compiled at load);
    empty: executions take the batch as it is."""

    @abc.abstractmethod
    def load(self) -> list[LoadedInstance]:
        """Initialise, place, compile and warm up every instance (runs in a worker thread).

        Raises:
            ModelLoadError: initialising or compiling failed (the message names the file).
        """

    @abc.abstractmethod
    def signature(self, inputs: Tensors) -> Hashable | None:
        """What an execution for ``inputs`` is compiled for; None: nothing to compile."""

    @abc.abstractmethod
    def arguments(
        self, request: InferRequest, state: Any, instance: LoadedInstance
    ) -> Mapping[str, Any]:
        """The arguments of one execution for ``request`` (and a stateful model's ``state``)."""

    @abc.abstractmethod
    def execute(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        """Run one execution to the end: its outputs (numpy arrays, or device arrays that a
        compiling backend leaves where they were computed, finished), and a stateful
        model's new state (None otherwise). Raises whatever the model's code raised."""

    async def execute_async(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        """`execute` for code that awaits (`Capabilities.is_async`)."""
        raise NotImplementedError(f"{type(self).__name__} does not run async code")

    def open_stream(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> Iterator[Any] | AsyncIterator[Any]:
        """A decoupled model's responses for one request (`Capabilities.streaming`): an
        iterator (each step runs in a worker thread) or an async iterator; close it when
        done."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def execute_requests(
        self, instance: LoadedInstance, requests: list[InferRequest]
    ) -> list[Mapping[str, Any] | Exception]:
        """One execution of a batch of requests (`Capabilities.request_lists`): each
        request's outputs, or the error that answers it alone."""
        raise NotImplementedError(f"{type(self).__name__} does not take lists of requests")

    async def execute_requests_async(
        self, instance: LoadedInstance, requests: list[InferRequest]
    ) -> list[Mapping[str, Any] | Exception]:
        """`execute_requests` for code that awaits (`Capabilities.is_async`)."""
        raise NotImplementedError(f"{type(self).__name__} does not run async code")

    def initial_state(self) -> Any:
        """The state a new sequence starts with (stateful models), or None."""
        return None

    def custom_metrics(self) -> list[CustomMetricFamily]:
        """The metric families the model's code made (shown on ``/metrics``)."""
        return []

    async def ready(self) -> bool:
        """The model's code's own readiness check, where it has one (a python-backend
        model's ``is_ready()``); loaded means ready for the others."""
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """What the backend keeps running while it is loaded (an asyncio loop, the tasks of
        streams), in the runner's nursery: started once the instances are loaded, cancelled
        once they have ended. The default runs nothing."""
        task_status.started()

    def traceable(self) -> Callable[..., Mapping[str, Any]]:
        """``fn(params, **inputs)``, one execution as JAX can trace it into an ensemble's
        fused function (`Capabilities.traceable`); ``params``: an instance's."""
        raise NotImplementedError(f"{type(self).__name__} cannot be traced")

    def close(self) -> None:  # noqa: B027 (a hook: most backends hold nothing to release)
        """Release what `load` acquired (the runner calls it once its instances ended)."""
