"""examples/detection_pipeline: its repository loads, every answer is right by the example's own
check and by an independent computation of what the control flow should have done, and
``orchestrion run`` prints how many items and iterations ran."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import trio

import orchestrion
from orchestrion.frontends import main as cli

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "detection_pipeline"


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def by_hand(image: np.ndarray) -> tuple[np.ndarray, bool, int]:
    """What the pipeline should do, written without it: the detector's boxes and doubt, and
    the refined boxes after the rounds the loop takes (while a box changes, at most 3)."""
    models = EXAMPLE / "models"
    detector = load(models / "detector" / "1" / "model.py")
    refine = load(models / "refine" / "1" / "model.py")
    kernel = np.load(models / "detection_pipeline" / "1" / "smoothing.npy")
    threshold = np.array([0.5], np.float32)
    found = detector.execute(image, threshold, kernel)
    boxes, rounds = found["BOXES"], np.array([0], np.int32)
    for _ in range(3):
        step = refine.execute(boxes, image, threshold, rounds)
        boxes, rounds = step["REFINED"], step["NEXT_ROUND"]
        if not step["CHANGED"][0]:
            break
    return boxes, bool(found["UNSURE"][0]), int(rounds[0])


async def test_every_answer_is_what_the_control_flow_should_give() -> None:
    """40 images: boxes, rounds, the second opinion's presence and the classifier's items
    match a computation by hand; the step statistics count the same items and skips."""
    example = load(EXAMPLE / "example.py")
    rng = np.random.default_rng(7)
    images = [example.make_inputs(i, rng)["IMAGE"] for i in range(40)]
    answers: dict[int, Any] = {}
    async with orchestrion.open_server(EXAMPLE / "models") as server:

        async def one(index: int) -> None:
            answers[index] = await server.infer("detection_pipeline", {"IMAGE": images[index]})

        async with trio.open_nursery() as nursery:
            for index in range(len(images)):
                nursery.start_soon(one, index)
        steps = server.step_statistics("detection_pipeline")
    items = asked = rounds_total = 0
    for index, image in enumerate(images):
        outputs = answers[index].outputs
        example.check({"IMAGE": image}, outputs)
        boxes, unsure, rounds = by_hand(image)
        np.testing.assert_array_equal(outputs["BOXES"], boxes)
        assert int(outputs["ROUNDS"][0]) == rounds
        assert len(outputs["CLASS_PROBABILITIES"]) == len(boxes)
        assert ((outputs["SECOND_OPINION"] == -1).all()) != unsure
        items += len(boxes)
        asked += unsure
        rounds_total += rounds
    assert 0 < asked < len(images)  # the sample exercises both sides of the condition
    assert steps[1].items == items
    assert (steps[2].runs, steps[2].skipped) == (asked, len(images) - asked)
    assert steps[3].runs == rounds_total


def test_orchestrion_run_says_how_many_items_and_iterations_ran(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first screen of ``orchestrion run`` has the control-flow table."""
    code = cli(["run", str(EXAMPLE), "-n", "16", "-c", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "16/16" in out
    assert "control flow" in out
    for declared in ("map over", "when unsure", "loop", "items", "iterations"):
        assert declared in out, out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_over_the_wire_to_tritonclient(protocol: str) -> None:
    """``orchestrion serve`` of the example's repository answers tritonclient over HTTP and
    gRPC as in-process (a skipped second opinion comes back as its declared default), and
    /metrics counts the map's items and the loop's iterations."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from orchestrion.testing import get, start_server

    example = load(EXAMPLE / "example.py")
    rng = np.random.default_rng(11)
    images = [example.make_inputs(i, rng)["IMAGE"] for i in range(6)]
    served = start_server(repository=EXAMPLE / "models")
    try:
        module: Any = httpclient if protocol == "http" else grpcclient
        client = module.InferenceServerClient(getattr(served, protocol))
        try:
            items = rounds = 0
            for image in images:
                given = module.InferInput("IMAGE", [64, 64], "FP32")
                given.set_data_from_numpy(image)
                result = client.infer("detection_pipeline", [given])
                boxes, unsure, expected_rounds = by_hand(image)
                np.testing.assert_array_equal(result.as_numpy("BOXES"), boxes)
                assert result.as_numpy("ROUNDS").tolist() == [expected_rounds]
                assert result.as_numpy("CLASS_PROBABILITIES").shape == (len(boxes), 4)
                skipped = (result.as_numpy("SECOND_OPINION") == -1).all()
                assert skipped != unsure
                items += len(boxes)
                rounds += expected_rounds
        finally:
            client.close()
        metrics = get(served.metrics, "/metrics")[1].decode()
        labels = 'ensemble="detection_pipeline",model="{}",step="{}"'
        lines = metrics.splitlines()
        assert f"orchestrion_step_items_total{{{labels.format('classifier', 1)}}} {items}" in lines
        assert f"orchestrion_step_runs_total{{{labels.format('refine', 3)}}} {rounds}" in lines
    finally:
        assert served.stop() == 0, served.text()
