"""Every load-time rule an ensemble's wiring must satisfy (`validate_ensemble`).

How this works: an ensemble is a set of named tensors. Each tensor is produced exactly once,
either by the client (an ensemble input) or by one step's ``output_map``, and consumed by the
steps whose ``input_map`` names it (or returned as an ensemble output). `validate_ensemble`
checks the wiring against the composing models' configs and returns every problem it finds,
each naming the ensemble, the step and the tensor. It runs named checks in a fixed order (the
order of the messages): the ensemble's own settings, the models its steps use, each step's
model and maps and the tensors it produces, then each step's inputs (the data types and shapes
along each tensor), then unused ensemble inputs, the ensemble's outputs, unused step outputs,
reachability and decoupled producers.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ._config import ModelConfig, TensorConfig
from ._dtypes import DataType
from ._ensemble import EnsembleGraph, StepPlan, is_decoupled
from ._ensemble_control import EnsembleControl, EnsembleLoop, read_control

MAX_INFLIGHT_LIMIT = 2**32


def _full_shape(tensor: TensorConfig, max_batch_size: int) -> tuple[int, ...]:
    return ((-1,) if max_batch_size > 0 else ()) + tensor.dims


def _did_you_mean(graph: EnsembleGraph, name: str, models: Mapping[str, ModelConfig]) -> str:
    steps = ", ".join(f"step[{s.index}]" for s in graph.steps if s.model_name == name)
    close = difflib.get_close_matches(name, list(models), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f" ('{name}' in {steps}{hint})"


def _own_shape(tensor: TensorConfig, max_batch_size: int) -> tuple[int, ...]:
    """An ensemble input's or output's shape inside the ensemble: its reshape, if any."""
    dims = tensor.reshape.shape if tensor.reshape is not None else tensor.dims
    return ((-1,) if max_batch_size > 0 else ()) + dims


def _shapes_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))


def _type_name(data_type: object) -> str:
    return str(getattr(data_type, "name", data_type))


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


@attrs.define
class _TensorInfo:
    """What is known about an ensemble tensor while validating: where it comes from."""

    source: str
    data_type: object
    shape: tuple[int, ...]
    """The full shape (a leading -1 when its producer batches); () when unknown."""
    step: int | None  # None for an ensemble input
    batching: bool = False

    def fits(self, shape: tuple[int, ...], batching: bool) -> bool:
        """Triton's consistency rule: the full shapes agree, or only one side batches and
        the per-item dims agree (a batch of 1 is added or removed on the way)."""
        if not self.shape or _shapes_agree(self.shape, shape):
            return True
        if self.batching == batching:
            return False
        mine = self.shape[1:] if self.batching else self.shape
        theirs = shape[1:] if batching else shape
        return _shapes_agree(mine, theirs)


def validate_ensemble(
    config: ModelConfig,
    models: Mapping[str, ModelConfig],
    versions: Mapping[str, Iterable[int]] | None = None,
) -> list[str]:
    """Check an ensemble's load-time rules and return every problem found (empty when valid).

    The rules: the ensemble sets no ``backend``, ``instance_group``, ``optimization`` or
    ``model_warmup``, and its ``max_inflight_requests`` is below 2^32; every step names a
    model of the repository (at a version it has), maps the model's real inputs (every
    required one) and outputs, and takes batches at least as large as the ensemble's; each
    tensor is produced once (as an ensemble input or by one step), every ensemble input is
    consumed, every ensemble output produced and every step output used; data types and
    shapes agree along each tensor; the ensemble's outputs are reachable from its inputs; and
    no step, nor the outputs, combines the iterations of two different decoupled producers.

    Args:
        config: the ensemble's config.
        models: the configs of the other models of the repository, by name.
        versions: the versions available for each model, when known; used to check steps
            that ask for a specific ``model_version``.
    """
    sched = config.ensemble_scheduling
    if sched is None:
        return [f"ensemble '{config.name}': platform 'ensemble' needs ensemble_scheduling"]
    errors = _setting_errors(config)
    if not sched.step:
        errors.append(f"ensemble '{config.name}': ensemble_scheduling has no step")
        return errors
    control, problems = read_control(config)
    if problems:  # the wiring checks need the declarations: a mistake there comes first
        return errors + problems
    graph = EnsembleGraph.from_config(config, control)
    tensors = _ensemble_input_tensors(config)
    errors.extend(_constant_errors(config, control, tensors))
    errors.extend(_unknown_model_errors(config, graph, models))
    for step in graph.steps:  # first every producer, so that consumers can be checked
        errors.extend(_step_errors(config, step, models, versions))
        errors.extend(_step_output_errors(config, step, models, tensors, control))
    errors.extend(_join_errors(config, control, tensors))
    for step in graph.steps:
        errors.extend(_step_input_errors(config, step, models, tensors, control))
    errors.extend(_control_errors(config, graph, models, tensors))
    consumed = {tensor for step in graph.steps for tensor in step.waits}
    consumed.update(t for alternatives in control.alternatives.values() for t in alternatives)
    for loop in control.loops:
        consumed.add(loop.condition)
        consumed.update(source for source, _ in loop.carry)
    errors.extend(_unused_input_errors(config, consumed))
    errors.extend(
        f"ensemble '{config.name}': parameters 'constant.{name}': the constant is not used "
        "by any step"
        for name in control.constants
        if name not in consumed
    )
    errors.extend(_ensemble_output_errors(config, tensors))
    errors.extend(_unused_tensor_errors(config, tensors, consumed))
    errors.extend(_reachability_errors(config, graph, tensors))
    errors.extend(_decoupled_errors(config, graph, models))
    return errors


def _setting_errors(config: ModelConfig) -> list[str]:
    """Fields an ensemble must not set, and the range of ``max_inflight_requests``."""
    assert config.ensemble_scheduling is not None
    errors = []
    for field, present in (
        ("backend", bool(config.backend)),
        ("instance_group", bool(config.instance_group)),
        ("optimization", config.optimization is not None),
        ("model_warmup", bool(config.model_warmup)),
    ):
        if present:
            errors.append(f"ensemble '{config.name}': an ensemble must not set '{field}'")
    inflight = config.ensemble_scheduling.max_inflight_requests
    if not 0 <= inflight < MAX_INFLIGHT_LIMIT:
        errors.append(
            f"ensemble '{config.name}': max_inflight_requests must be an integer in [0, 2^32), "
            f"got {inflight}"
        )
    return errors


def _ensemble_input_tensors(config: ModelConfig) -> dict[str, _TensorInfo]:
    """The tensors the client produces: the ensemble's inputs."""
    return {
        t.name: _TensorInfo(
            source=f"ensemble input '{t.name}'",
            data_type=t.data_type,
            shape=_own_shape(t, config.max_batch_size),
            step=None,
            batching=config.max_batch_size > 0,
        )
        for t in config.input
    }


def _unknown_model_errors(
    config: ModelConfig, graph: EnsembleGraph, models: Mapping[str, ModelConfig]
) -> list[str]:
    """One message naming every model the steps use that the repository lacks."""
    unknown = sorted(
        {s.model_name for s in graph.steps if s.model_name and s.model_name not in models}
    )
    if not unknown:
        return []
    return [
        f"ensemble '{config.name}': steps use models that are not in the repository: "
        + ", ".join(f"'{m}'" for m in unknown)
        + "".join(_did_you_mean(graph, m, models) for m in unknown)
    ]


def _step_errors(
    config: ModelConfig,
    step: StepPlan,
    models: Mapping[str, ModelConfig],
    versions: Mapping[str, Iterable[int]] | None,
) -> list[str]:
    """A step's model and maps: both maps given, the version available, batches big enough."""
    where = step.describe(config.name)
    errors = []
    if not step.model_name:
        errors.append(f"ensemble '{config.name}' step[{step.index}]: model_name is required")
    if not step.inputs:
        errors.append(f"{where}: input_map is required")
    if not step.outputs:
        errors.append(f"{where}: output_map is required")
    model = models.get(step.model_name)
    if model is None:
        return errors
    if versions is not None and step.model_version > 0:
        available = sorted(versions.get(step.model_name, ()))
        if step.model_version not in available:
            errors.append(
                f"{where}: requires version {step.model_version}, which is not available "
                f"(available: {', '.join(map(str, available)) or 'none'})"
            )
    if config.max_batch_size > 0 and 0 < model.max_batch_size < config.max_batch_size:
        errors.append(
            f"{where}: the model's max_batch_size {model.max_batch_size} is smaller than "
            f"the ensemble's max_batch_size {config.max_batch_size}"
        )
    return errors


def _step_output_errors(
    config: ModelConfig,
    step: StepPlan,
    models: Mapping[str, ModelConfig],
    tensors: dict[str, _TensorInfo],
    control: EnsembleControl,
) -> list[str]:
    """A step's outputs: real outputs of its model, each tensor produced once; records in
    ``tensors`` each tensor it is the first to produce (a mapped step's with a first
    dimension of its items)."""
    where = step.describe(config.name)
    model = models.get(step.model_name)
    own = control.step(step.index)
    mapped = own is not None and bool(own.mapped)
    errors = []
    for model_output, tensor in step.outputs:
        out = model.output_named(model_output) if model else None
        if model is not None and out is None:
            errors.append(
                f"{where}: output_map key '{model_output}' is not an output of the model "
                f"(outputs: {', '.join(o.name for o in model.output) or 'none'})"
            )
        if tensor in tensors:
            errors.append(
                f"{where}: tensor '{tensor}' is produced more than once "
                f"(also by {tensors[tensor].source})"
            )
            continue
        shape = _full_shape(out, model.max_batch_size) if out and model else ()
        if mapped and out is not None and model is not None and model.max_batch_size == 0:
            shape = (-1, *shape)
        tensors[tensor] = _TensorInfo(
            source=f"step[{step.index}] (model '{step.model_name}') output '{model_output}'",
            data_type=out.data_type if out else None,
            shape=shape,
            step=step.index,
            batching=model is not None and model.max_batch_size > 0 and not mapped,
        )
    return errors


def _step_input_errors(
    config: ModelConfig,
    step: StepPlan,
    models: Mapping[str, ModelConfig],
    tensors: Mapping[str, _TensorInfo],
    control: EnsembleControl,
) -> list[str]:
    """A step's inputs: each tensor produced, each key a real input of the model, agreeing in
    data type and shape with the tensor (a mapped tensor: each of its items); and every
    required input of the model mapped."""
    where = step.describe(config.name)
    model = models.get(step.model_name)
    own = control.step(step.index)
    items = own.mapped if own is not None else frozenset()
    errors = []
    for model_input, tensor in step.inputs:
        info = tensors.get(tensor)
        if info is not None and tensor in items:
            if info.data_type is not None and not info.shape:
                errors.append(
                    f"{where}: parameters 'step[{step.index}].map': tensor '{tensor}' "
                    f"({info.source}) has no dimension to map over"
                )
                continue
            elif info.shape and model is not None and model.max_batch_size == 0:
                item = f"an item of {info.source}"
                info = attrs.evolve(info, shape=info.shape[1:], batching=False, source=item)
            elif info.shape:
                item = f"items of {info.source}, each with a batch dimension of 1"
                info = attrs.evolve(info, batching=True, source=item)
        if info is None:
            errors.append(
                f"{where}: input '{model_input}' takes tensor '{tensor}', which is neither "
                "an ensemble input nor produced by any step"
            )
        if model is None:
            continue
        inp = model.input_named(model_input)
        if inp is None:
            errors.append(
                f"{where}: input_map key '{model_input}' is not an input of the model "
                f"(inputs: {', '.join(i.name for i in model.input) or 'none'})"
            )
        elif info is not None and info.data_type is not None:
            errors.extend(_agreement_errors(where, tensor, info, model_input, inp, model))
    if model is not None:
        mapped = {m for m, _ in step.inputs}
        missing = [i.name for i in model.input if not i.optional and i.name not in mapped]
        if missing:
            errors.append(
                f"{where}: required model inputs are not mapped in input_map: "
                + ", ".join(f"'{m}'" for m in missing)
            )
    return errors


def _agreement_errors(
    where: str,
    tensor: str,
    info: _TensorInfo,
    model_input: str,
    inp: TensorConfig,
    model: ModelConfig,
) -> list[str]:
    """Whether a tensor's data type and shape are what the step's model input expects."""
    errors = []
    if info.data_type != inp.data_type:
        errors.append(
            f"{where}: tensor '{tensor}' is {info.data_type.name} "  # type: ignore[attr-defined]
            f"({info.source}) but input '{model_input}' expects "
            f"{inp.data_type.name}"
        )
    shape = _full_shape(inp, model.max_batch_size)
    if not info.fits(shape, model.max_batch_size > 0):
        errors.append(
            f"{where}: tensor '{tensor}' has shape {_fmt_shape(info.shape)} "
            f"({info.source}) but input '{model_input}' expects {_fmt_shape(shape)}"
        )
    return errors


def _unused_input_errors(config: ModelConfig, consumed: set[str]) -> list[str]:
    """Every ensemble input is taken by some step."""
    return [
        f"ensemble '{config.name}': ensemble input '{t.name}' is not used by any step"
        for t in config.input
        if t.name not in consumed
    ]


def _ensemble_output_errors(config: ModelConfig, tensors: Mapping[str, _TensorInfo]) -> list[str]:
    """Every ensemble output is produced by a step, agreeing in data type and shape."""
    name = config.name
    errors = []
    for t in config.output:
        info = tensors.get(t.name)
        if info is None or info.step is None:
            errors.append(
                f"ensemble '{name}': ensemble output '{t.name}' is not produced by any step"
            )
            continue
        if info.data_type is not None and info.data_type != t.data_type:
            errors.append(
                f"ensemble '{name}': ensemble output '{t.name}' is {t.data_type.name} but "
                f"{info.source} is {info.data_type.name}"  # type: ignore[attr-defined]
            )
        shape = _own_shape(t, config.max_batch_size)
        if not info.fits(shape, config.max_batch_size > 0):
            errors.append(
                f"ensemble '{name}': ensemble output '{t.name}' has shape {_fmt_shape(shape)} "
                f"but {info.source} has shape {_fmt_shape(info.shape)}"
            )
    return errors


def _unused_tensor_errors(
    config: ModelConfig, tensors: Mapping[str, _TensorInfo], consumed: set[str]
) -> list[str]:
    """Every step output is consumed by a step or returned as an ensemble output."""
    outputs = {t.name for t in config.output}
    return [
        f"ensemble '{config.name}': tensor '{tensor}' ({info.source}) is neither consumed "
        "by a step nor an ensemble output"
        for tensor, info in tensors.items()
        if info.step is not None and tensor not in consumed and tensor not in outputs
    ]


def _reachability_errors(
    config: ModelConfig, graph: EnsembleGraph, tensors: Mapping[str, _TensorInfo]
) -> list[str]:
    """Outputs must be computable from the inputs (a step whose inputs never exist never
    runs); steps that wait on each other form a cycle, which only a loop may declare."""
    available = set(graph.given)
    alternatives = graph.control.alternatives
    ran: set[int] = set()
    progress = True
    while progress:
        progress = False
        for step in graph.steps:
            if step.index not in ran and all(t in available for t in step.waits):
                ran.add(step.index)
                available.update(t for _, t in step.outputs)
                available.update(j for j, alts in alternatives.items() if available & set(alts))
                progress = True
    cycle = _cycle(graph, ran)
    why = cycle or "the steps leading to it wait on each other or on tensors nobody produces"
    errors = [
        f"ensemble '{config.name}': ensemble output '{t.name}' is not reachable from the "
        f"ensemble inputs ({why})"
        for t in config.output
        if (info := tensors.get(t.name)) is not None
        and info.step is not None
        and t.name not in available
    ]
    if cycle and not errors:
        errors.append(f"ensemble '{config.name}': {why}")
    return errors


def _decoupled_errors(
    config: ModelConfig, graph: EnsembleGraph, models: Mapping[str, ModelConfig]
) -> list[str]:
    """A step (or the ensemble's outputs) may not combine iterations of different decoupled
    producers; an ensemble containing a decoupled model is itself one."""
    origin: dict[str, frozenset[int]] = {t.name: frozenset() for t in config.input}
    errors = []

    def describe(sources: frozenset[int]) -> str:
        return ", ".join(
            f"step[{i}] (model '{graph.steps[i].model_name}')" for i in sorted(sources)
        )

    # Steps in dependency order; unreachable ones were reported already.
    pending = list(graph.steps)
    while pending:
        ready = [s for s in pending if all(t in origin for _, t in s.inputs)]
        if not ready:
            break
        for step in ready:
            pending.remove(step)
            sources = frozenset().union(*(origin[t] for _, t in step.inputs))
            if len(sources) > 1:
                errors.append(
                    f"{step.describe(config.name)}: takes inputs from different decoupled "
                    f"producers: {describe(sources)}"
                )
            if len(sources) > 1:
                sources = frozenset()  # reported above: do not report it again downstream
            decoupled = is_decoupled(step.model_name, models)
            produced = frozenset({step.index}) if decoupled else sources
            for _, t in step.outputs:
                origin[t] = produced
    outputs = frozenset().union(*(origin.get(t.name, frozenset()) for t in config.output))
    if len(outputs) > 1:
        errors.append(
            f"ensemble '{config.name}': its outputs come from different decoupled producers: "
            f"{describe(outputs)}"
        )
    return errors


def _cycle(graph: EnsembleGraph, ran: set[int]) -> str:
    """Steps among those that never run that wait on each other, in a cycle (``""``: none)."""
    after = {
        step.index: sorted({i for t in step.waits for i in graph.makers(t)} - ran)
        for step in graph.steps
        if step.index not in ran
    }
    state: dict[int, int] = {}
    path: list[int] = []
    for start in sorted(after):
        if start in state:
            continue
        todo: list[tuple[int, int]] = [(start, 0)]
        while todo:
            index, position = todo.pop()
            if position == 0:
                state[index] = 1
                path.append(index)
            children = after.get(index, [])
            if position < len(children):
                todo.append((index, position + 1))
                child = children[position]
                if state.get(child) == 1:
                    cycle = [*path[path.index(child) :], child]
                    loops = {graph.control.loop_of(i) for i in cycle}
                    text = " -> ".join(f"step[{i}]" for i in cycle)
                    if len(loops) == 1 and None not in loops:
                        (loop,) = loops
                        assert loop is not None
                        return (
                            f"steps of loop '{loop.name}' wait on each other: {text}; an "
                            "iteration feeds the next through the loop's 'next'"
                        )
                    return (
                        f"steps wait on each other in a cycle: {text}; repeat steps with a "
                        "'loop.NAME' parameter"
                    )
                if child not in state:
                    todo.append((child, 0))
            else:
                state[index] = 2
                path.pop()
    return ""


def _constant_errors(
    config: ModelConfig, control: EnsembleControl, tensors: dict[str, _TensorInfo]
) -> list[str]:
    """Constants are tensors of their own: records them in ``tensors`` (every request
    starts with them, as with the ensemble's inputs)."""
    errors = []
    for name, declared in control.constants.items():
        if name in tensors:
            errors.append(
                f"ensemble '{config.name}': parameters 'constant.{name}': the name is taken "
                f"by {tensors[name].source}"
            )
            continue
        tensors[name] = _TensorInfo(
            source=f"constant '{name}'",
            data_type=declared.data_type,
            shape=declared.dims,
            step=None,
        )
    return errors


def _join_errors(
    config: ModelConfig, control: EnsembleControl, tensors: dict[str, _TensorInfo]
) -> list[str]:
    """A join's alternatives are step outputs of one data type; records the join in
    ``tensors`` as its first alternative is."""
    errors = []
    for joined, alternatives in control.alternatives.items():
        key = f"ensemble '{config.name}': parameters 'any.{joined}'"
        if joined in tensors:
            errors.append(f"{key}: the name is taken by {tensors[joined].source}")
            continue
        infos = []
        for tensor in alternatives:
            info = tensors.get(tensor)
            if info is None or info.step is None:
                errors.append(f"{key}: alternative '{tensor}' is not made by any step")
            else:
                infos.append((tensor, info))
        kinds = {info.data_type for _, info in infos if info.data_type is not None}
        shapes = [info for _, info in infos if info.shape]
        if any(not shapes[0].fits(i.shape, i.batching) for i in shapes[1:]):
            errors.append(
                f"{key}: the alternatives differ in shape: "
                + ", ".join(f"'{t}' is {_fmt_shape(info.shape)}" for t, info in infos)
            )
        for tensor in alternatives:
            if tensor in control.defaults:
                errors.append(
                    f"{key}: alternative '{tensor}' has a default, which would arrive first "
                    f"whenever its step is skipped; declare 'default.{joined}' instead"
                )
        if len(kinds) > 1:
            errors.append(
                f"{key}: the alternatives differ in data type: "
                + ", ".join(f"'{t}' is {_type_name(info.data_type)}" for t, info in infos)
            )
        if infos and len(infos) == len(alternatives):
            first = infos[0][1]
            tensors[joined] = attrs.evolve(
                first, source=f"join 'any.{joined}' of {', '.join(alternatives)}"
            )
    return errors


def _control_errors(
    config: ModelConfig,
    graph: EnsembleGraph,
    models: Mapping[str, ModelConfig],
    tensors: Mapping[str, _TensorInfo],
) -> list[str]:
    """Conditions, maps, defaults and loops against the wiring."""
    control = graph.control
    name = config.name
    errors = _step_control_errors(config, graph, models, tensors)
    for tensor, declared in control.defaults.items():
        key = f"ensemble '{name}': parameters 'default.{tensor}'"
        info = tensors.get(tensor)
        if info is None or info.step is None:
            errors.append(f"{key}: tensor '{tensor}' is not made by any step")
        elif info.data_type is not None and info.data_type != declared.data_type:
            errors.append(
                f"{key}: the default is {declared.data_type.name} and {info.source} is "
                f"{_type_name(info.data_type)}"
            )
        elif not info.fits(declared.dims, False):
            errors.append(
                f"{key}: the default has dims {_fmt_shape(declared.dims)} and "
                f"{info.source} has shape {_fmt_shape(info.shape)}"
            )
    for loop in control.loops:
        errors.extend(_loop_errors(config, graph, models, tensors, loop))
    if control.flows and is_decoupled(name, {**models, name: config}):
        errors.append(
            f"ensemble '{name}': conditions, joins, loops, maps, defaults and step timeouts "
            "are not available in an ensemble that streams (it has a decoupled step)"
        )
    return errors


def _step_control_errors(
    config: ModelConfig,
    graph: EnsembleGraph,
    models: Mapping[str, ModelConfig],
    tensors: Mapping[str, _TensorInfo],
) -> list[str]:
    """Each step's condition (a BOOL tensor made before it) and map (of tensors it takes)."""
    errors = []
    for index, own in graph.control.steps.items():
        step = graph.steps[index]
        name = config.name
        key = f"ensemble '{name}': parameters 'step[{index}]"
        if own.when is not None:
            info = tensors.get(own.when)
            if info is None:
                errors.append(f"{key}.when': tensor '{own.when}' is not made by any step")
            elif info.data_type is not None and info.data_type is not DataType.BOOL:
                errors.append(
                    f"{key}.when': tensor '{own.when}' ({info.source}) is "
                    f"{_type_name(info.data_type)}; a condition is BOOL"
                )
            elif info.step == index:
                errors.append(f"{key}.when': tensor '{own.when}' is the step's own output")
        taken = {t for _, t in step.inputs}
        for tensor in sorted(own.mapped - taken):
            errors.append(f"{key}.map': tensor '{tensor}' is not one the step takes")
        model = models.get(step.model_name)
        if own.mapped and model is not None and model.decoupled:
            errors.append(f"{key}.map': a decoupled model's step cannot be mapped")
    return errors


def _loop_errors(
    config: ModelConfig,
    graph: EnsembleGraph,
    models: Mapping[str, ModelConfig],
    tensors: Mapping[str, _TensorInfo],
    loop: EnsembleLoop,
) -> list[str]:
    """A loop's condition, its carried tensors, and what its steps may be."""
    key = f"ensemble '{config.name}': parameters 'loop.{loop.name}'"
    made = {t: i for i in loop.steps for _, t in graph.steps[i].outputs}
    errors = _carry_errors(key, graph, tensors, loop, made)
    info = tensors.get(loop.condition)
    if loop.condition not in made:
        errors.append(f"{key}: 'while' tensor '{loop.condition}' is not made by a step of the loop")
    elif info is not None and info.data_type not in (None, DataType.BOOL):
        errors.append(
            f"{key}: 'while' tensor '{loop.condition}' is "
            f"{_type_name(info.data_type)}; a condition is BOOL"
        )
    for index in sorted(loop.steps):
        step = graph.steps[index]
        if is_decoupled(step.model_name, models):
            errors.append(f"{key}: step[{index}]'s model '{step.model_name}' is decoupled")
    for joined, alternatives in graph.control.alternatives.items():
        if any(t in made for t in alternatives):
            errors.append(
                f"{key}: join 'any.{joined}' takes a tensor the loop makes (join after the loop)"
            )
    errors.extend(
        f"{key}: step[{i}] (model '{graph.steps[i].model_name}') takes what the loop makes "
        "and makes what the loop takes, so it would wait for the loop's end and the loop for "
        "it: add it to the loop's 'steps'"
        for i in _between(graph, loop)
    )
    return errors


def _between(graph: EnsembleGraph, loop: EnsembleLoop) -> list[int]:
    """The steps outside ``loop`` that take (through other steps) what it makes and make what
    it takes: the loop would wait for them, and they for its end."""

    def closure(start: set[int], edges: Mapping[int, set[int]]) -> set[int]:
        seen, todo = set(), list(start)
        while todo:
            index = todo.pop()
            for other in edges.get(index, ()):
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        return seen

    after: dict[int, set[int]] = {}  # step -> the steps that take what it makes
    before: dict[int, set[int]] = {}  # step -> the steps that make what it takes
    for step in graph.steps:
        for tensor in step.waits:
            for maker in graph.makers(tensor):
                after.setdefault(maker, set()).add(step.index)
                before.setdefault(step.index, set()).add(maker)
    downstream = closure(set(loop.steps), after) - loop.steps
    upstream = closure(set(loop.steps), before) - loop.steps
    return sorted(downstream & upstream)


def _carry_errors(
    key: str,
    graph: EnsembleGraph,
    tensors: Mapping[str, _TensorInfo],
    loop: EnsembleLoop,
    made: Mapping[str, int],
) -> list[str]:
    """A loop's ``next``: each a tensor the loop makes, fed to one only its steps take."""
    errors = []
    for source, target in loop.carry:
        if source not in made:
            errors.append(f"{key}: 'next' takes '{source}', which no step of the loop makes")
            continue
        if target in made:
            errors.append(f"{key}: 'next' feeds '{target}', which a step of the loop makes")
            continue
        takers = [step.index for step in graph.steps if target in step.waits]
        users = [i for i in takers if i in loop.steps]
        outside = [i for i in takers if i not in loop.steps]
        if not users:
            errors.append(f"{key}: 'next' feeds '{target}', which no step of the loop takes")
        if outside or target in graph.outputs:
            errors.append(
                f"{key}: 'next' feeds '{target}', which is also taken outside the loop "
                f"({', '.join(f'step[{i}]' for i in outside) or 'an ensemble output'}); "
                f"take the loop's '{source}' there"
            )
        a, b = tensors.get(source), tensors.get(target)
        if a and b and a.data_type and b.data_type and a.data_type != b.data_type:
            errors.append(
                f"{key}: 'next' feeds '{source}' ({_type_name(a.data_type)}) to '{target}' "
                f"({_type_name(b.data_type)})"
            )
        elif a and b and a.data_type and b.data_type and not b.fits(a.shape, a.batching):
            errors.append(
                f"{key}: 'next' feeds '{source}' of shape {_fmt_shape(a.shape)} to "
                f"'{target}' of shape {_fmt_shape(b.shape)}"
            )
    return errors
