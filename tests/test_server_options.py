"""`ServerOptions`: one declaration of a server's settings that every face takes as
``options=``, its fields accepted as keyword arguments over it."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

import orchestrion
import orchestrion.aio
from orchestrion._options import ServerOptionFields, chosen
from orchestrion.testing import plus_one

X = np.arange(16, dtype=np.float32)


def test_the_keyword_arguments_are_the_options_fields() -> None:
    """The TypedDict that types the faces' keyword arguments names every field of
    ServerOptions and nothing else (the two declarations cannot drift apart)."""
    fields = set(attrs.fields_dict(orchestrion.ServerOptions))
    assert ServerOptionFields.__optional_keys__ == fields
    assert not ServerOptionFields.__required_keys__


def test_keyword_arguments_override_the_options() -> None:
    base = orchestrion.ServerOptions(metrics_port=0, model_config_name="cpu")
    merged = chosen(base, {"metrics_port": None})
    assert (merged.metrics_port, merged.model_config_name) == (None, "cpu")
    assert chosen(None, {}) == orchestrion.ServerOptions()
    with pytest.raises(TypeError):
        chosen(base, {"metrics_prot": 0})  # type: ignore[typeddict-unknown-key]


async def test_open_server_takes_options(tmp_path: Path) -> None:
    """open_server takes options= (here: a metrics endpoint and a load list), and a keyword
    argument overrides one of its fields."""
    options = orchestrion.ServerOptions(metrics_port=0, load_models=[])
    async with orchestrion.open_server(models=[plus_one("a")], options=options) as server:
        assert server.metrics_url is not None
        assert (await server.infer("a", {"X": X})).outputs["Y"].tolist() == (X + 1).tolist()
    async with orchestrion.open_server(
        models=[plus_one("a")], options=options, metrics_port=None
    ) as server:
        assert server.metrics_url is None


def test_the_blocking_face_takes_options() -> None:
    options = orchestrion.ServerOptions(metrics_port=0)
    with orchestrion.Server(models=[plus_one("a")], options=options) as blocking:
        assert blocking.metrics_url is not None
        assert blocking.infer("a", {"X": X}).outputs["Y"].tolist() == (X + 1).tolist()


def test_the_asyncio_face_takes_options() -> None:
    import asyncio

    async def main() -> list[float]:
        options = orchestrion.ServerOptions(metrics_port=0)
        async with orchestrion.aio.open_server(models=[plus_one("a")], options=options) as s:
            return (await s.infer("a", {"X": X})).outputs["Y"].tolist()  # type: ignore[no-any-return]

    assert asyncio.run(main()) == (X + 1).tolist()
