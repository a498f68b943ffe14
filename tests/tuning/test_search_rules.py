"""The search's rules on a synthetic pipeline: each candidate's throughput is a known
function of its knobs and its measurement takes a known time, on trio's virtual clock (so the
budget arithmetic is exact and the tests take no time). What the in-process and remote
measurements feed the search is tested in test_tune_search.py and test_tune_command.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from orchestrion.tuning import Constraints, Knob, Objective, Point, Status
from orchestrion.tuning._search import CandidateResult, SearchOutcome, search

COUNT = Knob("m", "instance_count", (1, 2, 4))
FUSION = Knob("e", "fusion", ("on", "off"))


def point(throughput: float, p99: float = 10.0) -> Point:
    return Point(
        concurrency=4,
        throughput=throughput,
        p50_ms=p99 / 2,
        p99_ms=p99,
        mean_ms=p99 / 2,
        requests=100,
        errors=0,
        stable=True,
        windows=3,
    )


def synthetic(
    rate: Callable[[dict[str, object], int], float],
    seconds: Callable[[dict[str, object]], float] = lambda c: 1.0,
) -> Callable[[CandidateResult], Awaitable[None]]:
    """A measure function: ``rate(candidate, times measured before)``, after ``seconds``."""
    seen: list[dict[str, object]] = []

    async def measure(result: CandidateResult) -> None:
        candidate = dict(result.candidate)
        before = sum(c == candidate for c in seen)
        seen.append(candidate)
        await trio.sleep(seconds(candidate))
        result.points = [point(rate(candidate, before))]

    return measure


def landscape(candidate: dict[str, object], _: int) -> float:
    """100 per instance; fusion off costs 20%."""
    rate = 100.0 * int(candidate.get("m.instance_count", 1))  # type: ignore[call-overload]
    return rate * (0.8 if candidate.get("e.fusion") == "off" else 1.0)


async def test_a_quick_search_walks_one_knob_at_a_time_to_the_best(
    autojump_clock: trio.testing.MockClock,
) -> None:
    measure = synthetic(landscape)
    outcome = await search([COUNT, FUSION], measure, Constraints(), budget_s=1000)
    searched = [dict(r.candidate) for r in outcome.results if r.role == "search"]
    # Count 2 beats 1, count 4 beats 2 (from the best so far), fusion off loses; the second
    # pass finds nothing new to try from count 4, and ends.
    assert searched == [
        {},
        {"m.instance_count": 2},
        {"m.instance_count": 4},
        {"m.instance_count": 4, "e.fusion": "off"},
    ]
    assert outcome.winner == {"m.instance_count": 4}
    assert outcome.final_rounds == 3
    assert not outcome.budget_ran_out
    finals = [r for r in outcome.results if r.role == "final"]
    # The configuration as it is and the two best, round after round, every other round
    # in reverse order.
    orders = [[r.label for r in finals if r.final_round == n] for n in (1, 2, 3)]
    assert orders[0] == ["as configured", "m.instance_count=4", "e.fusion=off, m.instance_count=4"]
    assert orders[1] == list(reversed(orders[0]))
    assert orders[2] == orders[0]
    assert "more than 5% better" in outcome.reason


async def test_a_change_within_five_percent_is_not_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def flat(candidate: dict[str, object], _: int) -> float:
        return 104.0 if candidate.get("m.instance_count") == 2 else 100.0

    measure = synthetic(flat)
    outcome = await search([COUNT], measure, Constraints(), budget_s=1000)
    assert outcome.leader == {}
    assert outcome.winner == {}
    assert "no finalist measured more than 5% better" in outcome.reason


async def test_the_final_rounds_overrule_a_lucky_search_measurement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def lucky(candidate: dict[str, object], before: int) -> float:
        if candidate == {"m.instance_count": 2}:
            return 150.0 if before == 0 else 100.0  # only its first measurement was fast
        return 100.0

    measure = synthetic(lucky)
    outcome = await search([COUNT], measure, Constraints(), budget_s=1000)
    assert outcome.leader == {"m.instance_count": 2}  # the search believed it
    assert outcome.winner == {}
    assert outcome.final_rounds == 3


async def test_the_search_stops_in_time_for_two_final_rounds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    knobs = [Knob("m", "instance_count", tuple(range(1, 30)))]
    measure = synthetic(landscape, lambda c: 2.0)
    started = trio.current_time()
    outcome = await search(knobs, measure, Constraints(), budget_s=60, brute=True)
    elapsed = trio.current_time() - started

    assert outcome.budget_ran_out
    assert all(r.status is Status.MEASURED for r in outcome.results)  # nothing cut short
    assert outcome.final_rounds == 2
    # Each candidate takes 2 s; a candidate starts only if it ends before the budget less
    # two final rounds of three (each 2 s, and a fifth more) and 1 s: by 42 s. So 21 start
    # after the configuration as it is, and the final rounds run from 44 s to 56 s.
    assert len([r for r in outcome.results if r.role == "search"]) == 22
    assert elapsed == 56


async def test_a_candidate_far_longer_than_the_others_is_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def slow(candidate: dict[str, object]) -> float:
        return 500.0 if candidate.get("m.instance_count") == 4 else 2.0

    measure = synthetic(landscape, slow)
    outcome = await search([COUNT], measure, Constraints(), budget_s=60)
    cut = [r for r in outcome.results if r.status is Status.CUT]
    assert [r.label for r in cut] == ["m.instance_count=4"]
    assert outcome.budget_ran_out
    assert outcome.winner == {"m.instance_count": 2}  # the final rounds still ran
    assert outcome.final_rounds >= 1


async def test_constraints_decide_which_points_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def costly(candidate: dict[str, object], _: int) -> float:
        return landscape(candidate, 0)

    measure = synthetic(costly)

    async def with_memory(result: CandidateResult) -> None:
        await measure(result)
        result.memory = int(result.candidate.get("m.instance_count", 1)) * 100  # type: ignore[call-overload]

    outcome = await search([COUNT], with_memory, Constraints(max_memory=250), budget_s=1000)
    assert outcome.winner == {"m.instance_count": 2}  # 4 instances: 400 > 250
    four = next(r for r in outcome.results if r.label == "m.instance_count=4")
    assert four.best(Constraints(max_memory=250)) is None
    assert four.best(Constraints()) is not None


async def test_a_configuration_that_cannot_run_ends_the_search(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def broken(result: CandidateResult) -> None:
        result.status, result.error = Status.FAILED, "refused"

    outcome = SearchOutcome()
    await search([COUNT], broken, Constraints(), budget_s=1000, outcome=outcome)
    assert [r.status for r in outcome.results] == [Status.FAILED]
    assert outcome.reason == "the configuration as it is did not run: refused"


async def test_a_candidate_a_little_longer_than_the_first_is_not_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    knobs = [Knob("m", "instance_count", tuple(range(1, 30)))]
    measure = synthetic(landscape, lambda c: 2.0 if not c else 2.6)
    outcome = await search(knobs, measure, Constraints(), budget_s=60, brute=True)
    assert outcome.budget_ran_out
    assert all(r.status is Status.MEASURED for r in outcome.results)
    assert outcome.final_rounds == 2


async def test_the_latency_objective_compares_mean_p99(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One round fast, one slow: a finalist whose p99 is 5, 30, 5 ms (mean 13.3) does not
    beat 10, 10, 10 ms, though its mean of 1000/p99 is higher."""
    p99s = {(): [10.0] * 4, (("m.instance_count", 2),): [4.0, 5.0, 30.0, 5.0]}
    seen: dict[tuple[tuple[str, object], ...], int] = {}

    async def measure(result: CandidateResult) -> None:
        key = tuple(sorted(result.candidate.items()))
        count = seen[key] = seen.get(key, -1) + 1
        await trio.sleep(1)
        result.points = [point(100.0, p99s.get(key, [50.0] * 4)[count])]

    latency = Constraints(objective=Objective.LATENCY)
    outcome = await search([COUNT], measure, latency, budget_s=1000)
    assert outcome.leader == {"m.instance_count": 2}  # 4 ms in the search
    assert outcome.final_rounds == 3
    assert outcome.winner == {}


async def test_a_final_round_the_budget_cuts_is_not_compared(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def measure(result: CandidateResult) -> None:
        # The finalists' first final-round measurement hangs far past the budget.
        await trio.sleep(1000.0 if result.role == "final" and result.candidate else 2.0)
        result.points = [point(landscape(dict(result.candidate), 0))]

    outcome = await search([COUNT], measure, Constraints(), budget_s=60)
    assert outcome.final_rounds == 0
    assert outcome.budget_ran_out
    assert outcome.winner == {}
    assert outcome.reason == "final round 1 was cut by the budget: the configuration stays as it is"
    assert [r.status for r in outcome.results if r.role == "final"][-1] is Status.CUT


async def test_stopped_in_the_final_rounds_the_complete_rounds_still_choose(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outcome = SearchOutcome()
    measure = synthetic(landscape)
    with trio.CancelScope() as scope:

        def started(result: CandidateResult) -> None:
            if result.final_round == 2:
                scope.cancel()  # as Ctrl-C does, in the second round

        await search(
            [COUNT], measure, Constraints(), budget_s=1000, outcome=outcome, started=started
        )
    assert scope.cancelled_caught
    assert outcome.final_rounds == 1
    assert outcome.winner == {"m.instance_count": 4}
    assert outcome.results[-1].status is Status.CANCELLED
