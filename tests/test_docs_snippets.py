"""Every code block of README.md and docs/guide.md that a user would paste runs as written,
from the repository root, in the order the page shows them.

A block is run according to the HTML comment on the line just before its fence:
- none: a ``python`` block runs as a script (``.venv``'s interpreter); each line of a
  ``bash`` block runs with ``.venv/bin`` first on PATH (an activated environment);
- ``<!-- snippet: continues -->``: the block is the previous python block's continuation
  (both run as one script);
- ``<!-- snippet: model.py -->``: a model's code file: it is executed as a module and must
  define ``execute`` (or ``TritonPythonModel``);
- ``<!-- snippet: server -->``: a command that serves until stopped: it runs in the
  background until the page's last block has run (the blocks after it are its clients),
  and must become ready (``/v2/health/ready``) first;
- ``<!-- snippet: skip (why) -->``: not run (the test command itself, a fragment).
Blocks of other languages (configs, layouts) are text."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "guide.md"]
_MARKER = re.compile(r"<!--\s*snippet:\s*([\w.]+)")
_TIMEOUT = 300


@attrs.frozen
class Snippet:
    """One fenced block of a page."""

    page: Path
    line: int
    language: str
    marker: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    """The fenced blocks of ``page``, each with the marker written just before it."""
    found: list[Snippet] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = lines[index]
        if not fence.startswith("```"):
            index += 1
            continue
        language = fence[3:].strip()
        previous = lines[index - 1] if index else ""
        marker = _MARKER.search(previous)
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        code = "\n".join(lines[index + 1 : end]) + "\n"
        found.append(Snippet(page, index + 1, language, marker.group(1) if marker else None, code))
        index = end + 1
    return found


def _env() -> dict[str, str]:
    venv = ROOT / ".venv" / "bin"
    return {**os.environ, "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "120"}


def _run(argv: list[str], snippet: Snippet) -> str | None:
    """Run ``argv`` from the repository root; None when it succeeded, else why not."""
    try:
        done = subprocess.run(
            argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return f"{snippet.where}: still running after {_TIMEOUT} s"
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-3000:]
        return f"{snippet.where}: exit status {done.returncode}\n{output}"
    return None


def _start_server(snippet: Snippet) -> tuple[subprocess.Popen[bytes] | None, str | None]:
    command = snippet.code.strip()
    port = re.search(r"--http-port[ =](\d+)", command)
    url = f"http://127.0.0.1:{port.group(1) if port else 8000}/v2/health/ready"
    process = subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read().decode() if process.stdout else ""
            return None, f"{snippet.where}: the server exited ({process.returncode})\n{output}"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return process, None
        except OSError:
            time.sleep(0.25)
    _stop(process)
    return None, f"{snippet.where}: the server was not ready within 120 s"


def _stop(process: subprocess.Popen[bytes]) -> str:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    return process.stdout.read().decode() if process.stdout else ""


def _model_file(snippet: Snippet) -> str | None:
    namespace: dict[str, object] = {}
    try:
        exec(compile(snippet.code, snippet.where, "exec"), namespace)
    except Exception as exc:
        return f"{snippet.where}: {type(exc).__name__}: {exc}"
    if "execute" not in namespace and "TritonPythonModel" not in namespace:
        return f"{snippet.where}: a model file defines neither execute nor TritonPythonModel"
    return None


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_snippet_of_the_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    """Run the page's blocks in order (see the module); every one succeeds."""
    blocks = snippets(page)
    assert blocks, f"{page} has no code blocks"
    failures: list[str] = []
    servers: list[subprocess.Popen[bytes]] = []
    script: list[Snippet] = []

    def run_script() -> None:
        if not script:
            return
        path = tmp_path / f"snippet_{script[0].line}.py"
        path.write_text("".join(s.code for s in script))
        failure = _run([sys.executable, str(path)], script[0])
        if failure:
            failures.append(failure)
        script.clear()

    try:
        for block in blocks:
            if block.marker == "skip":
                continue
            if block.language == "python" and block.marker == "continues":
                script.append(block)
                continue
            run_script()
            if block.language == "python" and block.marker == "model.py":
                failure = _model_file(block)
            elif block.language == "python":
                script.append(block)
                continue
            elif block.language == "bash" and block.marker == "server":
                process, failure = _start_server(block)
                if process is not None:
                    servers.append(process)
            elif block.language == "bash":
                failure = None
                for line in block.code.splitlines():
                    if line.strip() and not line.lstrip().startswith("#"):
                        failure = failure or _run(["bash", "-c", line], block)
            else:
                continue  # a config or a layout: text
            if failure:
                failures.append(failure)
        run_script()
    finally:
        for process in servers:
            _stop(process)
    assert failures == [], "\n\n".join(failures)


def test_the_pages_mark_what_they_do_not_run() -> None:
    """Only the markers this test knows are used, and few blocks are skipped."""
    for page in PAGES:
        blocks = snippets(page)
        markers = {b.marker for b in blocks} - {None}
        assert markers <= {"skip", "continues", "model.py", "server"}, (page, markers)
        assert sum(b.marker == "skip" for b in blocks) <= 3, page
