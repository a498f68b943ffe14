"""The reliability suite's report: each test records (`reliability_report.record`) what it
tried, how much of it and what happened; pytest adds whether the test passed. The rows are
printed at the end of the run and, with ``ORCHESTRION_RELIABILITY_REPORT=docs/reliability.md``,
written as that document."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from support.reliability_report import AREAS, SIZE, TRIALS

_UNRECORDED: dict[str, str] = {}
"""Tests of the suite that failed before recording a row: their node id and error line."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Mark each test's rows with its outcome (a failure in any phase is a failure); a test
    that failed before recording anything is listed on its own, never left out."""
    recorded = any(t.test == report.nodeid for t in TRIALS)
    if report.failed and "reliability/" in report.nodeid and not recorded:
        lines = str(report.longrepr).strip().splitlines()
        _UNRECORDED[report.nodeid] = lines[-1] if lines else "failed"
    for trial in TRIALS:
        if trial.test != report.nodeid:
            continue
        if report.failed:
            trial.outcome = "FAILED"
        elif report.when == "call" and trial.outcome != "FAILED":
            trial.outcome = "passed"


def _rows() -> Iterator[str]:
    for area in AREAS:
        trials = [t for t in TRIALS if t.area == area]
        if not trials:
            continue
        yield f"\n## {area}\n"
        yield "| tried | amount | what happened | test |"
        yield "|---|---|---|---|"
        for t in trials:
            name = t.test.split("::")[-1]
            happened = t.happened if t.outcome == "passed" else f"**{t.outcome}**: {t.happened}"
            yield f"| {t.tried} | {t.amount} | {happened} | `{name}` |"


def _document() -> str:
    versions = ", ".join(
        f"{name} {metadata.version(name)}"
        for name in ("trio", "jax", "redis", "grpcio", "h11", "hypothesis")
    )
    passed = sum(t.outcome == "passed" for t in TRIALS)
    head = [
        "# Reliability report",
        "",
        "Written by the reliability suite itself (`tests/reliability/`), with this command:",
        "",
        "```",
        f"ORCHESTRION_LOAD_REQUESTS={SIZE} ORCHESTRION_RELIABILITY_REPORT=docs/reliability.md \\",
        "    .venv/bin/python -m pytest tests/reliability",
        "```",
        "",
        f"- run on {datetime.date.today().isoformat()}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; {versions};",
        f"- {passed} of {len(TRIALS)} trials passed; {len(_UNRECORDED)} tests failed before "
        "recording a trial (listed at the end). Each row is one test's record: what it "
        "threw at orchestrion, how much of it, and what the test checked happened. CI runs the "
        "same tests at a smaller size (3,000 requests per load test, fewer Hypothesis "
        "examples).",
    ]
    limits = [
        "",
        "## What these tests cannot show",
        "",
        "- A synchronous model that hangs while running inline holds the event loop: no "
        "timeout can fire until it returns. The watchdog names it in the log (see the row "
        "above); models that can take long belong in a worker thread (`execution: thread`), "
        "where a hang holds one instance and the request's timeout answers the caller.",
        "- A writer with access to Redis can store a well-formed entry of the right names, "
        "types and shapes with wrong values under a request's key; the checks catch foreign, "
        "corrupted and misshapen entries, not forged values. Protect Redis with a password "
        "or ACL and TLS.",
        "- Revisions fingerprint files, not behaviour: a repository model whose answers "
        "depend on something outside its config and version folder (a file elsewhere, a "
        "service it calls, the time) can still be answered from an entry made before that "
        "changed; such a model should not enable the cache. A model made in Python is safe "
        "only while its `revision` is changed with its code and data (its default is random, "
        "never shared).",
        "- Large HTTP bodies are decoded and encoded in worker threads, in slices that each "
        "hold the GIL briefly (the test above checks that no call holds the event loop 100 ms, "
        "with the watchdog at that threshold, after a warm-up request: on this VM the first "
        "touch of memory the host has not backed yet costs several times a machine's, and "
        "the first large request after start can hold the loop longer). A BYTES element still "
        "costs a Python object, and grpcio's and protobuf's copies of a large gRPC message "
        'still hold it (about 1.8 s per 256 MiB; `docs/performance.md`, "Large requests"). '
        "The default limits (64 MiB HTTP, 256 MiB gRPC) bound what one request can do.",
        "- The stream backpressure test stops a client's reads with a proxy: gRPC's own "
        "client library keeps reading into its memory however slowly its caller consumes, so "
        "there the buffering moves into the client, not the server.",
        "- The connection-limit and slowloris tests run one attacker at a time against one "
        "server on loopback, with small limits and timeouts. Connections that send nothing "
        "make room for newcomers, but a distributed attack that sends heads a byte at a time "
        "holds up to --http-max-connections connections for --http-header-timeout (60 s), "
        "and bodies at just over --http-body-min-rate are read to their end.",
        "- Sizes: the load tests run for seconds, not days; `bench/soak.py` runs longer "
        "rounds (see docs/performance.md).",
    ]
    unrecorded = []
    if _UNRECORDED:
        unrecorded = ["", "## Failed before recording a trial", ""]
        unrecorded += [f"- `{test}`: {error}" for test, error in _UNRECORDED.items()]
    return "\n".join([*head, *_rows(), *unrecorded, *limits, ""])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the document where ``ORCHESTRION_RELIABILITY_REPORT`` says."""
    target = os.environ.get("ORCHESTRION_RELIABILITY_REPORT")
    if target and TRIALS:
        Path(target).write_text(_document())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the rows, one line each."""
    if not TRIALS and not _UNRECORDED:
        return
    terminalreporter.section("reliability report")
    for t in TRIALS:
        terminalreporter.write_line(
            f"{t.outcome:>8}  {t.area}: {t.tried} ({t.amount}): {t.happened}"
        )
    for test, error in _UNRECORDED.items():
        terminalreporter.write_line(f"  FAILED  before recording a trial: {test}: {error}")
    if sys.stdout.isatty() and not os.environ.get("ORCHESTRION_RELIABILITY_REPORT"):
        terminalreporter.write_line("(ORCHESTRION_RELIABILITY_REPORT=PATH writes the document)")
