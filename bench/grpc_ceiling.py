"""How fast can a Python gRPC server answer perf_analyzer at all? grpcio's ceiling, side by side
with Triton and orchestrion on the vs_triton ensemble, cache hits.

    .venv/bin/python bench/grpc_ceiling.py [--concurrency "1 4 8"] [--quick]
    .venv/bin/python bench/grpc_ceiling.py --check   # the canned servers answer as orchestrion

One run measures, with perf_analyzer over gRPC at each concurrency:

- Triton 2.51.0 and orchestrion with the response cache off, and on with one repeated input,
  so every request after the first is a cache hit (``bench/vs_triton.sh`` with
  ``PROTOCOLS=grpc``: it installs both on first use);
- three *canned* servers: grpcio servers that answer every RPC with bytes serialized once in
  advance, so they decode nothing, run nothing and encode nothing. What they reach is what
  grpcio's own layer allows a Python server on this machine, whatever the server does:
  ``grpcio asyncio`` (``grpc.aio.server``, the API orchestrion's front end uses) and
  ``grpcio sync`` (``grpc.server`` with a thread pool of 1 and of 8 workers).

The canned answers are orchestrion's own: this script loads the vs_triton ensemble through the
embedding API and serializes its metadata, configs, statistics and one inference response, so
perf_analyzer sees the same model as from the real servers. Each canned server runs in a child
process; perf_analyzer runs on the same cores as the server, as in ``vs_triton.sh``.

It prints one table: infer/s, p50, p99, and each row's throughput against Triton's with the
cache off and with cache hits at the same concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import report_reader, run_vs_triton, table

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PEERS = BENCH / ".peers"
PERF_ANALYZER = PEERS / "bin" / "perf_analyzer"
MODELS = BENCH / "vs_triton" / "orchestrion_models"
SAVED = PEERS / "grpc_ceiling.json"
SERVICE = "inference.GRPCInferenceService"
CACHES = ("cache off", "cache hits")
CANNED = {
    "grpcio asyncio, canned": ("aio", 0),
    "grpcio sync (1 thread), canned": ("sync", 1),
    "grpcio sync (8 threads), canned": ("sync", 8),
}


def _log(message: str) -> None:
    print(f"[grpc_ceiling {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def capture(path: Path) -> None:
    """Serialize orchestrion's answers for the vs_triton ensemble into ``path`` (pickle)."""
    import numpy as np
    import trio

    import orchestrion
    from orchestrion.protocols._kserve_grpc import (
        encode_grpc_response,
        model_config_response,
        model_metadata_message,
        model_statistics_message,
        server_metadata_message,
    )

    async def main() -> dict[str, Any]:
        async with orchestrion.open_server(MODELS) as server:
            response = await server.infer("ensemble", {"INPUT": np.ones((1, 16), np.float32)})
            names = server.model_names()
            return {
                "ServerMetadata": server_metadata_message(orchestrion.__version__),
                "ModelMetadata": model_metadata_message(
                    server.model_config("ensemble"), server.model_versions("ensemble")
                ),
                "ModelStatistics": model_statistics_message(server.model_statistics()),
                "ModelInfer": encode_grpc_response(response),
                "ModelConfig": {n: model_config_response(server.model_config(n)) for n in names},
            }

    messages = trio.run(main)
    serialized = {
        key: (
            {n: m.SerializeToString() for n, m in value.items()}
            if isinstance(value, dict)
            else value.SerializeToString()
        )
        for key, value in messages.items()
    }
    path.write_bytes(pickle.dumps(serialized))


def serve_canned(kind: str, workers: int, port: int, answers_path: Path) -> None:
    """(In a child process.) A grpcio server answering every RPC with canned bytes."""
    import grpc
    from tritonclient.grpc import service_pb2

    answers = pickle.loads(answers_path.read_bytes())
    configs: dict[str, bytes] = answers.pop("ModelConfig")
    live = service_pb2.ServerLiveResponse(live=True).SerializeToString()
    ready = service_pb2.ServerReadyResponse(ready=True).SerializeToString()
    fixed = answers | {"ServerLive": live, "ServerReady": ready, "ModelReady": ready}

    def answer(method: str, request: bytes) -> bytes:
        if method == "ModelConfig":  # the one answer that depends on the request
            name = service_pb2.ModelConfigRequest.FromString(request).name
            return configs[name]
        return bytes(fixed[method])

    def handler(method: str) -> Any:
        if kind == "aio":

            async def unary_async(request: bytes, context: Any) -> bytes:
                return answer(method, request)

            behaviour: Any = unary_async
        else:

            def unary(request: bytes, context: Any) -> bytes:
                return answer(method, request)

            behaviour = unary
        return grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=None, response_serializer=None
        )

    methods = [*fixed, "ModelConfig"]
    generic = grpc.method_handlers_generic_handler(SERVICE, {m: handler(m) for m in methods})
    address = f"127.0.0.1:{port}"
    if kind == "aio":

        async def main() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((generic,))
            server.add_insecure_port(address)
            await server.start()
            await server.wait_for_termination()

        asyncio.run(main())
    else:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            server = grpc.server(pool)
            server.add_generic_rpc_handlers((generic,))
            server.add_insecure_port(address)
            server.start()
            server.wait_for_termination()


def check_canned(results: Path) -> None:
    """Start each canned server and check, through a grpcio client, that it answers what
    orchestrion answers (no perf_analyzer needed: the smoke test runs this)."""
    import grpc
    from tritonclient.grpc import service_pb2

    answers_path = results / "answers.pickle"
    capture(answers_path)
    answers = pickle.loads(answers_path.read_bytes())
    requests = {
        "ModelMetadata": service_pb2.ModelMetadataRequest(name="ensemble"),
        "ModelStatistics": service_pb2.ModelStatisticsRequest(),
        "ModelInfer": service_pb2.ModelInferRequest(model_name="ensemble"),
        **{
            f"ModelConfig/{name}": service_pb2.ModelConfigRequest(name=name)
            for name in answers["ModelConfig"]
        },
    }
    for label, (kind, workers) in CANNED.items():
        port = _free_port()
        command = [sys.executable, __file__, "--serve", kind, str(workers), str(port)]
        process = subprocess.Popen([*command, str(answers_path)])
        try:
            _wait_for_port(port, process)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                for key, request in requests.items():
                    method, _, name = key.partition("/")
                    call = channel.unary_unary(
                        f"/{SERVICE}/{method}",
                        request_serializer=type(request).SerializeToString,
                        response_deserializer=None,
                    )
                    expected = answers[method][name] if name else answers[method]
                    if call(request, timeout=10) != expected:
                        raise SystemExit(f"{label}: {key} does not answer orchestrion's bytes")
            print(f"{label}: answers as orchestrion ({len(requests)} RPCs checked)")
        finally:
            process.terminate()
            process.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the canned server exited with {process.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"the canned server did not listen on {port} within {timeout:.0f} s")


def perf_analyzer(port: int, concurrency: int, stem: Path, quick: bool) -> None:
    """One perf_analyzer run (the settings of vs_triton.sh); its CSV and log at ``stem``."""
    stem.with_suffix(".csv").unlink(missing_ok=True)
    command = [
        str(PERF_ANALYZER),
        *("-m", "ensemble", "-u", f"127.0.0.1:{port}", "-i", "grpc", "-b", "1"),
        *("--concurrency-range", f"{concurrency}:{concurrency}", "--input-data", "random"),
        *("--measurement-interval", "1500" if quick else "3000"),
        *("--stability-percentage", "25", "--max-trials", "4" if quick else "8", "-v"),
        *("-f", str(stem.with_suffix(".csv"))),
    ]
    env = {**os.environ, "LD_LIBRARY_PATH": str(PEERS / "lib")}
    with stem.with_suffix(".log").open("wb") as log:
        try:
            subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=90)
        except subprocess.TimeoutExpired:
            _log(f"perf_analyzer timed out at concurrency {concurrency} (log: {stem}.log)")


def measure_canned(
    concurrency: list[int], results: Path, quick: bool
) -> dict[tuple[str, int], Any]:
    """Each canned server in turn, perf_analyzer at each concurrency."""
    read = report_reader()

    answers = results / "answers.pickle"
    capture(answers)
    found: dict[tuple[str, int], Any] = {}
    for label, (kind, workers) in CANNED.items():
        port = _free_port()
        command = [sys.executable, __file__, "--serve", kind, str(workers), str(port), str(answers)]
        process = subprocess.Popen(command)
        try:
            _wait_for_port(port, process)
            for c in concurrency:
                _log(f"{label}, concurrency {c}")
                stem = results / f"{kind}{workers}_c{c}"
                perf_analyzer(port, c, stem, quick)
                found[(label, c)] = read(stem)
        finally:
            process.terminate()
            process.wait(timeout=30)
    return found


def measure_servers(concurrency: list[int], results: Path, quick: bool) -> dict[str, Any]:
    """Triton and orchestrion over gRPC, cache off and hits, through vs_triton.sh."""
    settings = {
        "SERVERS": "triton orchestrion",
        "PROTOCOLS": "grpc",
        "CACHE": "off on",
        "CONCURRENCY": " ".join(map(str, concurrency)),
        "RESULTS": str(results),
    }
    read = run_vs_triton(settings, quick)

    names = {"triton": "Triton 2.51", "orchestrion": "orchestrion"}
    return {
        (f"{name}, {'cache hits' if cache == 'on' else 'cache off'}", c): read(
            results / server / f"grpc_cache-{cache}_c{c}"
        )
        for server, name in names.items()
        for cache in ("off", "on")
        for c in concurrency
    }


def render(found: dict[tuple[str, int], Any], concurrency: list[int]) -> str:
    """The table: each row against Triton's (cache off, cache hits) at the same concurrency."""
    labels = list(dict.fromkeys(label for label, _ in found))
    rows = []
    for label in labels:
        for c in concurrency:
            row = found.get((label, c))
            if row is None:
                rows.append([label, str(c), "-", "-", "-", "-", "-"])
                continue
            rps, p50, p99, stable = row
            ratios = [
                f"{rps / triton[0]:.2f}" if triton else "-"
                for triton in (found.get((f"Triton 2.51, {cache}", c)) for cache in CACHES)
            ]
            rows.append(
                [
                    label,
                    str(c),
                    f"{rps:,.0f}" + ("" if stable else "*"),
                    "-" if p50 is None else f"{p50:,.0f}",
                    "-" if p99 is None else f"{p99:,.0f}",
                    *ratios,
                ]
            )
    header = [
        "server (gRPC, perf_analyzer)",
        "conc",
        "infer/s",
        "p50 µs",
        "p99 µs",
        *(f"÷ Triton {cache.split()[1]}" for cache in CACHES),
    ]
    return table(header, rows, left=1) + "\n(* no stable window: the last window's throughput)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1 4 8", help='space-separated (default "1 4 8")')
    parser.add_argument("--quick", action="store_true", help="shorter windows (a smoke run)")
    parser.add_argument(
        "--check", action="store_true", help="only check the canned servers' answers"
    )
    parser.add_argument("--from-json", type=Path, help=f"re-render a saved run ({SAVED.name})")
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        kind, workers, port, answers = args.serve
        serve_canned(kind, int(workers), int(port), Path(answers))
        return
    concurrency = [int(c) for c in args.concurrency.split()]
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        found = {(label, c): row for label, c, row in saved["rows"]}
        print(render(found, saved["concurrency"]))
        return
    with tempfile.TemporaryDirectory(prefix="grpc_ceiling-") as scratch:
        results = Path(scratch)
        if args.check:
            check_canned(results)
            return
        _log("Triton and orchestrion, cache off and hits (bench/vs_triton.sh)")
        found = measure_servers(concurrency, results, args.quick)
        if not PERF_ANALYZER.is_file():
            raise SystemExit(f"{PERF_ANALYZER} is missing: bench/vs_triton.sh should install it")
        found |= measure_canned(concurrency, results, args.quick)
    rows = [[label, c, row] for (label, c), row in found.items()]
    SAVED.write_text(json.dumps({"concurrency": concurrency, "rows": rows}))
    _log(f"saved to {SAVED.relative_to(ROOT)} (--from-json re-renders it)")
    print(render(found, concurrency))


if __name__ == "__main__":
    main()
