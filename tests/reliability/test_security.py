"""Security of `orchestrion serve`, end to end through real processes: what it binds, its size
limits, Redis credentials that never leak, Redis over TLS, values read from Redis validated
before use, and a load API that never leaves the model repository."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
import trustme
from tritonclient.utils import InferenceServerException

from orchestrion.testing import RedisServer, Served, get, post
from support.raw_http import exchange, host_port, status_of
from support.reliability_report import record
from support.served import MODELS, pipeline_body, serve_command, start_server

# -- helpers -------------------------------------------------------------------------------


def _wait_for(served: Served, text: str, since: int = 0, timeout: float = 10.0) -> bool:
    """Whether ``text`` appears in a line printed after line ``since`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in line for line in served.output[since:]):
            return True
        time.sleep(0.02)
    return False


def _run_to_exit(
    *flags: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, str]:
    """Run ``orchestrion serve`` that is expected to fail at start: its exit code and output."""
    done = subprocess.run(
        serve_command(*flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**_clean_env(), "COLUMNS": "200", **(env or {})},
        timeout=timeout,
        check=False,
    )
    return done.returncode, done.stdout.decode(errors="replace")


_CREDENTIAL_VARIABLES = (
    "ORCHESTRION_REDIS_USERNAME",
    "ORCHESTRION_REDIS_PASSWORD",
    "TRITONCACHE_REDIS_USERNAME",
    "TRITONCACHE_REDIS_PASSWORD",
)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _CREDENTIAL_VARIABLES}


def _external_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one (Linux ioctl)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15])
                )  # SIOCGIFADDR
            except OSError:
                continue
        address = socket.inet_ntoa(packed[20:24])
        if not address.startswith("127."):
            return address
    return None


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=3).close()
    except ConnectionRefusedError:
        return True
    return False


# -- binding -------------------------------------------------------------------------------


def test_binds_loopback_unless_told_otherwise() -> None:
    """Without address flags HTTP, gRPC and metrics listen on 127.0.0.1 only (the machine's
    other address is refused); --http-address 0.0.0.0 opens HTTP alone, --host 0.0.0.0 all."""
    external = _external_ipv4()
    served = start_server()
    try:
        endpoints = {"http": served.http, "grpc": served.grpc, "metrics": served.metrics}
        for kind, address in endpoints.items():
            host, port = host_port(address)
            assert host == "127.0.0.1", (kind, address)
            if external is not None:
                assert _refused(external, port), f"{kind} answers on {external}:{port}"
    finally:
        assert served.stop() == 0, served.text()

    served = start_server("--http-address", "0.0.0.0")
    try:
        assert host_port(served.http)[0] == "0.0.0.0"
        assert host_port(served.grpc)[0] == "127.0.0.1"
        assert host_port(served.metrics)[0] == "127.0.0.1"
        if external is not None:
            port = host_port(served.http)[1]
            assert get(f"{external}:{port}", "/v2/health/live")[0] == 200
            assert _refused(external, host_port(served.grpc)[1])
            assert _refused(external, host_port(served.metrics)[1])
    finally:
        assert served.stop() == 0, served.text()

    served = start_server("--host", "0.0.0.0")
    try:
        for address in (served.http, served.grpc, served.metrics):
            assert host_port(address)[0] == "0.0.0.0", address
        if external is not None:
            http_port = host_port(served.http)[1]
            assert get(f"{external}:{http_port}", "/v2/health/live")[0] == 200
            metrics_port = host_port(served.metrics)[1]
            assert get(f"{external}:{metrics_port}", "/metrics")[0] == 200
            with grpcclient.InferenceServerClient(
                f"{external}:{host_port(served.grpc)[1]}"
            ) as client:
                assert client.is_server_live()
    finally:
        assert served.stop() == 0, served.text()
    checked = f"also refused on {external}" if external else "no other IPv4 address to try"
    record(
        "Security",
        "Default binding of HTTP, gRPC and metrics; --http-address 0.0.0.0; --host 0.0.0.0",
        "3 servers x 3 endpoints",
        f"default: all on 127.0.0.1 ({checked}); each flag binds exactly what it names",
    )


# -- size limits ---------------------------------------------------------------------------


def _identity_fp32(count: int) -> grpcclient.InferInput:
    item = grpcclient.InferInput("IN_FP32", [1, count], "FP32")
    item.set_data_from_numpy(np.arange(count, dtype=np.float32).reshape(1, count))
    return item


def test_request_and_message_size_limits() -> None:
    """Bodies over --http-max-input-size (declared, chunked, or inflating from gzip) get 413,
    headers over 64 KiB 431/400, a gRPC message over --grpc-max-message-size RESOURCE_EXHAUSTED;
    the server keeps serving on both protocols."""
    served = start_server("--http-max-input-size", "4096", "--grpc-max-message-size", "8192")
    path = "/v2/models/pipeline/infer"
    try:
        status, body = post(served.http, path, b" " * 5000)
        assert status == 413, body
        assert b"--http-max-input-size" in body
        chunks = b"".join(b"7d0\r\n" + b" " * 2000 + b"\r\n" for _ in range(3)) + b"0\r\n\r\n"
        reply = exchange(
            served.http,
            f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + chunks,
        )
        assert status_of(reply) == 413, reply[:300]
        bomb = gzip.compress(b" " * 1_000_000)
        status, body = post(served.http, path, bomb, {"Content-Encoding": "gzip"})
        assert status == 413, body
        reply = exchange(
            served.http,
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        )
        assert status_of(reply) in (400, 431), reply[:300]
        with grpcclient.InferenceServerClient(served.grpc) as client:
            with pytest.raises(InferenceServerException) as refused:
                client.infer("identity_batch", [_identity_fp32(4096)])
            assert "RESOURCE_EXHAUSTED" in str(refused.value.status()), refused.value
            small = client.infer("identity_batch", [_identity_fp32(16)])
            np.testing.assert_array_equal(
                small.as_numpy("OUT_FP32"), np.arange(16, dtype=np.float32).reshape(1, 16)
            )
        status, body = post(served.http, path, pipeline_body(1.0))
        assert status == 200, body
    finally:
        assert served.stop() == 0, served.text()
    record(
        "Security",
        "HTTP bodies over --http-max-input-size=4096: 5000 bytes declared, 6000 chunked "
        "(no Content-Length), a 1 MB gzip bomb of 1 KiB; a 100 KiB header",
        "4 requests",
        "413 for each body (before inflating past the limit), 431/400 for the header",
    )
    record(
        "Security",
        "gRPC message over --grpc-max-message-size=8192 (a 16 KiB tensor)",
        "1 request",
        "RESOURCE_EXHAUSTED; a small request on the same channel and an HTTP infer still served",
    )


# -- credentials ---------------------------------------------------------------------------


class _Load:
    """Threads that send distinct pipeline requests over HTTP until stopped."""

    def __init__(self, address: str, threads: int = 2) -> None:
        self.address = address
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        i = 0
        while not self._stop.is_set():
            status, _ = post(
                self.address, "/v2/models/pipeline/infer", pipeline_body(index * 1000 + i % 50)
            )
            self.statuses.append(status)
            i += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def _everything_reported(served: Served) -> list[str]:
    """Every document, error and metric the server gives out, over HTTP and gRPC."""
    texts: list[str] = []
    for path in (
        "/v2",
        "/v2/models/pipeline",
        "/v2/models/pipeline/config",
        "/v2/models/pipeline/stats",
        "/v2/models/stats",
        "/v2/models/nope",
        "/v2/trace/setting",
        "/v2/logging",
    ):
        texts.append(get(served.http, path)[1].decode(errors="replace"))
    for path, body in (
        ("/v2/repository/index", b"{}"),
        ("/v2/models/pipeline/infer", b"{not json"),
        ("/v2/models/nope/infer", pipeline_body(1.0)),
        ("/v2/repository/models/pipeline/load", b"{}"),
        ("/v2/models/pipeline/infer", b'{"inputs": [{"name": "X"}]}'),
    ):
        texts.append(post(served.http, path, body)[1].decode(errors="replace"))
    texts.append(get(served.metrics, "/metrics")[1].decode(errors="replace"))
    with grpcclient.InferenceServerClient(served.grpc) as client:
        texts.append(json.dumps(client.get_server_metadata(as_json=True)))
        texts.append(json.dumps(client.get_model_metadata("pipeline", as_json=True)))
        texts.append(json.dumps(client.get_model_config("pipeline", as_json=True)))
        texts.append(json.dumps(client.get_inference_statistics(as_json=True)))
        item = grpcclient.InferInput("INPUT", [1, 16], "FP32")
        item.set_data_from_numpy(np.full((1, 16), 3.0, np.float32))
        client.infer("pipeline", [item])
        for call in (
            lambda: client.infer("nope", [item]),
            lambda: client.load_model("pipeline"),
            lambda: client.get_model_config("nope"),
        ):
            try:
                call()
            except InferenceServerException as exc:
                texts.append(str(exc))
    return texts


@pytest.mark.parametrize(
    "source", ["flag", "ORCHESTRION_REDIS_PASSWORD", "TRITONCACHE_REDIS_PASSWORD"]
)
def test_redis_password_never_appears_in_output_or_answers(tmp_path: Path, source: str) -> None:
    """A Redis password (by flag or environment variable) is absent from everything the server
    prints or answers: a start-up refused for it, --log-verbose 1 logs, a Redis outage under
    load and the recovery, HTTP/gRPC errors, documents, statistics, metrics and the SIGTERM."""
    secret = "orchsecret" + secrets.token_hex(16)
    decoy = "decoy" + secrets.token_hex(16)
    server = RedisServer(tmp_path, ["--requirepass", secret])
    server.start()
    admin = redis.Redis(host="127.0.0.1", port=server.port, password=secret)
    flags = [f"--cache-config={c}" for c in [*server.cache_config, "redis,retry_interval=100"]]
    flags.append("--frontend-cache-size=0")  # every request goes to Redis (the outage)
    env: dict[str, str] = {}
    if source == "flag":
        flags.append(f"--cache-config=redis,password={secret}")
    else:
        env[source] = secret
    try:
        # The password given is wrong: start-up is refused, without showing it.
        admin.config_set("requirepass", decoy)
        code, output = _run_to_exit(*flags, env=env)
        admin.config_set("requirepass", secret)
        assert code != 0, output
        assert "rejected the credentials" in output, output[-2000:]
        assert secret not in output

        served = start_server(*flags, "--log-verbose", "1", env=env)
        try:
            for _ in range(2):
                status, body = post(served.http, "/v2/models/pipeline/infer", pipeline_body(1))
                assert status == 200, body
            reported = _everything_reported(served)
            load = _Load(served.http)
            deadline = time.monotonic() + 10
            while len(load.statuses) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            mark = len(served.output)
            server.kill()
            outage = _wait_for(served, "redis cache unavailable", mark)
            reported += _everything_reported(served)
            mark = len(served.output)
            server.start()  # same port, same password
            recovered = _wait_for(served, "available again", mark)
            load.stop()
            reported += _everything_reported(served)
        finally:
            code = served.stop()
        assert code == 0, served.text()[-3000:]
        assert outage, served.text()[-3000:]
        assert recovered, served.text()[-3000:]
        assert set(load.statuses) == {200}, set(load.statuses)
        assert "DEBUG" in served.text()  # verbose logging was on
        assert secret not in served.text()
        for text in reported:
            assert secret not in text, text
    finally:
        admin.close()
        server.stop()
    record(
        "Security",
        f"Redis password by {source}: searched in all the output and answers of a refused "
        "start-up and of a --log-verbose 1 server through a Redis outage under load, HTTP and "
        "gRPC errors, documents, statistics, metrics and SIGTERM",
        "1 refused start-up + 1 server (~45 documents, errors and metrics texts)",
        "the password appears nowhere; the outage and recovery are logged, every request "
        "answered 200",
    )


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_redis(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisServer, dict[str, str]]]:
    """A TLS-only redis-server (client certificates required), certificates from trustme."""
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    issued = ca.issue_cert("127.0.0.1", "localhost")
    issued.private_key_pem.write_to_path(str(folder / "server.key"))
    issued.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    client = ca.issue_cert("orchestrion-client")
    client.private_key_pem.write_to_path(str(folder / "client.key"))
    client.cert_chain_pems[0].write_to_path(str(folder / "client.pem"))
    files = {p.name: str(p) for p in folder.iterdir()}
    server = RedisServer(
        folder,
        [
            "--tls-cert-file",
            files["server.pem"],
            "--tls-key-file",
            files["server.key"],
            "--tls-ca-cert-file",
            files["ca.pem"],
        ],
        tls=True,
    )
    server.start()
    try:
        yield server, files
    finally:
        server.stop()


def _tls_flags(files: dict[str, str], *, ca: bool = True) -> list[str]:
    return [
        "--cache-config=redis,tls_enabled=true",
        f"--cache-config=redis,cert={files['client.pem']}",
        f"--cache-config=redis,key={files['client.key']}",
        *([f"--cache-config=redis,cacert={files['ca.pem']}"] if ca else []),
    ]


def _pipeline_cache_counts(served: Served) -> tuple[int, int]:
    status, body = get(served.http, "/v2/models/pipeline/stats")
    assert status == 200, body
    stats = json.loads(body)["model_stats"][0]["inference_stats"]
    return int(stats["cache_hit"]["count"]), int(stats["cache_miss"]["count"])


def test_redis_over_tls_end_to_end(tls_redis: tuple[RedisServer, dict[str, str]]) -> None:
    """orchestrion serve with tls_enabled, cert, key and cacert caches the pipeline in a
    TLS-only Redis: the second identical HTTP request is a hit in the statistics and metrics,
    and the entry is in Redis."""
    server, files = tls_redis
    client = redis.Redis(
        host="127.0.0.1",
        port=server.port,
        ssl=True,
        ssl_certfile=files["client.pem"],
        ssl_keyfile=files["client.key"],
        ssl_ca_certs=files["ca.pem"],
    )
    flags = [f"--cache-config={c}" for c in server.cache_config] + _tls_flags(files)
    served = start_server(*flags)
    try:
        first = post(served.http, "/v2/models/pipeline/infer", pipeline_body(7.0))
        assert first[0] == 200, first
        deadline = time.monotonic() + 10
        while not client.keys("orchestrion:*"):  # written over TLS
            assert time.monotonic() < deadline, "the entry never reached Redis"
            time.sleep(0.02)
        second = post(served.http, "/v2/models/pipeline/infer", pipeline_body(7.0))
        assert second[0] == 200, second
        assert json.loads(first[1])["outputs"] == json.loads(second[1])["outputs"]
        assert _pipeline_cache_counts(served) == (1, 1)  # read back over TLS
        metrics = get(served.metrics, "/metrics")[1].decode()
        assert any(
            line.startswith("nv_cache_num_hits ") and float(line.split()[-1]) >= 1
            for line in metrics.splitlines()
        ), metrics
    finally:
        client.close()
        assert served.stop() == 0, served.text()
    record(
        "Security",
        "Redis cache over TLS (trustme CA, client certificates, TLS-only redis-server) "
        "through orchestrion serve",
        "2 identical HTTP requests",
        "the entry written to Redis over TLS, then read back: a miss then a hit in "
        "/v2/models/pipeline/stats and nv_cache_num_hits",
    )


@pytest.mark.parametrize("how", ["plaintext", "tls without the CA"])
def test_tls_redis_with_a_wrong_config_fails_start_up_clearly(
    tls_redis: tuple[RedisServer, dict[str, str]], how: str
) -> None:
    """Against a TLS-only Redis, a plaintext config (or TLS that cannot verify the server)
    fails start-up with a non-zero exit and one clear message, no traceback."""
    server, files = tls_redis
    flags = [f"--cache-config={c}" for c in server.cache_config]
    if how != "plaintext":
        flags += _tls_flags(files, ca=False)
    started = time.monotonic()
    code, output = _run_to_exit(*flags)
    assert time.monotonic() - started < 30
    assert code != 0, output
    assert f"cannot reach Redis at 127.0.0.1:{server.port}" in output, output[-2000:]
    record(
        "Security",
        f"orchestrion serve against a TLS-only Redis with a wrong config ({how})",
        "1 start-up",
        "start-up refused, non-zero exit, a message naming Redis; checked: no traceback",
    )
    assert "Traceback" not in output, output[-3000:]


# -- values read from Redis ----------------------------------------------------------------


class _CachedPipeline:
    """A served pipeline cached in a real Redis, with the entries of two requests, A and B."""

    def __init__(self, served: Served, client: redis.Redis) -> None:
        self.served = served
        self.client = client
        self.key_a = self.key_b = b""
        self.original_a = self.original_b = b""
        self.reference_a: Any = None

    def keys(self) -> set[bytes]:
        return set(self.client.keys("orchestrion:*"))

    def settle(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.keys()) < count:
            assert time.monotonic() < deadline, "the entries never reached Redis"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def cached_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_CachedPipeline]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    client = redis.Redis(host="127.0.0.1", port=server.port)
    flags = [f"--cache-config={c}" for c in server.cache_config]
    # No tier in the front end: each trial's request must reach Redis, whose values change.
    served = start_server(*flags, "--log-verbose", "1", "--frontend-cache-size=0")
    try:
        state = _CachedPipeline(served, client)
        status, body = post(served.http, "/v2/models/pipeline/infer", pipeline_body(1.0))
        assert status == 200, body
        state.reference_a = json.loads(body)["outputs"]
        state.settle(1)
        (state.key_a,) = state.keys()
        status, body = post(served.http, "/v2/models/pipeline/infer", pipeline_body(2.0))
        assert status == 200, body
        assert json.loads(body)["outputs"] != state.reference_a
        state.settle(2)
        (state.key_b,) = state.keys() - {state.key_a}
        state.original_a = client.get(state.key_a) or b""
        state.original_b = client.get(state.key_b) or b""
        yield state
    finally:
        code = served.stop()
        client.close()
        server.stop()
    assert code == 0, served.text()[-3000:]
    assert "Traceback" not in served.text(), served.text()[-3000:]


def _trial(state: _CachedPipeline, value: bytes) -> tuple[bool, bool, list[str]]:
    """Store ``value`` under request A's key and send A: (a miss?, the right answer?, the
    lines logged meanwhile). Leaves A's intact entry in Redis again."""
    served = state.served
    state.client.set(state.key_a, value)
    hits, misses = _pipeline_cache_counts(served)
    mark = len(served.output)
    status, body = post(served.http, "/v2/models/pipeline/infer", pipeline_body(1.0))
    assert status == 200, body
    after_hits, after_misses = _pipeline_cache_counts(served)
    miss = (after_hits, after_misses) == (hits, misses + 1)
    right = json.loads(body)["outputs"] == state.reference_a
    if miss:  # the miss stores the right entry again: wait until it has landed
        deadline = time.monotonic() + 10
        while state.client.get(state.key_a) == value and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.05)
    state.client.set(state.key_a, state.original_a)
    deadline = time.monotonic() + 1  # the log line may still be on its way through the pipe
    while not _about_a(state, served.output[mark:]) and time.monotonic() < deadline:
        time.sleep(0.02)
    logged = [line for line in served.output[mark:] if "cache" in line]
    return miss, right, logged


def _about_a(state: _CachedPipeline, lines: list[str]) -> bool:
    hex_a = state.key_a.decode().split(":", 1)[1]
    return any(hex_a in line or "belongs to another request" in line for line in lines)


def test_corrupted_or_foreign_redis_values_are_logged_misses(
    cached_pipeline: _CachedPipeline,
) -> None:
    """Random bytes, truncated or padded entries, a broken header, and a well-formed entry of
    another request copied onto this request's key: each is a miss with the right answer and
    a log line (the first of each kind a WARNING), never an error or a wrong answer."""
    state = cached_pipeline
    original = state.original_a
    magic_end = len(b"ORCHCE3\n") + 4
    values = {
        "random bytes": os.urandom(len(original)),
        "the magic, then random bytes": original[:8] + os.urandom(len(original) - 8),
        "empty": b"",
        "truncated in the header": original[: magic_end + 10],
        "truncated in the tensors": original[: len(original) // 2 + 20],
        "last byte cut": original[:-1],
        "a byte appended": original + b"\0",
        "a header that is not JSON": original[:8] + struct.pack("<I", 5) + b"{nope" + b"x" * 64,
        "a header length past the end": original[:8] + struct.pack("<I", 2**31) + original[12:],
        "a foreign well-formed entry (request B's)": state.original_b,
    }
    failures = []
    for what, value in values.items():
        miss, right, logged = _trial(state, value)
        if not (miss and right and _about_a(state, logged)):
            failures.append(f"{what}: miss={miss} right={right} logged={logged}")
    text = state.served.text()
    assert failures == [], failures
    lines = text.split("\n")
    assert any("WARNING" in line and "ignoring the value of" in line for line in lines)
    assert any("WARNING" in line and "belongs to another request" in line for line in lines)
    status, _ = get(state.served.http, "/v2/health/ready")
    assert status == 200
    record(
        "Security",
        "Values in Redis replaced under a served pipeline's key: random bytes, truncated, "
        "padded, broken headers, and a well-formed entry of another request",
        f"{len(values)} values",
        "each a miss with the right answer, and logged (the first of each kind at WARNING, "
        "later ones at DEBUG); no error",
    )


def _split(value: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """An entry's JSON header and its tensors' bytes (see protocols/_cache_key.py)."""
    (length,) = struct.unpack_from("<I", value, 8)
    header = json.loads(value[12 : 12 + length])
    chunks, offset = [], 12 + length
    for _, _, _, nbytes in header["outputs"]:
        chunks.append(value[offset : offset + nbytes])
        offset += nbytes
    return header, chunks


def _join(header: dict[str, Any], chunks: list[bytes]) -> bytes:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return b"ORCHCE3\n" + struct.pack("<I", len(encoded)) + encoded + b"".join(chunks)


def _crafted(original: bytes) -> dict[str, bytes]:
    """Well-formed entries with this request's key but outputs the model never gives.

    (An entry that leaves an output out is not among them: a model may leave outputs out of a
    response, so such an entry is as valid as any other. Nor are right-shaped entries with
    wrong values: only access control on Redis keeps a writer from forging those.)"""
    header, chunks = _split(original)
    names = [o[0] for o in header["outputs"]]
    index = names.index("CLASS")

    def variant(change: Callable[[dict[str, Any], list[bytes]], None]) -> bytes:
        copy, parts = json.loads(json.dumps(header)), list(chunks)
        change(copy, parts)
        return _join(copy, parts)

    def dtype(h: dict[str, Any], _: list[bytes]) -> None:
        h["outputs"][index][1] = "INT32"  # same bytes, read as integers

    def shape(h: dict[str, Any], _: list[bytes]) -> None:
        h["outputs"][index][2] = list(reversed(h["outputs"][index][2]))  # [1, 2] -> [2, 1]

    def renamed(h: dict[str, Any], _: list[bytes]) -> None:
        h["outputs"][index][0] = "EVIL"

    def extra(h: dict[str, Any], parts: list[bytes]) -> None:
        h["outputs"].append(["EXTRA", "FP32", [1, 1], 4])
        parts.append(np.float32(42).tobytes())

    return {
        "CLASS as INT32": variant(dtype),
        "CLASS with shape [2, 1]": variant(shape),
        "CLASS renamed EVIL": variant(renamed),
        "an extra output": variant(extra),
    }


def test_crafted_redis_entries_with_wrong_outputs_are_misses(
    cached_pipeline: _CachedPipeline,
) -> None:
    """A well-formed entry under this request's key (its digest and signature) whose outputs
    the model never gives (a wrong data type, shape or name, a missing or an extra output) is
    a miss with a log line and the right answer, not a hit with a wrong answer."""
    state = cached_pipeline
    crafted = _crafted(state.original_a)
    failures = []
    for what, value in crafted.items():
        miss, right, logged = _trial(state, value)
        if not (miss and right and _about_a(state, logged)):
            failures.append(f"{what}: miss={miss} right answer={right} logged={bool(logged)}")
    happened = (
        "each a miss with the right answer"
        if not failures
        else f"{len(failures)} of {len(crafted)} served as hits with a wrong answer"
    )
    record(
        "Security",
        "Crafted well-formed entries with the request's own key in Redis, whose outputs the "
        "pipeline never gives (CLASS as INT32, shape [2, 1], renamed; an extra output)",
        f"{len(crafted)} entries",
        happened,
    )
    assert failures == [], failures


# -- the load API and the repository -------------------------------------------------------


@pytest.fixture(scope="module")
def explicit_repository(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Served, Path]]:
    """Explicit mode over a private repository (square), next to a loadable model folder
    outside it ('outside'), which the repository also links to ('escape' -> ../outside)."""
    base = tmp_path_factory.mktemp("traversal")
    repository = base / "repository"
    repository.mkdir()
    shutil.copytree(MODELS / "square", repository / "square")
    outside = base / "outside"
    shutil.copytree(MODELS / "square", outside)
    config = outside / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "square"', 'name: "outside"'))
    (repository / "escape").symlink_to(outside, target_is_directory=True)
    served = start_server(
        "--model-control-mode=explicit", "--load-model", "square", repository=repository
    )
    yield served, outside
    assert served.stop() == 0, served.text()


def _traversal_names(outside: str) -> list[str]:
    return [
        "..",
        ".",
        "../outside",
        "/etc",
        outside,
        "%2e%2e",
        "%2e%2e%2foutside",
        "a/../../outside",
        "square/../../outside",
        "..\\outside",
        "out\0side",
        "square\0",
        "escape",
        "",
    ]


def test_load_api_never_leaves_the_repository(explicit_repository: tuple[Served, Path]) -> None:
    """Path-like model names (.., ../x, absolute paths, percent-encoded dots, NUL, backslash,
    a symlink out of the repository) are refused over HTTP (400/404 with a JSON error, or
    Triton's 500 "failed to load ..., failed to poll from model repository" for a name that
    is no repository folder) and gRPC (INVALID_ARGUMENT/NOT_FOUND, or INTERNAL with that
    text); nothing outside is loaded and the server keeps serving."""
    served, outside = explicit_repository
    names = _traversal_names(str(outside))
    failures = []
    segments = [urllib.parse.quote(name, safe="") for name in names] + [
        "..",
        "%2e%2e",
        "%2E%2E%2Foutside",
        "..%2foutside",
        "..%5coutside",
        "square%00",
    ]
    for segment in segments:
        path = f"/v2/repository/models/{segment}/load"
        status, body = post(served.http, path, b"{}")
        error = json.loads(body or b"{}").get("error", "")
        polled = status == 500 and "failed to poll from model repository" in error
        if (status not in (400, 404) and not polled) or not error:
            failures.append(f"HTTP {segment[:40]}: {status} {body[:120]!r}")
    status, body = post(served.http, "/v2/repository/models/../outside/load", b"{}")
    if status not in (400, 404):
        failures.append(f"HTTP raw ../outside: {status} {body[:200]!r}")
    with grpcclient.InferenceServerClient(served.grpc) as client:
        for name in names:
            try:
                client.load_model(name)
            except InferenceServerException as exc:
                polled = "INTERNAL" in str(exc.status()) and "failed to poll" in exc.message()
                refused = any(c in str(exc.status()) for c in ("INVALID_ARGUMENT", "NOT_FOUND"))
                if not (refused or polled):
                    failures.append(f"gRPC {name[:40]!r}: {exc.status()} {exc.message()[:120]}")
            else:
                failures.append(f"gRPC {name[:40]!r}: loaded")
        assert not client.is_model_ready("outside")
        assert not client.is_model_ready("escape")
        assert client.is_model_ready("square")
        item = grpcclient.InferInput("Y", [1], "INT32")
        item.set_data_from_numpy(np.array([7], np.int32))
        assert client.infer("square", [item]).as_numpy("Z").tolist() == [49]
    index = json.loads(post(served.http, "/v2/repository/index", b"{}")[1])
    loaded = {m["name"] for m in index if m.get("state") == "READY"}
    assert loaded == {"square"}, index
    assert get(served.http, "/v2/models/outside")[0] == 404
    record(
        "Security",
        "Load API with path-like names in explicit mode: .., ../x, absolute paths, "
        "%2e%2e, a/../../x, backslash, NUL, a symlink out of the repository",
        f"{len(segments) + 1} URLs over HTTP, {len(names)} names over gRPC",
        "each refused (HTTP 400/404 with a JSON error, gRPC INVALID_ARGUMENT/NOT_FOUND, or "
        "Triton's 500/INTERNAL 'failed to poll from model repository' for no such folder); "
        "nothing outside the repository loaded; the server keeps serving",
    )
    assert failures == [], failures


def test_load_api_refuses_a_very_long_name_cleanly(
    explicit_repository: tuple[Served, Path],
) -> None:
    """A 10,000-character model name (longer than a file name may be) is refused like any
    other name that is no repository folder: HTTP 400/404 and gRPC INVALID_ARGUMENT/NOT_FOUND,
    not an internal error that shows the repository's absolute path."""
    served, _ = explicit_repository
    name = "a" * 10_000
    status, body = post(served.http, f"/v2/repository/models/{name}/load", b"{}")
    with grpcclient.InferenceServerClient(served.grpc) as client:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model(name)
        assert client.is_model_ready("square")
    grpc_status = str(refused.value.status())
    record(
        "Security",
        "Load API with a 10,000-character model name, over HTTP and gRPC",
        "2 requests",
        f"HTTP {status}, gRPC {grpc_status.removeprefix('StatusCode.')}; the server keeps serving",
    )
    assert status in (400, 404), body[:200]
    assert "INVALID_ARGUMENT" in grpc_status or "NOT_FOUND" in grpc_status, refused.value


def test_error_answers_name_neither_other_models_nor_the_servers_paths(tmp_path: Path) -> None:
    """An unknown model's error does not list what else is loaded, and a failed load names
    its files relative to the repository: a client learns neither other models nor where
    the server keeps its files (the server's log has the whole story)."""
    root = tmp_path / "private-repository"
    shutil.copytree(MODELS / "square", root / "square")
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "config.pbtxt").write_text('name: "broken"\nmax_batch_size: nope\n')
    (root / "broken" / "1" / "model.py").write_text("def execute(X):\n    return {}\n")
    served = start_server("--model-control-mode=explicit", "--load-model=square", repository=root)
    answers: list[str] = []
    try:
        answers.append(post(served.http, "/v2/models/secret/infer", b"{}")[1].decode())
        answers.append(post(served.http, "/v2/repository/models/broken/load", b"")[1].decode())
        client = grpcclient.InferenceServerClient(served.grpc)
        try:
            for call in (
                lambda: client.get_model_metadata("secret"),
                lambda: client.load_model("broken"),
            ):
                with pytest.raises(InferenceServerException) as caught:
                    call()
                answers.append(str(caught.value))
        finally:
            client.close()
    finally:
        served.stop()
    leaks = [a for a in answers if "square" in a or str(tmp_path) in a]
    assert leaks == []
    assert all("broken/config.pbtxt" in a for a in answers[1::2])
    assert str(root) in served.text()  # the operator still sees where
    record(
        "Security",
        "Error answers to a client: an unknown model's name, and a load of a broken config, "
        "over HTTP and gRPC",
        f"{len(answers)} error answers",
        "none lists the other loaded models or the repository's path (files named relative "
        "to it); the server's log keeps the full path",
    )
