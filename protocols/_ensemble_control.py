"""Control flow in an ensemble, declared in its ``parameters``: conditional steps, joins on the
first of several alternatives, bounded loops, steps mapped over items, constants, defaults,
per-step parameters and per-step timeouts.

How this works. Triton's text-format parser refuses fields its ``ModelConfig`` lacks, and an
ensemble's ``parameters`` map is the place it accepts anything; so every declaration is one
entry of that map, its key saying what it is about, its value a string (JSON where it has
parts). A ``config.pbtxt`` that uses them still parses in Triton. `read_control` turns the
entries into an `EnsembleControl` and returns every mistake it finds, each naming the
ensemble and the parameter's key; the wiring rules that need the composing models' configs
(data types, shapes, cycles) are checked with the rest of the ensemble's rules in
``_ensemble_validation``.

The keys (``N`` is a step's index in ``ensemble_scheduling.step``, from 0):

- ``step[N].when``: ``"TENSOR"`` or ``"not TENSOR"``: the step runs only when the BOOL
  tensor's elements are all true (or, with ``not``, not all true); otherwise it is skipped.
- ``step[N].parameters``: a JSON object of strings, numbers and booleans added to the
  parameters of the step's requests (over the client's of the same name).
- ``step[N].timeout_ms``: the most the step may take, in milliseconds (a map: all its items).
- ``step[N].map``: the step's input tensors (comma-separated) mapped over: the step's model
  runs once per item along their first dimension, the outputs gathered back in order.
- ``step[N].max_items_in_flight``: a map's bound on items sent and not yet answered.
- ``constant.NAME``: a tensor every request starts with, as ``{"data_type": "TYPE_FP32",
  "dims": [2], "value": [0.5, 0.5]}`` or with ``"file": "NAME.npy"`` (in the ensemble's
  version folder) instead of ``value``.
- ``default.TENSOR``: the value a tensor takes when the step producing it is skipped (same
  form as a constant).
- ``any.NAME``: ``"A, B"``: a tensor that is the first of the alternatives to arrive.
- ``loop.NAME``: ``{"steps": [2, 3], "while": "TENSOR", "max_iterations": 3, "next":
  {"OUT": "IN"}}``: the steps run again while the BOOL tensor holds, at most that many
  times; each ``next`` entry feeds a body output to the tensor a body step takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from ._config import ModelConfig
from ._dtypes import DataType
from ._request_options import ParameterValue

DEFAULT_MAX_ITEMS_IN_FLIGHT = 64
"""A map's bound on items in flight when ``step[N].max_items_in_flight`` is not given."""

_STEP_KEY = re.compile(r"step\[(\d+)\]\.(\w+)")
_NAMED_KEY = re.compile(r"(constant|default|any|loop)\.(.+)")
_STEP_FIELDS = ("when", "parameters", "timeout_ms", "map", "max_items_in_flight")
_LOOP_FIELDS = frozenset({"steps", "while", "max_iterations", "next"})


def _names(value: str | Iterable[str]) -> frozenset[str]:
    """Tensor names: a comma-separated string, or any collection of names."""
    if isinstance(value, str):
        return frozenset(n.strip() for n in value.split(",") if n.strip())
    return frozenset(value)


def _pairs(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(a), str(b)) for a, b in items))


@attrs.frozen
class DeclaredTensor:
    """A tensor declared in the config: a constant or a default (`DeclaredTensor.of` makes one
    from an array)."""

    data_type: DataType
    dims: tuple[int, ...] = attrs.field(converter=tuple)
    value: np.ndarray | None = attrs.field(eq=False, repr=False)
    """The value given inline, already of ``data_type`` and ``dims``; None when in a file."""
    file: str | None = None
    """The ``.npy`` file of the value, in the ensemble's version folder."""

    @classmethod
    def of(cls, value: Any) -> DeclaredTensor:
        """The tensor ``value`` (an array, or anything ``numpy.asarray`` takes), inline."""
        array = np.array(value)
        array.setflags(write=False)
        return cls(DataType.from_numpy(array.dtype), array.shape, array)

    def as_parameter(self) -> str:
        """The JSON of a ``constant.NAME`` or ``default.T`` parameter."""
        spec: dict[str, Any] = {"data_type": self.data_type.config_name, "dims": list(self.dims)}
        if self.value is None:
            spec["file"] = self.file
        elif self.data_type is DataType.BYTES:
            spec["value"] = [
                v.decode() if isinstance(v, bytes) else str(v) for v in self.value.ravel()
            ]
        else:
            spec["value"] = self.value.tolist()
        return json.dumps(spec)


@attrs.frozen
class StepControl:
    """What the parameters declare for one step."""

    when: str | None = None
    """The BOOL tensor the step runs on (None: always runs)."""
    negate: bool = False
    """``when: "not T"``: the step runs when ``T`` does not hold."""
    parameters: Mapping[str, ParameterValue] = attrs.field(factory=dict)
    timeout: float | None = None
    """Seconds the step may take (None: no limit of its own)."""
    mapped: frozenset[str] = attrs.field(default=frozenset(), converter=_names)
    """The step's input tensors it runs once per item of (empty: not a map)."""
    max_items: int = DEFAULT_MAX_ITEMS_IN_FLIGHT

    @property
    def needs_task(self) -> bool:
        """The step must run in a task of its own (a map, a timeout)."""
        return bool(self.mapped) or self.timeout is not None


@attrs.frozen
class EnsembleLoop:
    """A bounded loop: steps run again while a tensor holds."""

    name: str
    steps: frozenset[int] = attrs.field(converter=frozenset)
    condition: str
    """The BOOL tensor, made by a step of the loop, that says whether to go round again."""
    max_iterations: int
    carry: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_pairs)
    """(body output, tensor it replaces in the next iteration) pairs (a mapping is taken)."""


def _loops(value: Iterable[EnsembleLoop]) -> tuple[EnsembleLoop, ...]:
    return tuple(value)


@attrs.frozen
class EnsembleControl:
    """Every control declaration of one ensemble: what `read_control` reads from its
    ``parameters``, and what an ensemble made in Python declares with `to_parameters`::

        control = EnsembleControl(
            constants={"threshold": DeclaredTensor.of(np.array([0.5], np.float32))},
            steps={1: StepControl(mapped="crops"), 2: StepControl(when="unsure")},
            loops=[EnsembleLoop("refine", [3], "changed", 3, {"BOXES": "boxes"})],
        )
        config = ModelConfig(..., parameters=control.to_parameters())
    """

    constants: Mapping[str, DeclaredTensor] = attrs.field(factory=dict)
    defaults: Mapping[str, DeclaredTensor] = attrs.field(factory=dict)
    """The value each tensor takes when the step making it is skipped."""
    alternatives: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    """``any.NAME``: each joined tensor and the tensors it is the first of."""
    steps: Mapping[int, StepControl] = attrs.field(factory=dict)
    """What each step declares, by its index in ``ensemble_scheduling.step``."""
    loops: tuple[EnsembleLoop, ...] = attrs.field(default=(), converter=_loops)

    @property
    def flows(self) -> bool:
        """Whether a request's path can differ from Triton's plain dataflow (anything but
        constants and per-step parameters is declared)."""
        return bool(
            self.defaults
            or self.alternatives
            or self.loops
            or any(s.when or s.mapped or s.timeout is not None for s in self.steps.values())
        )

    @property
    def empty(self) -> bool:
        """Nothing is declared: the ensemble is Triton's."""
        return not (self.constants or self.steps or self.flows)

    def to_parameters(self) -> dict[str, str]:
        """The ``parameters`` entries that declare this (`read_control` reads them back): how
        an ensemble made in Python declares its control flow, in its `ModelConfig`."""
        out: dict[str, str] = {}
        for name, declared in self.constants.items():
            out[f"constant.{name}"] = declared.as_parameter()
        for name, declared in self.defaults.items():
            out[f"default.{name}"] = declared.as_parameter()
        for name, alternatives in self.alternatives.items():
            out[f"any.{name}"] = ", ".join(alternatives)
        for index, own in self.steps.items():
            key = f"step[{index}]"
            if own.when is not None:
                out[f"{key}.when"] = f"not {own.when}" if own.negate else own.when
            if own.parameters:
                out[f"{key}.parameters"] = json.dumps(dict(own.parameters))
            if own.timeout is not None:
                out[f"{key}.timeout_ms"] = str(round(own.timeout * 1000))
            if own.mapped:
                out[f"{key}.map"] = ", ".join(sorted(own.mapped))
            if own.max_items != DEFAULT_MAX_ITEMS_IN_FLIGHT:
                out[f"{key}.max_items_in_flight"] = str(own.max_items)
        for loop in self.loops:
            out[f"loop.{loop.name}"] = json.dumps(
                {
                    "steps": sorted(loop.steps),
                    "while": loop.condition,
                    "max_iterations": loop.max_iterations,
                    "next": dict(loop.carry),
                }
            )
        return out

    def step(self, index: int) -> StepControl | None:
        """What is declared for step ``index`` (None: nothing)."""
        return self.steps.get(index)

    def loop_of(self, index: int) -> EnsembleLoop | None:
        """The loop step ``index`` belongs to, if any."""
        return next((loop for loop in self.loops if index in loop.steps), None)


class _Problems(list[str]):
    """Mistakes found, each prefixed with the ensemble and the parameter."""

    def __init__(self, ensemble: str) -> None:
        super().__init__()
        self.ensemble = ensemble

    def add(self, key: str, problem: str) -> None:
        self.append(f"ensemble '{self.ensemble}': parameters '{key}': {problem}")


def read_control(config: ModelConfig) -> tuple[EnsembleControl, list[str]]:
    """The control declarations of an ensemble's ``parameters``, and every mistake in them
    (each naming the ensemble and the parameter). Keys that are not control declarations
    (``fusion``, a user's own) are left alone."""
    problems = _Problems(config.name)
    count = len(config.ensemble_scheduling.step) if config.ensemble_scheduling else 0
    step_fields: dict[int, dict[str, Any]] = {}
    named = _Named()
    for key, text in sorted(config.parameters.items()):
        if match := _STEP_KEY.fullmatch(key):
            index, field = int(match[1]), match[2]
            if index >= count:
                problems.add(key, f"there is no step[{index}] (the ensemble has {count})")
            elif field not in _STEP_FIELDS:
                problems.add(key, f"unknown field '{field}' (known: {', '.join(_STEP_FIELDS)})")
            else:
                value = _step_field(problems, key, field, text)
                if value is not None:
                    step_fields.setdefault(index, {}).update(value)
        elif match := _NAMED_KEY.fullmatch(key):
            named.read(problems, key, match[1], match[2], text, count)
        elif key.startswith(("step[", "step.", "steps.")):
            problems.add(key, "a step's key is 'step[N].FIELD', N its index from 0")
        elif key in ("constant.", "default.", "any.", "loop."):
            problems.add(key, "the key names no tensor or loop after the dot")
    _whole_problems(problems, named, step_fields)
    control = EnsembleControl(
        constants=named.constants,
        defaults=named.defaults,
        alternatives=named.alternatives,
        steps={i: StepControl(**fields) for i, fields in sorted(step_fields.items())},
        loops=tuple(named.loops),
    )
    return control, list(problems)


def _whole_problems(
    problems: _Problems, named: _Named, step_fields: Mapping[int, Mapping[str, Any]]
) -> None:
    """Mistakes only the declarations together show: a join of joins, a bound on a map's
    items without a map, a step in two loops."""
    for joined, alternatives in named.alternatives.items():
        nested = [a for a in alternatives if a in named.alternatives]
        if nested:
            problems.add(
                f"any.{joined}",
                f"alternative '{nested[0]}' is itself a join: list all the alternatives in "
                "one join (the first of them to arrive is the same)",
            )
    for index, fields in step_fields.items():
        if "max_items" in fields and "mapped" not in fields:
            problems.add(f"step[{index}].max_items_in_flight", f"step[{index}] has no 'map'")
    seen: dict[int, str] = {}
    for loop in named.loops:
        for index in sorted(loop.steps):
            if index in seen:
                problems.add(
                    f"loop.{loop.name}",
                    f"step[{index}] is already in loop '{seen[index]}' (loops do not nest)",
                )
            seen[index] = loop.name


@attrs.define
class _Named:
    """The ``constant.``, ``default.``, ``any.`` and ``loop.`` entries read so far."""

    constants: dict[str, DeclaredTensor] = attrs.field(factory=dict)
    defaults: dict[str, DeclaredTensor] = attrs.field(factory=dict)
    alternatives: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    loops: list[EnsembleLoop] = attrs.field(factory=list)

    def read(
        self, problems: _Problems, key: str, kind: str, name: str, text: str, count: int
    ) -> None:
        if kind in ("constant", "default"):
            declared = _declared_tensor(problems, key, text)
            if declared is not None:
                (self.constants if kind == "constant" else self.defaults)[name] = declared
        elif kind == "any":
            names = tuple(n.strip() for n in text.split(","))
            if len(names) < 2 or not all(names):
                problems.add(key, f"give two or more tensor names, comma-separated: {text!r}")
            else:
                self.alternatives[name] = names
        else:
            loop = _loop(problems, key, name, text, count)
            if loop is not None:
                self.loops.append(loop)


def _step_field(problems: _Problems, key: str, field: str, text: str) -> dict[str, Any] | None:
    """The `StepControl` fields one ``step[N].FIELD`` entry gives (None: a mistake)."""
    if field == "when":
        words = text.split()
        if len(words) == 1:
            return {"when": words[0]}
        if len(words) == 2 and words[0] == "not":
            return {"when": words[1], "negate": True}
        problems.add(key, f"give a BOOL tensor's name, or 'not' and one: {text!r}")
        return None
    if field == "map":
        names = [n.strip() for n in text.split(",")]
        if not all(names):
            problems.add(
                key, f"give the step's input tensors to map over, comma-separated: {text!r}"
            )
            return None
        return {"mapped": frozenset(names)}
    if field == "parameters":
        value = _json(problems, key, text)
        if value is None:
            return None
        if not isinstance(value, dict) or not all(
            isinstance(v, str | int | float | bool) for v in value.values()
        ):
            problems.add(key, "give a JSON object of strings, numbers and booleans")
            return None
        return {"parameters": value}
    number = _positive_int(problems, key, text)
    if number is None:
        return None
    if field == "timeout_ms":
        return {"timeout": number / 1000}
    return {"max_items": number}


def _json(problems: _Problems, key: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        problems.add(key, f"not valid JSON ({exc.msg} at character {exc.pos}): {text!r}")
        return None


def _positive_int(problems: _Problems, key: str, text: object) -> int | None:
    try:
        number = int(str(text))
    except ValueError:
        number = 0
    if number <= 0:
        problems.add(key, f"must be a positive integer, got {text!r}")
        return None
    return number


def _declared_tensor(problems: _Problems, key: str, text: str) -> DeclaredTensor | None:
    """A ``constant.NAME`` or ``default.TENSOR`` entry."""
    spec = _json(problems, key, text)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        problems.add(key, 'give a JSON object: {"data_type": ..., "dims": [...], "value": ...}')
        return None
    unknown = sorted(set(spec) - {"data_type", "dims", "value", "file"})
    if unknown:
        problems.add(key, f"unknown fields {unknown} (known: data_type, dims, value, file)")
        return None
    try:
        data_type = DataType.from_config_name(str(spec.get("data_type", "")))
    except ValueError:
        problems.add(key, f"'data_type' must be a TYPE_... name, got {spec.get('data_type')!r}")
        return None
    dims = spec.get("dims", [])
    if not isinstance(dims, list) or not all(isinstance(d, int) and d >= 0 for d in dims):
        problems.add(key, f"'dims' must be a list of sizes (no -1), got {dims!r}")
        return None
    if ("value" in spec) == ("file" in spec):
        problems.add(key, "give exactly one of 'value' and 'file'")
        return None
    if "file" in spec:
        file = spec["file"]
        if not isinstance(file, str) or not file.endswith(".npy") or "/" in file or "\\" in file:
            problems.add(key, f"'file' must name a .npy file of the version folder, got {file!r}")
            return None
        return DeclaredTensor(data_type, tuple(dims), None, file)
    try:
        value = np.array(spec["value"], dtype=data_type.numpy_dtype)
        if data_type is DataType.BYTES:
            value = np.array([str(v).encode() for v in value.ravel()], dtype=object)
        value = value.reshape(dims)
    except (ValueError, TypeError, OverflowError) as exc:
        problems.add(
            key, f"'value' does not make a {data_type.config_name} tensor of dims {dims}: {exc}"
        )
        return None
    value.setflags(write=False)
    return DeclaredTensor(data_type, tuple(dims), value)


def _loop(problems: _Problems, key: str, name: str, text: str, count: int) -> EnsembleLoop | None:
    """A ``loop.NAME`` entry."""
    spec = _json(problems, key, text)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        problems.add(
            key, 'give a JSON object: {"steps": [...], "while": ..., "max_iterations": ...}'
        )
        return None
    unknown = sorted(set(spec) - _LOOP_FIELDS)
    if unknown:
        problems.add(key, f"unknown fields {unknown} (known: {', '.join(sorted(_LOOP_FIELDS))})")
        return None
    if "max_iterations" not in spec:
        problems.add(key, "a loop needs 'max_iterations', its bound")
        return None
    bound = _positive_int(problems, key + " max_iterations", spec["max_iterations"])
    steps = spec.get("steps")
    if (
        not isinstance(steps, list)
        or not steps
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
    ):
        problems.add(key, f"'steps' must list the loop's step indices, got {steps!r}")
        return None
    outside = [s for s in steps if not 0 <= s < count]
    if outside:
        problems.add(key, f"there is no step {outside} (the ensemble has {count})")
        return None
    condition = spec.get("while")
    if not isinstance(condition, str) or not condition:
        problems.add(key, "'while' must name the BOOL tensor that says whether to go round again")
        return None
    carry = spec.get("next", {})
    if not isinstance(carry, dict) or not all(isinstance(v, str) for v in carry.values()):
        problems.add(key, "'next' must map body outputs to the tensors they replace")
        return None
    if bound is None:
        return None
    return EnsembleLoop(name, frozenset(steps), condition, bound, tuple(sorted(carry.items())))


def holds(value: np.ndarray | None) -> bool:
    """Whether a condition tensor holds: present, not empty, every element true."""
    if value is None or value.size == 0:
        return False
    return bool(value.item()) if value.size == 1 else bool(np.all(value))
