"""What system shared memory saves: perf_analyzer against ``orchestrion serve``, the same 1 MiB
and 16 MiB tensors sent in the request body and through shared memory, side by side.

    .venv/bin/python bench/shared_memory.py [--sizes 1,16] [--concurrency 1] [--quick]

The model (bench/shared_memory/echo) echoes one FP32 tensor, so each request moves its size in
and out. ``body``: perf_analyzer sends the input in the request (HTTP binary data, gRPC raw
contents) and reads the output from the response. ``shared memory``: perf_analyzer's
``--shared-memory system`` puts the input in a region it registered and asks for the output
in another; the server reads one and writes the other with a single copy each, and the
messages carry only their descriptions. One server serves every row; each row is one
perf_analyzer run (``--measurement-interval``, stability 25 %), on the same 2 cores as the
server. perf_analyzer comes from bench/vs_triton.sh (which fetches it on first use).

Expectation: shared memory saves the copies of the body (socket, HTTP/gRPC framing, protobuf
or JSON parsing, the response's encoding): several times the throughput at 16 MiB, less at
1 MiB, where the fixed cost of a request weighs more.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH, report_reader, table

from orchestrion.testing import start_server

PERF_ANALYZER = BENCH / ".peers" / "bin" / "perf_analyzer"
MODELS = BENCH / "shared_memory"
MIB = 1 << 20


def _log(message: str) -> None:
    print(f"[shared_memory {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _perf(
    address: str,
    protocol: str,
    size: int,
    memory: str,
    concurrency: int,
    interval: int,
    stem: Path,
) -> None:
    command = [
        str(PERF_ANALYZER),
        "-m",
        "echo",
        "-u",
        address,
        "-i",
        protocol,
        "--shape",
        f"INPUT:{size // 4}",
        "--input-data",
        "random",
        "--shared-memory",
        memory,
        "--output-shared-memory-size",
        str(size),
        "--concurrency-range",
        f"{concurrency}:{concurrency}",
        "--measurement-interval",
        str(interval),
        "--stability-percentage",
        "25",
        "--max-trials",
        "8",
        "-v",
        "-f",
        str(stem.with_suffix(".csv")),
    ]
    # perf_analyzer's libb64 and libcudart: where bench/vs_triton.sh links them.
    env = {**os.environ, "LD_LIBRARY_PATH": str(BENCH / ".peers" / "lib")}
    with stem.with_suffix(".log").open("w") as log:
        subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, timeout=600, check=False, env=env
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16", help="tensor sizes in MiB (default: 1,16)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    parser.add_argument("--quick", action="store_true", help="1.5 s windows (a smoke run)")
    args = parser.parse_args()
    if not PERF_ANALYZER.is_file():
        sys.exit(f"{PERF_ANALYZER} is missing: run bench/vs_triton.sh once to fetch it")
    interval = 1500 if args.quick else 4000
    sizes = [int(float(s) * MIB) for s in args.sizes.split(",")]
    read = report_reader()
    rows = []
    served = start_server(
        "--no-cache",
        "--allow-client-shm=true",
        "--http-max-input-size",
        str(max(sizes) * 2),
        repository=MODELS,
    )
    try:
        with tempfile.TemporaryDirectory() as folder:
            for protocol, address in (("grpc", served.grpc), ("http", served.http)):
                for size in sizes:
                    results = {}
                    for memory in ("none", "system"):
                        _log(f"{protocol} {size // MIB} MiB shared memory {memory}")
                        stem = Path(folder) / f"{protocol}_{size}_{memory}"
                        _perf(address, protocol, size, memory, args.concurrency, interval, stem)
                        results[memory] = read(stem)
                    for memory, label in (("none", "body"), ("system", "shared memory")):
                        got = results[memory]
                        body = results["none"]
                        ratio = (
                            f"{got[0] / body[0]:.2f}x"
                            if got is not None and body is not None and body[0]
                            else "-"
                        )
                        rows.append(
                            [
                                protocol,
                                f"{size // MIB} MiB",
                                label,
                                f"{got[0]:,.1f}{'' if got[3] else '*'}" if got else "failed",
                                f"{got[1] / 1000:,.2f}" if got and got[1] else "-",
                                f"{got[2] / 1000:,.2f}" if got and got[2] else "-",
                                f"{got[0] * 2 * size / MIB:,.0f}" if got else "-",
                                ratio,
                            ]
                        )
    finally:
        code = served.stop()
        if code != 0:
            print(served.text(), file=sys.stderr)
    print(
        f"echo (FP32 in and out), perf_analyzer concurrency {args.concurrency}, "
        f"{interval / 1000:g} s windows; *: no stable window"
    )
    print(
        table(
            [
                "protocol",
                "size",
                "tensors in",
                "infer/s",
                "p50 ms",
                "p99 ms",
                "MiB/s moved",
                "vs body",
            ],
            rows,
            left=3,
        )
    )


if __name__ == "__main__":
    main()
