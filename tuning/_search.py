"""The search: which candidates `tune` measures, in what order, within its budget, and which
one wins.

How this works. The configuration as it is is measured first. A quick search then changes
one knob at a time from the best configuration so far (coordinate descent), in `KNOB_NAMES`
order, model by model, and keeps a change only when it beats the best by more than
``improvement`` (5%: the noise of a shared machine, so that a knob that does nothing is
left as configured); it passes over the knobs again while a pass improved anything, at most
`QUICK_PASSES` times. A brute-force search measures every combination of the knobs' values.
A candidate that fails to load or to answer is reported with its error and the search goes
on.

A candidate is judged by its best point that meets the constraints (no failed request, p99
at most ``max_p99_ms``) when its memory is within ``max_memory``: the highest throughput
(objective "throughput") or the lowest p99 (objective "latency").

The final rounds. A shared machine's noise between two measurements of one configuration is
often over 10%, so the search alone does not choose: the configuration as it is and the
search's best two (the finalists) are then measured again in turn, round after round (at most
`FINAL_ROUNDS`), side by side under the same load. A finalist wins only if its mean over
the complete rounds beats the configuration as it is by more than ``improvement``;
otherwise the configuration stays as it is.

The budget. Everything runs within ``budget_s``. The search starts a candidate only while one
more (as long as the longest so far) still leaves time for two final rounds (each three such
candidates, and a fifth more); a hard stop, set from the first candidate's time, cuts a
candidate that runs far longer (reported as cut). A third final round runs if the budget
still allows it, and the first may run a little past the budget rather than leave the
winner unchecked.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from ._knobs import Candidate, Knob, label
from ._measure import Point

QUICK_PASSES = 3
FINAL_ROUNDS = 3
RESERVED_ROUNDS = 2
"""Final rounds the search leaves time for (later ones run while the budget lasts)."""
FINALISTS = 2
"""Candidates besides the configuration as it is in the final rounds."""


class Objective(enum.Enum):
    """What `tune` maximises among the candidates that meet the constraints."""

    THROUGHPUT = "throughput"
    LATENCY = "latency"


class Status(enum.Enum):
    """How a candidate's measurement ended."""

    MEASURED = "measured"
    FAILED = "failed"
    """It failed to load, or every request failed (``error`` says why)."""
    CUT = "cut by the budget"
    CANCELLED = "cancelled"


@attrs.frozen(kw_only=True)
class Constraints:
    """What a candidate's point must meet, and what is maximised among those that do."""

    objective: Objective = Objective.THROUGHPUT
    max_p99_ms: float | None = None
    max_memory: int | None = None
    """Bytes of resident memory the candidate may add to the process."""
    improvement: float = 0.05
    """How much better a change must measure to be kept over the best so far."""


@attrs.define(kw_only=True)
class CandidateResult:
    """One candidate's measurement."""

    index: int
    candidate: Candidate
    status: Status = Status.MEASURED
    error: str = ""
    points: list[Point] = attrs.Factory(list)
    memory: int | None = None
    """Peak resident memory over the process's before loading, in bytes."""
    device_memory: int | None = None
    load_s: float = 0.0
    seconds: float = 0.0
    """Wall time of its load and measurement."""
    role: str = "search"
    """"search", or "final" (measured again in the final rounds)."""
    final_round: int = 0
    """Its final round (from 1; 0: the search)."""

    @property
    def label(self) -> str:
        """How the report names it."""
        return label(self.candidate)

    def best(self, constraints: Constraints) -> Point | None:
        """Its point that meets ``constraints`` and does best on their objective; None:
        none meets them (or its memory is over the limit, or it was not measured)."""
        if self.status is not Status.MEASURED:
            return None
        limit = constraints.max_memory
        if limit is not None and self.memory is not None and self.memory > limit:
            return None
        ok = [p for p in self.points if _meets(p, constraints)]
        if not ok:
            return None
        if constraints.objective is Objective.LATENCY:
            return min(ok, key=lambda p: p.p99_ms)
        return max(ok, key=lambda p: p.throughput)

    def value(self, constraints: Constraints) -> float:
        """Its objective as a number where more is better: its best point's throughput, or
        (objective latency) minus its p99; -inf when it meets nothing."""
        point = self.best(constraints)
        if point is None:
            return -math.inf
        if constraints.objective is Objective.LATENCY:
            return -point.p99_ms
        return point.throughput


def _meets(point: Point, constraints: Constraints) -> bool:
    if point.errors or point.requests == 0:
        return False
    return constraints.max_p99_ms is None or point.p99_ms <= constraints.max_p99_ms


Measure = Callable[[CandidateResult], Awaitable[None]]
"""Load and measure one candidate, filling in its result (status, points, memory)."""

Hook = Callable[[CandidateResult], None]
"""Told of a candidate as it starts, and as it ends."""


def _ignore(result: CandidateResult) -> None:
    pass


@attrs.define(kw_only=True)
class SearchOutcome:
    """What the search ran and what it chose."""

    results: list[CandidateResult] = attrs.Factory(list)
    winner: Candidate = attrs.Factory(dict)
    reason: str = ""
    """Why the winner is what it is (in words, for the report)."""
    budget_ran_out: bool = False
    interrupted: bool = False
    planned: int = 0
    """Candidates the search meant to measure (a quick search's first pass)."""
    final_rounds: int = 0
    """Complete final rounds (the ones compared)."""
    leader: Candidate = attrs.Factory(dict)
    """The search's best so far (a change kept only when it measured more than
    ``improvement`` better): what an interrupted run writes."""

    def result(self, candidate: Candidate, role: str = "search") -> CandidateResult | None:
        """The measurement of ``candidate`` in ``role``, if it ran."""
        for result in self.results:
            if result.role == role and dict(result.candidate) == dict(candidate):
                return result
        return None


def quick_plan(knobs: Sequence[Knob]) -> int:
    """The candidates a quick search's first pass measures."""
    return 1 + sum(len(knob.values) - 1 for knob in knobs)


def brute_plan(knobs: Sequence[Knob]) -> int:
    """The candidates a brute-force search measures."""
    return math.prod(len(knob.values) for knob in knobs)


async def search(
    knobs: Sequence[Knob],
    measure: Measure,
    constraints: Constraints,
    *,
    budget_s: float,
    brute: bool = False,
    outcome: SearchOutcome | None = None,
    started: Hook = _ignore,
    finished: Hook = _ignore,
) -> SearchOutcome:
    """Search ``knobs`` within ``budget_s`` seconds and check the winner (see the module's
    docstring). ``outcome`` is filled as the search goes, so that a caller cancelled
    meanwhile still has what ran (and, cancelled in the final rounds, the choice its
    complete rounds make); ``started`` and ``finished`` hear of each candidate."""
    outcome = outcome if outcome is not None else SearchOutcome()
    outcome.planned = brute_plan(knobs) if brute else quick_plan(knobs)
    runner = _Runner(measure, outcome, constraints, started, finished)
    runner.budget_end = trio.current_time() + budget_s
    baseline = await runner.run({}, until=runner.budget_end)
    if baseline.status is Status.CUT:
        outcome.budget_ran_out = True
        outcome.reason = "the budget ran out before the configuration as it is was measured"
        return outcome
    if baseline.status is not Status.MEASURED:
        outcome.reason = f"the configuration as it is did not run: {baseline.error}"
        return outcome
    if brute:
        await runner.brute(knobs)
    else:
        await runner.quick(knobs)
    await runner.final_rounds()
    return outcome


@attrs.define
class _Runner:
    measure: Measure
    outcome: SearchOutcome
    constraints: Constraints
    started: Hook
    finished: Hook
    budget_end: float = math.inf
    """When the whole budget ends (on trio's clock)."""
    best: CandidateResult | None = None
    cut_round: int = 0
    """The final round the budget cut, if one was."""

    async def run(
        self,
        candidate: Candidate,
        role: str = "search",
        final_round: int = 0,
        *,
        until: float = math.inf,
    ) -> CandidateResult:
        """Measure ``candidate``; one still running at ``until`` is cut (status CUT)."""
        result = CandidateResult(
            index=len(self.outcome.results),
            candidate=dict(candidate),
            role=role,
            final_round=final_round,
        )
        self.outcome.results.append(result)
        self.started(result)
        began = trio.current_time()
        try:
            with trio.move_on_at(until) as scope:
                await self.measure(result)
            if scope.cancelled_caught:
                result.status = Status.CUT
                self.outcome.budget_ran_out = True
        except BaseException as exc:
            if _cancelled(exc):
                result.status = Status.CANCELLED  # by the caller (Ctrl-C)
            else:  # a bug, not the candidate's: it is raised, and the row says so
                result.status, result.error = Status.FAILED, repr(exc)
            raise
        finally:
            result.seconds = trio.current_time() - began
            self.finished(result)
        if role == "search" and self._better(result):
            self.best = result
            self.outcome.leader = dict(result.candidate)
        return result

    def _better(self, result: CandidateResult) -> bool:
        if self.best is None:
            return True
        return _beats(
            result.value(self.constraints), self.best.value(self.constraints), self.constraints
        )

    def _seen(self, candidate: Candidate) -> bool:
        return self.outcome.result(candidate) is not None

    async def _try(self, candidate: Candidate) -> bool:
        """Measure ``candidate`` if there is time; whether the search may go on."""
        until = self._stop_for_one()
        if until is None:
            return False
        return (await self.run(candidate, until=until)).status is not Status.CUT

    async def quick(self, knobs: Sequence[Knob]) -> None:
        """Coordinate descent from the best so far (see the module's docstring)."""
        for _ in range(QUICK_PASSES):
            improved = False
            for knob in knobs:
                for value in knob.values:
                    assert self.best is not None
                    candidate = dict(self.best.candidate)
                    if value == knob.values[0]:
                        candidate.pop(knob.key, None)
                    else:
                        candidate[knob.key] = value
                    if self._seen(candidate):
                        continue
                    before = self.best
                    if not await self._try(candidate):
                        return
                    improved = improved or self.best is not before
            if not improved:
                return

    async def brute(self, knobs: Sequence[Knob]) -> None:
        """Every combination of the knobs' values, in order."""
        for values in itertools.product(*(knob.values for knob in knobs)):
            candidate = {
                knob.key: value
                for knob, value in zip(knobs, values, strict=True)
                if value != knob.values[0]
            }
            if not self._seen(candidate) and not await self._try(candidate):
                return

    def _longest(self) -> float:
        return max(
            (r.seconds for r in self.outcome.results if r.status is Status.MEASURED), default=0.0
        )

    def _stop_for_one(self) -> float | None:
        """When one more search candidate must be cut, or None (and ``budget_ran_out``):
        no time for one. It may start if one as long as the longest so far still leaves
        time for `RESERVED_ROUNDS` final rounds (each `FINALISTS` + 1 of the longest, and a
        fifth more); it is cut only where it would leave less than one."""
        one_round = 1.2 * (1 + FINALISTS) * self._longest()
        now = trio.current_time()
        if now + self._longest() <= self.budget_end - RESERVED_ROUNDS * one_round - 1.0:
            return self.budget_end - one_round - 1.0
        self.outcome.budget_ran_out = True
        return None

    def finalists(self) -> list[Candidate]:
        """The configuration as it is, and the search's best `FINALISTS` that meet the
        constraints."""
        ranked = sorted(
            (r for r in self.outcome.results if r.role == "search" and r.candidate),
            key=lambda r: r.value(self.constraints),
            reverse=True,
        )
        best = [dict(r.candidate) for r in ranked if r.value(self.constraints) > -math.inf]
        return [{}, *best[:FINALISTS]]

    async def final_rounds(self) -> None:
        """Measure the finalists in turn, round after round, and choose (see the module's
        docstring); cancelled (Ctrl-C), the complete rounds still choose."""
        outcome = self.outcome
        finalists = self.finalists()
        if len(finalists) == 1:
            measured = sum(r.status is Status.MEASURED for r in outcome.results)
            outcome.winner = {}
            outcome.reason = (
                "no other candidate met the constraints"
                if measured > 1
                else "the budget ran out before another candidate was measured"
            ) + ": the configuration stays as it is"
            return
        rounds: list[list[CandidateResult]] = []
        try:
            for number in range(1, FINAL_ROUNDS + 1):
                measured_round = await self._round(finalists, number)
                if measured_round is None:
                    break
                rounds.append(measured_round)
                outcome.final_rounds = len(rounds)
        finally:
            self._choose(finalists, rounds)

    async def _round(
        self, finalists: Sequence[Candidate], number: int
    ) -> list[CandidateResult] | None:
        """Final round ``number``, or None: no time for it, or it was cut."""
        estimate = 1.2 * sum(self._last_seconds(c) for c in finalists)
        # The first round may run past the budget (by its own length and 5 s) rather than
        # leave the winner unchecked; a later one must fit.
        until = self.budget_end + (estimate + 5.0 if number == 1 else 0.0)
        if number > 1 and trio.current_time() + estimate > until:
            return None
        # Every other round in reverse order: no finalist always runs first or last.
        order = list(range(len(finalists)))[:: 1 if number % 2 else -1]
        measured: dict[int, CandidateResult] = {}
        for i in order:
            measured[i] = await self.run(finalists[i], "final", number, until=until)
            if measured[i].status is Status.CUT:
                self.cut_round = number
                return None  # an incomplete round is not compared
        return [measured[i] for i in range(len(finalists))]

    def _last_seconds(self, candidate: Candidate) -> float:
        times = [r.seconds for r in self.outcome.results if dict(r.candidate) == candidate]
        return times[-1] if times else 0.0

    def _choose(
        self, finalists: Sequence[Candidate], rounds: Sequence[list[CandidateResult]]
    ) -> None:
        outcome = self.outcome
        outcome.final_rounds = len(rounds)
        outcome.winner = {}
        if not rounds:
            cut = (
                f"final round {self.cut_round} was cut by the budget"
                if self.cut_round
                else ("no final round ran")
            )
            outcome.reason = f"{cut}: the configuration stays as it is"
            return
        scores = [score([r[i] for r in rounds], self.constraints) for i in range(len(finalists))]
        best = max(range(1, len(finalists)), key=lambda i: scores[i])
        count = f"{len(rounds)} final round{'s' if len(rounds) > 1 else ''}"
        better = f"{self.constraints.improvement:.0%} better"
        if _beats(scores[best], scores[0], self.constraints):
            outcome.winner = dict(finalists[best])
            outcome.reason = (
                f"over {count}, it measured more than {better} than the configuration as it is"
            )
        else:
            outcome.reason = (
                f"over {count}, no finalist measured more than {better}: the configuration "
                "stays as it is"
            )


def score(results: Sequence[CandidateResult], constraints: Constraints) -> float:
    """The mean `CandidateResult.value` of ``results`` (one candidate over the final
    rounds); -inf when one of them meets nothing."""
    values = [r.value(constraints) for r in results]
    if not values or -math.inf in values:
        return -math.inf
    return sum(values) / len(values)


def _beats(challenger: float, configured: float, constraints: Constraints) -> bool:
    """Whether ``challenger``'s `score` is more than ``improvement`` better."""
    if challenger == -math.inf:
        return False
    if configured == -math.inf:
        return True
    margin = constraints.improvement * abs(configured)
    return challenger > configured + margin


def _cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_cancelled(inner) for inner in exc.exceptions)
    return isinstance(exc, trio.Cancelled)
