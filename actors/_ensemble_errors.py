"""How an ensemble reports the failure of one of its steps.

How this works: `step_failed` prefixes a composing model's error with the ensemble and the
step (``in ensemble 'e', step[1]: ...``), keeps the original as its cause, and keeps its
kind where the client should see it: a step request that its model refused as invalid is a
`StepRefusedError` (Triton passes on that request's INVALID_ARG), and a model's own error
keeps its code (`ModelReportedError`). `left_out_note` adds which
of the step's input tensors an earlier step's model left out of its answer, the usual reason
for such a refusal (Triton's message says only that the input is missing).
"""

from __future__ import annotations

from collections.abc import Collection

from ..protocols import (
    EnsembleGraph,
    InferenceError,
    InferenceTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelReportedError,
    StepPlan,
    StepRefusedError,
)


class ItemFailed(Exception):
    """The request of one item of a mapped step failed: which item, and its error."""

    def __init__(self, where: str, error: Exception) -> None:
        super().__init__(f"{where}: {error}")
        self.where = where
        self.error = error


def step_failed(
    ensemble: str, plan: StepPlan, error: Exception, note: str = "", *, item: str = ""
) -> InferenceError | InferenceTimeoutError:
    """``error`` of a step's model as the ensemble reports it: prefixed with the step (and
    ``item``, a mapped step's item), and followed by ``note`` (see `left_out_note`). A step
    request its model refused as invalid (or a nested ensemble's refused step) is a
    `StepRefusedError`; a step that ran out of its own time an `InferenceTimeoutError`."""
    where = f"in ensemble '{ensemble}', step[{plan.index}]{item}: "
    wrapped: InferenceError | InferenceTimeoutError
    if isinstance(error, InferenceTimeoutError):
        wrapped = InferenceTimeoutError(f"{where}{error}")
    elif isinstance(error, ModelReportedError):  # the model's own words, and its code
        # The step's model named, unless a nested ensemble's step reported it (named there).
        own = error.model_name == plan.model_name
        text = f"model '{error.model_name}': {error}" if own else str(error)
        wrapped = ModelReportedError(f"{where}{text}", model_name=plan.model_name, code=error.code)
    else:
        refused = isinstance(error, StepRefusedError) or (
            isinstance(error, InvalidRequestError) and not isinstance(error, ModelNotFoundError)
        )
        wrapped = (StepRefusedError if refused else InferenceError)(
            f"{where}{error}{note}", model_name=plan.model_name
        )
    wrapped.__cause__ = error
    return wrapped


def left_out_note(graph: EnsembleGraph, plan: StepPlan, left_out: Collection[str] | None) -> str:
    """For the error of step ``plan``: which of its input tensors an earlier step's model left
    out of its answer, and which (``""`` when none). Triton's error says only that the input
    is missing."""
    if not left_out:
        return ""
    notes = []
    for _, tensor in plan.inputs:
        if tensor in left_out:
            producer = graph.steps[graph.producer[tensor]]
            output = next(o for o, t in producer.outputs if t == tensor)
            notes.append(
                f"tensor '{tensor}': step[{producer.index}]'s model '{producer.model_name}' "
                f"left its output '{output}' out"
            )
    return f" ({'; '.join(notes)})" if notes else ""
