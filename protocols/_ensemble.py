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
    _needed: dict[frozenset[str], frozenset[int]] = attrs.field(
        factory=dict, init=False, eq=False, repr=False
    )

    @classmethod
    def from_config(cls, config: ModelConfig) -> EnsembleGraph:
        """The graph of an ensemble config (which should have passed `validate_ensemble`)."""
        assert config.ensemble_scheduling is not None
        steps = tuple(
            StepPlan(
                index=i,
                model_name=s.model_name,
                model_version=-1 if s.model_version <= 0 else s.model_version,
                inputs=tuple(sorted(s.input_map.items())),
                outputs=tuple(sorted(s.output_map.items())),
            )
            for i, s in enumerate(config.ensemble_scheduling.step)
        )
        consumers: dict[str, list[int]] = {}
        producer: dict[str, int] = {}
        for step in steps:
            for _, tensor in step.inputs:
                consumers.setdefault(tensor, []).append(step.index)
            for _, tensor in step.outputs:
                producer[tensor] = step.index
        return cls(
            name=config.name,
            steps=steps,
            inputs=tuple(t.name for t in config.input),
            outputs=tuple(t.name for t in config.output),
            consumers={t: tuple(dict.fromkeys(c)) for t, c in consumers.items()},
            producer=producer,
        )

    def needed_steps(self, requested: frozenset[str]) -> frozenset[int]:
        """The steps that must run to produce ``requested`` outputs (everything else is pruned)."""
        cached = self._needed.get(requested)
        if cached is not None:
            return cached
        needed: set[int] = set()
        todo = [self.producer[t] for t in requested if t in self.producer]
        while todo:
            index = todo.pop()
            if index in needed:
                continue
            needed.add(index)
            todo.extend(self.producer[t] for _, t in self.steps[index].inputs if t in self.producer)
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
