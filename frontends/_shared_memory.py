"""Triton's system shared memory extension: clients register POSIX shared memory regions, then
send inputs and receive outputs through them instead of in the request and response bodies.

How this works: registering a region opens its object (``/dev/shm/<key>``) and keeps the file
descriptor; nothing is mapped. A request's inputs are read from it and its outputs written
into it with ``preadv``/``pwrite``, so a region that its owner shrinks or removes makes that
request fail (a short read, a size check) instead of crashing the server the way a mapped
page past the end of the file would (SIGBUS). Every offset and size is checked against the
registered part of the region and against the object's current size. A request leases the
regions it names (`SharedMemory.lease`): unregistering one that a request is using takes
effect when the last such request is done, so no descriptor is closed (and reused by another
file) under a read. The registry lives on the trio thread; only the copies run in worker
threads.

Who may use it: any client that reaches the ports can read (through a model's outputs) and
overwrite any shared memory object the server's user can open. `serve` allows it only when
every front end listens on loopback addresses, unless told otherwise
(``--allow-client-shm``), and bounds the number of regions. CUDA shared memory is not
offered: registering one is a clear error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import numpy as np

from ..protocols import (
    InvalidRequestError,
    RegionNotFoundError,
    SharedInput,
    SharedMemoryRef,
    UnsupportedError,
    WireRequest,
    tensor_from_bytes,
    tensor_to_bytes,
)

DEFAULT_MAX_REGIONS = 1024
"""How many regions may be registered at once by default (each holds a file descriptor)."""

SHM_FOLDER = "/dev/shm"
"""Where Linux keeps POSIX shared memory objects (``shm_open``'s namespace)."""

DISABLED = (
    "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
)
"""Triton's answer when client shared memory is turned off."""

CUDA_UNSUPPORTED = (
    "CUDA shared memory is not supported: orchestrion serves system shared memory only "
    "(register the region with register_system_shared_memory)"
)

_MAX_IO = 0x7FFFF000
"""The most bytes Linux moves in one read or write call."""


@attrs.define(eq=False)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    users: int = 0
    unregistered: bool = False

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


@attrs.define(eq=False)
class SharedMemory:
    """The registered system shared memory regions of one server (`serve` makes one, shared
    by the HTTP and gRPC front ends). Use it on the trio thread; `close` when done.

    Args:
        allowed: whether clients may register and use regions (Triton's
            ``--allow-client-shm``); when not, status lists none and the rest is refused.
        max_regions: how many regions may be registered at once.
        refusal: the refusal's words (Triton's by default).
    """

    allowed: bool = True
    max_regions: int = DEFAULT_MAX_REGIONS
    refusal: str = DISABLED
    """What a client is told when regions are not allowed."""
    _regions: dict[str, _Region] = attrs.field(factory=dict, init=False)
    _draining: list[_Region] = attrs.field(factory=list, init=False)
    """Unregistered regions that requests still use: closed when the last one is done."""

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes at ``offset`` of the shared memory object ``key``
        (``"/name"``, as given to ``shm_open``) as region ``name``.

        Raises:
            UnsupportedError: client shared memory is turned off.
            InvalidRequestError: the name is taken or empty, the key is not a shared memory
                object name, the object cannot be opened, the part lies outside it, or the
                limit of regions is reached.
        """
        self._check_allowed()
        if not name:
            raise InvalidRequestError(
                "'region name' is necessary to register system shared memory region"
            )
        if name in self._regions:
            raise InvalidRequestError(f"shared memory region '{name}' already in manager")
        if len(self._regions) >= self.max_regions:
            raise InvalidRequestError(
                f"cannot register shared memory region '{name}': {self.max_regions} regions are "
                "registered, the most this server allows (--max-shm-regions); unregister some"
            )
        for value, what in ((offset, "offset"), (byte_size, "byte_size")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(
                    f"cannot register shared memory region '{name}': {what} must be a "
                    "non-negative integer"
                )
        fd = _open(name, key)
        try:
            size = _object_size(fd, name, key)
            if offset + byte_size > size:
                raise InvalidRequestError(
                    f"failed to register shared memory region '{name}': invalid args (offset "
                    f"{offset} + byte_size {byte_size} is past the end of '{key}', {size} bytes)"
                )
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = _Region(name, key, offset, byte_size, fd)

    def unregister(self, name: str = "") -> None:
        """Unregister region ``name``, or every region when ``name`` is empty. Unknown names
        are no error (Triton's). A region in use by requests closes when they are done.

        Raises:
            UnsupportedError: client shared memory is turned off.
        """
        self._check_allowed()
        names = [name] if name else list(self._regions)
        for each in names:
            region = self._regions.pop(each, None)
            if region is None:
                continue
            region.unregistered = True
            if region.users:
                self._draining.append(region)
            else:
                os.close(region.fd)

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """The registered regions (``name``, ``key``, ``offset``, ``byte_size``), or the one
        named.

        Raises:
            RegionNotFoundError: ``name`` is not registered.
        """
        if not name:
            return [region.status() for region in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFoundError(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    def close(self) -> None:
        """Close every region's descriptor (the server is done; no request is running)."""
        for region in [*self._regions.values(), *self._draining]:
            with contextlib.suppress(OSError):
                os.close(region.fd)
        self._regions.clear()
        self._draining.clear()

    @contextlib.contextmanager
    def lease(self, request: WireRequest) -> Iterator[Lease | None]:
        """The regions ``request`` names, checked and held until the block ends (None when it
        names none).

        Raises:
            UnsupportedError: client shared memory is turned off.
            RegionNotFoundError: a region is not registered.
            InvalidRequestError: an offset or size lies outside its region.
        """
        if not request.shared_inputs and not request.shared_outputs:
            yield None
            return
        self._check_allowed()
        places: dict[str, tuple[_Region, int, int]] = {}
        for name, shared in request.shared_inputs.items():
            places[name] = self._place(shared.where)
        outputs: dict[str, tuple[_Region, int, int]] = {}
        for name, where in request.shared_outputs.items():
            outputs[name] = self._place(where)
        held = {id(r): r for r, _, _ in [*places.values(), *outputs.values()]}
        for region in held.values():
            region.users += 1
        try:
            yield Lease(places, outputs, dict(request.shared_inputs))
        finally:
            for region in held.values():
                region.users -= 1
                if region.unregistered and not region.users:
                    self._draining.remove(region)
                    os.close(region.fd)

    def _place(self, where: SharedMemoryRef) -> tuple[_Region, int, int]:
        """The region, absolute offset and size of ``where``, checked against the region."""
        region = self._regions.get(where.region)
        if region is None:
            raise RegionNotFoundError(f"Unable to find shared memory region: '{where.region}'")
        if where.offset >= region.byte_size:
            raise InvalidRequestError(
                f"Invalid offset for shared memory region: '{where.region}' (offset "
                f"{where.offset}, the region has {region.byte_size} bytes)"
            )
        if where.offset + where.byte_size > region.byte_size:
            raise InvalidRequestError(
                f"Invalid offset + byte size for shared memory region: '{where.region}' "
                f"(offset {where.offset} + byte size {where.byte_size}, the region has "
                f"{region.byte_size} bytes)"
            )
        return region, region.offset + where.offset, where.byte_size

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise UnsupportedError(self.refusal)


@attrs.frozen
class Lease:
    """The shared memory one request reads its inputs from and writes its outputs into;
    `read_inputs` and `write_outputs` do blocking I/O (run them in a worker thread)."""

    _inputs: Mapping[str, tuple[_Region, int, int]]
    _outputs: Mapping[str, tuple[_Region, int, int]]
    _described: Mapping[str, SharedInput]

    @property
    def size(self) -> int:
        """Bytes this lease reads and writes at most (to decide whether to use a thread)."""
        return sum(size for _, _, size in [*self._inputs.values(), *self._outputs.values()])

    def read_inputs(self) -> dict[str, np.ndarray[Any, Any]]:
        """The inputs in shared memory, as tensors (copies: the client may reuse its region
        as soon as the response arrives).

        Raises:
            InvalidRequestError: a region shrank or was removed, or a tensor's bytes do not
                match its shape and data type.
        """
        tensors = {}
        for name, (region, offset, size) in self._inputs.items():
            buffer = np.empty(size, dtype=np.uint8)
            _check_object(region, offset + size)
            done = 0
            while done < size:
                view = buffer[done : done + _MAX_IO]
                got = os.preadv(region.fd, [view.data], offset + done)
                if got == 0:
                    raise _shrunk(region)
                done += got
            described = self._described[name]
            tensors[name] = tensor_from_bytes(
                buffer.data, described.datatype, described.shape, name
            )
        return tensors

    def write_outputs(self, outputs: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Write each output asked for in shared memory into its place. Every size is checked
        before anything is written.

        Raises:
            InvalidRequestError: an output is larger than the place the request gave it, or a
                region shrank or was removed.
        """
        writes = []
        for name, (region, offset, size) in self._outputs.items():
            array = outputs.get(name)
            if array is None:
                continue
            raw = memoryview(tensor_to_bytes(np.asarray(array))).cast("B")
            if len(raw) > size:
                raise InvalidRequestError(
                    f"shared memory size specified with the request for output '{name}' "
                    f"({size} bytes) should be at least {len(raw)} bytes to hold the results"
                )
            writes.append((region, offset, raw))
        for region, offset, raw in writes:
            _check_object(region, offset + len(raw))
            done = 0
            while done < len(raw):
                done += os.pwrite(region.fd, raw[done : done + _MAX_IO], offset + done)


def _open(name: str, key: str) -> int:
    """The descriptor of shared memory object ``key`` (``shm_open``'s name rules: one
    leading slash at most, then a name without slashes)."""
    if not isinstance(key, str):
        raise InvalidRequestError(
            f"cannot register shared memory region '{name}': key must be a string"
        )
    base = key.lstrip("/")
    if not base or "/" in base or base in (".", "..") or "\0" in base or len(base) > 255:
        raise InvalidRequestError(
            f"cannot register shared memory region '{name}' - invalid shm key '{key}' (a "
            "shared memory object name: '/name', no other slash)"
        )
    try:
        fd = os.open(
            os.path.join(SHM_FOLDER, base), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        )
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise InvalidRequestError(
                f"cannot register shared memory region '{name}': the server has no file "
                "descriptors left"
            ) from None
        raise InvalidRequestError(
            f"Unable to open shared memory region: '{key}' ({exc.strerror})"
        ) from None
    return fd


def _object_size(fd: int, name: str, key: str) -> int:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidRequestError(
            f"cannot register shared memory region '{name}': '{key}' is not a shared memory object"
        )
    return info.st_size


def _check_object(region: _Region, end: int) -> None:
    """Refuse a region whose object was removed, or shrank below ``end``."""
    info = os.fstat(region.fd)
    if info.st_nlink == 0:
        raise InvalidRequestError(
            f"shared memory region '{region.name}': its object '{region.key}' was removed "
            "(shm_unlink) after it was registered; register it again"
        )
    if info.st_size < end:
        raise _shrunk(region, info.st_size)


def _shrunk(region: _Region, size: int | None = None) -> InvalidRequestError:
    now = f" to {size} bytes" if size is not None else ""
    return InvalidRequestError(
        f"shared memory region '{region.name}': its object '{region.key}' shrank{now} after it "
        f"was registered ({region.offset + region.byte_size} bytes registered)"
    )
