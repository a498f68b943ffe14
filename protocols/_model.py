"""A model's definition as data: its config and the code that runs it (a Python function, a
Triton python-backend class or an ONNX graph), with what identifies it (version, revision)
and the files read beside it (labels, initial states). The runtime (``orchestrion.actors``)
runs it; the backends (``orchestrion.backends``) read it; neither owns it."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ._config import ModelConfig


@attrs.define(eq=False)
class Model:
    """A model (or ensemble) definition: a config plus, for models, the code that runs it.

    Args:
        config: the model's configuration (``platform="ensemble"`` for an ensemble).
        execute: ``execute([params,] INPUT0, INPUT1, ...) -> {"OUTPUT0": array, ...}``, one
            argument per config input, by name. Ensembles have none. May be an ``async def``
            (then ``jit`` must be False).
        initialize: optional ``initialize(config) -> params`` (a pytree), run once per
            instance; its result is passed as the first argument of ``execute``.
        initial_state: for a stateful model (``sequence_batching``): ``initial_state(config)
            -> state`` (a pytree), the state a sequence starts with (None when absent).
            ``execute`` then takes a ``state`` parameter and returns ``(outputs, new_state)``.
        jit: compile ``execute`` with ``jax.jit`` (the default). False runs it as plain
            Python, for work JAX cannot trace (decoding bytes, strings, I/O).
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
        directory: the version folder a repository's model was read from (its files beside
            the code: a python-backend model's ``pb_utils.get_model_dir()``, and its folder
            is Triton's ``model_repository`` argument); None for a model made in Python
            (then the folder of ``source``, when that is a file).
    """

    config: ModelConfig
    execute: Callable[..., Any] | None = None
    initialize: Callable[[ModelConfig], Any] | None = None
    initial_state: Callable[[ModelConfig], Any] | None = None
    jit: bool = True
    triton_model: type | None = None
    onnx: Path | bytes | None = attrs.field(default=None, repr=False)
    version: int = 1
    source: str = "<python>"
    config_source: str = "<python>"
    """Where the config came from (its ``config.pbtxt``), for error messages."""
    revision: str = attrs.field(factory=lambda: secrets.token_hex(16))
    labels: Mapping[str, Sequence[str]] = attrs.field(factory=dict)
    initial_states: Mapping[str, bytes] = attrs.field(factory=dict, repr=False)
    directory: Path | None = None

    @property
    def name(self) -> str:
        """The model's name (from its config)."""
        return self.config.name
