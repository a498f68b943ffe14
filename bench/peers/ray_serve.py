"""Ray Serve as a peer: orchestrion's two benchmark pipelines served by Ray Serve.

Run with the Ray venv's interpreter (see ``setup_ray.sh``), never orchestrion's:

    bench/.venv-ray/bin/python bench/peers/ray_serve.py --pipelines tiny,image \
        --ways handle,http --concurrency 1,16,64 [--requests N] [--quick]

It prints ONE JSON document on stdout; every log line (its own, Ray's, the replicas') goes to
stderr. Pipelines (same math as orchestrion's):

* ``tiny``: bench/pipeline.py. ``preprocess`` (x*2+1 on float32 [1,16]), then ``classify``
  (sum over axis 1 -> [1]) and ``segment`` (x - mean(x) -> [1,16]) in parallel; each step
  jitted with JAX in its own deployment.
* ``image``: examples/image_pipeline. The three ``models/*/1/model.py`` files are imported
  at runtime (importlib) inside the replicas: PNG bytes -> Pillow preprocess (not jitted) ->
  JAX classifier and JAX segmentation net (``jax.jit(execute)(initialize(config), x)``, like
  orchestrion). Inputs are the example's pool of 16 PNGs (``example._images()``), sent in
  turn. Ray has no response cache; the example's ensemble config enables orchestrion's.

Layout: model composition, one deployment per step plus an ingress deployment, one replica
each (``num_cpus=0`` so four replicas fit on two cores). The ingress calls preprocess, then
classify and segment concurrently (the preprocess ``DeploymentResponse`` is passed to both)
and returns both outputs. Two ways of calling: ``handle`` (the ingress DeploymentHandle,
awaited by N asyncio tasks in this driver) and ``http`` (Serve's HTTP proxy on 127.0.0.1, N
asyncio-stream keep-alive connections; raw float32 / PNG bytes in, raw float32 bytes out).

Each pipeline gets its own Ray session: ``ray.init`` + ``serve.start`` + ``serve.run`` (the
replicas jit and warm up in their constructors, so "ready" includes compilation) is the cold
start. During the measurements a thread sums the RSS of this driver and all its descendants
(GCS, raylet, workers, agents, Serve controller/proxy/replicas) every 0.5 s; the peak and the
process count are reported, plus one PSS sum (shared pages split) at the end. Correctness is
checked once per pipeline against a direct computation done in this driver after Ray is shut
down (so the driver holds no JAX while it is measured). Shutdown: serve.shutdown() and
ray.shutdown().
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib.util
import json
import os
import platform
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

# stdout is reserved for the JSON document: keep a private copy of fd 1 and point fd 1 at
# stderr, so Ray's children (which inherit fd 1) and any stray print() go to stderr.
_JSON_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IMAGE_DIR = ROOT / "examples" / "image_pipeline"
MODELS = IMAGE_DIR / "models"
TINY_SHAPE = (1, 16)
N_CLASSES = 1000
IMG = (3, 224, 224)


def log(*parts: object) -> None:
    print("[ray_serve]", *parts, file=sys.stderr, flush=True)


def load_module(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None, path
    assert spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the steps (jax is imported inside, so the driver never loads it while measuring) --------


def tiny_step(step: str) -> Any:
    import jax
    import jax.numpy as jnp

    fns = {
        "preprocess": lambda x: x * 2 + 1,
        "classify": lambda x: jnp.sum(x, axis=1),
        "segment": lambda x: x - jnp.mean(x),
    }
    fn = jax.jit(fns[step])
    return lambda x: np.asarray(fn(x))


def image_step(step: str) -> Any:
    folder = {
        "preprocess": "image_preprocess_model",
        "classify": "classification_model",
        "segment": "segmentation_model",
    }[step]
    module = load_module(MODELS / folder / "1" / "model.py", f"_ray_peer_{folder}")
    if step == "preprocess":  # JIT = False: plain Python (Pillow)

        def run(image: bytes) -> np.ndarray:
            raw = np.empty((1, 1), dtype=object)
            raw[0, 0] = image
            return module.execute(RAW_IMAGE=raw)["PREPROCESSED_OUTPUT"]

        return run
    import jax

    params = module.initialize({"name": folder, "max_batch_size": 1})
    fn = jax.jit(module.execute)
    output = "CLASSIFICATION_OUTPUT" if step == "classify" else "SEGMENTATION_OUTPUT"
    return lambda x: np.asarray(fn(params, FORMATTED_IMAGE=x)[output])


def warmup_input(pipeline: str) -> Any:
    if pipeline == "tiny":
        return np.ones(TINY_SHAPE, np.float32)
    return np.zeros((1, *IMG), np.float32)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Step:
    def __init__(self, pipeline: str, step: str) -> None:
        self.fn = tiny_step(step) if pipeline == "tiny" else image_step(step)
        if not (pipeline == "image" and step == "preprocess"):
            self.fn(warmup_input(pipeline))  # compile now: ready means compiled

    def __call__(self, x: Any) -> np.ndarray:
        return self.fn(x)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Ingress:
    def __init__(self, pipeline: str, preprocess: Any, classify: Any, segment: Any) -> None:
        self.pipeline = pipeline
        self.pre, self.cls, self.seg = preprocess, classify, segment

    async def infer(self, x: Any) -> dict[str, np.ndarray]:
        pre = self.pre.remote(x)
        c, s = await asyncio.gather(self.cls.remote(pre), self.seg.remote(pre))
        return {"CLASSIFICATION": c, "SEGMENTATION": s}

    async def __call__(self, request: Any) -> Any:  # HTTP: raw bytes in, raw float32 out
        from starlette.responses import Response

        body = await request.body()
        if self.pipeline == "tiny":
            x: Any = np.frombuffer(body, np.float32).reshape(TINY_SHAPE)
        else:
            x = body
        out = await self.infer(x)
        content = (
            out["CLASSIFICATION"].astype(np.float32).tobytes()
            + out["SEGMENTATION"].astype(np.float32).tobytes()
        )
        return Response(content=content, media_type="application/octet-stream")


def build_app(pipeline: str, max_ongoing: int) -> Any:
    opts = {"max_ongoing_requests": max_ongoing}
    steps = [
        Step.options(name=f"{pipeline}_{s}", **opts).bind(pipeline, s)
        for s in ("preprocess", "classify", "segment")
    ]
    return Ingress.options(name=f"{pipeline}_ingress", **opts).bind(pipeline, *steps)


def split_http(pipeline: str, body: bytes) -> dict[str, np.ndarray]:
    flat = np.frombuffer(body, np.float32)
    if pipeline == "tiny":
        return {"CLASSIFICATION": flat[:1].copy(), "SEGMENTATION": flat[1:].reshape(TINY_SHAPE)}
    return {
        "CLASSIFICATION": flat[:N_CLASSES].reshape(1, N_CLASSES),
        "SEGMENTATION": flat[N_CLASSES:].reshape(1, *IMG),
    }


# -- inputs and reference ------------------------------------------------------------------


def inputs(pipeline: str) -> list[Any]:
    if pipeline == "tiny":
        return [np.random.default_rng(0).standard_normal(TINY_SHAPE).astype(np.float32)]
    example = load_module(IMAGE_DIR / "example.py", "_ray_peer_example")
    return list(example._images())


def to_body(pipeline: str, x: Any) -> bytes:
    return x.tobytes() if pipeline == "tiny" else bytes(x)


def reference(pipeline: str, x: Any) -> dict[str, np.ndarray]:
    """The same functions called directly in this process (imports JAX)."""
    if pipeline == "tiny":
        pre = tiny_step("preprocess")(x)
        want = {
            "CLASSIFICATION": tiny_step("classify")(pre),
            "SEGMENTATION": tiny_step("segment")(pre),
        }
        p = x * np.float32(2) + np.float32(1)  # and numpy, as bench/pipeline.py checks
        np.testing.assert_allclose(want["CLASSIFICATION"], p.sum(axis=1), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(want["SEGMENTATION"], p - p.mean(), rtol=1e-6, atol=1e-6)
        return want
    pre = image_step("preprocess")(x)
    return {
        "CLASSIFICATION": image_step("classify")(pre),
        "SEGMENTATION": image_step("segment")(pre),
    }


# -- memory sampling -----------------------------------------------------------------------


class TreeSampler(threading.Thread):
    """Sum of RSS over this process and all its descendants, every ``period`` seconds."""

    def __init__(self, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.stop_event = threading.Event()
        self.peak_rss = 0
        self.max_procs = 0
        self.samples = 0
        self.names_at_peak: dict[str, int] = {}

    @staticmethod
    def tree() -> list[psutil.Process]:
        me = psutil.Process()
        return [me, *me.children(recursive=True)]

    def sample(self) -> None:
        total, names = 0, collections.Counter()
        procs = self.tree()
        for p in procs:
            try:
                total += p.memory_info().rss
                names[p.name()] += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self.samples += 1
        self.max_procs = max(self.max_procs, len(procs))
        if total > self.peak_rss:
            self.peak_rss, self.names_at_peak = total, dict(names)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.period)

    def stop(self) -> None:
        self.stop_event.set()
        self.join()

    def pss_now(self) -> int:
        total = 0
        for p in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
                total += p.memory_full_info().pss
        return total


# -- load generation -----------------------------------------------------------------------


async def drive(call: Any, n: int, concurrency: int) -> tuple[np.ndarray, float]:
    latencies = np.empty(n, dtype=np.int64)
    next_index = 0

    async def client(worker: int) -> None:
        nonlocal next_index
        clock = time.perf_counter_ns
        while next_index < n:
            index = next_index
            next_index += 1
            t0 = clock()
            await call(worker, index)
            latencies[index] = clock() - t0

    start = time.perf_counter()
    await asyncio.gather(*(client(w) for w in range(concurrency)))
    return latencies, time.perf_counter() - start


class HttpConn:
    """One keep-alive HTTP/1.1 connection over asyncio streams."""

    def __init__(self, port: int, path: str) -> None:
        self.port, self.path = port, path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> bytes:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status = await self.reader.readline()
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        if "content-length" in headers:
            data = await self.reader.readexactly(int(headers["content-length"]))
        else:  # chunked
            chunks = []
            while size := int((await self.reader.readline()).strip(), 16):
                chunks.append(await self.reader.readexactly(size))
                await self.reader.readline()
            await self.reader.readline()
            data = b"".join(chunks)
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"HTTP {status!r}: {data[:300]!r}")
        if headers.get("connection", "").lower() == "close":
            self.writer.close()
            self.writer = None
        return data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def measure_pipeline(
    pipeline: str, handle: Any, port: int, xs: list[Any], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    n = args.requests or (args.requests_tiny if pipeline == "tiny" else args.requests_image)
    bodies = [to_body(pipeline, x) for x in xs]
    rows: list[dict[str, Any]] = []
    outputs: dict[str, Any] = {}

    # one output per way for the correctness check (input 0)
    outputs["handle"] = await handle.infer.remote(xs[0])
    conn = HttpConn(port, f"/{pipeline}")
    for attempt in range(100):  # the proxy may need a moment after serve.run
        try:
            outputs["http"] = split_http(pipeline, await conn.post(bodies[0]))
            break
        except (OSError, RuntimeError) as exc:
            conn = HttpConn(port, f"/{pipeline}")
            if attempt == 99:
                raise
            log("http not ready yet:", exc)
            await asyncio.sleep(0.2)
    conn.close()

    for way in args.ways:
        for concurrency in args.concurrency:
            if way == "handle":

                async def call(worker: int, index: int) -> Any:
                    return await handle.infer.remote(xs[index % len(xs)])

                conns: list[HttpConn] = []
            else:
                conns = [HttpConn(port, f"/{pipeline}") for _ in range(concurrency)]

                async def call(worker: int, index: int, conns: list[HttpConn] = conns) -> Any:
                    return await conns[worker].post(bodies[index % len(bodies)])

            warm = max(2 * concurrency, args.warmup if pipeline == "tiny" else args.warmup // 4)
            await drive(call, warm, concurrency)
            lat, elapsed = await drive(call, n, concurrency)
            for c in conns:
                c.close()
            row = {
                "pipeline": pipeline,
                "way": way,
                "concurrency": concurrency,
                "requests": n,
                "warmup": warm,
                "throughput_rps": n / elapsed,
                "p50_ms": float(np.percentile(lat, 50)) / 1e6,
                "p99_ms": float(np.percentile(lat, 99)) / 1e6,
                "mean_ms": float(lat.mean()) / 1e6,
                "elapsed_s": elapsed,
            }
            log(
                f"{pipeline:5s} {way:6s} c={concurrency:<3d} {row['throughput_rps']:8.1f} req/s "
                f"p50 {row['p50_ms']:7.2f} ms p99 {row['p99_ms']:7.2f} ms"
            )
            rows.append(row)
    return rows, outputs


def outside_tree(sampler: TreeSampler) -> int:
    """Processes naming this Ray session's folder that are not in the sampled tree (want 0)."""
    session = ray._private.worker._global_node.get_session_dir_path()
    mine = {p.pid for p in sampler.tree()}
    count = 0
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid not in mine and any(session in a for a in p.info["cmdline"] or ()):
                count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return count


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipeline(
    pipeline: str, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    xs = inputs(pipeline)
    port = free_port()
    logging_config = {"log_level": "WARNING", "enable_access_log": args.access_log}
    t0 = time.perf_counter()
    ray.init(
        include_dashboard=args.dashboard,
        logging_level="WARNING",
        configure_logging=True,
    )
    t_init = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=logging_config)
    app = build_app(pipeline, args.max_ongoing)
    handle = serve.run(
        app, name=pipeline, route_prefix=f"/{pipeline}", logging_config=logging_config
    )
    t_ready = time.perf_counter()
    cold = {
        "ray_init_s": t_init - t0,
        "serve_start_and_run_s": t_ready - t_init,
        "total_s": t_ready - t0,
    }
    log(f"{pipeline}: cold start {cold['total_s']:.2f} s (ray.init {cold['ray_init_s']:.2f} s)")

    sampler = TreeSampler(0.5)
    sampler.sample()
    rss_ready = sampler.peak_rss
    procs_ready = sampler.max_procs
    outside = outside_tree(sampler)
    sampler.start()
    try:
        rows, outputs = asyncio.run(measure_pipeline(pipeline, handle, port, xs, args))
    finally:
        sampler.stop()
        pss = sampler.pss_now()
        serve.shutdown()
        ray.shutdown()
    time.sleep(1.0)
    leftover = len(psutil.Process().children(recursive=True))
    memory = {
        "rss_after_ready_mib": rss_ready / 2**20,
        "processes_after_ready": procs_ready,
        "peak_rss_mib": sampler.peak_rss / 2**20,
        "peak_processes": sampler.max_procs,
        "rss_samples": sampler.samples,
        "pss_end_mib": pss / 2**20,
        "process_names_at_peak": sampler.names_at_peak,
        "session_processes_outside_tree": outside,
        "leftover_children_after_shutdown": leftover,
    }
    log(
        f"{pipeline}: peak RSS {memory['peak_rss_mib']:.0f} MiB over {sampler.max_procs} "
        f"processes, PSS {memory['pss_end_mib']:.0f} MiB"
    )
    return rows, {"cold_start": cold, "memory": memory}, {"x": xs[0], "outputs": outputs}


def check(pipeline: str, x: Any, outputs: dict[str, Any]) -> dict[str, Any]:
    want = reference(pipeline, x)
    result: dict[str, Any] = {}
    for way, got in outputs.items():
        ok = True
        for name, w in want.items():
            g = np.asarray(got[name])
            if (
                g.shape != w.shape
                or g.dtype != np.float32
                or not np.allclose(g, w, rtol=1e-5, atol=1e-6)
            ):
                ok = False
                log(
                    f"{pipeline}/{way}/{name}: MISMATCH shape {g.shape} vs {w.shape}, max diff "
                    f"{np.max(np.abs(g.astype(np.float64) - w)) if g.shape == w.shape else 'n/a'}"
                )
        result[way] = ok
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", default="tiny,image")
    parser.add_argument("--ways", default="handle,http")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--requests", type=int, default=0, help="per measurement, both pipelines")
    parser.add_argument("--requests-tiny", type=int, default=1000)
    parser.add_argument("--requests-image", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=40, help="tiny; image uses a quarter")
    parser.add_argument("--max-ongoing", type=int, default=100, help="max_ongoing_requests")
    parser.add_argument("--access-log", action="store_true", help="Serve access logs on")
    parser.add_argument("--dashboard", action="store_true", help="start Ray's dashboard")
    parser.add_argument("--quick", action="store_true", help="~1-minute smoke run")
    args = parser.parse_args()
    args.pipelines = [p for p in args.pipelines.split(",") if p]
    args.ways = [w for w in args.ways.split(",") if w]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    assert set(args.pipelines) <= {"tiny", "image"}, args.pipelines
    assert set(args.ways) <= {"handle", "http"}, args.ways
    if args.quick:
        args.concurrency = [c for c in args.concurrency if c <= 16] or args.concurrency[:1]
        args.requests_tiny, args.requests_image, args.warmup = 100, 20, 20

    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    per_pipeline: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    for pipeline in args.pipelines:
        r, info, sample = run_pipeline(pipeline, args)
        rows += r
        per_pipeline[pipeline] = info
        samples[pipeline] = sample
    # Correctness after Ray is gone, so JAX was not loaded in the driver while measuring.
    for pipeline, sample in samples.items():
        per_pipeline[pipeline]["correct"] = check(pipeline, sample["x"], sample["outputs"])
        log(f"{pipeline}: correct {per_pipeline[pipeline]['correct']}")

    import jax

    document = {
        "peer": "ray_serve",
        "environment": {
            "python": platform.python_version(),
            "ray": ray.__version__,
            "jax": jax.__version__,
            "numpy": np.__version__,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
        "settings": {
            "pipelines": args.pipelines,
            "ways": args.ways,
            "concurrency": args.concurrency,
            "requests": {
                p: args.requests or (args.requests_tiny if p == "tiny" else args.requests_image)
                for p in args.pipelines
            },
            "max_ongoing_requests": args.max_ongoing,
            "access_log": args.access_log,
            "dashboard": args.dashboard,
            "quick": args.quick,
            "replicas_per_deployment": 1,
            "rss_sample_period_s": 0.5,
        },
        "pipelines": per_pipeline,
        "rows": rows,
        "total_s": time.perf_counter() - began,
    }
    json.dump(document, _JSON_OUT, indent=2)
    _JSON_OUT.write("\n")
    _JSON_OUT.flush()


if __name__ == "__main__":
    main()
