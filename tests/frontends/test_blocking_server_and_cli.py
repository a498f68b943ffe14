"""The blocking facade (`orchestrion.Server`) and the `orchestrion` command (`run`, `serve`)."""

from __future__ import annotations

import argparse
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import orchestrion
from orchestrion.frontends._cli import _parser
from orchestrion.frontends._cli import main as cli
from orchestrion.testing import ensemble, model, step, tensor
from support.served import start_server

REPO = Path(__file__).resolve().parents[2]


def threads() -> set[str]:
    """Live threads, minus trio's idle worker cache (its workers exit after 10 s idle)."""
    return {t.name for t in threading.enumerate() if not t.name.startswith("Trio thread")}


def _models() -> list[orchestrion.Model]:
    def fail(X):
        raise ValueError("nope")

    return [
        model("double", lambda X: {"Y": X * 2}, [tensor("X", dims=(2,))], [tensor("Y", dims=(2,))]),
        model("fail", fail, [tensor("X", dims=(2,))], [tensor("Y", dims=(2,))], jit=False),
        ensemble(
            "e",
            [tensor("IN", dims=(2,))],
            [tensor("OUT", dims=(2,))],
            [step("double", {"X": "IN"}, {"Y": "OUT"})],
        ),
    ]


def test_blocking_server_infers_and_owns_its_thread() -> None:
    """`Server` answers from ordinary code, raises the same errors, and joins its thread on exit."""
    before = threads()
    with orchestrion.Server(models=_models()) as server:
        out = server.infer("e", {"IN": np.array([1, 2], np.float32)}, request_id="x")
        assert out.outputs["OUT"].tolist() == [2.0, 4.0]
        assert out.request_id == "x"
        with pytest.raises(orchestrion.InferenceError, match="model 'fail'"):
            server.infer("fail", {"X": np.zeros(2, np.float32)})
        with pytest.raises(orchestrion.ModelNotFoundError):
            server.infer("missing", {})
        assert server.model_names() == ["double", "e", "fail"]
        assert server.is_model_ready("e")
        assert server.model_config("e").is_ensemble
        assert server.model_statistics("double")[0].execution_count == 1
        assert [s.model_name for s in server.step_statistics("e")] == ["double"]
        server.unload_model("e")
        assert not server.is_model_ready("e")
    assert threads() <= before  # none left behind (an earlier test's may have ended meanwhile)
    with pytest.raises(orchestrion.ServerClosedError):
        server.infer("e", {})


def test_blocking_server_reports_load_errors() -> None:
    """A bad model makes `Server.__enter__` raise and leaves no thread behind."""
    before = threads()
    broken = model("b", lambda Q: {"Y": Q}, [tensor("X")], [tensor("Y")])
    with (
        pytest.raises(orchestrion.ConfigError, match="no parameter for inputs X"),
        orchestrion.Server(models=[broken]),
    ):
        pass
    assert threads() <= before  # none left behind (an earlier test's may have ended meanwhile)


def test_blocking_server_serves_several_threads() -> None:
    """Calls from several threads at once each get their own answer."""
    results: dict[int, float] = {}
    with orchestrion.Server(models=_models()) as server:

        def client(i: int) -> None:
            for _ in range(20):
                out = server.infer("e", {"IN": np.full(2, i, np.float32)})
                results[i] = float(out.outputs["OUT"][0])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert results == {i: 2.0 * i for i in range(4)}


def test_cli_runs_the_image_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    """`orchestrion run examples/image_pipeline` answers every request and prints a summary."""
    code = cli(["run", str(REPO / "examples" / "image_pipeline"), "-n", "12", "-c", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "errors" in out
    assert "throughput" in out
    for name in ("image_preprocess_model", "classification_model", "segmentation_model"):
        assert name[:14] in out
    assert "12/12" in out
    assert "cache local:" in out  # the embedded default: a local cache


TINY_CONFIG = """
name: "inc"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
response_cache { enable: true }
"""
TINY_MODEL = "JIT = False\n\ndef execute(X):\n    return {'Y': X + 1}\n"
TINY_EXAMPLE = """
import numpy as np
MODEL = "inc"
REQUESTS = 20
CONCURRENCY = 2

def make_inputs(index, rng):
    return {"X": np.full(4, index % 2, np.float32)}
"""


@pytest.fixture
def tiny_example(tmp_path: Path) -> Path:
    """An example whose 20 requests repeat two inputs (a cache's best case)."""
    version = tmp_path / "tiny" / "models" / "inc" / "1"
    version.mkdir(parents=True)
    (version.parent / "config.pbtxt").write_text(TINY_CONFIG)
    (version / "model.py").write_text(TINY_MODEL)
    (tmp_path / "tiny" / "example.py").write_text(TINY_EXAMPLE)
    return tmp_path / "tiny"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], "cache local: 18 hits, 2 misses"),
        (["--cache-config", "local,size=65536"], "cache local: 18 hits, 2 misses"),
        (["--no-cache"], "ok"),
    ],
)
def test_cli_cache_flags(
    tiny_example: Path, capsys: pytest.CaptureFixture[str], flags: list[str], expected: str
) -> None:
    """`run` uses a local cache by default; --cache-config picks one; --no-cache none."""
    assert cli(["run", str(tiny_example), "-c", "1", *flags]) == 0
    out = capsys.readouterr().out
    assert expected in out
    if "--no-cache" in flags:
        assert "cache local" not in out


def test_cli_deprecated_byte_size_flag(
    tiny_example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--response-cache-byte-size still works, with a visible deprecation warning."""
    assert cli(["run", str(tiny_example), "-c", "1", "--response-cache-byte-size", "65536"]) == 0
    out = capsys.readouterr().out
    assert "deprecated" in out
    assert "--cache-config local,size=65536" in out
    assert "cache local: 18 hits" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--cache-config", "local,size=1", "--response-cache-byte-size", "9"],
            "cannot be used together",
        ),
        (["--cache-config", "local"], "expected <name>,<key>=<value>"),
        (["--cache-config", "local,size=1", "--cache-config", "redis,host=x"], "names two caches"),
        (["--cache-config", "local,size=10"], "cannot hold any entry"),
        (
            ["--cache-config", "redis,host=127.0.0.1", "--cache-config", "redis,port=1"],
            "cannot reach Redis",
        ),
        (["--no-cache", "--cache-config", "local,size=4096"], "cannot be combined"),
    ],
)
def test_cli_cache_errors(
    tiny_example: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """Bad cache flags stop `run` with exit status 2 and a message that says why."""
    assert cli(["run", str(tiny_example), *flags]) == 2
    assert message in capsys.readouterr().out


def test_cli_unknown_example(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown example is a clear error with exit status 2, listing the examples."""
    assert cli(["run", "no_such_example"]) == 2
    out = capsys.readouterr().out
    assert "no example 'no_such_example'" in out
    assert (
        "the examples are: detection_pipeline, image_pipeline, onnx_pipeline, "
        "streaming_backpressure"
    ) in out


@pytest.mark.parametrize(
    ("flags", "headline", "note"),
    [
        ([], "20 computed by the pipeline", False),
        (
            ["--cache-config", "local,size=65536"],
            "2 computed by the pipeline, 18 answered from the response cache",
            True,
        ),
    ],
)
def test_cli_run_says_what_was_computed_and_what_came_from_the_cache(
    tiny_example: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    headline: str,
    note: bool,
) -> None:
    """The headline separates requests the pipeline computed from the cache's answers, a note
    says when repeats made the figures cache hits, and the columns are explained. (The tiny
    example's model caches; without --cache-config, this test runs it with --no-cache.)"""
    chosen = flags or ["--no-cache"]
    assert cli(["run", str(tiny_example), "-c", "1", *chosen]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines at the terminal width
    assert headline in out
    assert ("The example sends 2 distinct inputs" in out) is note
    assert "execs: executions (a batch is one execution of several requests)" in out


def test_cli_missing_repository_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve` and `validate` with a repository path that does not exist: one line saying so."""
    for command in (["serve"], ["validate"]):
        assert cli([*command, "--model-repository", "/no/such/repository"]) != 0
        out = capsys.readouterr().out
        assert "/no/such/repository: model repository does not exist" in out
        assert "Traceback" not in out


def test_every_cli_flag_has_help_with_its_default() -> None:
    """Every flag of every command says what it does; those with a default say it, and the
    top-level help names every command."""
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert all(name in (parser.description or "") for name in ("serve", "run", "validate", "tune"))
    missing = []
    for name, command in commands.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            text = action.help or ""
            if not text:
                missing.append(f"{name} {action.option_strings[0]}: no help")
            elif action.default not in (None, False, []) and "default" not in text:
                missing.append(f"{name} {action.option_strings[0]}: no default in its help")
    assert missing == []


def test_cli_serve_exposes_metrics_until_interrupted(tiny_example: Path) -> None:
    """`orchestrion serve` loads a repository, serves /metrics, and stops on Ctrl-C."""
    served = start_server(repository=tiny_example / "models")
    try:
        with urllib.request.urlopen(f"http://{served.metrics}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert 'nv_inference_request_success{model="inc",version="1"} 0' in text
        assert 'orchestrion_model_load_seconds{model="inc",version="1"}' in text
    finally:
        code = served.stop(how=signal.SIGINT)
    assert code == 0
    assert "stopped" in served.text()


_STUCK_FINALIZE = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = pb_utils.Tensor("Y", np.ones(1, np.float32))
        return [pb_utils.InferenceResponse([out]) for _ in requests]

    def finalize(self):
        print("finalize started", flush=True)
        time.sleep(120)  # a model whose finalize does not end (waits on its own threads)
"""


def test_a_second_signal_exits_at_once_when_a_finalize_hangs(tmp_path: Path) -> None:
    """The first SIGINT stops gracefully, which waits for every model's finalize; a second
    one exits at once (status 130) instead of waiting on a finalize that does not end."""
    folder = tmp_path / "stuck"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(_STUCK_FINALIZE)
    (folder / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [{ name: "X", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "Y", data_type: TYPE_FP32, dims: [1] }]\n'
    )
    served = start_server(repository=tmp_path)
    served.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while "finalize started" not in served.text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "finalize started" in served.text()
    started = time.monotonic()
    code = served.stop(timeout=20, how=signal.SIGINT)
    assert code == 128 + signal.SIGINT
    assert time.monotonic() - started < 10
    assert "SIGINT again: exiting now" in served.text()


def test_cli_runs_the_streaming_example(capsys: pytest.CaptureFixture[str]) -> None:
    """`orchestrion run examples/streaming_backpressure` streams every chunk of every request."""
    code = cli(["run", str(REPO / "examples" / "streaming_backpressure"), "-n", "2", "-c", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "streamed 48 responses" in out
    assert "peak intermediates in flight per step" in out
