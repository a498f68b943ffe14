"""Triton's BYTES wire format (`protocols/_bytes_wire.py`) against a plain reference."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrion.protocols import InvalidRequestError
from orchestrion.protocols._bytes_wire import decode_bytes, encode_bytes


def reference(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def as_array(items: list[bytes]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


elements = st.lists(st.binary(max_size=12), max_size=40)
uniform = st.integers(0, 6).flatmap(
    lambda n: st.lists(st.binary(min_size=n, max_size=n), min_size=1, max_size=40)
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(elements, uniform))
def test_round_trip_matches_the_reference(items: list[bytes]) -> None:
    """Encoding gives the reference bytes (NULs and empty elements included), and decoding
    them gives the elements back."""
    wire = encode_bytes(as_array(items))
    assert wire == reference(items)
    assert decode_bytes(wire, len(items), "T").tolist() == items


@settings(max_examples=200, deadline=None)
@given(st.one_of(elements, uniform), st.integers(-6, 6))
def test_a_wrong_length_or_count_is_an_invalid_request(items: list[bytes], cut: int) -> None:
    """Cutting or padding the data, or claiming one more element, is refused with the tensor
    named; never a wrong decode."""
    wire = reference(items)
    changed = wire[:cut] if cut < 0 else wire + b"\0" * cut
    for data, count in ((changed, len(items)), (wire, len(items) + 1)):
        if (data, count) == (wire, len(items)):
            continue
        with pytest.raises(InvalidRequestError, match="'T'"):
            decode_bytes(data, count, "T")


def test_str_elements_and_large_blocks() -> None:
    """str elements are UTF-8; more elements than one encoding block still come out right."""
    items = [f"é{i}" for i in range(70_000)]
    wire = encode_bytes(np.array(items, dtype=object))
    assert wire == reference([s.encode() for s in items])
    with pytest.raises(TypeError, match="bytes or str"):
        encode_bytes(np.array([1, 2], dtype=object))
