"""Triton's request rescheduling for python-backend models: a request whose ``execute``
calls ``request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)`` runs
again, in a later ``execute`` (Triton's iterative sequences, ``sequence_batching {
iterative_sequence: true }``).

How this works: `run_iterations` calls ``execute`` with a call's requests, then again with
those it rescheduled (the same request objects: the same response sender, the model's own
attributes on them), until none is; the others are answered as usual. A rescheduled request
of a model that is not decoupled must have None in the returned list (its one response
comes in a later iteration), as Triton checks. The iterations of one call run one after
another on its instance; a request cancelled meanwhile (its client gone, its deadline past)
runs no further. A decoupled request's iterations are run by its stream
(`PushedStream`), which lets the instance's other streams take their turn in between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..protocols import InferRequest
from ._base import LoadedInstance
from ._triton_answers import Answer
from ._triton_api import TritonModelException
from ._triton_calls import cancelled_here
from ._triton_requests import InferenceRequest

if TYPE_CHECKING:
    from ._triton_host import TritonHost

Outcome = Mapping[str, Any] | Exception


def not_reschedulable(model_name: str, *, async_execute: bool = False) -> TritonModelException:
    """The error of a request rescheduled by a model whose config does not allow it (or,
    ``async_execute``, an ``async def execute`` of a model that is not decoupled)."""
    needs = (
        "a synchronous execute (def execute) where the model is not decoupled"
        if async_execute
        else "'sequence_batching { iterative_sequence: true }' in the model's config"
    )
    return TritonModelException(
        f"model '{model_name}' rescheduled a request "
        f"(set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)): request rescheduling "
        f"needs {needs}"
    )


def run_iterations(
    backend: TritonHost,
    instance: LoadedInstance,
    requests: list[InferRequest],
    answers: Sequence[Answer],
    received: Sequence[InferenceRequest],
) -> list[Outcome]:
    """``execute`` of ``received`` (made for ``requests``), then of those it rescheduled,
    until none is: each request's outputs, or the error answering it."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    while pending:
        batch = [received[i] for i in pending]
        for request in batch:
            request.release()
        try:
            result = backend.call(instance, batch, requests[pending[0]])
        except Exception as exc:
            failure = backend.failed(instance, exc)
            for i in pending:  # a response already sent stays the answer (Triton's)
                outcomes[i] = failure if answers[i].response is None else answers[i].outcome()
            break
        again = [i for i in pending if received[i].rescheduled]
        if again and not backend.config.iterative:
            for i in again:
                outcomes[i] = not_reschedulable(backend.model.name)
            pending = [i for i in pending if i not in again]
            again = []
        _settle(backend, result, pending, again, answers, outcomes)
        pending = again
        if pending and cancelled_here():
            for i in pending:
                outcomes[i] = TritonModelException("the request was cancelled while rescheduled")
            break
    return [
        outcome
        if outcome is not None
        else TritonModelException("execute gave no answer for a request")
        for outcome in outcomes
    ]


def _settle(
    backend: TritonHost,
    result: Any,
    ran: list[int],
    again: list[int],
    answers: Sequence[Answer],
    outcomes: list[Outcome | None],
) -> None:
    """The outcomes of the requests of ``ran`` that were not rescheduled (``again``; one
    rescheduled with a response in the list fails, and leaves ``again``)."""
    done = [i for i in ran if i not in again]
    if result is None:  # each request answered through its sender
        for i in done:
            outcomes[i] = answers[i].wait()
        return
    if isinstance(result, list | tuple) and len(result) == len(ran):
        for position, i in enumerate(ran):
            item = result[position]
            if i in again and item is not None:  # Triton's words (and spelling)
                outcomes[i] = TritonModelException(
                    "Expected a None object in the execute function return list for "
                    f"reschduled request, found type '{type(item)}'."
                )
                again.remove(i)
        done_items = [result[p] for p, i in enumerate(ran) if i not in again]
        settled = backend.returned(done_items, [answers[i] for i in done])
    else:  # a malformed result: every request of the call fails, the rescheduled too
        failed = backend.returned(result, [answers[i] for i in ran])
        for i, outcome in zip(ran, failed, strict=True):
            outcomes[i] = outcome.wait() if isinstance(outcome, Answer) else outcome
        again.clear()
        return
    for i, outcome in zip(done, settled, strict=True):
        outcomes[i] = outcome.wait() if isinstance(outcome, Answer) else outcome
