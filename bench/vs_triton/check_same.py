"""Checks that a server computes the vs_triton ensemble's math (so both servers compute the same).

Sends a few fixed inputs (batch 1 and batch 3) to model `ensemble` and compares CLASS and SEG
with a numpy reference of the same formulas and weights (rtol 1e-5, atol 1e-6).

    # a running server over HTTP (tritonclient; bench/.venv-triton has it):
    bench/.venv-triton/bin/python bench/vs_triton/check_same.py --http 127.0.0.1:18000
    # orchestrion in-process, no network (orchestrion's own venv):
    .venv/bin/python bench/vs_triton/check_same.py --in-process

Exit status 0 when every output matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

Infer = Callable[[np.ndarray], dict[str, np.ndarray]]


def reference(x: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 10)) * 0.25).astype(np.float32)
    b = (rng.standard_normal(10) * 0.1).astype(np.float32)
    pre = (x * np.float32(2) + np.float32(1)).astype(np.float32)
    logits = pre @ w + b
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return {
        "CLASS": (e / e.sum(axis=-1, keepdims=True)).astype(np.float32),
        "SEG": (np.tanh(pre) * np.float32(0.5)).astype(np.float32),
    }


def inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(42)
    return [
        np.ones((1, 16), np.float32),
        np.linspace(-2, 2, 16, dtype=np.float32)[None],
        rng.standard_normal((3, 16)).astype(np.float32),
    ]


def http_infer(url: str) -> Infer:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=url)

    def infer(x: np.ndarray) -> dict[str, np.ndarray]:
        tensor = httpclient.InferInput("INPUT", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        outputs = [httpclient.InferRequestedOutput(n) for n in ("CLASS", "SEG")]
        result = client.infer("ensemble", [tensor], outputs=outputs)
        return {n: result.as_numpy(n) for n in ("CLASS", "SEG")}

    return infer


def check(label: str, infer: Infer) -> bool:
    ok = True
    for x in inputs():
        got, want = infer(x), reference(x)
        for name, expected in want.items():
            actual = np.asarray(got[name])
            if actual.shape != expected.shape or not np.allclose(
                actual, expected, rtol=1e-5, atol=1e-6
            ):
                ok = False
                diff = (
                    float(np.max(np.abs(actual - expected)))
                    if actual.shape == expected.shape
                    else f"shape {actual.shape} != {expected.shape}"
                )
                print(f"{label}: {name} differs for input {x.shape}: max |diff| {diff}")
    print(f"{label}: {'same numbers as the numpy reference' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="append", default=[], help="HOST:PORT (repeatable)")
    parser.add_argument("--in-process", action="store_true", help="orchestrion.Server, no network")
    args = parser.parse_args()
    ok = True
    for url in args.http:
        ok &= check(f"http://{url}", http_infer(url))
    if args.in_process:
        import orchestrion

        repo = Path(__file__).resolve().parent / "orchestrion_models"
        with orchestrion.Server(model_repository=repo) as server:
            ok &= check(
                "orchestrion in-process",
                lambda x: dict(server.infer("ensemble", {"INPUT": x}).outputs),
            )
    if not args.http and not args.in_process:
        parser.error("give --http HOST:PORT and/or --in-process")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
