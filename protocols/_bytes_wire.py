"""Triton's wire format of BYTES tensors: each element as a 4-byte little-endian length, then
its bytes. Used by the front ends (raw tensor contents) and by the cache (keys and entries).

How this works: a BYTES tensor is an object array of Python ``bytes``, so some work per
element cannot be avoided; the rest is done per byte, in numpy and in C. Encoding joins the
elements in one ``b"".join`` per block of elements and scatters the length prefixes in between
with numpy, instead of making two Python objects per element (which cost 3.8 GB and 12 s for
16M empty elements). Decoding walks the prefixes (each element's offset depends on the one
before), except when every element has the same length, the usual case (fixed-size strings,
empty elements): then one strided numpy check validates all prefixes, and the elements come
out of one numpy conversion.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ._errors import InvalidRequestError

_PREFIX = struct.Struct("<I")
_BLOCK = 1 << 16
"""Elements encoded per block: bounds the temporary index arrays (a few MiB)."""


def element_bytes(item: object) -> bytes:
    """One BYTES element as ``bytes`` (a str is UTF-8 encoded)."""
    if type(item) is bytes:
        return item
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, bytes | bytearray | memoryview):  # np.bytes_ too: plain bytes out
        return bytes(item)
    raise TypeError(f"BYTES elements must be bytes or str, got {type(item).__name__}")


def _elements(array: np.ndarray[Any, Any]) -> list[bytes]:
    items = array.tolist()
    if set(map(type, items)) <= _ONLY_BYTES:
        return items  # type: ignore[no-any-return]
    return [element_bytes(item) for item in items]


_ONLY_BYTES = {bytes}


def encode_bytes(array: np.ndarray[Any, Any]) -> bytes:
    """``array`` (BYTES: bytes or str elements) in Triton's wire format, a block of
    elements at a time (each call into C is short: other threads run between blocks).

    Raises:
        TypeError: an element is neither bytes nor str.
    """
    flat = array.reshape(-1)
    blocks = [
        _encode_block(_elements(flat[at : at + _BLOCK])) for at in range(0, flat.size, _BLOCK)
    ]
    if not blocks:
        return b""
    return blocks[0] if len(blocks) == 1 else b"".join(blocks)


def _encode_block(items: list[bytes]) -> bytes:
    if not items:
        return b""
    lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
    if int(lengths.max(initial=0)) > 0xFFFFFFFF:
        raise ValueError("a BYTES element is longer than 4 GiB - 1 (its 4-byte length)")
    ends = np.cumsum(lengths + 4)
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    starts = ends - lengths - 4  # where each element's prefix begins
    prefix_at = (starts[:, None] + np.arange(4)).reshape(-1)
    out[prefix_at] = lengths.astype("<u4").view(np.uint8)
    payload = b"".join(items)
    if payload:
        data = np.ones(len(out), dtype=bool)
        data[prefix_at] = False
        out[data] = np.frombuffer(payload, dtype=np.uint8)
    return out.tobytes()


def decode_bytes(buffer: bytes | memoryview, count: int, tensor: str) -> np.ndarray[Any, Any]:
    """``count`` BYTES elements from ``buffer`` (a flat object array of ``bytes``).

    Raises:
        InvalidRequestError: a length prefix runs past the end, the data falls short, or
            bytes are left over (``tensor`` is named).
    """
    view = memoryview(buffer).cast("B")
    size = len(view)
    if count * 4 > size:  # each element has a 4-byte length: check before allocating
        raise InvalidRequestError(
            f"input '{tensor}': {size} bytes cannot hold {count} BYTES elements (4-byte "
            "length prefixes)"
        )
    out = np.empty(count, dtype=object)
    if count == 0:
        if size:
            raise InvalidRequestError(
                f"input '{tensor}': {size} bytes left over after 0 BYTES elements"
            )
        return out
    (first,) = _PREFIX.unpack_from(view, 0)
    if size == count * (4 + first) and _uniform(view, count, first):
        record = np.dtype([("length", "<u4"), ("data", f"V{first}")])
        records = np.frombuffer(view, dtype=record)["data"]
        for at in range(0, count, _BLOCK):  # a block at a time: short calls into C
            if first == 0:
                out[at : at + _BLOCK].fill(b"")
            else:
                out[at : at + _BLOCK] = records[at : at + _BLOCK].tolist()
        return out
    offset = 0
    unpack = _PREFIX.unpack_from
    for i in range(count):
        if offset + 4 > size:
            raise InvalidRequestError(
                f"input '{tensor}': BYTES data ends after {i} of {count} elements"
            )
        (length,) = unpack(view, offset)
        offset += 4
        if offset + length > size:
            raise InvalidRequestError(
                f"input '{tensor}': BYTES element {i} claims {length} bytes, only "
                f"{size - offset} remain"
            )
        out[i] = bytes(view[offset : offset + length])
        offset += length
    if offset != size:
        raise InvalidRequestError(
            f"input '{tensor}': {size - offset} bytes left over after {count} BYTES elements"
        )
    return out


def _uniform(view: memoryview, count: int, length: int) -> bool:
    """Whether all ``count`` prefixes, ``4 + length`` bytes apart, say ``length``."""
    prefixes: np.ndarray[Any, Any] = np.ndarray(
        shape=(count,), dtype="<u4", buffer=view, strides=(4 + length,)
    )
    return bool((prefixes == length).all())
