"""One command, a side-by-side answer: orchestrion against the hand-written floor, Ray Serve and
Triton, on the tiny 3-step pipeline and on the image pipeline, cache off and on.

    .venv/bin/python bench/compare.py            # everything, ~15 minutes on 2 cores
    .venv/bin/python bench/compare.py --quick    # a smoke run of every part, ~4 minutes
    .venv/bin/python bench/compare.py --skip ray,triton

What runs, each system in processes of its own (so each peak RSS is its own):
- orchestrion in-process and the floor (a minimal hand-written trio pipeline of the same jitted
  functions): ``bench/pipeline.py`` on the tiny pipeline (the seed's shape: preprocess, then
  classify and segment in parallel);
- orchestrion in-process on the image pipeline (``examples/image_pipeline``), cache off and
  on (the example's requests reuse a pool of images, so "on" is mostly hits), next to the
  example's three models called directly one request at a time (the compute alone: no server);
- Ray Serve with DeploymentHandles (in-process) and over HTTP, on both pipelines:
  ``bench/peers/ray_serve.py`` in its own virtual environment (``bench/peers/setup_ray.sh``
  makes it; Ray is not a dependency of orchestrion);
- orchestrion and Triton 2.51.0 over gRPC and HTTP under perf_analyzer, cache off and on:
  ``bench/vs_triton.sh`` (its own ensemble of the same shape; see its header).

It prints one table (throughput, p50, p99, peak RSS, and the throughput ratio against
orchestrion in-process on the same pipeline and concurrency), draws throughput and p99 against
concurrency (``docs/compare_throughput.png``, ``docs/compare_p99.png``), and writes the table,
the command, the versions and the machine into ``docs/performance.md`` between the
``compare.py`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import run_vs_triton

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DOCS = ROOT / "docs"
RAY_PYTHON = BENCH / ".venv-ray" / "bin" / "python"
BEGIN, END = "<!-- compare.py:begin -->", "<!-- compare.py:end -->"

Row = dict[str, Any]


def _log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _run(command: Sequence[str], env: dict[str, str] | None = None) -> tuple[str, int]:
    """Run a command; return its stdout and its peak RSS in KiB (the child's ru_maxrss)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, cwd=ROOT
    )
    assert process.stdout is not None
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}")
    return out, usage.ru_maxrss


# ---------------------------------------------------------------- orchestrion in-process


def tiny_inprocess(concurrency: list[int], requests: int, repeats: int) -> list[Row]:
    """orchestrion and the floor on the tiny pipeline (bench/pipeline.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.json"
        _, rss = _run(
            [
                sys.executable,
                str(BENCH / "pipeline.py"),
                "--json",
                str(path),
                "--concurrency",
                ",".join(map(str, concurrency)),
                "--requests",
                str(requests),
                "--repeats",
                str(repeats),
                "--warmup",
                str(min(300, requests)),
            ]
        )
        data = json.loads(path.read_text())
    names = {"orchestrion": "orchestrion, in-process", "floor": "floor (hand-written trio)"}
    return [
        {
            "pipeline": "tiny",
            "system": names[r["variant"]],
            "cache": "off",
            "concurrency": r["concurrency"],
            "rps": r["throughput_rps"],
            "p50_ms": r["p50_us"] / 1000,
            "p99_ms": r["p99_us"] / 1000,
            "rss_mib": rss / 1024,
        }
        for r in data["rows"]
        if r["variant"] in names
    ]


def image_worker(concurrency: list[int], requests: int, cache: str) -> None:
    """(In a child process.) The image pipeline through the embedding API; JSON on stdout."""
    import numpy as np
    import trio

    import orchestrion
    from orchestrion.frontends._examples import load_example

    example = load_example("image_pipeline")
    rng = np.random.default_rng(0)
    inputs = [example.make_inputs(i, rng) for i in range(requests)]

    async def main() -> list[Row]:
        rows = []
        config = "local,size=268435456" if cache == "on" else None
        async with orchestrion.open_server(example.model_repository, cache_config=config) as server:
            for x in inputs[:20]:
                await server.infer(example.model, x)
            for c in concurrency:
                todo = iter(inputs)
                latencies: list[float] = []

                async def client() -> None:
                    for x in todo:  # noqa: B023 (each round's own iterator)
                        start = time.perf_counter()
                        await server.infer(example.model, x)
                        latencies.append(time.perf_counter() - start)  # noqa: B023

                began = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(c):
                        nursery.start_soon(client)
                took = time.perf_counter() - began
                rows.append(
                    {
                        "concurrency": c,
                        "rps": len(latencies) / took,
                        "p50_ms": float(np.percentile(latencies, 50)) * 1000,
                        "p99_ms": float(np.percentile(latencies, 99)) * 1000,
                    }
                )
        return rows

    print(json.dumps(trio.run(main)))


def image_direct_worker(requests: int) -> None:
    """(In a child process.) The image pipeline's three models called directly, one request
    at a time, no server: the example's compute alone. JSON on stdout."""
    import importlib.util

    import jax
    import numpy as np

    from orchestrion.frontends._examples import load_example

    example = load_example("image_pipeline")

    def module(name: str) -> Any:
        spec = importlib.util.spec_from_file_location(
            name, example.model_repository / name / "1" / "model.py"
        )
        assert spec is not None
        assert spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded

    preprocess = module("image_preprocess_model")
    models = [module(n) for n in ("classification_model", "segmentation_model")]
    steps = [(jax.jit(m.execute), m.initialize(None)) for m in models]
    rng = np.random.default_rng(0)
    inputs = [example.make_inputs(i, rng) for i in range(requests)]

    def infer(x: dict[str, Any]) -> None:
        image = preprocess.execute(x["IMAGE"])["PREPROCESSED_OUTPUT"]
        for fn, params in steps:
            for value in fn(params, image).values():
                np.asarray(value)

    for x in inputs[:20]:
        infer(x)
    latencies = []
    began = time.perf_counter()
    for x in inputs:
        start = time.perf_counter()
        infer(x)
        latencies.append(time.perf_counter() - start)
    took = time.perf_counter() - began
    row = {
        "concurrency": 1,
        "rps": len(latencies) / took,
        "p50_ms": float(np.percentile(latencies, 50)) * 1000,
        "p99_ms": float(np.percentile(latencies, 99)) * 1000,
    }
    print(json.dumps([row]))


def image_inprocess(concurrency: list[int], requests: int) -> list[Row]:
    """orchestrion in-process on the image pipeline, cache off and on (child processes)."""
    rows = []
    for cache in ("off", "on"):
        out, rss = _run(
            [
                sys.executable,
                __file__,
                "--image-worker",
                cache,
                "--concurrency",
                ",".join(map(str, concurrency)),
                "--requests",
                str(requests),
            ]
        )
        for r in json.loads(out):
            rows.append(
                {
                    "pipeline": "image",
                    "system": "orchestrion, in-process",
                    "cache": cache,
                    **r,
                    "rss_mib": rss / 1024,
                }
            )
    out, rss = _run([sys.executable, __file__, "--image-direct", "--requests", str(requests)])
    rows += [
        {
            "pipeline": "image",
            "system": "direct calls (no server, serial)",
            "cache": "off",
            **r,
            "rss_mib": rss / 1024,
        }
        for r in json.loads(out)
    ]
    return rows


# ---------------------------------------------------------------- peers


def ray(concurrency: list[int], quick: bool) -> list[Row]:
    """Ray Serve (its own venv): both pipelines, through handles and over HTTP."""
    if not RAY_PYTHON.exists():
        _log("installing Ray Serve into bench/.venv-ray (bench/peers/setup_ray.sh)")
        subprocess.run(["bash", str(BENCH / "peers" / "setup_ray.sh")], check=True, cwd=ROOT)
    command = [
        str(RAY_PYTHON),
        str(BENCH / "peers" / "ray_serve.py"),
        "--pipelines",
        "tiny,image",
        "--ways",
        "handle,http",
        "--concurrency",
        ",".join(map(str, concurrency)),
    ]
    if quick:
        command.append("--quick")
    out, _ = _run(command)
    return ray_rows(json.loads(out))


def ray_rows(document: Any) -> list[Row]:
    """Rows from ray_serve.py's JSON document (peak RSS: the whole Ray process tree)."""
    rows = []
    for r in document["rows"]:
        way = "DeploymentHandle" if r["way"] == "handle" else "HTTP"
        memory = document["pipelines"][r["pipeline"]]["memory"]
        rows.append(
            {
                "pipeline": r["pipeline"],
                "system": f"Ray Serve, {way}",
                "cache": "off",
                "concurrency": r["concurrency"],
                "rps": r["throughput_rps"],
                "p50_ms": r["p50_ms"],
                "p99_ms": r["p99_ms"],
                "rss_mib": memory["peak_rss_mib"],
            }
        )
    return rows


def network(concurrency: list[int], servers: list[str], quick: bool) -> list[Row]:
    """orchestrion and Triton under perf_analyzer (bench/vs_triton.sh)."""
    results = BENCH / ".peers" / "compare"
    settings = {
        "SERVERS": " ".join(servers),
        "CONCURRENCY": " ".join(map(str, concurrency)),
        "RESULTS": str(results),
    }
    read = run_vs_triton(settings, quick)

    rows = []
    for server in servers:
        for cache in ("off", "on"):
            rss_file = results / server / f"rss_cache-{cache}.txt"
            rss = int(rss_file.read_text().split()[0]) / 1024 if rss_file.is_file() else None
            for protocol in ("grpc", "http"):
                for c in concurrency:
                    found = read(results / server / f"{protocol}_cache-{cache}_c{c}")
                    if found is None:
                        continue
                    rps, p50, p99, stable = found
                    name = "orchestrion" if server == "orchestrion" else "Triton 2.51"
                    rows.append(
                        {
                            "pipeline": "tiny (vs_triton)",
                            "system": f"{name}, {protocol} (perf_analyzer)",
                            "cache": "hits" if cache == "on" else "off",
                            "concurrency": c,
                            "rps": rps,
                            "p50_ms": p50 / 1000 if p50 is not None else None,
                            "p99_ms": p99 / 1000 if p99 is not None else None,
                            "rss_mib": rss,
                            "unstable": not stable,
                        }
                    )
    return rows


# ---------------------------------------------------------------- report


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def render(rows: list[Row]) -> str:
    """The table, with each row's throughput against orchestrion in-process."""
    base = {
        (r["pipeline"].split(" ")[0], r["cache"], r["concurrency"]): r["rps"]
        for r in rows
        if r["system"] == "orchestrion, in-process"
    }
    header = [
        "pipeline",
        "system",
        "cache",
        "conc",
        "req/s",
        "p50 ms",
        "p99 ms",
        "peak RSS MiB",
        "÷ orch. in-process",
    ]
    cells = [header]
    for r in rows:
        key = (r["pipeline"].split(" ")[0], "off" if r["cache"] == "hits" else r["cache"])
        reference = base.get((*key, r["concurrency"]))
        ratio = r["rps"] / reference if reference else None
        star = "*" if r.get("unstable") else ""
        cells.append(
            [
                r["pipeline"],
                r["system"],
                r["cache"],
                str(r["concurrency"]),
                _fmt(r["rps"], ",.0f") + star,
                _fmt(r["p50_ms"], ".2f"),
                _fmt(r["p99_ms"], ".2f"),
                _fmt(r["rss_mib"], ",.0f"),
                _fmt(ratio, ".3f"),
            ]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = []
    for number, line in enumerate(cells):
        lines.append(
            "  ".join(
                cell.ljust(w) if i < 3 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            ).rstrip()
        )
        if number == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows: list[Row], stem: str) -> list[Path]:
    """Throughput and p99 against concurrency, one line per (pipeline, system, cache)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for metric, label, scale in (
        ("rps", "requests/s", "log"),
        ("p99_ms", "p99 latency (ms)", "log"),
    ):
        figure, axes = plt.subplots(1, 2, figsize=(13, 5))
        for axis, family in zip(axes, ("tiny", "image"), strict=True):
            series: dict[str, list[tuple[int, float]]] = {}
            for r in rows:
                if r["pipeline"].split(" ")[0] != family or r[metric] is None:
                    continue
                name = f"{r['system']} (cache {r['cache']})"
                series.setdefault(name, []).append((int(r["concurrency"]), float(r[metric])))
            colours = plt.get_cmap("tab20")
            for number, (name, points) in enumerate(sorted(series.items())):
                points.sort()
                axis.plot(
                    *zip(*points, strict=True),
                    marker="os^Dv"[number % 5],
                    linestyle=("-", "--")[number % 2],
                    color=colours(number % 20),
                    label=name,
                )
            axis.set_xscale("log", base=2)
            axis.set_yscale(scale)
            axis.set_xlabel("concurrency")
            axis.set_ylabel(label)
            axis.set_title(f"{family} pipeline")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=7)
        figure.tight_layout()
        path = DOCS / f"{stem}_{'throughput' if metric == 'rps' else 'p99'}.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        made.append(path)
    return made


def write_docs(table: str, command: str, took: float, skipped: list[str]) -> None:
    """Replace the compare.py section of docs/performance.md."""
    import jax
    import trio

    import orchestrion

    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
    skipped_note = f" Skipped: {', '.join(skipped)}." if skipped else ""
    body = f"""{BEGIN}
## orchestrion, the floor, Ray Serve and Triton side by side (`bench/compare.py`)

```bash
{command}
```

Run on {time.strftime("%Y-%m-%d")} in {took / 60:.0f} minutes.
Machine: {machine}.
Python {platform.python_version()}, orchestrion {orchestrion.__version__}, jax {jax.__version__},
trio {trio.__version__}; peers: Ray Serve from `bench/peers/setup_ray.sh`, Triton 2.51.0 and
perf_analyzer 2.51.0 from `bench/vs_triton.sh`.{skipped_note}
Peak RSS is per system: the measuring process for in-process rows (orchestrion and the floor
share one), the whole process tree for servers. `*`: perf_analyzer found no stable window.

```
{table}
```

![throughput against concurrency](compare_throughput.png)
![p99 latency against concurrency](compare_p99.png)
{END}"""
    path = DOCS / "performance.md"
    text = path.read_text()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + body + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    path.write_text(text)


def main() -> None:
    """Run every part, print the table, draw the plots, update the docs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--skip", default="", help="comma-separated: ray, triton, network")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    parser.add_argument("--from-json", metavar="PATH", help="re-render a saved run (rows.json)")
    parser.add_argument("--image-worker", choices=("off", "on"), help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--image-direct", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.image_worker:
        image_worker(concurrency, args.requests, args.image_worker)
        return
    if args.image_direct:
        image_direct_worker(args.requests)
        return
    if args.from_json:  # re-render a saved run (the table, plots and docs), measure nothing
        saved = json.loads(Path(args.from_json).read_text())
        print(render(saved["rows"]))
        if not args.no_docs:
            plot(saved["rows"], "compare")
            write_docs(
                render(saved["rows"]),
                ".venv/bin/python bench/compare.py",
                saved["took"],
                saved["skipped"],
            )
        return
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    began = time.perf_counter()
    rows: list[Row] = []
    _log("orchestrion and the floor, in-process, tiny pipeline")
    rows += tiny_inprocess(concurrency, 600 if args.quick else 5000, 1 if args.quick else 3)
    _log("orchestrion in-process, image pipeline")
    rows += image_inprocess(concurrency, 64 if args.quick else 400)
    if "ray" not in skip:
        _log("Ray Serve")
        try:
            rows += ray(concurrency, args.quick)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            _log(f"Ray Serve failed, left out: {exc}")
            skip.add("ray (failed)")
    if "network" not in skip:
        servers = ["orchestrion"] if "triton" in skip else ["triton", "orchestrion"]
        _log(f"over the network with perf_analyzer: {', '.join(servers)}")
        rows += network(concurrency, servers, args.quick)
    took = time.perf_counter() - began
    saved = BENCH / ".peers" / "compare" / "rows.json"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"rows": rows, "took": took, "skipped": sorted(skip)}))
    table = render(rows)
    print(table)
    print(f"\ntotal time: {took / 60:.1f} minutes")
    if not args.no_docs:
        for path in plot(rows, "compare"):
            _log(f"wrote {path.relative_to(ROOT)}")
        command = "    ".join([".venv/bin/python bench/compare.py", *sys.argv[1:]]).replace(
            "    ", " "
        )
        write_docs(table, command, took, sorted(skip))
        _log("wrote docs/performance.md (the compare.py section)")


if __name__ == "__main__":
    main()
