"""Which steps of an ensemble run for a set of requested outputs, and in what order.

How this works. Pruning keeps only the steps that lead to a requested output: a `Plan` lists
them, the outputs of each that someone consumes (the step asks its model for only those), and
how many of each step's input tensors other steps produce (the scheduler counts them down as
they arrive; a step with none left is ready). `Plans` makes one plan per set of requested
outputs, once, and orders a plan's steps so that each comes after the steps it needs (the
order of a streamed request, and of the fused call).
"""

from __future__ import annotations

import attrs

from ..protocols import EnsembleGraph, InferenceError


@attrs.frozen
class Plan:
    """What runs for one set of requested outputs (cached per set)."""

    needed: frozenset[int]
    """The steps that lead to a requested output."""
    step_outputs: dict[int, frozenset[str]]
    """For each needed step, the model outputs someone consumes."""
    missing: dict[int, int]
    """For each needed step, how many of its input tensors are not ensemble inputs."""
    first: tuple[int, ...]
    """The needed steps that take only ensemble inputs: they start each request."""


@attrs.define(eq=False)
class Plans:
    """The plans of one ensemble's graph, made once per set of requested outputs."""

    name: str
    """The ensemble's name (for errors)."""
    graph: EnsembleGraph
    _plans: dict[frozenset[str], Plan] = attrs.field(init=False, factory=dict)

    def plan(self, requested: frozenset[str]) -> Plan:
        """The steps that run for the outputs ``requested`` (made once per set)."""
        return self._plans.get(requested) or self._make_plan(requested)

    def _make_plan(self, requested: frozenset[str]) -> Plan:
        graph = self.graph
        needed = graph.needed_steps(requested)
        wanted = set(requested)
        for index in needed:
            wanted.update(graph.steps[index].waits)
        control = graph.control
        for joined, alternatives in control.alternatives.items():
            if joined in wanted:
                wanted.update(alternatives)
        for loop in control.loops:
            if loop.steps <= needed:
                wanted.add(loop.condition)
                wanted.update(source for source, _ in loop.carry)
        given = graph.given
        missing = {i: len(set(graph.steps[i].waits) - given) for i in sorted(needed)}
        plan = Plan(
            needed=needed,
            step_outputs={
                i: frozenset(o for o, t in graph.steps[i].outputs if t in wanted) for i in needed
            },
            missing=missing,
            first=tuple(i for i, n in missing.items() if n == 0),
        )
        self._plans[requested] = plan
        return plan

    def order(self, plan: Plan) -> list[int]:
        """The needed steps in an order where each comes after the steps it needs."""
        available = set(self.graph.given)
        left = sorted(plan.needed)
        order: list[int] = []
        while left:
            ready = [
                i
                for i in left
                if all(
                    t in available or t not in self.graph.producer
                    for t in self.graph.steps[i].waits
                )
            ]
            if not ready:  # cannot happen in a validated graph
                raise InferenceError(
                    f"ensemble '{self.name}': no step can run", model_name=self.name
                )
            for index in ready:
                order.append(index)
                left.remove(index)
                available.update(t for _, t in self.graph.steps[index].outputs)
        return order
