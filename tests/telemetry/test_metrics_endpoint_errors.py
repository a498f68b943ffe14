"""The metrics endpoint: errors of the caller and bad ports are told apart."""

from __future__ import annotations

import pytest

import orchestrion
from orchestrion.protocols import ConfigError
from orchestrion.testing import plus_one


async def test_an_oserror_of_the_callers_block_is_not_a_bind_error() -> None:
    """An OSError raised by the code inside the server block leaves as itself."""
    with pytest.raises(ConnectionRefusedError):
        async with orchestrion.open_server(models=[plus_one("a")], metrics_port=0):
            raise ConnectionRefusedError(111, "the application's own connection failed")


async def test_a_port_out_of_range_is_a_config_error() -> None:
    """A metrics port that cannot be bound (70000) is a ConfigError, as documented."""
    with pytest.raises(ConfigError, match="is not a TCP port"):
        async with orchestrion.open_server(models=[plus_one("a")], metrics_port=70000):
            pass
