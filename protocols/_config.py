"""Model configuration as plain attrs classes.

The classes mirror Triton's ``ModelConfig`` protobuf message field for field (same names, same
defaults), so a Triton user recognises every attribute, and a ``config.pbtxt`` converts to them
one to one (see ``_converter.py``). Fields of the schema that orchestrion does not implement are
absent here, so loading a file that sets one is an error naming that field rather than a
setting silently ignored.

``dims`` never include the batch dimension: when ``max_batch_size > 0`` every tensor carries an
extra leading batch dimension, exactly as in Triton.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from ._dtypes import DataType

ENSEMBLE_PLATFORM = "ensemble"
ONNX_PLATFORM = "onnxruntime_onnx"
"""Triton's platform name of ONNX models (run through ONNX Runtime)."""
ONNX_BACKEND = "onnxruntime"
"""Triton's backend name of ONNX models; either name alone makes a model an ONNX model."""
OWN_BACKENDS = ("", "python", "jax", ONNX_BACKEND)
"""The ``backend`` values orchestrion runs itself; any other names a python-based backend
(``<backend directory>/<name>/model.py``, as Triton's ``--backend-directory`` finds one)."""


class InstanceKind(enum.Enum):
    """Where instances of a model run (``instance_group.kind``)."""

    KIND_AUTO = "KIND_AUTO"
    KIND_GPU = "KIND_GPU"
    KIND_CPU = "KIND_CPU"
    KIND_MODEL = "KIND_MODEL"


def _dims(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


@attrs.frozen(kw_only=True)
class Reshape:
    """The shape the model sees instead of the tensor's ``dims`` (``reshape { shape }``)."""

    shape: tuple[int, ...] = attrs.field(default=(), converter=_dims)


@attrs.frozen(kw_only=True)
class TensorConfig:
    """One input or output of a model (``input [...]`` / ``output [...]``)."""

    name: str
    data_type: DataType
    dims: tuple[int, ...] = attrs.field(default=(), converter=_dims)
    reshape: Reshape | None = None
    optional: bool = False
    """Inputs only: the input may be left out of a request."""
    format: str = "FORMAT_NONE"
    """Inputs only: Triton's image layout hint (``FORMAT_NHWC``/``FORMAT_NCHW``); informative."""
    label_filename: str = ""
    """Outputs only: a file of class labels next to the config; informative."""


@attrs.frozen(kw_only=True)
class VersionPolicy:
    """Which version folders are served (``version_policy``).

    Exactly one of the three is set; the default is Triton's: the latest version only.
    """

    latest: int | None = None
    """Serve the ``num_versions`` highest versions."""
    all: bool = False
    """Serve every version."""
    specific: tuple[int, ...] | None = None
    """Serve exactly these versions."""


@attrs.frozen(kw_only=True)
class InstanceGroup:
    """``instance_group``: ``count`` concurrent instances of the model on ``kind`` devices."""

    name: str = ""
    kind: InstanceKind = InstanceKind.KIND_AUTO
    count: int = 1
    gpus: tuple[int, ...] = attrs.field(default=(), converter=_dims)
    # Accepted for compatibility; orchestrion has no rate limiter or host policies.
    host_policy: str = ""
    rate_limiter: Mapping[str, Any] | None = None


@attrs.frozen(kw_only=True)
class QueuePolicy:
    """``dynamic_batching.default_queue_policy``."""

    timeout_action: str = "REJECT"
    default_timeout_microseconds: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0


@attrs.frozen(kw_only=True)
class DynamicBatching:
    """``dynamic_batching``: gather requests into batches."""

    preferred_batch_size: tuple[int, ...] = attrs.field(default=(), converter=_dims)
    max_queue_delay_microseconds: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy | None = None
    priority_queue_policy: Mapping[str, QueuePolicy] = attrs.field(factory=dict)
    """Queue policy per priority level (keys are the levels, as Triton's JSON writes them)."""


@attrs.frozen(kw_only=True)
class SequenceBatching:
    """``sequence_batching``: a stateful model that keeps state per correlation id.

    The strategy and control sub-messages are kept as Triton wrote them (plain data).
    """

    max_sequence_idle_microseconds: int = 0
    control_input: tuple[Mapping[str, Any], ...] = ()
    state: tuple[Mapping[str, Any], ...] = ()
    direct: Mapping[str, Any] | None = None
    oldest: Mapping[str, Any] | None = None
    iterative_sequence: bool = False
    """Triton's iterative sequences: a request that its model reschedules runs again
    (a python-backend model's ``set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``),
    without correlation ids or state."""


@attrs.frozen(kw_only=True)
class ModelTransactionPolicy:
    """``model_transaction_policy``: ``decoupled`` models send zero or many responses."""

    decoupled: bool = False


@attrs.frozen(kw_only=True)
class ResponseCache:
    """``response_cache``: whether responses of this model may be cached."""

    enable: bool = False


@attrs.frozen(kw_only=True)
class EnsembleStep:
    """One step of an ensemble: which model runs and how tensors are wired to it.

    ``input_map`` maps the model's input names to ensemble tensor names, ``output_map`` the
    model's output names to ensemble tensor names. ``model_version`` -1 or 0 means the latest.
    """

    model_name: str = ""
    model_version: int = -1
    input_map: Mapping[str, str] = attrs.field(factory=dict)
    output_map: Mapping[str, str] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class EnsembleScheduling:
    """``ensemble_scheduling``: the steps and the per-step in-flight limit (0 = unbounded)."""

    step: tuple[EnsembleStep, ...] = ()
    max_inflight_requests: int = 0


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A model's configuration: Triton's ``ModelConfig`` message as attrs.

    Build one in Python for models defined without files, or load one from ``config.pbtxt``
    with `load_model_config`.
    """

    name: str = ""
    """Empty in a ``config.pbtxt`` means: the model's folder name."""
    platform: str = ""
    backend: str = ""
    max_batch_size: int = 0
    version_policy: VersionPolicy | None = None
    input: tuple[TensorConfig, ...] = ()
    output: tuple[TensorConfig, ...] = ()
    instance_group: tuple[InstanceGroup, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    sequence_batching: SequenceBatching | None = None
    ensemble_scheduling: EnsembleScheduling | None = None
    model_transaction_policy: ModelTransactionPolicy | None = None
    response_cache: ResponseCache | None = None
    parameters: Mapping[str, str] = attrs.field(factory=dict)
    default_model_filename: str = ""
    metric_tags: Mapping[str, str] = attrs.field(factory=dict)
    # Accepted for compatibility with Triton files; an ensemble must not set them, and
    # Python models have nothing to optimise or warm up with them.
    optimization: Mapping[str, Any] | None = None
    model_warmup: tuple[Mapping[str, Any], ...] = ()

    @property
    def is_ensemble(self) -> bool:
        """Whether this is an ensemble (``platform: "ensemble"``)."""
        return self.platform == ENSEMBLE_PLATFORM

    @property
    def is_onnx(self) -> bool:
        """Whether this is an ONNX model (``platform: "onnxruntime_onnx"`` or ``backend:
        "onnxruntime"``), run through ONNX Runtime."""
        return self.platform == ONNX_PLATFORM or self.backend == ONNX_BACKEND

    @property
    def stateful(self) -> bool:
        """Whether the model keeps state per correlation id (``sequence_batching``, not an
        iterative sequence)."""
        batching = self.sequence_batching
        return batching is not None and not batching.iterative_sequence

    @property
    def iterative(self) -> bool:
        """Whether its requests may be rescheduled (``iterative_sequence: true``)."""
        return self.sequence_batching is not None and self.sequence_batching.iterative_sequence

    @property
    def decoupled(self) -> bool:
        """Whether the model is decoupled (zero or many responses per request)."""
        return self.model_transaction_policy is not None and self.model_transaction_policy.decoupled

    def input_named(self, name: str) -> TensorConfig | None:
        """The input called ``name``, or None."""
        return next((t for t in self.input if t.name == name), None)

    def output_named(self, name: str) -> TensorConfig | None:
        """The output called ``name``, or None."""
        return next((t for t in self.output if t.name == name), None)
