"""`mlserver start`, plus the one Triton endpoint perf_analyzer reads before it measures.

perf_analyzer asks the server for the model's Triton config (its batch size, inputs and
outputs) once, before its first request: ``GET /v2/models/<name>/config`` over HTTP, the
``inference.GRPCInferenceService/ModelConfig`` RPC over gRPC. Both are Triton extensions of the
KServe v2 protocol that MLServer does not offer, so perf_analyzer stops with "failed to get
model config". This launcher adds them, answering a fixed config for the model ``ensemble``
(``max_batch_size: 8``, INPUT FP32 [16], CLASS FP32 [10], SEG FP32 [16], as
``bench/vs_triton/orchestrion_models/ensemble`` declares), then runs MLServer's own command
line unchanged. Inference requests do not go through anything added here.

    bench/.venv-mlserver/bin/python bench/vs_mlserver/serve.py start MODEL_FOLDER

Run with MLServer's virtual environment (``bench/vs_mlserver.sh`` makes it); settings come
from ``MLSERVER_*`` environment variables as for ``mlserver start``.
"""

from __future__ import annotations

from typing import Any

import grpc
import mlserver.grpc.server as grpc_server
import mlserver.rest.server as rest_server
from fastapi.responses import JSONResponse
from mlserver.cli.main import main

MODEL = "ensemble"
MAX_BATCH_SIZE = 8
INPUTS = [("INPUT", [16])]
OUTPUTS = [("CLASS", [10]), ("SEG", [16])]
TYPE_FP32 = 11  # Triton's model_config.proto, enum DataType

CONFIG_JSON: dict[str, Any] = {
    "name": MODEL,
    "platform": "",
    "backend": "python",
    "max_batch_size": MAX_BATCH_SIZE,
    "input": [{"name": n, "data_type": "TYPE_FP32", "dims": d} for n, d in INPUTS],
    "output": [{"name": n, "data_type": "TYPE_FP32", "dims": d} for n, d in OUTPUTS],
}


# -- the same config in protobuf's wire format (ModelConfigResponse), without Triton's stubs ---
# (tritonclient's generated classes cannot be imported next to MLServer's: both register
# ``inference.*`` in protobuf's default pool, "duplicate symbol 'inference.ServerLiveRequest'")


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values take ten bytes
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # a length-delimited field
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:  # a varint field
    return _varint(number << 3) + _varint(value)


def _tensor(name: str, dims: list[int], dims_field: int) -> bytes:
    # ModelInput: name 1, data_type 2, dims 4; ModelOutput: name 1, data_type 2, dims 3.
    packed = b"".join(_varint(d) for d in dims)
    return _field(1, name.encode()) + _int_field(2, TYPE_FP32) + _field(dims_field, packed)


def _config_response() -> bytes:
    # ModelConfig: name 1, max_batch_size 4, input 5, output 6, backend 17.
    config = (
        _field(1, MODEL.encode())
        + _int_field(4, MAX_BATCH_SIZE)
        + b"".join(_field(5, _tensor(n, d, 4)) for n, d in INPUTS)
        + b"".join(_field(6, _tensor(n, d, 3)) for n, d in OUTPUTS)
        + _field(17, b"python")
    )
    return _field(1, config)  # ModelConfigResponse: config 1


CONFIG_RESPONSE = _config_response()


# -- the two endpoints, added where MLServer builds its servers ------------------------------


async def _config_http(model_name: str) -> JSONResponse:
    if model_name != MODEL:
        return JSONResponse({"error": f"unknown model '{model_name}'"}, status_code=404)
    return JSONResponse(CONFIG_JSON)


async def _config_grpc(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return CONFIG_RESPONSE  # the request names the model; there is only one


_create_app = rest_server.create_app
_create_server = grpc_server.GRPCServer._create_server


def _create_app_with_config(*args: Any, **kwargs: Any) -> Any:
    app = _create_app(*args, **kwargs)
    app.add_api_route("/v2/models/{model_name}/config", _config_http, methods=["GET"])
    return app


def _create_server_with_config(self: Any) -> Any:
    server = _create_server(self)
    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelConfig": grpc.unary_unary_rpc_method_handler(_config_grpc)},
    )
    server.add_generic_rpc_handlers((handler,))
    return server


rest_server.create_app = _create_app_with_config
grpc_server.GRPCServer._create_server = _create_server_with_config

if __name__ == "__main__":
    main()
