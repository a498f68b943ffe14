"""Models loaded on first use, and unloaded least recently used first under a budget
(``orchestrion serve --model-load-on-demand`` with ``--model-count-limit`` and
``--model-memory-limit``): many models served from little memory.

How this works: the front ends hold a `Lease` on a model for each request's whole life
(`OnDemand.using`; a streamed answer keeps it until its last part). A model the server has
loaded is marked as used now. A model that is not loaded but has a folder in the repository
is loaded through `ModelControl.load`; concurrent first requests wait for that one load. Before
the load, under the model control's lock, `OnDemand` makes room: while the models the load
adds (the model and the composing models it needs, as `plan_load` reads them) would take the
server over a limit, the least recently used model that nothing holds is unloaded. A model is
held by a lease (a request in flight), or by a loaded ensemble that uses it, so an ensemble
keeps its steps while it runs and while it is loaded. When everything loaded is held, the
load waits for a lease to end (at most `ROOM_WAIT` seconds, then a 503). A model's memory is
counted as the bytes of its folder's files (its weights, for the models that have them).

Counted for ``/metrics``: loads, evictions and their seconds, the models loaded and their
bytes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import attrs
import trio

from .._server import AsyncServer
from ..protocols import (
    ConfigError,
    CustomMetricFamily,
    CustomMetricSample,
    ModelControlError,
)
from ..repository import LoadPlan, find_model_folder
from ._control import ModelControl

_log = logging.getLogger("orchestrion")

ROOM_WAIT = 30.0
"""Seconds a load waits for a loaded model to be free to unload, when every one is in use."""


def folder_bytes(folder: Path | None) -> int:
    """The bytes of the files under ``folder`` (0: no folder); links are not followed."""
    if folder is None:
        return 0
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


@attrs.define(eq=False)
class Lease:
    """A request's hold on a model: while it lasts, the model is not unloaded."""

    _owner: OnDemand
    name: str
    _held: bool = True

    def release(self) -> None:
        """End the hold (once; later calls do nothing)."""
        if self._held:
            self._held = False
            self._owner._released(self.name)


@attrs.define(eq=False)
class OnDemand:
    """Loads models on first use and unloads the least recently used under a budget."""

    server: AsyncServer
    control: ModelControl
    max_models: int | None = None
    """The most models loaded at once (composing models count); None: no limit."""
    max_bytes: int | None = None
    """The most bytes of model files loaded at once; None: no limit."""
    _used: collections.OrderedDict[str, None] = attrs.field(
        factory=collections.OrderedDict, init=False
    )
    """Loaded models, least recently used first."""
    _leases: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    _loading: dict[str, trio.Event] = attrs.field(factory=dict, init=False)
    _freed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _sizes: dict[str, int] = attrs.field(factory=dict, init=False)
    loads: int = 0
    load_seconds: float = 0.0
    evictions: int = 0
    eviction_seconds: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.max_models is not None and self.max_models < 1:
            raise ConfigError(f"--model-count-limit must be >= 1, not {self.max_models}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ConfigError(f"--model-memory-limit must be >= 1 byte, not {self.max_bytes}")
        for name in self.server.model_names():
            self._used[name] = None

    @contextlib.asynccontextmanager
    async def using(self, name: str) -> AsyncIterator[Lease]:
        """Hold ``name`` for a request (loading it first if it is in the repository and not
        loaded); the lease ends with the block unless the caller keeps it (`kept`).

        Raises:
            LoadRequestError, ModelLoadError: the model's folder cannot be loaded (as a load
                request's).
            ModelControlError: no room can be made (503).
        """
        lease = await self.lease(name)
        try:
            yield lease
        finally:
            lease.release()

    async def lease(self, name: str) -> Lease:
        """A hold on ``name`` that the caller releases (see `using`)."""
        self._leases[name] += 1
        lease = Lease(self, name)
        try:
            while name not in self.server.model_names() and self._in_repository(name):
                loading = self._loading.get(name)
                if loading is not None:
                    await loading.wait()  # another request's load of it; then look again
                    if name not in self.server.model_names():
                        break  # that load failed: this request's answer is a 404 as usual
                    continue
                await self._load(name)
        except BaseException:
            lease.release()
            raise
        if name in self._used:
            self._used.move_to_end(name)
        return lease

    def _released(self, name: str) -> None:
        self._leases[name] -= 1
        if self._leases[name] <= 0:
            del self._leases[name]
            self._freed.set()

    def _in_repository(self, name: str) -> bool:
        root = self.server.model_repository
        return root is not None and find_model_folder(root, name) is not None

    async def _load(self, name: str) -> None:
        self._loading[name] = done = trio.Event()
        started = time.perf_counter()
        try:
            await self.control.load(name, room=self._make_room)
        finally:
            del self._loading[name]
            done.set()
        seconds = time.perf_counter() - started
        self.loads += 1
        self.load_seconds += seconds
        self._forget_unloaded()
        for loaded in self.server.model_names():
            if loaded not in self._used:
                self._used[loaded] = None
        self._used.move_to_end(name)
        _log.info("model '%s' loaded on first use in %.2f s", name, seconds)

    async def _make_room(self, plan: LoadPlan) -> None:
        """Unload what must go for ``plan`` to fit (called by `ModelControl.load`, under its
        lock, before it loads).

        Raises:
            ModelControlError: the plan alone is over a limit, or every loaded model stayed
                in use for `ROOM_WAIT` seconds.
        """
        names = [entry.name for entry in plan.entries]
        sizes = await trio.to_thread.run_sync(self._entry_sizes, plan)
        self._sizes.update(sizes)
        added, added_bytes = len(names), sum(sizes.values())
        self._check_fits(names, added, added_bytes)
        with trio.move_on_after(ROOM_WAIT):
            while self._over(added, added_bytes):
                victim = self._victim(set(names))
                if victim is None:
                    self._freed = trio.Event()
                    await self._freed.wait()
                    continue
                await self._evict(victim)
            return
        raise ModelControlError(
            f"cannot load model '{names[0]}': every loaded model stayed in use for "
            f"{ROOM_WAIT:g} s, and loading it needs room (--model-count-limit "
            f"{self.max_models}, --model-memory-limit {self.max_bytes}); retry later"
        )

    def _check_fits(self, names: Sequence[str], added: int, added_bytes: int) -> None:
        if self.max_models is not None and added > self.max_models:
            raise ModelControlError(
                f"cannot load model '{names[0]}': it needs {added} models loaded at once "
                f"({', '.join(names)}), over --model-count-limit {self.max_models}"
            )
        if self.max_bytes is not None and added_bytes > self.max_bytes:
            raise ModelControlError(
                f"cannot load model '{names[0]}': its files take {added_bytes} bytes, over "
                f"--model-memory-limit {self.max_bytes}"
            )

    def _entry_sizes(self, plan: LoadPlan) -> dict[str, int]:
        return {entry.name: folder_bytes(entry.path) for entry in plan.entries}

    def _over(self, added: int, added_bytes: int) -> bool:
        loaded = self.server.model_names()
        count = len(loaded) + added
        size = sum(self._sizes.get(name, 0) for name in loaded) + added_bytes
        return (self.max_models is not None and count > self.max_models) or (
            self.max_bytes is not None and size > self.max_bytes
        )

    def _victim(self, keep: set[str]) -> str | None:
        """The least recently used loaded model that nothing holds (None: none is free)."""
        self._forget_unloaded()
        held = self._held_by_ensembles()
        for name in self._used:
            if name not in keep and name not in held and self._leases[name] == 0:
                return name
        return None

    def _held_by_ensembles(self) -> set[str]:
        held: set[str] = set()
        for name in self.server.model_names():
            scheduling = self.server.model_config(name).ensemble_scheduling
            if scheduling is not None:
                held.update(step.model_name for step in scheduling.step)
        return held

    async def _evict(self, name: str) -> None:
        started = time.perf_counter()
        await self.control.unload_held(name)
        seconds = time.perf_counter() - started
        self.evictions += 1
        self.eviction_seconds += seconds
        self._used.pop(name, None)
        _log.info("model '%s' unloaded to make room (least recently used) in %.2f s", name, seconds)

    def _forget_unloaded(self) -> None:
        loaded = set(self.server.model_names())
        for name in [n for n in self._used if n not in loaded]:
            del self._used[name]

    def metric_families(self) -> list[CustomMetricFamily]:
        """The loads, evictions and what is loaded, for ``/metrics``."""
        loaded = self.server.model_names()
        size = sum(self._sizes.get(name, 0) for name in loaded)

        def one(name: str, description: str, kind: str, value: float) -> CustomMetricFamily:
            sample = CustomMetricSample(labels={}, value=value)
            return CustomMetricFamily(
                name=name, description=description, kind=kind, samples=(sample,)
            )

        return [
            one(
                "orchestrion_model_loads_total", "Models loaded on first use", "counter", self.loads
            ),
            one(
                "orchestrion_model_load_seconds_total",
                "Seconds spent loading models on first use",
                "counter",
                self.load_seconds,
            ),
            one(
                "orchestrion_model_evictions_total",
                "Models unloaded to make room (least recently used first)",
                "counter",
                self.evictions,
            ),
            one(
                "orchestrion_model_eviction_seconds_total",
                "Seconds spent unloading models to make room",
                "counter",
                self.eviction_seconds,
            ),
            one("orchestrion_models_loaded", "Models loaded now", "gauge", len(loaded)),
            one(
                "orchestrion_models_loaded_bytes",
                "Bytes of the files of the models loaded now",
                "gauge",
                size,
            ),
        ]
