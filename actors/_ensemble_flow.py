"""Control flow on the scheduler's board: skipped steps, joins, loops and maps.

How this works. The scheduler (``_ensemble_scheduler``) counts down, for each step of a run,
the tensors it still waits for; a step with none left is ready. `Flow` adds what an
ensemble's parameters declare (`EnsembleControl`) to that count, without a second
scheduler:

- A ready step whose condition (``step[N].when``) does not hold, or that waits for a skipped
  tensor, is skipped (`Flow.skips`, `Flow.skip`): its outputs are skipped too (or take their
  declared default), and arrive as such, so that what takes them is skipped in turn.
- A join (``any.NAME``) takes the first of its alternatives to arrive; once every
  alternative is absent it is skipped (`Flow.arrived`).
- A loop's steps count their tensors among themselves; the steps after the loop count the
  loop's tensors only once the loop is over (`EnsembleGraph.deferred`). When the last step of
  an iteration is done (`Flow.step_done`) and the loop's condition holds (and the bound is
  not reached), its ``next`` tensors are carried over, the iteration's tensors cleared, and
  the loop's steps counted again from what they make among themselves.
- A mapped step (`map_step`) sends one request per item to its model, at most
  ``max_items_in_flight`` at a time (each through the model's batcher and instances, and its
  cache), and gathers the answers in order.

Everything else is the scheduler's: channels, slots, backpressure, errors, cancellation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import trio

from ..protocols import (
    EnsembleGraph,
    EnsembleLoop,
    InferenceError,
    InferRequest,
    InferResponse,
    InvalidRequestError,
    ModelConfig,
    StepControl,
    holds,
)
from ._ensemble_errors import ItemFailed
from ._ensemble_runs import Router, Run, Step


@attrs.define(eq=False)
class Flow:
    """An ensemble's declared control flow, as the scheduler applies it to each run."""

    graph: EnsembleGraph
    defaults: Mapping[str, np.ndarray]
    """The value of each ``default.T`` (inline or read from its file)."""
    loop_of: dict[int, EnsembleLoop] = attrs.field(init=False)
    again: dict[int, int] = attrs.field(init=False)
    """For each step of a loop: how many tensors it waits for that the loop's steps make
    (what it counts down in the iterations after the first)."""

    def __attrs_post_init__(self) -> None:
        self.loop_of = {i: loop for loop in self.graph.control.loops for i in loop.steps}
        self.again = {}
        for index, loop in self.loop_of.items():
            made = {t for i in loop.steps for _, t in self.graph.steps[i].outputs}
            self.again[index] = len(set(self.graph.steps[index].waits) & made)

    # -- skipping --------------------------------------------------------------------------

    def skips(self, run: Run, index: int) -> bool:
        """Whether step ``index``, ready in ``run``, is skipped rather than run."""
        state = run.flow
        assert state is not None
        plan = self.graph.steps[index]
        if state.skipped and any(t in state.skipped for t in plan.waits):
            return True
        control = self.graph.control.step(index)
        if control is None or control.when is None:
            return False
        return holds(run.tensors.get(control.when)) == control.negate

    def skip(self, run: Run, index: int, ready: list[int]) -> None:
        """Skip step ``index``: its outputs are absent (or their defaults), and arrive."""
        plan = self.graph.steps[index]
        wanted = run.plan.step_outputs[index]
        for output, tensor in plan.outputs:
            if output in wanted:
                self._absent(run, tensor)
                self.arrived(run, tensor, ready)
        self.step_done(run, index, ready)

    def _absent(self, run: Run, tensor: str) -> None:
        default = self.defaults.get(tensor)
        if default is not None:
            run.tensors[tensor] = default
        else:
            assert run.flow is not None
            run.flow.skipped.add(tensor)

    # -- arrivals --------------------------------------------------------------------------

    def arrived(self, run: Run, tensor: str, ready: list[int]) -> None:
        """``tensor`` is final in ``run`` (present, left out or skipped): count it down for
        the steps that wait for it, and decide the joins it is an alternative of."""
        _count_down(run.missing, self.graph.consumers.get(tensor, ()), ready)
        for joined in self.graph.joins.get(tensor, ()):
            self._join(run, joined, tensor, ready)

    def _join(self, run: Run, joined: str, tensor: str, ready: list[int]) -> None:
        state = run.flow
        assert state is not None
        if joined in state.joined:
            return  # an earlier alternative won
        value = run.tensors.get(tensor)
        if value is None:
            absent = state.absent.get(joined, 0) + 1
            state.absent[joined] = absent
            if absent < len(self.graph.control.alternatives[joined]):
                return
            self._absent(run, joined)
        else:
            run.tensors[joined] = value
        state.joined.add(joined)
        self.arrived(run, joined, ready)

    # -- loops -----------------------------------------------------------------------------

    def step_done(self, run: Run, index: int, ready: list[int]) -> None:
        """Step ``index`` ran or was skipped: the end of its loop's iteration, when it was
        the last step of it."""
        loop = self.loop_of.get(index)
        if loop is None or run.dead:
            return
        state = run.flow
        assert state is not None
        left = state.left.get(loop.name, len(loop.steps)) - 1
        if left > 0:
            state.left[loop.name] = left
            return
        iteration = state.iterations[loop.name] = state.iterations.get(loop.name, 0) + 1
        tensors = run.tensors
        if (
            iteration < loop.max_iterations
            and holds(tensors.get(loop.condition))
            and all(source in tensors for source, _ in loop.carry)
        ):
            self._again(run, loop, ready)
            return
        state.left.pop(loop.name, None)
        for i in sorted(loop.steps):  # the loop is over: its tensors reach the steps after it
            for _, tensor in self.graph.steps[i].outputs:
                _count_down(run.missing, self.graph.deferred.get(tensor, ()), ready)

    def _again(self, run: Run, loop: EnsembleLoop, ready: list[int]) -> None:
        """Start the next iteration of ``loop`` in ``run``."""
        state = run.flow
        assert state is not None
        tensors = run.tensors
        carried = {target: tensors[source] for source, target in loop.carry}
        for i in loop.steps:
            for _, tensor in self.graph.steps[i].outputs:
                tensors.pop(tensor, None)
                state.skipped.discard(tensor)
                if run.left_out is not None:
                    run.left_out.discard(tensor)
        tensors.update(carried)
        state.left[loop.name] = len(loop.steps)
        for i in sorted(loop.steps):
            run.missing[i] = self.again[i]
            if self.again[i] == 0:
                ready.append(i)


def _count_down(missing: dict[int, int], consumers: tuple[int, ...], ready: list[int]) -> None:
    """One more tensor arrived for each of ``consumers`` still waiting; those with none left
    are ready."""
    for consumer in consumers:
        if consumer in missing:
            missing[consumer] -= 1
            if missing[consumer] == 0:
                ready.append(consumer)


def with_step_parameters(request: InferRequest, control: StepControl) -> InferRequest:
    """``request`` with the step's declared parameters over the client's."""
    options = attrs.evolve(
        request.options, parameters={**request.options.parameters, **control.parameters}
    )
    return attrs.evolve(request, options=options)


async def map_step(
    router: Router, step: Step, control: StepControl, request: InferRequest
) -> InferResponse:
    """Run a mapped step's model once per item of its mapped inputs (their first dimension),
    at most ``control.max_items`` at a time, and gather the outputs in order.

    A model that batches gets each item with a batch dimension of 1 (so its dynamic batcher
    gathers items); one that does not gets the item itself. Outputs are joined along a new
    first dimension (a batching model's along its batch dimension). A mapped tensor that an
    earlier model left out: the model is asked once without it, as without a map (it refuses
    the request if it requires the input).

    Raises:
        InvalidRequestError: the mapped inputs differ in length, or one has no dimension.
        ItemFailed: an item's request failed (the other items are cancelled).
    """
    plan = step.plan
    mapped = [name for name, tensor in plan.inputs if tensor in control.mapped]
    inputs = request.inputs
    lengths = {}
    for name in mapped:
        value = inputs.get(name)
        if value is None:  # an earlier model left it out: asked once, as Triton would ask
            return await router.infer(request, from_ensemble=True)  # (it refuses, if required)
        if value.ndim == 0:
            raise InvalidRequestError(f"input '{name}' is mapped over but has no dimension")
        lengths[name] = value.shape[0]
    if len(set(lengths.values())) > 1:
        raise InvalidRequestError(
            "the mapped inputs differ in length: "
            + ", ".join(f"'{n}' has {k}" for n, k in sorted(lengths.items()))
        )
    count = next(iter(lengths.values()), 0)
    config = router.model_config(plan.model_name, plan.model_version)
    batching = config.max_batch_size > 0
    results: list[Mapping[str, Any] | None] = [None] * count
    failure: list[ItemFailed] = []
    limit = trio.Semaphore(control.max_items)

    async def item(index: int, cancel: trio.CancelScope) -> None:
        try:
            part = index if not batching else slice(index, index + 1)
            item_inputs = {
                name: value[part] if name in lengths else value for name, value in inputs.items()
            }
            answer = await router.infer(
                request.derive(
                    model_name=plan.model_name,
                    model_version=plan.model_version,
                    inputs=item_inputs,
                    requested_outputs=request.requested_outputs,
                ),
                from_ensemble=True,
            )
            results[index] = answer.outputs
        except Exception as exc:
            if not failure:
                failure.append(ItemFailed(f" item {index} of {count}", exc))
            cancel.cancel()
        finally:
            limit.release()

    async with trio.open_nursery() as nursery:
        for index in range(count):
            await limit.acquire()
            if failure:
                limit.release()
                break
            step.items += 1
            nursery.start_soon(item, index, nursery.cancel_scope)
    if failure:
        raise failure[0]
    return InferResponse(
        model_name=plan.model_name,
        model_version=plan.model_version,
        request_id=request.options.request_id,
        outputs=_gathered(config, request.requested_outputs, results, batching),
    )


def _gathered(
    config: ModelConfig,
    wanted: frozenset[str] | None,
    results: list[Mapping[str, Any] | None],
    batching: bool,
) -> dict[str, np.ndarray]:
    """The items' outputs joined in order; an output some item left out is left out."""
    names = [t.name for t in config.output if not wanted or t.name in wanted]
    if not results:  # no items: empty outputs of the declared types
        return {
            t.name: np.empty((0, *(max(d, 0) for d in t.dims)), dtype=t.data_type.numpy_dtype)
            for t in config.output
            if t.name in names
        }
    gathered = {}
    for name in names:
        values = [r.get(name) if r is not None else None for r in results]
        if any(v is None for v in values):
            continue
        arrays = [np.asarray(v) for v in values]
        shapes = {a.shape[1:] if batching else a.shape for a in arrays}
        if len(shapes) > 1:
            raise InferenceError(
                f"model '{config.name}': the items' output '{name}' differ in shape "
                f"({', '.join(str(list(s)) for s in sorted(shapes))}), so they cannot be "
                "joined; a mapped step's outputs must have one shape for every item",
                model_name=config.name,
            )
        gathered[name] = np.concatenate(arrays) if batching else np.stack(arrays)
    return gathered
