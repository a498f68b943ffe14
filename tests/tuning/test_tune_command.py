"""``orchestrion tune`` as a user runs it: the command line, Ctrl-C, a running server
(``--url``), and the flags' checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from orchestrion import ConfigError, testing
from orchestrion.frontends import main
from orchestrion.tuning import Knob
from orchestrion.tuning._knobs import config_texts, discover_knobs, parse_knob, read_pipeline
from orchestrion.tuning._measure import Point, request_pool
from orchestrion.tuning._report import pareto
from support.sleepy import sleepy_repository

FLAGS = ("--concurrency", "4", "--measurement-interval", "250", "--max-trials", "6")


def tune_command(repository: Path, output: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "orchestrion",
        "tune",
        "--model-repository",
        str(repository),
        "--model",
        "pipe",
        "--output",
        str(output),
        *FLAGS,
        *flags,
    ]


def test_ctrl_c_stops_the_search_and_writes_the_report_of_what_ran(tmp_path: Path) -> None:
    repository = sleepy_repository(tmp_path)
    output = tmp_path / "report"
    command = tune_command(
        repository, output, "--search", "brute", "--knob", "sleepy.instance_count=2,3,4,5,6"
    )
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        deadline = time.monotonic() + 90
        ran = 0
        while ran < 2:  # the configuration as it is and one more, then Ctrl-C
            assert time.monotonic() < deadline, "no candidate measured in 90 s"
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            time.sleep(0.1)
            try:
                document = json.loads((output / "results.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            ran = sum(c["status"] == "measured" for c in document["candidates"])
        process.send_signal(signal.SIGINT)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    printed = process.stdout.read().decode() if process.stdout else ""
    assert code == 130, printed
    document = json.loads((output / "results.json").read_text())
    assert document["interrupted"] is True
    statuses = [c["status"] for c in document["candidates"]]
    assert statuses[:2] == ["measured", "measured"], statuses
    assert len(statuses) < 6, statuses
    report = (output / "report.md").read_text()
    assert "**interrupted** (Ctrl-C)" in report
    assert (output / "repository" / "sleepy" / "config.pbtxt").is_file()
    assert "report: " in printed
    assert "interrupted" in printed


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_tune_against_a_running_server_loads_each_candidate_and_restores_the_config(
    tmp_path: Path, scheme: str
) -> None:
    """The server starts with no model loaded: the first candidate loads the pipeline."""
    repository = sleepy_repository(tmp_path)
    served = testing.start_server("--model-control-mode", "explicit", repository=repository)
    try:
        url = f"{scheme}://{served.grpc if scheme == 'grpc' else served.http}"
        code = main(
            [
                *tune_command(repository, tmp_path / "report", "--url", url)[3:],
                "--knob",
                "sleepy.instance_count=4",
            ]
        )
        assert code == 0
        document = json.loads((tmp_path / "report" / "results.json").read_text())
        assert document["winner"] == {"sleepy.instance_count": 4}
        assert document["settings"]["url"] == url
        assert all(c["memory_bytes"] is None for c in document["candidates"])
        # The server has its configured config back.
        client = grpcclient.InferenceServerClient(served.grpc)
        try:
            config = client.get_model_config("sleepy", as_json=True)["config"]
            assert sum(int(g["count"]) for g in config["instance_group"]) == 1
        finally:
            client.close()
    finally:
        served.stop()
    assert "load request override" in served.text()


def test_flags_are_checked_with_the_flag_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repository = sleepy_repository(tmp_path)
    base = tune_command(repository, tmp_path / "out")[3:]
    cases = {
        ("--concurrency", "0"): "--concurrency '0'",
        ("--max-memory", "lots"): "--max-memory 'lots'",
        ("--knob", "sleepy.warp=2"): "unknown knob 'warp'",
        ("--knob", "pipe.instance_count=2"): "does not apply to an ensemble",
        ("--knob", "sleepy.fusion=on"): "does not apply to a model that is not an ensemble",
        ("--knob", "other.instance_count=2"): "'other' is not in the pipeline",
        ("--knob", "sleepy.instance_count=0"): "must be at least 1",
        ("--url", "ftp://127.0.0.1:8000"): "expected grpc://HOST:PORT or http://HOST:PORT",
        ("--max-memory", "1GiB", "--url", "grpc://127.0.0.1:1"): "measured in process only",
        ("--concurrency", "0:16"): "--concurrency '0:16'",
        ("--max-memory", "0"): "--max-memory '0'",
        ("--knob", "sleepy.max_queue_delay_us=0"): "cannot batch requests dynamically",
        ("--shape", "X:a"): "--shape 'X:a'",
        ("--budget", "0"): "--budget 0.0: must be a number of seconds over 0",
        ("--budget", "nan"): "--budget nan: must be a number of seconds over 0",
        ("--max-p99-ms", "inf"): "--max-p99-ms inf: must be a number over 0",
    }
    for flags, words in cases.items():
        assert main([*base, *flags]) == 2, flags
        printed = " ".join(capsys.readouterr().out.split())
        assert words in printed, (flags, printed)
    assert not (tmp_path / "out").exists()


def test_discovered_knobs_and_configs_change_only_what_a_knob_names(tmp_path: Path) -> None:
    repository = sleepy_repository(tmp_path)
    pipeline = read_pipeline(repository, "pipe")
    knobs = {k.key: k for k in discover_knobs(pipeline, cores=2)}
    assert knobs["sleepy.instance_count"] == Knob("sleepy", "instance_count", (1, 2))
    assert knobs["sleepy.execution"].values == ("thread", "auto")
    assert knobs["pipe.max_inflight_requests"].values == (0, 4, 16)
    assert knobs["pipe.fusion"].values == ("on", "off", "xla")
    assert "sleepy.max_queue_delay_us" not in knobs  # max_batch_size 0: nothing to batch
    assert parse_knob("sleepy.instance_count=3,1", pipeline).values == (1, 3)

    texts = config_texts(pipeline, {"sleepy.instance_count": 3, "pipe.max_inflight_requests": 2})
    assert set(texts) == {"sleepy", "pipe"}
    assert "count: 3" in texts["sleepy"]
    assert "kind: KIND_CPU" in texts["sleepy"]
    assert "max_inflight_requests: 2" in texts["pipe"]
    assert texts["pipe"].startswith("# The ensemble a client calls.\n")
    assert config_texts(pipeline, {}) == {}


def test_generated_requests_follow_the_config(tmp_path: Path) -> None:
    repository = sleepy_repository(tmp_path)
    pool = request_pool(read_pipeline(repository, "pipe").config)
    assert len(pool) == 16
    assert all(
        set(r) == {"IN"} and r["IN"].shape == (4,) and r["IN"].dtype == "float32" for r in pool
    )
    assert len({r["IN"].tobytes() for r in pool}) == 16
    with pytest.raises(ConfigError, match="has no input NOPE"):
        request_pool(read_pipeline(repository, "pipe").config, shapes={"NOPE": (1,)})


def test_the_pareto_front_keeps_points_no_other_beats_on_both() -> None:
    def point(p99: float, rate: float) -> Point:
        return Point(
            concurrency=1,
            throughput=rate,
            p50_ms=p99,
            p99_ms=p99,
            mean_ms=p99,
            requests=10,
            errors=0,
            stable=True,
            windows=3,
        )

    points = [point(10, 100), point(12, 90), point(20, 300), point(5, 50), point(30, 250)]
    assert [(p.p99_ms, p.throughput) for p in pareto(points)] == [(5, 50), (10, 100), (20, 300)]
