"""A model's definition as data: its config and the code that runs it, as one of a union of
small frozen kinds (`Function`: a Python function, `TritonClass`: a Triton python-backend
class, `OnnxGraph`: an ONNX graph), with what identifies it (version, revision) and the files
read beside it (labels, initial states). The runtime (``orchestrion.actors``) runs it; the
backends (``orchestrion.backends``) read it, each the kind it registers
(``backends/_kinds.py``); neither owns it."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ._config import ModelConfig
from ._errors import ConfigError


@attrs.frozen
class Function:
    """A model's code as Python functions (a ``model.py`` with ``execute``)."""

    execute: Callable[..., Any]
    """``execute([params,] INPUT0, ...) -> {"OUTPUT0": array, ...}`` (see `Model`)."""
    initialize: Callable[[ModelConfig], Any] | None = None
    """``initialize(config) -> params``, run once per instance."""
    initial_state: Callable[[ModelConfig], Any] | None = None
    """``initial_state(config) -> state``, a stateful model's state at a sequence's start."""
    jit: bool = True
    """Compile ``execute`` with ``jax.jit``; False runs it as plain Python."""


@attrs.frozen
class TritonClass:
    """A model's code as a Triton python-backend class (``TritonPythonModel``)."""

    model_class: type


@attrs.frozen
class OnnxGraph:
    """A model's code as an ONNX graph: its ``.onnx`` file's path or bytes."""

    graph: Path | bytes = attrs.field(repr=False)


ModelCode = Function | TritonClass | OnnxGraph
"""The kinds of model code; each backend runs one (``backends/_kinds.py``)."""


def _code_of(
    where: str,
    execute: Callable[..., Any] | None,
    initialize: Callable[[ModelConfig], Any] | None,
    initial_state: Callable[[ModelConfig], Any] | None,
    jit: bool | None,
    triton_model: type | None,
    onnx: Path | bytes | None,
) -> ModelCode | None:
    """The one kind of code `Model`'s keyword arguments give (None: no code).

    Raises:
        ConfigError: they give more than one kind.
    """
    function = execute is not None or initialize is not None or initial_state is not None
    given = [
        name
        for name, present in (
            ("execute/initialize/initial_state", function),
            ("triton_model", triton_model is not None),
            ("onnx", onnx is not None),
        )
        if present
    ]
    if len(given) > 1:
        raise ConfigError(
            f"{where}: a model's code is one kind: a Python function (execute), a Triton "
            f"python class (triton_model) or an ONNX graph (onnx); got {' and '.join(given)}"
        )
    if triton_model is not None:
        return TritonClass(triton_model)
    if onnx is not None:
        return OnnxGraph(onnx)
    if not function:
        return None
    if execute is None or not callable(execute):
        raise ConfigError(f"{where}: defines no execute function")
    return Function(execute, initialize, initial_state, True if jit is None else jit)


@attrs.frozen(eq=False, init=False)
class Model:
    """A model (or ensemble) definition: a config plus, for models, the code that runs it.

    Args:
        config: the model's configuration (``platform="ensemble"`` for an ensemble).
        code: the code that runs it, as one of `ModelCode`'s kinds (None for an ensemble);
            or give it by the keyword arguments below, one kind only.
        execute: ``execute([params,] INPUT0, INPUT1, ...) -> {"OUTPUT0": array, ...}``, one
            argument per config input, by name. Ensembles have none. May be an ``async def``
            (then ``jit`` must be False).
        initialize: optional ``initialize(config) -> params`` (a pytree), run once per
            instance; its result is passed as the first argument of ``execute``.
        initial_state: for a stateful model (``sequence_batching``): ``initial_state(config)
            -> state`` (a pytree), the state a sequence starts with (None when absent).
            ``execute`` then takes a ``state`` parameter and returns ``(outputs, new_state)``.
        jit: compile ``execute`` with ``jax.jit`` (None: the default, True). False runs it
            as plain Python, for work JAX cannot trace (decoding bytes, strings, I/O).
        triton_model: a Triton python-backend model class (``TritonPythonModel``: its
            ``initialize(args)``, ``execute(requests)``, ``finalize()``), given instead of
            ``execute``; a repository's ``model.py`` that defines ``TritonPythonModel`` runs
            this way (see docs/guide.md, "Bringing a Triton repository").
        onnx: an ONNX model, run by ONNX Runtime instead of ``execute``: the path of its
            ``.onnx`` file (external data is read from beside it) or the file's bytes. Its
            config has ``platform="onnxruntime_onnx"`` (or ``backend="onnxruntime"``) and
            is checked against the graph when the model loads; a repository's
            ``<version>/model.onnx`` comes this way, its config completed from the graph.
        version: the version number this definition is served as.
        source: where the code came from (its ``model.py``), for error messages.
        config_source: where the config came from, for error messages.
        revision: identifies this code and config in response-cache keys, so that no
            answer of another revision is ever served from the cache. A repository's model
            gets a fingerprint of its ``config.pbtxt`` and version folder (equal files, equal
            revision: replicas of one deploy share a Redis cache; a reload or another deploy
            does not). A model made in Python gets a random one unless given: pass the
            same string in every process (and change it with the code or its data) to share
            cached answers across processes.
        labels: class labels per output, for the classification extension (a client asking
            an output for its top classes gets ``"score:index:label"``); a repository's model
            reads them from each output's ``label_filename``, one label per line.
        initial_states: the bytes of each implicit state's ``initial_state`` ``data_file``
            (by the state's ``input_name``), in row-major order; a repository's model reads
            them from its ``initial_state/`` folder.
        constants: an ensemble's constants and defaults declared with a ``file`` (see
            docs/guide.md, "Control flow"), by tensor name; a repository's ensemble reads
            them from its version folder.
        directory: the version folder a repository's model was read from (its files beside
            the code: a python-backend model's ``pb_utils.get_model_dir()``, and its folder
            is Triton's ``model_repository`` argument); None for a model made in Python
            (then the folder of ``source``, when that is a file).
    """

    config: ModelConfig
    code: ModelCode | None
    version: int
    source: str
    config_source: str
    """Where the config came from (its ``config.pbtxt``), for error messages."""
    revision: str
    labels: Mapping[str, Sequence[str]]
    initial_states: Mapping[str, bytes] = attrs.field(repr=False)
    directory: Path | None
    constants: Mapping[str, np.ndarray] = attrs.field(repr=False, eq=False)

    def __init__(
        self,
        config: ModelConfig,
        execute: Callable[..., Any] | None = None,
        initialize: Callable[[ModelConfig], Any] | None = None,
        initial_state: Callable[[ModelConfig], Any] | None = None,
        jit: bool | None = None,
        triton_model: type | None = None,
        onnx: Path | bytes | None = None,
        *,
        code: ModelCode | None = None,
        version: int = 1,
        source: str = "<python>",
        config_source: str = "<python>",
        revision: str | None = None,
        labels: Mapping[str, Sequence[str]] | None = None,
        initial_states: Mapping[str, bytes] | None = None,
        directory: Path | None = None,
        constants: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Raises `ConfigError` where the arguments give more than one kind of code (with
        ``code``, the keywords of a `Function`'s parts change those parts, as
        ``attrs.evolve(model, initial_state=...)`` does)."""
        where = f"{source} (model '{config.name}')"
        if code is None:
            code = _code_of(where, execute, initialize, initial_state, jit, triton_model, onnx)
        elif triton_model is not None or onnx is not None:
            raise ConfigError(f"{where}: give its code once, as code= or by triton_model/onnx")
        else:  # keywords change a function's parts (as attrs.evolve passes them)
            parts: dict[str, object] = {"execute": execute, "initialize": initialize}
            parts |= {"initial_state": initial_state, "jit": jit}
            changed = [name for name, value in parts.items() if value is not None]
            if changed and not isinstance(code, Function):
                raise ConfigError(
                    f"{where}: {', '.join(changed)} are parts of a Python function's code, "
                    f"and this model's is {type(code).__name__}"
                )
            if isinstance(code, Function) and changed:
                code = Function(
                    execute if execute is not None else code.execute,
                    initialize if initialize is not None else code.initialize,
                    initial_state if initial_state is not None else code.initial_state,
                    code.jit if jit is None else jit,
                )
        self.__attrs_init__(
            config=config,
            code=code,
            version=version,
            source=source,
            config_source=config_source,
            revision=revision if revision is not None else secrets.token_hex(16),
            labels=labels if labels is not None else {},
            initial_states=initial_states if initial_states is not None else {},
            directory=directory,
            constants=constants if constants is not None else {},
        )

    @property
    def name(self) -> str:
        """The model's name (from its config)."""
        return self.config.name
