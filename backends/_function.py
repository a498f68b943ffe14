"""What the JAX and plain-Python backends share: a model whose code is an ``execute``
function of its inputs (the ``model.py`` contract).

How this works: ``execute([params,] [state,] INPUT0, INPUT1, ..., [request])`` is called with
one keyword argument per input present, by name; ``params`` is what ``initialize(config)``
returned for the instance, ``state`` a stateful model's sequence state (``execute`` then
returns ``(outputs, new_state)``), ``request`` the request's metadata for a model that asks.
Instances follow ``instance_group``: one per device (a JAX device; KIND_GPU places on GPUs).
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
import threading
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from types import ModuleType
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

if TYPE_CHECKING:
    from ..protocols import Model


_module_ids = itertools.count()


_MODELS = "_orchestrion_models"
_IMPORTING = threading.Lock()
"""One model's code is imported at a time: the import path is changed while it is."""


class CallersModel(ModuleType):
    """``sys.modules["model"]``: the ``model.py`` of the model whose code is running, as
    Triton's stub has it (each model's code is the top-level module ``model`` of its own
    process): Triton's QA models run ``unittest.main("model")`` in ``execute``. Each
    attribute read finds the innermost model ``model.py`` among the callers' frames."""

    def _callers(self) -> dict[str, Any]:
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name.startswith(f"{_MODELS}.") and name.endswith(".model"):
                return frame.f_globals
            frame = frame.f_back  # type: ignore[assignment]
        raise AttributeError(
            "module 'model' is a model's own model.py, read from that model's code only"
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return self._callers()[name]
        except KeyError:
            raise AttributeError(f"module 'model' has no attribute {name!r}") from None

    def __dir__(self) -> list[str]:
        return list(self._callers())


def import_code_file(path: Path, label: str) -> ModuleType:
    """Import a model's code file (a ``model.py``) as a module of its own, never entered in
    ``sys.modules`` (two versions of one model, or two models' helpers, never clash).

    A model may import modules that sit beside it, as Triton's python backend lets it
    (it puts the version folder and the model's folder on the import path of the model's
    own process): ``import helper`` finds ``helper.py`` in the version folder, then in the
    model's folder (after the installed packages, as in Triton), and ``from . import
    helper`` finds it in the version folder. Both are imported for this model alone:
    once its import is done they leave ``sys.modules``, so another model's ``helper.py``
    is its own, and imports at the top of the file (Triton's stub runs them there too)
    are the ones that see the folders.

    Raises:
        ModelLoadError: the file cannot be imported, or importing it raised (the message
            names the file and keeps the original error).
    """
    package = f"{_MODELS}.m{next(_module_ids)}_{label}"
    module_name = f"{package}.{path.stem}"
    folders = [str(path.parent), str(path.parent.parent)]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    holder = ModuleType(package)
    holder.__path__ = [str(path.parent)]  # `from . import helper`: the version folder
    with _IMPORTING:
        if _MODELS not in sys.modules:  # the parent of every model's package (empty)
            root = sys.modules[_MODELS] = ModuleType(_MODELS)
            root.__path__ = []
        if path.stem == "model" and "model" not in sys.modules:  # no module of that name
            sys.modules["model"] = CallersModel("model")
        before = set(sys.modules)
        added = [f for f in folders if f not in sys.path]
        sys.path.extend(added)
        sys.modules[package] = holder
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ModelLoadError(f"{path}: import failed: {type(exc).__name__}: {exc}") from exc
        finally:
            for folder in added:
                sys.path.remove(folder)
            for name in set(sys.modules) - before:
                if name.startswith(package) or _beside(sys.modules[name], folders):
                    del sys.modules[name]
    return module


def _beside(module: ModuleType, folders: list[str]) -> bool:
    """Whether ``module`` was imported from a model's folders (its helpers, packages of
    helpers included)."""
    file = getattr(module, "__file__", None)
    return file is not None and any(Path(file).is_relative_to(f) for f in folders)


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
        return [self._instance(i, d) for i, d in enumerate(devices(self.model))]

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
            )
    return response


def host_outputs(raw: Any) -> Any:
    """A plain-Python result's arrays on the host (numpy); waits for JAX's asynchronous
    dispatch of any JAX array the code returned."""
    if type(raw) is dict or isinstance(raw, Mapping):
        return to_host(raw)
    return raw
