"""Triton's sequence batcher as a stateful model sees it: control inputs and implicit state.

How this works: a model with ``sequence_batching`` may name *control inputs*, tensors the
batcher fills for every request (``CONTROL_SEQUENCE_START``/``END``/``READY`` as a pair of
false/true values, ``CONTROL_SEQUENCE_CORRID`` as the correlation id in a data type), and
*implicit state*: an ``input_name`` the batcher feeds with what the model returned as
``output_name`` for the sequence's previous request (on the first one: its
``initial_state``, zeros, or zeros with every variable dim 1). `SequenceTensors.of` reads
and checks all of it, and the strategy (``direct`` slots or ``oldest`` candidates) the
batcher uses (`orchestrion.actors._sequence_batcher`); `model_facing` is the config the model's
code sees: the client's inputs and outputs plus those tensors. Clients never send them (a
request naming one is refused as an unexpected input); a state output reaches them only when
the config lists it among its outputs, as in Triton.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ._config import ModelConfig, TensorConfig
from ._dtypes import DataType

START, END, READY, CORRID = "START", "END", "READY", "CORRID"
"""The kinds of control (Triton's ``CONTROL_SEQUENCE_<kind>``)."""
_FLAGS = {START, END, READY}
_PAIRS = {
    "int32_false_true": DataType.INT32,
    "fp32_false_true": DataType.FP32,
    "bool_false_true": DataType.BOOL,
}
_CORRID_TYPES = frozenset(
    {DataType.UINT64, DataType.INT64, DataType.UINT32, DataType.INT32, DataType.BYTES}
)
INITIAL_STATE_FOLDER = "initial_state"
"""The folder of a model's ``initial_state { data_file }`` files, beside its config."""


@attrs.frozen(kw_only=True)
class Control:
    """One control input: what it says, in which data type, with which values."""

    name: str
    kind: str
    """`START`, `END`, `READY` or `CORRID`."""
    data_type: DataType
    values: tuple[Any, ...] = ()
    """A flag's false and true values (empty for `CORRID`)."""


@attrs.frozen(kw_only=True)
class State:
    """One implicit state tensor of a sequence."""

    input_name: str
    output_name: str
    data_type: DataType
    dims: tuple[int, ...]
    initial_dims: tuple[int, ...] | None = None
    """An ``initial_state``'s dims (fixed), or None: zeros of ``dims``, each -1 as 1."""
    data_file: str = ""
    """The ``initial_state``'s ``data_file`` (under `INITIAL_STATE_FOLDER`); "": zeros."""

    def start_shape(self) -> tuple[int, ...]:
        """The shape of the state a sequence starts with (no batch dimension)."""
        if self.initial_dims is not None:
            return self.initial_dims
        return tuple(1 if d < 0 else d for d in self.dims)


@attrs.frozen(kw_only=True)
class SequenceTensors:
    """A stateful model's controls, states and batching strategy, as its config says."""

    controls: tuple[Control, ...] = ()
    states: tuple[State, ...] = ()
    oldest: bool = False
    """The Oldest strategy (a dynamic batch of candidate sequences' requests); False: Direct
    (each sequence in its own batch slot)."""
    max_queue_delay_us: int = 0
    minimum_slot_utilization: float = 0.0
    """Direct: the share of an instance's slots with a request ready that runs a batch at
    once; fewer wait up to ``max_queue_delay_us`` for more."""
    max_candidate_sequences: int = 0
    """Oldest: the sequences an instance takes at once (0: its ``max_batch_size``, at least 1)."""
    preferred_batch_size: tuple[int, ...] = ()
    preserve_ordering: bool = False

    @classmethod
    def of(cls, config: ModelConfig) -> SequenceTensors:
        """The sequence tensors of ``config`` (which has ``sequence_batching``).

        Raises:
            ValueError: a field is wrong (every problem, one per line; see `problems`).
        """
        found, problems = _read(config)
        if problems:
            raise ValueError("\n".join(problems))
        return found

    @property
    def names(self) -> frozenset[str]:
        """Every tensor the batcher adds or takes: control and state inputs, state outputs."""
        return frozenset(
            {c.name for c in self.controls}
            | {s.input_name for s in self.states}
            | {s.output_name for s in self.states}
        )

    def slots(self, max_batch_size: int) -> int:
        """How many sequences one instance holds at once (Triton's sequence slots)."""
        if self.oldest and self.max_candidate_sequences > 0:
            return self.max_candidate_sequences
        return max(1, max_batch_size)

    def control_values(
        self,
        *,
        start: bool,
        end: bool,
        ready: bool,
        correlation_id: int | str,
        batching: bool,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """The control tensors of one request (or of an empty slot: ``ready`` False), each
        of shape ``[1, 1]`` (``[1]`` for a model that does not batch)."""
        shape = (1, 1) if batching else (1,)
        out: dict[str, np.ndarray[Any, Any]] = {}
        for control in self.controls:
            if control.kind == CORRID:
                out[control.name] = _correlation_tensor(control.data_type, correlation_id, shape)
            else:
                on = {START: start, END: end, READY: ready}[control.kind]
                value = control.values[1 if on else 0]
                out[control.name] = np.full(shape, value, control.data_type.numpy_dtype)
        return out


def _correlation_tensor(
    data_type: DataType, correlation_id: int | str, shape: tuple[int, ...]
) -> np.ndarray[Any, Any]:
    if data_type is DataType.BYTES:
        array = np.empty(shape, dtype=object)
        array[...] = str(correlation_id).encode()
        return array
    dtype = data_type.numpy_dtype
    value = correlation_id if isinstance(correlation_id, int) else 0  # Triton: 0 for a string id
    if not np.iinfo(dtype).min <= value <= np.iinfo(dtype).max:
        value = value & int(np.iinfo(dtype).max)  # wraps as Triton's cast does
    return np.full(shape, value, dtype)


def sequence_problems(config: ModelConfig) -> list[str]:
    """What is wrong with ``config``'s control inputs, states and strategy (empty: nothing,
    or no ``sequence_batching``)."""
    if config.sequence_batching is None:
        return []
    return _read(config)[1]


def sequence_tensor_names(config: ModelConfig) -> frozenset[str]:
    """The names of the tensors ``config``'s sequence batcher adds or takes (empty: none, or
    no ``sequence_batching``; a config with problems names what it can)."""
    if config.sequence_batching is None:
        return frozenset()
    return _read(config)[0].names


def model_facing(config: ModelConfig) -> ModelConfig:
    """``config`` as the model's code sees it: with its sequence batcher's control and
    state inputs among its inputs and its state outputs among its outputs (each control
    ``dims: [1]``, each state its ``dims``); ``config`` itself when it has none."""
    if config.sequence_batching is None:
        return config
    tensors, problems = _read(config)
    if problems or not (tensors.controls or tensors.states):
        return config
    inputs = [TensorConfig(name=c.name, data_type=c.data_type, dims=(1,)) for c in tensors.controls]
    inputs += [
        TensorConfig(name=s.input_name, data_type=s.data_type, dims=s.dims) for s in tensors.states
    ]
    declared = {t.name for t in config.output}
    outputs = [
        TensorConfig(name=s.output_name, data_type=s.data_type, dims=s.dims)
        for s in tensors.states
        if s.output_name not in declared
    ]
    return attrs.evolve(config, input=(*config.input, *inputs), output=(*config.output, *outputs))


def _read(config: ModelConfig) -> tuple[SequenceTensors, list[str]]:
    batching = config.sequence_batching
    assert batching is not None
    where = f"model '{config.name}': sequence_batching"
    problems: list[str] = []
    if batching.iterative_sequence and (
        batching.control_input or batching.state or batching.direct or batching.oldest
    ):
        problems.append(
            f"{where}: an iterative sequence takes no control_input, state or strategy (its "
            "requests carry no correlation ids: a rescheduled request keeps its own)"
        )
    controls = _controls(batching.control_input, where, problems)
    states = _states(batching.state, where, problems)
    taken = {t.name for t in config.input}
    for name in [c.name for c in controls] + [s.input_name for s in states]:
        if name in taken:
            problems.append(f"{where}: '{name}' is also an input the client sends")
        taken.add(name)
    outputs = {t.name: t for t in config.output}
    for state in states:
        listed = outputs.get(state.output_name)
        if listed is not None and listed.data_type is not state.data_type:
            problems.append(
                f"{where}: state output '{state.output_name}' is {state.data_type.value} but "
                f"listed among the outputs as {listed.data_type.value}"
            )
    fields: dict[str, Any] = {"controls": tuple(controls), "states": tuple(states)}
    if batching.direct is not None and batching.oldest is not None:
        problems.append(f"{where}: direct and oldest exclude each other")
    if batching.oldest is not None:
        fields.update(_oldest(batching.oldest, config.max_batch_size, where, problems))
    elif batching.direct is not None:
        fields.update(_direct(batching.direct, where, problems))
    return SequenceTensors(**fields), problems


def _controls(
    entries: Sequence[Mapping[str, Any]], where: str, problems: list[str]
) -> list[Control]:
    controls: list[Control] = []
    kinds: set[str] = set()
    for entry in entries:
        name = str(entry.get("name", ""))
        label = f"{where}: control_input '{name}'"
        if not name:
            problems.append(f"{where}: a control_input has no name")
            continue
        listed = list(entry.get("control", ()))
        if len(listed) != 1:
            problems.append(f"{label} must have exactly one control, has {len(listed)}")
            continue
        control = listed[0]
        # Proto3 leaves an enum's first value out: no kind is CONTROL_SEQUENCE_START.
        kind = str(control.get("kind", "CONTROL_SEQUENCE_START")).removeprefix("CONTROL_SEQUENCE_")
        if kind not in (*_FLAGS, CORRID):
            problems.append(f"{label}: unknown kind CONTROL_SEQUENCE_{kind}")
            continue
        if kind in kinds:
            problems.append(f"{where}: more than one CONTROL_SEQUENCE_{kind} control input")
            continue
        kinds.add(kind)
        found = _control(name, kind, control, label, problems)
        if found is not None:
            controls.append(found)
    return controls


def _control(
    name: str, kind: str, control: Mapping[str, Any], label: str, problems: list[str]
) -> Control | None:
    pairs = [key for key in _PAIRS if key in control]
    if kind == CORRID:
        if pairs:
            problems.append(f"{label}: CONTROL_SEQUENCE_CORRID takes a data_type, not {pairs[0]}")
            return None
        try:
            data_type = DataType.from_config_name(str(control.get("data_type", "")))
        except ValueError:
            data_type = None
        if data_type not in _CORRID_TYPES:
            problems.append(
                f"{label}: CONTROL_SEQUENCE_CORRID needs a data_type of TYPE_UINT64, "
                f"TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING, not "
                f"{control.get('data_type', 'none')}"
            )
            return None
        assert data_type is not None
        return Control(name=name, kind=kind, data_type=data_type)
    if "data_type" in control:
        problems.append(
            f"{label}: CONTROL_SEQUENCE_{kind} takes a false/true pair, not a data_type"
        )
        return None
    if len(pairs) != 1:
        problems.append(
            f"{label}: CONTROL_SEQUENCE_{kind} must set exactly one of int32_false_true, "
            "fp32_false_true and bool_false_true"
        )
        return None
    values = list(control[pairs[0]])
    if len(values) != 2:
        problems.append(
            f"{label}: {pairs[0]} must hold two values (false, true), has {len(values)}"
        )
        return None
    return Control(name=name, kind=kind, data_type=_PAIRS[pairs[0]], values=(values[0], values[1]))


def _states(entries: Sequence[Mapping[str, Any]], where: str, problems: list[str]) -> list[State]:
    states: list[State] = []
    outputs: set[str] = set()
    for entry in entries:
        input_name = str(entry.get("input_name", ""))
        output_name = str(entry.get("output_name", ""))
        label = f"{where}: state '{input_name}'"
        if not input_name or not output_name:
            problems.append(f"{where}: a state needs an input_name and an output_name")
            continue
        if output_name in outputs:
            problems.append(f"{label}: output_name '{output_name}' is another state's too")
            continue
        outputs.add(output_name)
        try:
            data_type = DataType.from_config_name(str(entry.get("data_type", "")))
        except ValueError:
            problems.append(f"{label}: data_type {entry.get('data_type', 'none')!s} is not a type")
            continue
        dims = tuple(int(d) for d in entry.get("dims", ()))
        if not dims or any(d == 0 or d < -1 for d in dims):
            problems.append(f"{label}: dims must be positive or -1, and at least one: {list(dims)}")
            continue
        state = _initial(
            State(input_name=input_name, output_name=output_name, data_type=data_type, dims=dims),
            list(entry.get("initial_state", ())),
            label,
            problems,
        )
        if state is not None:
            states.append(state)
    return states


def _initial(
    state: State, initial: list[Mapping[str, Any]], label: str, problems: list[str]
) -> State | None:
    if not initial:
        return state
    if len(initial) > 1:
        problems.append(f"{label}: at most one initial_state, has {len(initial)}")
        return None
    spec = initial[0]
    dims = tuple(int(d) for d in spec.get("dims", ()))
    if spec.get("data_type", state.data_type.config_name) != state.data_type.config_name:
        problems.append(
            f"{label}: initial_state data_type {spec.get('data_type')} differs from the "
            f"state's {state.data_type.config_name}"
        )
        return None
    fits = len(dims) == len(state.dims) and all(
        d > 0 and (s < 0 or s == d) for d, s in zip(dims, state.dims, strict=False)
    )
    if not fits:
        problems.append(
            f"{label}: initial_state dims {list(dims)} must be positive and fit the state's "
            f"dims {list(state.dims)}"
        )
        return None
    data_file = str(spec.get("data_file", ""))
    if bool(spec.get("zero_data", False)) == bool(data_file):
        problems.append(f"{label}: initial_state must set exactly one of zero_data and data_file")
        return None
    if data_file and state.data_type is DataType.BYTES:
        problems.append(f"{label}: a TYPE_STRING state cannot start from a data_file")
        return None
    return attrs.evolve(state, initial_dims=dims, data_file=data_file)


def _oldest(
    oldest: Mapping[str, Any], max_batch_size: int, where: str, problems: list[str]
) -> dict[str, Any]:
    preferred = tuple(int(p) for p in oldest.get("preferred_batch_size", ()))
    if any(p < 1 or p > max(1, max_batch_size) for p in preferred):
        problems.append(
            f"{where}: oldest preferred_batch_size {list(preferred)} must be 1 to "
            f"max_batch_size ({max_batch_size})"
        )
    return {
        "oldest": True,
        "max_candidate_sequences": int(oldest.get("max_candidate_sequences", 0)),
        "max_queue_delay_us": int(oldest.get("max_queue_delay_microseconds", 0)),
        "preferred_batch_size": preferred,
        "preserve_ordering": bool(oldest.get("preserve_ordering", False)),
    }


def _direct(direct: Mapping[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    utilization = float(direct.get("minimum_slot_utilization", 0.0))
    if not 0.0 <= utilization <= 1.0:
        problems.append(
            f"{where}: direct minimum_slot_utilization must be 0 to 1, not {utilization}"
        )
    return {
        "max_queue_delay_us": int(direct.get("max_queue_delay_microseconds", 0)),
        "minimum_slot_utilization": utilization,
    }


def initial_state_problem(state: State, data: bytes, source: str) -> str | None:
    """Why ``data`` (an ``initial_state`` ``data_file``'s bytes) cannot start ``state``;
    None when it can."""
    expected = (
        int(np.prod(state.start_shape(), dtype=np.int64)) * state.data_type.numpy_dtype.itemsize
    )
    if len(data) != expected:
        return (
            f"{source}: initial_state data_file of state '{state.input_name}' holds "
            f"{len(data)} bytes, its dims {list(state.start_shape())} of "
            f"{state.data_type.value} need {expected}"
        )
    return None


def start_value(state: State, data: bytes | None) -> np.ndarray[Any, Any]:
    """The value a sequence's ``state`` starts with (no batch dimension): ``data`` (its
    ``data_file``, checked by `initial_state_problem`) in row-major order, else zeros."""
    shape = state.start_shape()
    if data is not None:
        array = np.frombuffer(data, dtype=state.data_type.numpy_dtype).reshape(shape)
        return array.copy()
    if state.data_type is DataType.BYTES:
        zeros = np.empty(shape, dtype=object)
        zeros[...] = b""
        return zeros
    return np.zeros(shape, dtype=state.data_type.numpy_dtype)
