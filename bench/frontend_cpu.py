"""Where a served request's CPU goes: the front end's threads against the interpreter's.

Starts ``orchestrion serve`` on the vs_triton ensemble (``bench/vs_triton``) with each front
end, loads it with perf_analyzer (from ``bench/vs_triton.sh``'s set-up, which must have run
once) for a fixed time per protocol, cache setting and concurrency, and reads each thread's
CPU time from ``/proc/<pid>/task/*/stat`` before and after (and the ensemble's answered
requests from its statistics, so each request's share is exact). It prints, per request: the CPU
of the native front end's threads (named ``orchestrion-nati``), of the interpreter's main
thread (trio: routes, decoding, the pipeline, encoding) and of the other threads (with
``--frontend python``, grpcio's asyncio loop runs in one; JAX's and worker threads), and the
requests served per second. Ratios within one run are what to read.

    .venv/bin/python bench/frontend_cpu.py                   # native and python, ~3 minutes
    .venv/bin/python bench/frontend_cpu.py --frontends native --seconds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "bench" / ".peers"
PERF_ANALYZER = PEERS / "bin" / "perf_analyzer"
TICK = os.sysconf("SC_CLK_TCK")
_STARTED = re.compile(r"Started (HTTPService|GRPCInferenceService) at (\S+)")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid``, summed by kind."""
    kinds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / TICK
        if int(task.name) == pid:
            kind = "interpreter"
        elif name.startswith("orchestrion-nat"):
            kind = "native front end"
        else:
            kind = "other threads"
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return kinds


def start(frontend: str, cache: bool) -> tuple[subprocess.Popen[str], str, str]:
    command = [
        sys.executable,
        "-m",
        "orchestrion",
        "serve",
        "--model-repository",
        str(ROOT / "bench" / "vs_triton" / "orchestrion_models"),
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--allow-metrics=false",
        "--frontend",
        frontend,
        *(["--cache-config", "local,size=1048576"] if cache else []),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: dict[str, str] = {}
    assert process.stdout is not None
    deadline = time.monotonic() + 120
    while len(found) < 2:
        line = process.stdout.readline()
        if not line or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"orchestrion serve did not start ({frontend})")
        if (match := _STARTED.search(line)) is not None:
            found[match[1]] = match[2]
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://{found['HTTPService']}/v2/health/ready", timeout=2)
            break
        except OSError:
            time.sleep(0.1)
    return process, found["HTTPService"], found["GRPCInferenceService"]


def served(http: str) -> int:
    """Requests the ensemble has answered so far (its statistics)."""
    with urllib.request.urlopen(f"http://{http}/v2/models/ensemble/stats", timeout=10) as answer:
        document = json.loads(answer.read())
    return int(document["model_stats"][0]["inference_stats"]["success"]["count"])


def load(url: str, protocol: str, concurrency: int, seconds: float) -> None:
    """perf_analyzer's load for about ``seconds`` (stopped after 3x that: at tens of
    thousands of cache hits a second it takes longer over each window than the last)."""
    # The load ran when it is stopped; what it cost is read from the server.
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(
            [
                str(PERF_ANALYZER),
                "-m",
                "ensemble",
                "-u",
                url,
                "-i",
                protocol,
                "-b",
                "1",
                "--concurrency-range",
                f"{concurrency}:{concurrency}",
                # Three windows (perf_analyzer's least for a stable measurement) of a third each.
                "--measurement-interval",
                str(int(seconds * 1000 / 3)),
                "--max-trials",
                "10",
                "--stability-percentage",
                "100",
                "--input-data",
                "random",
            ],
            env={**os.environ, "LD_LIBRARY_PATH": str(PEERS / "lib")},
            capture_output=True,
            timeout=seconds * 3 + 5,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frontends", default="native python")
    parser.add_argument("--protocols", default="grpc http")
    parser.add_argument("--cache", default="off on")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    if not PERF_ANALYZER.exists():
        raise SystemExit("run bench/vs_triton.sh once first: it installs perf_analyzer")
    kinds = ("native front end", "interpreter", "other threads")
    print(
        f"{'front end':<9} {'protocol':<8} {'cache':<5} {'req/s':>8}  "
        + "  ".join(f"{k + ' µs':>19}" for k in kinds)
        + f"  {'total µs':>9}"
    )
    for frontend in args.frontends.split():
        for cache in args.cache.split():
            process, http, grpc = start(frontend, cache == "on")
            try:
                for protocol in args.protocols.split():
                    url = grpc if protocol == "grpc" else http
                    load(url, protocol, args.concurrency, 2.0)  # warm up
                    before, first, t0 = thread_cpu(process.pid), served(http), time.monotonic()
                    load(url, protocol, args.concurrency, args.seconds)
                    after, count = thread_cpu(process.pid), served(http) - first
                    rate = count / (time.monotonic() - t0)
                    per = {k: (after.get(k, 0) - before.get(k, 0)) / count * 1e6 for k in kinds}
                    print(
                        f"{frontend:<9} {protocol:<8} {cache:<5} {rate:>8,.0f}  "
                        + "  ".join(f"{per[k]:>19.0f}" for k in kinds)
                        + f"  {sum(per.values()):>9.0f}"
                    )
            finally:
                process.terminate()
                process.wait(30)


if __name__ == "__main__":
    main()
