"""Examples that ``orchestrion run`` drives: a folder with ``models/`` and ``example.py``.

``example.py`` defines ``MODEL`` (what to call), ``make_inputs(index, rng)`` (the inputs of
request ``index``), optionally ``check(inputs, outputs)`` (raises when a result is wrong),
``REQUESTS``, ``CONCURRENCY`` and ``DESCRIPTION``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..protocols import ConfigError

_Inputs = Mapping[str, Any]


@attrs.frozen(kw_only=True)
class Example:
    """A runnable example: its model repository and its request generator."""

    name: str
    path: Path
    model: str
    make_inputs: Callable[[int, np.random.Generator], _Inputs]
    check: Callable[[_Inputs, _Inputs], None] | None
    requests: int
    concurrency: int
    description: str

    @property
    def model_repository(self) -> Path:
        """The example's Triton-layout model repository."""
        return self.path / "models"


def find_example(name: str) -> Path:
    """The folder of example ``name``: a path, or a folder under ``examples/``.

    Raises:
        ConfigError: no such example (the places searched are listed).
    """
    candidates = [
        Path(name),
        Path("examples") / name,
        Path(__file__).parent.parent / "examples" / name,
    ]
    for candidate in candidates:
        if (candidate / "example.py").is_file():
            return candidate.resolve()
    searched = list(dict.fromkeys(str(c) for c in candidates))  # an absolute path thrice
    examples = Path(__file__).parent.parent / "examples"
    known = sorted(p.name for p in examples.iterdir() if (p / "example.py").is_file())
    raise ConfigError(
        f"no example '{name}' (looked for example.py in: {', '.join(searched)}; the examples "
        f"are: {', '.join(known)})"
    )


def load_example(name: str) -> Example:
    """Import an example's ``example.py``.

    Raises:
        ConfigError: not found, or ``MODEL``/``make_inputs`` missing.
    """
    path = find_example(name)
    source = path / "example.py"
    spec = importlib.util.spec_from_file_location(f"_orchestrion_example_{path.name}", source)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    missing = [n for n in ("MODEL", "make_inputs") if not hasattr(module, n)]
    if missing:
        raise ConfigError(f"{source}: defines no {' or '.join(missing)}")
    return Example(
        name=path.name,
        path=path,
        model=module.MODEL,
        make_inputs=module.make_inputs,
        check=getattr(module, "check", None),
        requests=int(getattr(module, "REQUESTS", 100)),
        concurrency=int(getattr(module, "CONCURRENCY", 8)),
        description=str(getattr(module, "DESCRIPTION", "")),
    )
