"""`orchestrion.tuning` on a pipeline whose best configuration is known: a python-backend model
that sleeps 20 ms per request (a sleep releases the GIL, so its instances run side by side on
any machine) behind an ensemble. With N instances it answers about N times 50 requests a
second; ``max_inflight_requests: 1`` on the ensemble holds it to one request at a time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrion import open_server
from orchestrion.tuning import (
    Constraints,
    LoadSettings,
    Status,
    TuneSettings,
    tune_async,
)
from support.sleepy import fingerprint, sleepy_repository

FAST = LoadSettings(concurrency=(4,), window_s=0.25, max_windows=6)


async def test_a_brute_force_search_finds_the_known_best_and_writes_it(tmp_path: Path) -> None:
    repository = sleepy_repository(tmp_path)
    before = fingerprint(repository)
    output = tmp_path / "report"
    settings = TuneSettings(
        budget_s=120,
        brute=True,
        load=FAST,
        knobs=("sleepy.instance_count=4", "pipe.max_inflight_requests=1"),
    )
    result = await tune_async(repository, "pipe", output, settings)

    assert result.winner == {"sleepy.instance_count": 4}
    assert not result.budget_ran_out
    assert not result.interrupted
    search = [r for r in result.results if r.role == "search"]
    assert sorted(r.label for r in search) == [
        "as configured",
        "pipe.max_inflight_requests=1",
        "pipe.max_inflight_requests=1, sleepy.instance_count=4",
        "sleepy.instance_count=4",
    ]
    assert all(r.status is Status.MEASURED for r in result.results)
    # Side by side in one run: the finalists measured again in turn, round after round.
    constraints = Constraints()
    rounds = {}
    for r in result.results:
        if r.role == "final":
            point = r.best(constraints)
            assert point is not None, r
            rounds.setdefault(r.label, []).append(point.throughput)
    assert set(rounds) == {
        "as configured",
        "sleepy.instance_count=4",
        "pipe.max_inflight_requests=1, sleepy.instance_count=4",
    } or set(rounds) == {"as configured", "sleepy.instance_count=4", "pipe.max_inflight_requests=1"}
    assert len({len(v) for v in rounds.values()}) == 1  # complete rounds only
    winner, configured = rounds["sleepy.instance_count=4"], rounds["as configured"]
    assert sum(winner) > 2 * sum(configured), (winner, configured)
    # One request at a time through the ensemble: about one instance's rate, 50/s.
    held = next(r for r in search if r.label == "pipe.max_inflight_requests=1").best(constraints)
    assert held is not None
    assert held.throughput < 80, held

    # The user's repository is untouched; the written one differs in sleepy's config only.
    assert fingerprint(repository) == before
    written = fingerprint(result.repository)
    assert written.keys() == before.keys()
    assert {k for k in written if written[k] != before[k]} == {"sleepy/config.pbtxt"}
    text = (result.repository / "sleepy" / "config.pbtxt").read_text()
    assert text.startswith("# orchestrion tune, ")
    assert "# changed: instance_count = 4" in text
    assert "# measured, this configuration: " in text
    assert "# measured, as configured: " in text
    assert "# A model that sleeps 20 ms per request." in text  # the user's comment kept
    assert "count: 4" in text
    assert 'string_value: "thread"' in text

    # The report: its tables, plots, and every measurement as JSON.
    report = (output / "report.md").read_text()
    assert "**sleepy.instance_count=4**" in report
    assert "| **sleepy.instance_count=4** (winner) | " in report
    assert "| as configured | " in report
    for plot in ("throughput_vs_p99.png", "throughput_vs_concurrency.png"):
        assert (output / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({plot})" in report
    document = json.loads((output / "results.json").read_text())
    assert 1 <= document["final_rounds"] <= 3
    assert len(document["candidates"]) == 4 + 3 * document["final_rounds"]
    assert document["winner"] == {"sleepy.instance_count": 4}
    assert all(c["points"][0]["concurrency"] == 4 for c in document["candidates"])

    # The written repository serves as it is.
    async with open_server(result.repository) as server:
        response = await server.infer("pipe", {"IN": np.arange(4, dtype=np.float32)})
        np.testing.assert_array_equal(response.outputs["OUT"], np.arange(4) + 1)
        assert sum(g.count for g in server.model_config("sleepy").instance_group) == 4


async def test_constraints_exclude_candidates_over_memory_and_points_over_p99(
    tmp_path: Path,
) -> None:
    """Each instance holds 60 MiB. Four instances are fastest but over a 180 MiB limit; two
    are within it, but at concurrency 16 their p99 (about 160 ms: eight requests ahead of
    each) breaks a 100 ms limit, so their best point is concurrency 1 (about 20 ms), no
    better than one instance's."""
    repository = sleepy_repository(tmp_path, hold_mib="60")
    settings = TuneSettings(
        budget_s=120,
        load=LoadSettings(concurrency=(1, 16), window_s=0.25, max_windows=6),
        constraints=Constraints(max_p99_ms=100, max_memory=180 * 2**20),
        knobs=("sleepy.instance_count=2,4",),
    )
    result = await tune_async(repository, "pipe", tmp_path / "report", settings)

    by_label = {r.label: r for r in result.results if r.role == "search"}
    four, two = by_label["sleepy.instance_count=4"], by_label["sleepy.instance_count=2"]
    assert four.memory is not None
    assert four.memory > 200 * 2**20, four.memory
    assert two.memory is not None
    assert 100 * 2**20 < two.memory < 180 * 2**20, two.memory
    assert four.best(settings.constraints) is None  # over the memory limit
    unconstrained = four.best(Constraints())
    assert unconstrained is not None
    assert unconstrained.concurrency == 16
    best_two = two.best(settings.constraints)
    assert best_two is not None
    assert best_two.concurrency == 1  # concurrency 16 breaks the p99 limit
    assert next(p for p in two.points if p.concurrency == 16).p99_ms > 100
    # Two instances at concurrency 1 are one instance's speed: kept only on noise over 5%.
    assert result.winner in ({}, {"sleepy.instance_count": 2})
    report = (tmp_path / "report" / "report.md").read_text()
    assert "max_p99_ms: 100" in report
    assert f"max_memory: {180 * 2**20}" in report


async def test_a_candidate_that_fails_to_load_is_reported_and_the_search_goes_on(
    tmp_path: Path,
) -> None:
    # sleepy's config is a link to a file outside the repository: never written through.
    repository = sleepy_repository(tmp_path, linked_config=True, fail_above="2")
    shared = (tmp_path / "shared" / "sleepy.pbtxt").read_text()
    settings = TuneSettings(budget_s=120, load=FAST, knobs=("sleepy.instance_count=4,2",))
    result = await tune_async(repository, "pipe", tmp_path / "report", settings)
    assert (tmp_path / "shared" / "sleepy.pbtxt").read_text() == shared
    written = result.repository / "sleepy" / "config.pbtxt"
    assert not written.is_symlink()
    assert "count: 2" in written.read_text()

    failed = next(r for r in result.results if r.label == "sleepy.instance_count=4")
    assert failed.status is Status.FAILED
    assert "refusing 4 instances (this test allows 2)" in failed.error
    assert failed.points == []
    later = [r for r in result.results if r.index > failed.index]
    assert any(r.label == "sleepy.instance_count=2" and r.status is Status.MEASURED for r in later)
    assert result.winner == {"sleepy.instance_count": 2}
    report = (tmp_path / "report" / "report.md").read_text()
    assert "failed: " in report
    assert "refusing 4 instances" in report


async def test_a_budget_that_runs_out_writes_the_best_so_far(tmp_path: Path) -> None:
    """25 combinations planned, each about 1.1 s, and 30 s: the search stops early enough
    for two final rounds, and what it found is written."""
    repository = sleepy_repository(tmp_path)
    settings = TuneSettings(
        budget_s=30,
        brute=True,
        load=FAST,
        knobs=("sleepy.instance_count=2,3,4,5", "pipe.max_inflight_requests=1,2,4,8"),
    )
    began = time.monotonic()
    result = await tune_async(repository, "pipe", tmp_path / "report", settings)
    elapsed = time.monotonic() - began

    assert result.budget_ran_out
    search = [r for r in result.results if r.role == "search"]
    assert 2 <= len(search) < 25
    assert search[0].status is Status.MEASURED  # the configuration as it is
    assert elapsed < 30 + 15  # the first final round may run past by its own length
    document = json.loads((tmp_path / "report" / "results.json").read_text())
    assert document["budget_ran_out"] is True
    assert document["final_rounds"] >= 1
    # The search stops before a candidate it could not finish (test_search_rules.py has
    # the arithmetic); one that runs far longer than the others is cut.
    assert {c["status"] for c in document["candidates"]} <= {"measured", "cut by the budget"}
    assert "the budget ran out" in (tmp_path / "report" / "report.md").read_text()
    measured = [dict(r.candidate) for r in search if r.status is Status.MEASURED]
    assert result.winner in measured
    assert (result.repository / "pipe" / "config.pbtxt").is_file()


async def test_the_output_folder_is_never_the_repository_or_a_full_folder(tmp_path: Path) -> None:
    from orchestrion import ConfigError

    repository = sleepy_repository(tmp_path)
    with pytest.raises(ConfigError, match="inside the model repository"):
        await tune_async(repository, "pipe", repository / "report")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not an empty folder"):
        await tune_async(repository, "pipe", tmp_path / "full")
    with pytest.raises(ConfigError, match="no model folder 'nope'"):
        await tune_async(repository, "nope", tmp_path / "out")
    assert not (repository / "report").exists()


async def test_a_pipeline_whose_every_request_fails_is_reported(tmp_path: Path) -> None:
    repository = sleepy_repository(tmp_path, broken="yes")
    settings = TuneSettings(budget_s=60, load=FAST, knobs=("sleepy.instance_count=2",))
    result = await tune_async(repository, "pipe", tmp_path / "report", settings)

    first = result.results[0]
    assert first.status is Status.FAILED
    assert "every request failed" in first.error
    assert "broken on purpose" in first.error
    assert len(result.results) == 1  # nothing to compare with
    assert result.winner == {}
    assert "did not run" in result.reason
    assert "broken on purpose" in (tmp_path / "report" / "report.md").read_text()
