"""A FastAPI application serving the image pipeline through orchestrion's asyncio API.

Run it from the repository root (``pip install 'orchestrion[examples]'`` brings FastAPI and
uvicorn):

    uvicorn examples.fastapi_app.app:app --port 8080

then ``curl -F image=@cat.png http://127.0.0.1:8080/classify``. The server is opened once, in
the application's lifespan, on the application's own event loop: each request awaits
``server.infer`` directly (no thread per request), and a client that disconnects cancels its
inference.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, UploadFile

import orchestrion
import orchestrion.aio

MODELS = Path(__file__).resolve().parent.parent / "image_pipeline" / "models"
TOP = 5


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the orchestrion server for the application's lifetime."""
    async with orchestrion.aio.open_server(model_repository=MODELS) as server:
        app.state.server = server
        yield


app = FastAPI(title="orchestrion image pipeline", lifespan=lifespan)


@app.post("/classify")
async def classify(image: UploadFile) -> dict[str, Any]:
    """The top classes of an uploaded PNG or JPEG, and the mean of its segmentation mask."""
    data = await image.read()
    server: orchestrion.aio.AioServer = app.state.server
    try:
        response = await server.infer(
            "ensemble_model", {"IMAGE": np.array([[data]], dtype=object)}, timeout=10.0
        )
    except orchestrion.InferenceError as exc:  # an image the preprocessing could not decode
        raise HTTPException(status_code=422, detail=str(exc)) from exc
    probabilities = response.outputs["CLASSIFICATION"][0]
    top = np.argsort(probabilities)[::-1][:TOP]
    return {
        "classes": [{"index": int(i), "probability": float(probabilities[i])} for i in top],
        "segmentation_mean": float(response.outputs["SEGMENTATION"].mean()),
    }


@app.get("/health")
async def health() -> dict[str, bool]:
    """Ready once every model of the pipeline is loaded."""
    server: orchestrion.aio.AioServer = app.state.server
    return {"ready": await server.is_model_ready("ensemble_model")}
