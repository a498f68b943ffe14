"""Response-cache keys and entries, and the data-only format entries are stored in.

How this works: `cache_key` hashes, with xxh3-128, the model name, its resolved version, its
*revision* (a fingerprint of the code and config that answer, so a reload or another deploy's
entries never answer) and each input's name, data type, shape and bytes, inputs in name order
(so the order a client sends them in does not matter). Array memory is hashed in place, never
copied (only a non-contiguous array is made contiguous first). Next to the 16-byte digest the
key keeps the request's *signature* (model, version, revision, and each input's name, type,
shape and byte length); an entry stores the signature of the request that produced it and a
hit is accepted only when the two match, so even a hash collision between requests of
different shapes cannot return a wrong answer.

An entry holds outputs only, never response parameters: those describe the request that asked
(its sequence id, say), so a hit's parameters are made from the hitting request itself.

`encode_entry`/`decode_entry` are the format of caches that store bytes (Redis): a JSON
header that describes the tensors, then their raw bytes. Nothing is ever unpickled.
"""

from __future__ import annotations

import functools
import json
import struct
import sys
from collections.abc import Iterable
from typing import Any, TypeAlias

import attrs
import numpy as np
import xxhash

from ._bytes_wire import decode_bytes, element_bytes, encode_bytes
from ._dtypes import DataType
from ._errors import InvalidRequestError
from ._messages import Tensors

TensorSignature: TypeAlias = tuple[str, str, tuple[int, ...], int]
"""One input as a cache key sees it: (name, protocol data type, shape, byte length)."""

_MAGIC = b"ORCHCE3\n"  # orchestrion cache entry, format 3 (2 stored parameters, no revision)
_LENGTH = struct.Struct("<I")
_HEADER = struct.Struct("<q")


@attrs.frozen(kw_only=True)
class CacheKey:
    """What identifies a response in the cache: a 128-bit digest plus the request's
    signature, checked on every hit."""

    digest: bytes
    """The 16-byte xxh3-128 digest of the full key material."""
    model_name: str
    model_version: int
    revision: str = ""
    """The fingerprint of the code and config that answered (see ``Runner.revision``)."""
    signature: tuple[TensorSignature, ...]
    """The inputs, in name order."""
    outputs: tuple[str, ...] | None = None
    """The outputs asked for, sorted, when a request asked for only some (None: all)."""

    @property
    def hex(self) -> str:
        """The digest as 32 hex digits (how byte-string stores name the entry)."""
        return self.digest.hex()


@attrs.frozen(kw_only=True)
class CacheEntry:
    """A stored response: its key and the outputs of the response.

    Output arrays are read-only; an entry is shared by every request that hits it. Response
    parameters are not stored: they belong to the request that asked.
    """

    key: CacheKey
    outputs: Tensors = attrs.field(eq=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (BYTES tensors: the bytes of their elements)."""
        return sum(_data_nbytes(a) for a in self.outputs.values())

    def matches(self, key: CacheKey) -> bool:
        """Whether this entry answers a request with ``key`` (digest and signature)."""
        mine = self.key
        return (
            mine.digest == key.digest
            and mine.signature == key.signature
            and mine.model_name == key.model_name
            and mine.model_version == key.model_version
            and mine.revision == key.revision
            and mine.outputs == key.outputs
        )


def _data_nbytes(array: np.ndarray[Any, Any]) -> int:
    if array.dtype.kind == "O":
        return sum(len(element_bytes(e)) for e in array.flat)
    return int(array.nbytes)


_TYPE_NAMES: dict[np.dtype[Any], str] = {}


def _type_name(array: np.ndarray[Any, Any]) -> str:
    dtype = array.dtype
    name = _TYPE_NAMES.get(dtype)
    if name is None:
        name = _TYPE_NAMES[dtype] = DataType.from_numpy(dtype).value
    return name


@functools.lru_cache(maxsize=4096)
def _input_header(name: str, type_name: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """The length-prefixed description of one input (cached: requests repeat shapes)."""
    encoded = name.encode()
    return struct.pack(
        f"<q{len(encoded)}s8sq{len(shape)}qq",
        len(encoded),
        encoded,
        type_name.encode(),
        len(shape),
        *shape,
        nbytes,
    )


@functools.lru_cache(maxsize=1024)
def _model_header(model_name: str, model_version: int, revision: str) -> bytes:
    name, fingerprint = model_name.encode(), revision.encode()
    return b"".join(
        [
            _HEADER.pack(len(name)),
            name,
            _HEADER.pack(model_version),
            _HEADER.pack(len(fingerprint)),
            fingerprint,
        ]
    )


def _raw(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The array's memory as flat bytes: a view when it is contiguous (no copy)."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)


def cache_key(
    model_name: str,
    model_version: int,
    inputs: Tensors,
    outputs: Iterable[str] | None = None,
    *,
    revision: str = "",
) -> CacheKey:
    """The cache key of a request for ``model_name`` at its resolved ``model_version``.

    Args:
        model_name: the model (or ensemble) that answers the request.
        model_version: the version that answers it (never -1).
        inputs: the request's checked inputs (numpy arrays, BYTES as object arrays).
        outputs: the outputs the request asked for when it asked for only some of them
            (an ensemble prunes its steps for them, so the response depends on them);
            None when it wants them all.
        revision: the fingerprint of the code and config of the version that answers (for
            an ensemble, its composing models' too): after a reload, or on a replica that
            runs other code, the same request has another key.

    Returns:
        the key; equal inputs give equal keys whatever their order in ``inputs``.
    """
    hasher = xxhash.xxh3_128(_model_header(model_name, model_version, revision))
    signature: list[TensorSignature] = []
    for input_name in sorted(inputs):
        array = inputs[input_name]
        type_name = _type_name(array)
        shape = tuple(map(int, array.shape))
        if array.dtype.kind == "O":
            data = encode_bytes(array)
            nbytes = len(data)
            # Every variable-length field is length-prefixed: no two inputs share material.
            hasher.update(_input_header(input_name, type_name, shape, nbytes))
            hasher.update(data)
        else:
            nbytes = int(array.nbytes)
            hasher.update(_input_header(input_name, type_name, shape, nbytes))
            # A C-contiguous array is hashed through the buffer protocol, in place.
            contiguous = array if array.flags.c_contiguous else np.ascontiguousarray(array)
            hasher.update(contiguous)  # type: ignore[arg-type]  # ndarray is a Buffer
        signature.append((input_name, type_name, shape, nbytes))
    wanted = None
    if outputs is not None:
        wanted = tuple(sorted(outputs))
        hasher.update(_HEADER.pack(-len(wanted)))  # negative: no input header looks like it
        for name in wanted:
            encoded = name.encode()
            hasher.update(_HEADER.pack(len(encoded)))
            hasher.update(encoded)
    return CacheKey(
        digest=hasher.digest(),
        model_name=model_name,
        model_version=model_version,
        revision=revision,
        signature=tuple(signature),
        outputs=wanted,
    )


def frozen_outputs(outputs: Tensors) -> dict[str, np.ndarray[Any, Any]]:
    """Read-only copies of ``outputs`` for an entry (the caller keeps its own arrays)."""
    frozen: dict[str, np.ndarray[Any, Any]] = {}
    for name, array in outputs.items():
        copy = np.array(array, copy=True, order="C")
        copy.flags.writeable = False
        frozen[name] = copy
    return frozen


def shared_outputs(entry: CacheEntry, wanted: frozenset[str] | None) -> dict[str, Any]:
    """The outputs of a hit: read-only views of the entry's arrays (only ``wanted`` ones).

    Views of a read-only base cannot be made writable, so no caller can change an entry.
    """
    return {
        name: array.view()
        for name, array in entry.outputs.items()
        if wanted is None or name in wanted
    }


STREAM_FINALS = "\x00final"
"""The output of a *stream entry* (the whole stream of a decoupled model or ensemble) that
holds each response's final flag, in order (BOOL, one per response). Response ``i``'s output
``name`` is stored as ``"<i>\\x00<name>"``: no model's output name holds a NUL, so a stream
entry goes through every cache (and its format) as an entry of plain outputs."""


def stream_entry(key: CacheKey, responses: Iterable[tuple[Tensors, bool]]) -> CacheEntry:
    """A stream entry for ``responses`` (each response's frozen outputs and final flag)."""
    outputs: dict[str, np.ndarray[Any, Any]] = {}
    finals: list[bool] = []
    for index, (tensors, final) in enumerate(responses):
        finals.append(final)
        for name, array in tensors.items():
            outputs[f"{index}\x00{name}"] = array
    flags = np.array(finals, dtype=np.bool_)
    flags.flags.writeable = False
    outputs[STREAM_FINALS] = flags
    return CacheEntry(key=key, outputs=outputs)


def stream_responses(
    entry: CacheEntry, wanted: frozenset[str] | None
) -> list[tuple[dict[str, Any], bool]] | None:
    """The responses of a stream entry, in order: read-only views of their outputs (only
    ``wanted`` ones) and their final flags; None: not a stream entry, or not an intact one."""
    finals = entry.outputs.get(STREAM_FINALS)
    if finals is None or finals.dtype != np.bool_ or finals.ndim != 1:
        return None
    responses: list[tuple[dict[str, Any], bool]] = [({}, bool(f)) for f in finals.tolist()]
    for stored, array in entry.outputs.items():
        if stored == STREAM_FINALS:
            continue
        index, _, name = stored.partition("\x00")
        if not index.isdigit() or int(index) >= len(responses) or not name:
            return None
        if wanted is None or name in wanted:
            responses[int(index)][0][name] = array.view()
    return responses


def entry_cost(entry: CacheEntry, key_size: int = 0) -> int:
    """Bytes an in-memory cache really spends on ``entry``: tensor data plus the Python
    objects around it (array headers, names, the key, the signature, the entry itself)."""
    cost = sys.getsizeof(entry) + sys.getsizeof(entry.key) + key_size
    cost += sys.getsizeof(entry.key.digest) + sys.getsizeof(entry.key.model_name)
    cost += sys.getsizeof(entry.key.signature) + sys.getsizeof(entry.outputs)
    for name, shape_name, shape, _ in entry.key.signature:
        cost += sys.getsizeof(name) + sys.getsizeof(shape_name) + sys.getsizeof(shape) + 100
    for name, array in entry.outputs.items():
        # getsizeof counts the data of an array that owns it: count the header here only.
        header = sys.getsizeof(array) - (array.nbytes if array.base is None else 0)
        cost += sys.getsizeof(name) + header + _data_nbytes(array)
        if array.dtype.kind == "O":
            cost += sum(sys.getsizeof(e) - len(element_bytes(e)) for e in array.flat)
    return cost


def encode_entry(entry: CacheEntry) -> bytes:
    """``entry`` in orchestrion's data-only cache format (JSON header + raw tensor bytes)."""
    header_outputs = []
    payload: list[Any] = []
    for name, array in entry.outputs.items():
        if array.dtype.kind == "O":
            data = encode_bytes(array)
            nbytes = len(data)
            payload.append(data)
        else:
            payload.append(_raw(array))
            nbytes = int(array.nbytes)
        header_outputs.append([name, _type_name(array), list(array.shape), nbytes])
    header = json.dumps(
        {
            "model": entry.key.model_name,
            "version": entry.key.model_version,
            "revision": entry.key.revision,
            "digest": entry.key.hex,
            "signature": [[n, t, list(s), b] for n, t, s, b in entry.key.signature],
            "requested": list(entry.key.outputs) if entry.key.outputs is not None else None,
            "outputs": header_outputs,
        },
        separators=(",", ":"),
    ).encode()
    return b"".join([_MAGIC, _LENGTH.pack(len(header)), header, *payload])


def decode_entry(data: bytes) -> CacheEntry:
    """Read an entry written by `encode_entry`. Arrays are read-only views of ``data``.

    Raises:
        ValueError: ``data`` is not an intact entry of this format.
    """
    view = memoryview(data)
    if bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise ValueError("not an orchestrion cache entry (or an unknown format version)")
    start = len(_MAGIC) + _LENGTH.size
    if len(view) < start:
        raise ValueError("cache entry truncated in its header")
    (length,) = _LENGTH.unpack_from(view, len(_MAGIC))
    try:
        header = json.loads(bytes(view[start : start + length]))
        signature = tuple(
            (str(n), str(t), tuple(int(d) for d in s), int(b)) for n, t, s, b in header["signature"]
        )
        requested = header["requested"]
        key = CacheKey(
            digest=bytes.fromhex(header["digest"]),
            model_name=str(header["model"]),
            model_version=int(header["version"]),
            revision=str(header["revision"]),
            signature=signature,
            outputs=None if requested is None else tuple(str(n) for n in requested),
        )
        described = [
            (str(n), str(t), tuple(int(d) for d in s), int(b)) for n, t, s, b in header["outputs"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cache entry has a malformed header: {exc}") from None
    offset = start + length
    outputs: dict[str, np.ndarray[Any, Any]] = {}
    for name, type_name, shape, nbytes in described:
        if nbytes < 0 or offset + nbytes > len(view):
            raise ValueError(f"cache entry truncated in output '{name}'")
        chunk = view[offset : offset + nbytes]
        offset += nbytes
        outputs[name] = _tensor(name, type_name, shape, chunk)
    if offset != len(view):
        raise ValueError(f"cache entry has {len(view) - offset} unexpected trailing bytes")
    return CacheEntry(key=key, outputs=outputs)


def _tensor(
    name: str, type_name: str, shape: tuple[int, ...], chunk: memoryview
) -> np.ndarray[Any, Any]:
    try:
        data_type = DataType(type_name)
    except ValueError:
        raise ValueError(f"cache entry output '{name}' has unknown type {type_name!r}") from None
    count = int(np.prod(shape, dtype=np.int64))
    if data_type is DataType.BYTES:
        try:
            array = decode_bytes(chunk, count, name).reshape(shape)
        except InvalidRequestError as exc:
            raise ValueError(f"cache entry output {exc}") from None
        array.flags.writeable = False
        return array
    dtype = data_type.numpy_dtype
    if count * dtype.itemsize != len(chunk):
        raise ValueError(f"cache entry output '{name}' has {len(chunk)} bytes for shape {shape}")
    return np.frombuffer(chunk, dtype=dtype, count=count).reshape(shape)
