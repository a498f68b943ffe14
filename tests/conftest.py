"""Shared fixtures: real Redis servers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrion.testing import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` on a free loopback port, stopped after the test."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
