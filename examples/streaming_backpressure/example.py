"""Driver of the streaming backpressure example, read by ``orchestrion run``.

Triton's streaming scenario: a decoupled producer yields many 1 MiB chunks per request, ~10x
faster than the consumer can reduce them. The ensemble's ``max_inflight_requests: 16``
bounds what waits between them, so memory stays flat however many chunks a request asks
for: the producer is suspended instead of buffering. The summary shows the peak number of
chunks in flight at the consumer step.
"""

import numpy as np

DESCRIPTION = "a decoupled producer 10x faster than its consumer, bounded by max_inflight_requests"
MODEL = "ensemble"
REQUESTS = 8
CONCURRENCY = 4
CHUNKS = 24


def make_inputs(index: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each request asks for CHUNKS chunks."""
    return {"CHUNKS": np.array([CHUNKS], dtype=np.int32)}


def check(inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
    """Each response summarises one chunk: its index, and a finite checksum."""
    summary = np.asarray(outputs["SUMMARY"])
    assert summary.shape == (2,), f"SUMMARY shape {summary.shape}"
    assert 0 <= summary[0] < int(inputs["CHUNKS"][0]), f"chunk index {summary[0]}"
    assert np.isfinite(summary[1]), "checksum is not finite"
