"""The dataflow graph of an ensemble: the checked wiring, in the form the scheduler runs.

How this works: an ensemble is a set of named tensors. Each tensor is produced exactly once,
either by the client (an ensemble input) or by one step's ``output_map``, and consumed by the
steps whose ``input_map`` names it (or returned as an ensemble output). `EnsembleGraph` is that
wiring once checked (by `validate_ensemble`, in ``_ensemble_validation``): for each step its
inputs and outputs, and for each tensor its consumers. Pruning is a backwards walk from the
requested outputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ._config import ModelConfig
from ._ensemble_control import EnsembleControl, read_control


@attrs.frozen(kw_only=True)
class StepPlan:
    """One step as the scheduler sees it."""

    index: int
    model_name: str
    model_version: int
    """-1 for the latest version (0 and -1 in the config both mean latest)."""
    inputs: tuple[tuple[str, str], ...]
    """(model input name, ensemble tensor name) pairs."""
    outputs: tuple[tuple[str, str], ...]
    """(model output name, ensemble tensor name) pairs."""
    waits: tuple[str, ...] = ()
    """The tensors the step waits for: those it takes, and its ``when`` condition."""

    def describe(self, ensemble: str) -> str:
        """``ensemble 'e' step[1] (model 'm')``, the prefix of messages about this step."""
        return f"ensemble '{ensemble}' step[{self.index}] (model '{self.model_name}')"


@attrs.frozen(kw_only=True)
class EnsembleGraph:
    """The validated wiring of an ensemble."""

    name: str
    steps: tuple[StepPlan, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    consumers: Mapping[str, tuple[int, ...]]
    """For each tensor, the indices of the steps that take it as an input."""
    producer: Mapping[str, int]
    """For each intermediate or output tensor, the index of the step that makes it."""
    control: EnsembleControl = attrs.field(factory=EnsembleControl)
    """What the ensemble's parameters declare (conditions, joins, loops, maps, constants)."""
    given: frozenset[str] = frozenset()
    """The tensors every request starts with: the ensemble's inputs and its constants."""
    joins: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    """For each tensor that is an alternative of an ``any.NAME`` join, the joins it feeds."""
    deferred: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)
    """For each tensor a loop's step makes, the steps outside the loop that take it: they
    see it once the loop is over (they are not in `consumers`)."""
    _needed: dict[frozenset[str], frozenset[int]] = attrs.field(
        factory=dict, init=False, eq=False, repr=False
    )

    @classmethod
    def from_config(
        cls, config: ModelConfig, control: EnsembleControl | None = None
    ) -> EnsembleGraph:
        """The graph of an ensemble config (which should have passed `validate_ensemble`);
        ``control``: its declarations, when already read (`read_control`)."""
        assert config.ensemble_scheduling is not None
        if control is None:
            control, _ = read_control(config)  # its mistakes: validate_ensemble reports them

        def waits(index: int, inputs: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
            own = control.step(index)
            tensors = [t for _, t in inputs]
            if own is not None and own.when is not None:
                tensors.append(own.when)
            return tuple(dict.fromkeys(tensors))

        steps = tuple(
            StepPlan(
                index=i,
                model_name=s.model_name,
                model_version=-1 if s.model_version <= 0 else s.model_version,
                inputs=tuple(sorted(s.input_map.items())),
                outputs=tuple(sorted(s.output_map.items())),
                waits=waits(i, tuple(sorted(s.input_map.items()))),
            )
            for i, s in enumerate(config.ensemble_scheduling.step)
        )
        consumers: dict[str, list[int]] = {}
        deferred: dict[str, list[int]] = {}
        producer: dict[str, int] = {}
        for step in steps:
            for _, tensor in step.outputs:
                producer[tensor] = step.index
        loop_of = {i: loop.name for loop in control.loops for i in loop.steps}
        for step in steps:
            for tensor in step.waits:
                made_by = producer.get(tensor)
                inside = loop_of.get(made_by) if made_by is not None else None
                if inside is not None and loop_of.get(step.index) != inside:
                    deferred.setdefault(tensor, []).append(step.index)
                else:
                    consumers.setdefault(tensor, []).append(step.index)
        joins: dict[str, list[str]] = {}
        for joined, alternatives in control.alternatives.items():
            for tensor in alternatives:
                joins.setdefault(tensor, []).append(joined)
        return cls(
            name=config.name,
            steps=steps,
            inputs=tuple(t.name for t in config.input),
            outputs=tuple(t.name for t in config.output),
            consumers={t: tuple(dict.fromkeys(c)) for t, c in consumers.items()},
            producer=producer,
            control=control,
            given=frozenset(t.name for t in config.input) | frozenset(control.constants),
            joins={t: tuple(j) for t, j in joins.items()},
            deferred={t: tuple(dict.fromkeys(c)) for t, c in deferred.items()},
        )

    def makers(self, tensor: str) -> list[int]:
        """The steps that make ``tensor``: its producer, or those of a join's alternatives."""
        if tensor in self.producer:
            return [self.producer[tensor]]
        return [
            self.producer[t]
            for t in self.control.alternatives.get(tensor, ())
            if t in self.producer
        ]

    def needed_steps(self, requested: frozenset[str]) -> frozenset[int]:
        """The steps that must run to produce ``requested`` outputs (everything else is pruned)."""
        cached = self._needed.get(requested)
        if cached is not None:
            return cached
        needed: set[int] = set()
        todo = [i for t in requested for i in self.makers(t)]
        while todo:
            index = todo.pop()
            if index in needed:
                continue
            needed.add(index)
            todo.extend(i for t in self.steps[index].waits for i in self.makers(t))
            loop = self.control.loop_of(index)
            if loop is not None:  # a loop runs whole: its condition's maker too
                todo.extend(loop.steps)
        result = self._needed[requested] = frozenset(needed)
        return result


def is_decoupled(name: str, models: Mapping[str, ModelConfig]) -> bool:
    """Whether ``name`` streams responses: a decoupled model, or an ensemble containing one."""
    seen: set[str] = set()

    def visit(current: str) -> bool:
        config = models.get(current)
        if config is None or current in seen:
            return False
        seen.add(current)
        if config.decoupled:
            return True
        sched = config.ensemble_scheduling
        return sched is not None and any(visit(s.model_name) for s in sched.step)

    return visit(name)
