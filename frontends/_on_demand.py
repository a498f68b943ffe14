"""Models loaded on first use, and unloaded least recently used first under a budget
(``orchestrion serve --model-load-on-demand`` with ``--model-count-limit`` and
``--model-memory-limit``): many models served from little memory.

How this works: the front ends hold a `Lease` on a model for each request's whole life
(`OnDemand.using`; a streamed answer keeps it until its last part). A model the server has
loaded is marked as used now. A model that is not loaded but has a folder in the repository
is loaded through `ModelControl.load`, in a task of `OnDemand`'s own nursery: concurrent first
requests wait for that one load, and a client that leaves does not cancel it for the others
(they get its error, if it fails). Before the load, under the model control's lock, `OnDemand`
makes room: while the models the load adds (the model and the composing models it needs, as
`plan_load` reads them) would take the server over a limit, the least recently used model
that nothing holds is unloaded. A model is held by a lease (a request in flight), by a loaded
ensemble that uses it, or by the ensemble being loaded, so an ensemble keeps its steps while
it loads, runs and stays loaded. Models loaded otherwise (``--load-model``, the load API)
count too, as the least recently used. When everything loaded is held, the
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

_ATTEMPTS = 3
"""Loads a request asks for before it answers as for a model that is not loaded (a model it
holds cannot be unloaded, so one is enough unless an unload API call races it)."""
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
class _Load:
    """One load of a model on first use, shared by the requests that wait for it."""

    done: trio.Event = attrs.field(factory=trio.Event)
    error: Exception | None = None


@attrs.define(eq=False)
class OnDemand:
    """Loads models on first use and unloads the least recently used under a budget. Open
    one with `open_on_demand` (it owns the tasks that load)."""

    server: AsyncServer
    control: ModelControl
    _nursery: trio.Nursery
    max_models: int | None = None
    """The most models loaded at once (composing models count); None: no limit."""
    max_bytes: int | None = None
    """The most bytes of model files loaded at once; None: no limit."""
    _used: collections.OrderedDict[str, None] = attrs.field(
        factory=collections.OrderedDict, init=False
    )
    """Loaded models, least recently used first."""
    _leases: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    _loading: dict[str, _Load] = attrs.field(factory=dict, init=False)
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
        self._track_loaded()

    @contextlib.asynccontextmanager
    async def using(self, name: str) -> AsyncIterator[Lease]:
        """Hold ``name`` for a request while the block runs (loading it first if it is in
        the repository and not loaded).

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
        """A hold on ``name`` that the caller releases (see `using`). The hold is taken
        before the load, so the model cannot be unloaded between its load and the request."""
        self._leases[name] += 1
        lease = Lease(self, name)
        try:
            for _ in range(_ATTEMPTS):
                if name in self.server.model_names() or not self._in_repository(name):
                    break
                load = self._loading.get(name)
                if load is None:
                    load = self._loading[name] = _Load()
                    self._nursery.start_soon(self._load, name, load)
                await load.done.wait()
                if load.error is not None:
                    raise load.error
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

    async def _load(self, name: str, load: _Load) -> None:
        """Load ``name`` (a task of the nursery: a requester that leaves does not cancel it);
        its error, if any, goes to the requests that wait for it."""
        started = time.perf_counter()
        try:
            await self.control.load(name, room=self._make_room, if_absent=True)
        except Exception as exc:
            load.error = exc
            return
        finally:
            del self._loading[name]
            load.done.set()
        seconds = time.perf_counter() - started
        self.loads += 1
        self.load_seconds += seconds
        self._track_loaded()
        self._used.move_to_end(name)
        _log.info("model '%s' loaded on first use in %.2f s", name, seconds)

    def _track_loaded(self) -> None:
        """Bring `_used` up to what is loaded: models loaded otherwise (at start, through
        the API) join as the least recently used; unloaded ones leave."""
        loaded = self.server.model_names()
        for name in [n for n in self._used if n not in loaded]:
            del self._used[name]
        for name in loaded:
            if name not in self._used:
                self._used[name] = None
                self._used.move_to_end(name, last=False)

    async def _make_room(self, plan: LoadPlan) -> None:
        """Unload what must go for ``plan`` to fit (called by `ModelControl.load`, under its
        lock, before it loads).

        Raises:
            ModelControlError: the plan alone is over a limit, or every loaded model stayed
                in use for `ROOM_WAIT` seconds.
        """
        names = [entry.name for entry in plan.entries]
        self._track_loaded()
        sizes = await trio.to_thread.run_sync(self._sizes_of, plan)
        self._sizes.update(sizes)
        added, added_bytes = len(names), sum(sizes[name] for name in names)
        self._check_fits(names, added, added_bytes)
        keep = set(names) | self._steps_of(plan)
        with trio.move_on_after(ROOM_WAIT):
            while self._over(added, added_bytes):
                victim = self._victim(keep)
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

    def _sizes_of(self, plan: LoadPlan) -> dict[str, int]:
        """The bytes of the plan's models and of loaded models not sized yet (disk reads:
        a worker thread's)."""
        sizes = {entry.name: folder_bytes(entry.path) for entry in plan.entries}
        root = self.server.model_repository
        for name in self.server.model_names():
            if name not in self._sizes and root is not None:
                sizes[name] = folder_bytes(find_model_folder(root, name))
        return sizes

    def _steps_of(self, plan: LoadPlan) -> set[str]:
        """Every model the plan's ensembles step into, however deep, loaded or not: what
        the load needs to stay loaded."""
        configs = {entry.name: entry.config for entry in plan.entries}
        todo = [entry.config for entry in plan.entries]
        steps: set[str] = set()
        while todo:
            scheduling = todo.pop().ensemble_scheduling
            for step in scheduling.step if scheduling is not None else ():
                if step.model_name in steps:
                    continue
                steps.add(step.model_name)
                if step.model_name in configs:
                    continue  # in the plan: its own steps are read from it
                if step.model_name in self.server.model_names():
                    todo.append(self.server.model_config(step.model_name))
        return steps

    def _over(self, added: int, added_bytes: int) -> bool:
        loaded = self.server.model_names()
        count = len(loaded) + added
        size = sum(self._sizes.get(name, 0) for name in loaded) + added_bytes
        return (self.max_models is not None and count > self.max_models) or (
            self.max_bytes is not None and size > self.max_bytes
        )

    def _victim(self, keep: set[str]) -> str | None:
        """The least recently used loaded model that nothing holds (None: none is free)."""
        self._track_loaded()
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


@contextlib.asynccontextmanager
async def open_on_demand(
    server: AsyncServer,
    control: ModelControl,
    *,
    max_models: int | None = None,
    max_bytes: int | None = None,
) -> AsyncIterator[OnDemand]:
    """An `OnDemand` for ``server``, its loads run in a nursery of this block (a load still
    running when the block ends is cancelled), its counters in the server's ``/metrics``.

    Raises:
        ConfigError: a limit below 1.
    """
    async with trio.open_nursery() as nursery:
        on_demand = OnDemand(server, control, nursery, max_models=max_models, max_bytes=max_bytes)
        with server.metric_families(on_demand.metric_families):
            yield on_demand
        nursery.cancel_scope.cancel()
