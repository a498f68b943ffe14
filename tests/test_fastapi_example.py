"""examples/fastapi_app over real HTTP: uvicorn serves the FastAPI app (which opens the image
pipeline with ``orchestrion.aio``) on a free loopback port; concurrent uploads are answered,
an image that cannot be decoded is a 422 and the app serves on, and SIGTERM stops it cleanly."""

from __future__ import annotations

import concurrent.futures
import http.client
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from orchestrion.testing import free_port

ROOT = Path(__file__).resolve().parent.parent


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(96, 128, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _post_image(port: int, data: bytes) -> tuple[int, Any]:
    boundary = "orchestrion-test-boundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="x.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(
            "POST",
            "/classify",
            body=body,
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.fixture(scope="module")
def app_port() -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "examples.fastapi_app.app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(process.stdout.read().decode() if process.stdout else "exited")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", "/health")
                if json.loads(connection.getresponse().read()).get("ready"):
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise TimeoutError("the FastAPI example did not become ready in 120 s")
        yield port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(60)
        finally:
            if process.poll() is None:
                process.kill()
        output = process.stdout.read().decode() if process.stdout else ""
        # uvicorn shuts down gracefully, then ends by the signal it caught (-SIGTERM).
        assert code in (0, -signal.SIGTERM), output
        assert "Application shutdown complete." in output
        assert "Traceback" not in output, output


def test_concurrent_uploads_are_classified(app_port: int) -> None:
    """Eight uploads at once: each gets its five top classes (probabilities, descending)
    and a segmentation mean in [0, 1]; the same image gets the same answer."""
    images = [_png(i % 4) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda data: _post_image(app_port, data), images))
    for status, body in answers:
        assert status == 200, body
        probabilities = [c["probability"] for c in body["classes"]]
        assert len(probabilities) == 5
        assert probabilities == sorted(probabilities, reverse=True)
        assert all(0 <= p <= 1 for p in probabilities)
        assert 0 <= body["segmentation_mean"] <= 1
    assert answers[0][1] == answers[4][1]


def test_an_image_that_cannot_be_decoded_is_a_422_and_the_app_serves_on(app_port: int) -> None:
    """Bytes that are no image: a 422 naming the preprocessing model; the next upload works."""
    status, body = _post_image(app_port, b"not an image at all")
    assert status == 422
    assert "image_preprocess_model" in body["detail"]
    status, _ = _post_image(app_port, _png(7))
    assert status == 200
