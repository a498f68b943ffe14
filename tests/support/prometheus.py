"""A real Prometheus server (Debian's ``prometheus``) scraping one target, for the tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from orchestrion.testing import free_port


class PrometheusServer:
    """``prometheus`` on a free loopback port, scraping ``target`` every 200 ms."""

    def __init__(self, workdir: Path, target: str, metrics_path: str = "/metrics") -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed; scripts/bootstrap installs it")
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 200ms\n  scrape_timeout: 150ms\n"
            "scrape_configs:\n  - job_name: orchestrion\n"
            f"    metrics_path: {metrics_path}\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>`` and return its ``data`` (raises if not ready)."""
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{query}"
        with urllib.request.urlopen(url, timeout=2) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def stop(self) -> str:
        """Stop it; returns what it logged."""
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        log = self.process.stderr.read().decode() if self.process.stderr else ""
        if self.process.stderr is not None:
            self.process.stderr.close()
        return log


def wait_for(predicate: Any, seconds: float, what: str) -> Any:
    """Poll a blocking ``predicate`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + seconds
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, AssertionError, KeyError) as exc:  # not up yet
            last = exc
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {seconds} s waiting for {what} (last error: {last})")
