"""The container images of deploy/container: size, build time, and how fast a container
serves after ``docker run`` and stops after SIGTERM.

A Docker daemon of this script's own (tests/support/containers.py: Debian's docker.io, as
root) builds each image from its shipped Dockerfile on a Debian bookworm base made by
debootstrap (the official Python image cannot be pulled here), then starts it ``--starts``
times, the way the tests run it (user 1000, read-only root, /tmp as tmpfs), serving
examples/onnx_pipeline:

- ready: ``docker run`` until ``/v2/health/ready`` answers 200 (polled every 50 ms);
- first request: one inference over HTTP right after (the models compiled at load);
- stop: SIGTERM until the container has exited, idle.

The largest installed packages of each image follow. A build reuses the daemon's cache
(kept under ~/.cache/orchestrion between runs); ``--cold`` builds without it. The images
are removed at the end (the CUDA one is about 5 GB).

    sudo .venv/bin/python bench/container.py [--images cpu,cuda] [--starts 5] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from _common import table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import containers  # tests/ is put on the path just above

MODELS = Path(__file__).resolve().parents[1] / "examples" / "onnx_pipeline" / "models"
DOCKERFILES = {"cpu": "Dockerfile", "cuda": "Dockerfile.cuda"}


def _ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}:8000/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _one_start(docker: containers.Docker, tag: str) -> tuple[float, float, float]:
    """(seconds to ready, first request ms, seconds from SIGTERM to exit)."""
    name = f"orchestrion-bench-{uuid.uuid4().hex[:8]}"
    flags = ["--user=1000", "--read-only", "--tmpfs=/tmp", f"--volume={MODELS}:/models:ro"]
    started = time.monotonic()
    docker.run("run", "--detach", f"--name={name}", *flags, tag)
    try:
        address = docker.run(
            "inspect", "--format={{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name
        ).stdout.strip()
        while not _ready(address):
            if time.monotonic() - started > 300:
                raise RuntimeError(f"{tag} not ready in 300 s:\n{docker.run('logs', name).stderr}")
            time.sleep(0.05)
        ready = time.monotonic() - started
        client = httpclient.InferenceServerClient(f"{address}:8000")
        given = httpclient.InferInput("IMAGE", [1, 64, 64, 3], "UINT8")
        given.set_data_from_numpy(np.zeros((1, 64, 64, 3), np.uint8))
        sent = time.monotonic()
        client.infer("pipeline", [given])
        first = (time.monotonic() - sent) * 1000
        client.close()
        term = time.monotonic()
        docker.run("kill", "--signal=TERM", name)
        docker.run("wait", name, timeout=60)
        return ready, first, time.monotonic() - term
    finally:
        docker.run("rm", "--force", name, check=False)


def _largest(docker: containers.Docker, tag: str, count: int = 6) -> list[tuple[str, int]]:
    listing = docker.run(
        "run",
        "--rm",
        "--entrypoint=sh",
        tag,
        "-c",
        "du -s /opt/orchestrion/lib/python3.11/site-packages/* | sort -rn | head -n " + str(count),
    ).stdout
    return [
        (Path(path).name, int(kib) * 1024)
        for kib, path in (line.split() for line in listing.splitlines())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", default="cpu", help="cpu, cuda or cpu,cuda (default: cpu)")
    parser.add_argument("--starts", type=int, default=5, help="starts per image (default: 5)")
    parser.add_argument("--cold", action="store_true", help="build without the daemon's cache")
    options = parser.parse_args()
    reason = containers.unavailable_reason()
    if reason is not None:
        sys.exit(f"container.py: {reason}")
    rows, parts = [], []
    with containers.docker_daemon() as docker:
        for kind in options.images.split(","):
            tag = f"orchestrion:{kind}-bench"
            built = containers.build_image(docker, DOCKERFILES[kind], tag, cold=options.cold)
            size = containers.image_size(docker, tag)
            starts = [_one_start(docker, tag) for _ in range(options.starts)]
            ready, first, stop = (sorted(column) for column in zip(*starts, strict=True))
            rows.append(
                [
                    kind,
                    f"{size / 1e6:.0f}",
                    f"{built:.0f}",
                    f"{statistics.median(ready):.2f} ({ready[0]:.2f}-{ready[-1]:.2f})",
                    f"{statistics.median(first):.0f}",
                    f"{statistics.median(stop):.2f}",
                ]
            )
            parts += [[kind, name, f"{size_ / 1e6:.0f}"] for name, size_ in _largest(docker, tag)]
            docker.run("image", "rm", tag, timeout=300)
    print(
        table(
            ["image", "MB", "build s", "ready s (min-max)", "first request ms", "stop s"],
            rows,
        )
    )
    print()
    print(table(["image", "largest packages", "MB"], parts, left=2))


if __name__ == "__main__":
    main()
