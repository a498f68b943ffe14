"""Checks that a KServe v2 server computes the vs_triton ensemble's numbers, over HTTP and gRPC.

Sends the inputs of ``bench/vs_triton/check_same.py`` (batch 1 and batch 3) to model
``ensemble`` and compares CLASS and SEG with its numpy reference (rtol 1e-5, atol 1e-6): over
HTTP as JSON tensors (MLServer has no binary tensor extension), over gRPC as raw bytes (what
perf_analyzer sends). Answers may come as raw bytes or typed contents.

    bench/.venv-mlserver/bin/python bench/vs_mlserver/check.py --http 127.0.0.1:20000 \\
        --grpc 127.0.0.1:20001

Needs numpy, and for --grpc grpcio and MLServer's generated KServe stubs: MLServer's virtual
environment (``bench/vs_mlserver.sh`` makes it). Exit status 0 when every output matches.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vs_triton"))
from check_same import inputs, reference

Infer = Callable[[np.ndarray], dict[str, np.ndarray]]
OUTPUTS = ("CLASS", "SEG")
TIMEOUT = 10.0


def http_infer(address: str) -> Infer:
    url = f"http://{address}/v2/models/ensemble/infer"

    def infer(x: np.ndarray) -> dict[str, np.ndarray]:
        body = {
            "inputs": [
                {
                    "name": "INPUT",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "data": x.ravel().tolist(),
                }
            ],
            "outputs": [{"name": n} for n in OUTPUTS],
        }
        request = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            answer = json.loads(response.read())
        return {
            o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"])
            for o in answer["outputs"]
        }

    return infer


def grpc_infer(address: str) -> Infer:
    import grpc
    from mlserver.grpc import dataplane_pb2 as pb
    from mlserver.grpc.dataplane_pb2_grpc import GRPCInferenceServiceStub

    stub = GRPCInferenceServiceStub(grpc.insecure_channel(address))

    def infer(x: np.ndarray) -> dict[str, np.ndarray]:
        request = pb.ModelInferRequest(
            model_name="ensemble",
            inputs=[
                pb.ModelInferRequest.InferInputTensor(
                    name="INPUT", datatype="FP32", shape=list(x.shape)
                )
            ],
            outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in OUTPUTS],
            raw_input_contents=[np.ascontiguousarray(x, np.float32).tobytes()],
        )
        answer = stub.ModelInfer(request, timeout=TIMEOUT)
        got = {}
        for i, o in enumerate(answer.outputs):
            if answer.raw_output_contents:
                values = np.frombuffer(answer.raw_output_contents[i], np.float32)
            else:
                values = np.asarray(o.contents.fp32_contents, np.float32)
            got[o.name] = values.reshape(tuple(o.shape))
        return got

    return infer


def check(label: str, infer: Infer) -> bool:
    ok = True
    for x in inputs():
        try:
            got = infer(x)
        except Exception as error:  # any failure is a mismatch
            print(f"{label}: request {x.shape} failed: {error}")
            ok = False
            continue
        for name, expected in reference(x).items():
            actual = np.asarray(got.get(name))
            if actual.shape != expected.shape or not np.allclose(
                actual, expected, rtol=1e-5, atol=1e-6
            ):
                ok = False
                print(f"{label}: {name} differs for input {x.shape}")
    print(f"{label}: {'same numbers as the numpy reference' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="append", default=[], help="HOST:PORT (repeatable)")
    parser.add_argument("--grpc", action="append", default=[], help="HOST:PORT (repeatable)")
    args = parser.parse_args()
    if not args.http and not args.grpc:
        parser.error("give --http HOST:PORT and/or --grpc HOST:PORT")
    ok = True
    for address in args.http:
        ok &= check(f"http://{address}", http_infer(address))
    for address in args.grpc:
        ok &= check(f"grpc://{address}", grpc_infer(address))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
