"""What the JAX and plain-Python backends share: a model whose code is an ``execute``
function of its inputs (the ``model.py`` contract).

How this works: ``execute([params,] [state,] INPUT0, INPUT1, ..., [request])`` is called with
one keyword argument per input present, by name; ``params`` is what ``initialize(config)``
returned for the instance, ``state`` a stateful model's sequence state (``execute`` then
returns ``(outputs, new_state)``), ``request`` the request's metadata for a model that asks.
Instances follow ``instance_group``: one per device (a JAX device; KIND_GPU places on GPUs).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..protocols import (
    Function,
    InferRequest,
    InferResponse,
    InstanceKind,
    ModelLoadError,
    Tensors,
    apply_reshape,
)
from ._base import Backend, LoadedInstance
from ._code_files import forget_code

if TYPE_CHECKING:
    from ..protocols import Model


def devices(model: Model) -> list[Any]:
    """One device per instance, following ``instance_group`` (checked at load)."""
    groups = model.config.instance_group
    if not groups:
        return [jax.devices()[0]]
    found: list[Any] = []
    for group in groups:
        if group.kind is InstanceKind.KIND_GPU:
            gpus = jax.devices("gpu")
            ids = group.gpus or tuple(range(len(gpus)))
            found.extend(gpus[ids[i % len(ids)]] for i in range(group.count))
        elif group.kind is InstanceKind.KIND_CPU:
            found.extend([jax.devices("cpu")[0]] * group.count)
        else:
            found.extend([jax.devices()[0]] * group.count)
    return found


def placement_problems(model: Model, in_config: str) -> list[str]:
    """Why ``instance_group`` cannot be placed on the devices JAX sees (empty: it can)."""
    kinds = {g.kind for g in model.config.instance_group}
    if InstanceKind.KIND_GPU not in kinds:
        return []
    try:
        gpus = len(jax.devices("gpu"))
    except RuntimeError:
        gpus = 0
    wanted = max((max(g.gpus, default=0) for g in model.config.instance_group), default=0)
    if gpus == 0:
        return [
            f"{in_config}: instance_group kind KIND_GPU, but JAX sees no GPU (install "
            "orchestrion[cuda] on a GPU machine, or use KIND_CPU)"
        ]
    if wanted >= gpus:
        return [f"{in_config}: instance_group asks for GPU {wanted}, but JAX sees {gpus}"]
    return []


def function_of(model: Model) -> Function:
    """``model``'s code, a `Function` (the function backends run no other kind)."""
    code = model.code
    if not isinstance(code, Function):
        raise TypeError(f"model '{model.name}' has no Python function to run: {code!r}")
    return code


def takes_request(model: Model) -> bool:
    """Whether ``execute`` asks for the request's metadata (a ``request`` parameter)."""
    if not isinstance(model.code, Function):
        return False
    try:
        return "request" in inspect.signature(model.code.execute).parameters
    except (TypeError, ValueError):
        return False


class FunctionBackend(Backend):
    """A model whose code is ``execute`` (and optionally ``initialize``, ``initial_state``)."""

    def __init__(self, model: Model, fn: Callable[..., Any]) -> None:
        self.model = model
        self.code = function_of(model)
        self.config = model.config
        self._fn = fn
        self._with_params = self.code.initialize is not None
        self._stateful = model.config.stateful
        self._takes_request = takes_request(model)

    def _instance(self, index: int, device: Any) -> LoadedInstance:
        """Run ``initialize`` for one instance and place what it returned."""
        model = self.model
        initialize = self.code.initialize
        params = None
        if initialize is not None:
            try:
                params = self._place(initialize(model.config), device)
            except Exception as exc:
                raise ModelLoadError(
                    f"{model.source} (model '{model.name}'): initialize failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return LoadedInstance(index=index, device=device, params=params)

    def _place(self, tree: Any, device: Any) -> Any:
        """``tree`` where ``device`` computes (a plain-Python model keeps it as it is)."""
        return tree

    def load(self) -> list[LoadedInstance]:
        """One instance per device of ``instance_group``, initialised (no compilation)."""
        try:
            return [self._instance(i, d) for i, d in enumerate(devices(self.model))]
        except BaseException:
            self.close()  # a model that did not load leaves nothing in sys.modules
            raise

    def close(self) -> None:
        """What the model's code imported after its load leaves ``sys.modules``."""
        forget_code(self.code.execute)

    def signature(self, inputs: Tensors) -> Hashable | None:
        """Plain Python compiles nothing."""
        return None

    def call(self, instance: LoadedInstance, arguments: Mapping[str, Any]) -> Any:
        """Call ``execute`` once (what it returns, unconverted)."""
        if self._with_params:
            return self._fn(instance.params, **arguments)
        return self._fn(**arguments)

    def arguments(
        self, request: InferRequest, state: Any, instance: LoadedInstance
    ) -> Mapping[str, Any]:
        """One keyword argument per input present (reshaped as the config says), then
        ``state`` and ``request`` where the model takes them."""
        args = self._inputs(request)
        if self._stateful:
            return {**args, "state": self._place(state, instance.device)}
        return args

    def _inputs(self, request: InferRequest) -> dict[str, Any]:
        inputs = request.inputs
        config = self.config
        args: dict[str, Any] = {}
        for tensor in config.input:
            value = inputs.get(tensor.name)
            if value is None:
                continue
            args[tensor.name] = self._view(apply_reshape(tensor, value, config.max_batch_size))
        if self._takes_request:
            # The request the model sees holds the same read-only views as its arguments.
            args["request"] = request.derive(
                model_name=request.model_name,
                model_version=request.model_version,
                inputs=dict(args),
                requested_outputs=request.requested_outputs,
            )
        return args

    def _view(self, value: Any) -> Any:
        return value

    def split_state(self, raw: Any) -> tuple[Any, Any]:
        """A stateful model returns ``(outputs, new_state)``; others just outputs."""
        if not self._stateful:
            return raw, None
        if not (isinstance(raw, tuple) and len(raw) == 2):
            raise TypeError(
                "a stateful model's execute must return (outputs, new_state), got "
                f"{type(raw).__name__}"
            )
        return raw[0], raw[1]

    def initial_state(self) -> Any:
        """``initial_state(config)``, or None when the model defines none."""
        make = self.code.initial_state
        return make(self.model.config) if make is not None else None


def on_host(value: Any) -> Any:
    """``value`` as a numpy array (a device array is copied to the host; one on the CPU is
    viewed in place, without a copy)."""
    return np.asarray(value)


def to_host(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors`` with every device array copied to the host (numpy arrays as they are)."""
    return {k: v if type(v) is np.ndarray else on_host(v) for k, v in tensors.items()}


def host_tensors(tensors: Tensors) -> Tensors:
    """``tensors`` itself when every one is a numpy array (the common case, no copy), else
    `to_host` of it."""
    for value in tensors.values():
        if type(value) is not np.ndarray:
            return to_host(tensors)
    return tensors


def response_on_host(response: InferResponse) -> InferResponse:
    """``response`` with its outputs on the host: what leaves the server (a client's
    answer, a cache entry) is numpy, whatever device computed it."""
    outputs = response.outputs
    for value in outputs.values():
        if type(value) is not np.ndarray:
            return InferResponse(  # not attrs.evolve: this runs for most responses
                model_name=response.model_name,
                model_version=response.model_version,
                request_id=response.request_id,
                outputs=to_host(outputs),
                parameters=response.parameters,
                final=response.final,
                error=response.error,
            )
    return response


def host_outputs(raw: Any) -> Any:
    """A plain-Python result's arrays on the host (numpy); waits for JAX's asynchronous
    dispatch of any JAX array the code returned."""
    if type(raw) is dict or isinstance(raw, Mapping):
        return to_host(raw)
    return raw
