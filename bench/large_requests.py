"""Large requests: time, peak server memory per request byte, and health-probe latency.

Run: ``.venv/bin/python bench/large_requests.py [--quick] [--sizes 16,64,256,1024]``.

For each size (MiB) and front end (gRPC raw contents, HTTP binary data), a fresh
``orchestrion serve`` (limits raised to allow the size) answers one FP32 request to the
``identity_plain`` test model, which echoes it back. While it runs, a thread samples the
server's VmRSS every 10 ms and another asks ``/v2/health/live`` every 20 ms on a keep-alive
connection. The table gives the request's wall time, the peak RSS above the server's resting
RSS divided by the request's size, and the slowest probe.

Expectation: the peak is a small multiple of the size (the message as the front end
received it, as parsed, the tensor, the answer's copies: 6 to 10); probes stay in the tens
of milliseconds, since decoding and encoding large bodies runs in worker threads.
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from _common import table
from tritonclient.grpc import service_pb2, service_pb2_grpc

from orchestrion.testing import Served, rss_kib, start_server

MIB = 1 << 20
MODELS = Path(__file__).resolve().parent.parent / "tests" / "kserve_models"


def grpc_request(served: Served, raw: bytes, n: int) -> None:
    limit = [("grpc.max_send_message_length", 2**31 - 1)]
    limit.append(("grpc.max_receive_message_length", 2**31 - 1))
    with grpc.insecure_channel(served.grpc, options=limit) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        message = service_pb2.ModelInferRequest(model_name="identity_plain")
        tensor = message.inputs.add()
        tensor.name, tensor.datatype = "IN_FP32", "FP32"
        tensor.shape.extend([2, n // 2])
        message.raw_input_contents.append(raw)
        answer = stub.ModelInfer(message, timeout=600)
        assert len(answer.raw_output_contents[0]) == len(raw)


def http_request(served: Served, raw: bytes, n: int) -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "IN_FP32",
                    "datatype": "FP32",
                    "shape": [2, n // 2],
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "OUT_FP32", "parameters": {"binary_data": True}}],
        }
    ).encode()
    connection = http.client.HTTPConnection(served.http, timeout=600)
    try:
        connection.request(
            "POST",
            "/v2/models/identity_plain/infer",
            header + raw,
            {"Inference-Header-Content-Length": str(len(header))},
        )
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200, body[:300]
    finally:
        connection.close()


def measure(size_mib: int, front_end: str) -> list[str]:
    n = size_mib * MIB // 4
    limits = [f"--grpc-max-message-size={2**31 - 1}", f"--http-max-input-size={2**31 - 1}"]
    served = start_server(*limits, repository=MODELS)
    try:
        raw = np.ones(n, np.float32).tobytes()
        base = rss_kib(served.process.pid)
        peak, probes, done = [base], [0.0], threading.Event()

        def sample() -> None:
            while not done.wait(0.01):
                peak[0] = max(peak[0], rss_kib(served.process.pid))

        def probe() -> None:
            connection = http.client.HTTPConnection(served.http, timeout=600)
            while not done.wait(0.02):
                began = time.perf_counter()
                connection.request("GET", "/v2/health/live")
                connection.getresponse().read()
                probes[0] = max(probes[0], time.perf_counter() - began)
            connection.close()

        threads = [threading.Thread(target=sample), threading.Thread(target=probe)]
        for thread in threads:
            thread.start()
        began = time.perf_counter()
        try:
            (grpc_request if front_end == "gRPC" else http_request)(served, raw, n)
        finally:
            took = time.perf_counter() - began
            done.set()
            for thread in threads:
                thread.join(60)
        grown = (peak[0] - base) * 1024
        return [
            front_end,
            f"{size_mib}",
            f"{took:.2f}",
            f"{grown / MIB:.0f}",
            f"{grown / (size_mib * MIB):.1f}x",
            f"{probes[0] * 1000:.0f}",
        ]
    finally:
        served.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16,64,256,1024", help="MiB, comma-separated")
    parser.add_argument("--quick", action="store_true", help="8 MiB only")
    args = parser.parse_args()
    sizes = [8] if args.quick else [int(s) for s in args.sizes.split(",")]
    rows = [measure(size, front_end) for size in sizes for front_end in ("gRPC", "HTTP")]
    header = ["front end", "MiB", "seconds", "peak +MiB", "peak / size", "slowest probe ms"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
