"""JSON read in slices (`orchestrion.protocols._json_slices`): the same value as
``json.loads`` for any document, the same errors for malformed ones, large arrays in runs when
asked, and the tensors an infer request's ``data`` makes from them."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrion.protocols import DataType, InvalidRequestError
from orchestrion.protocols import _json_slices as json_slices
from orchestrion.protocols._json_tensors import json_tensor as _json_tensor
from orchestrion.protocols._kserve_http import decode_http_request

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=30) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=400,
)


@pytest.fixture
def small_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of 40 characters: runs, and values longer than a window, in small documents."""
    monkeypatch.setattr(json_slices, "WINDOW", 40)


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN included, with the types json.loads gives (1 and 1.0 differ)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if type(a) is not type(b) and not (isinstance(a, list) and isinstance(b, list)):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=VALUES, indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans())
def test_any_document_reads_as_json_loads_reads_it(
    small_window: None, value: Any, indent: int | None, ascii_only: bool
) -> None:
    """Whatever the value, its whitespace and escapes: the same value, types included."""
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert _same(json_slices.loads(text), json.loads(text))
    assert _same(json_slices.loads(text.encode()), json.loads(text.encode()))


def test_nan_infinity_duplicates_and_big_numbers_as_json_loads(small_window: None) -> None:
    """NaN, Infinity and -Infinity read as floats, 1e400 as infinity, integers past 64 bits
    exactly, and a duplicate key keeps its last value."""
    text = (
        '{"a": [NaN, Infinity, -Infinity, 1e400, 123456789012345678901234567890, -0.0, 0],'
        ' "a": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], "b": "x"}'
    )
    assert _same(json_slices.loads(text), json.loads(text))


@pytest.mark.parametrize(
    "text",
    [
        '{"data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,, 15]}',
        '{"data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14 15]}',
        '{"data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}',
        '{"data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]} x',
        '{"data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], 3: 4}',
        '{"data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] "b": 1}',
        '{"data" [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}',
        '{"data": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "\\x"]}',
        '{"data": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k\n"]}',
        '{"data": [tru, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}',
        '{"data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 016]}',
    ],
)
def test_malformed_documents_raise_what_json_loads_raises(small_window: None, text: str) -> None:
    """The error and its position are Python's own."""
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as got:
        json_slices.loads(text)
    assert (got.value.msg, got.value.pos) == (expected.value.msg, expected.value.pos)


def test_large_arrays_come_in_runs_and_small_ones_as_lists() -> None:
    """With ``runs``, an array of more than a run's elements is a `Runs` whose runs hold its
    elements in order; a small array (a shape) stays a list."""
    data = list(range(100_000))
    text = json.dumps({"shape": [2, 50_000], "data": data, "rows": [[i, i] for i in range(40_000)]})
    document = json_slices.loads(text, runs=True)
    assert document["shape"] == [2, 50_000]
    assert isinstance(document["data"], json_slices.Runs)
    assert len(document["data"]) > 1
    assert document["data"].elements() == 100_000
    assert [x for run in document["data"] for x in run] == data
    assert isinstance(document["rows"], json_slices.Runs)
    assert not isinstance(json_slices.loads(text)["data"], json_slices.Runs)


@pytest.mark.parametrize(
    ("data", "dtype", "shape"),
    [
        (list(range(100_000)), DataType.INT64, [2, 50_000]),
        ([[float(i), -1.5] for i in range(50_000)], DataType.FP32, [100_000]),
        ([[[True, False]] * 3] * 20_000, DataType.BOOL, [20_000, 3, 2]),
        ([["ab", "é"]] * 40_000, DataType.BYTES, [40_000, 2]),
        ([list(range(70_000)), list(range(70_000))], DataType.UINT32, [2, 70_000]),
    ],
    ids=["flat", "rows", "deep", "bytes", "large-rows"],
)
def test_tensors_from_runs_are_those_from_lists(
    data: Any, dtype: DataType, shape: list[int]
) -> None:
    """A tensor made from the runs of its data (flat, in rows, deeper, BYTES, rows larger
    than a run) is the one made from the same data as plain lists."""
    text = json.dumps({"data": data})
    runs = json_slices.loads(text, runs=True)["data"]
    got = _json_tensor(runs, dtype, shape, "X")
    expected = _json_tensor(json.loads(text)["data"], dtype, shape, "X")
    assert got.dtype == expected.dtype
    assert got.shape == tuple(shape)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("data", "dtype", "message"),
    [
        ([*range(70_000), 1.5], DataType.INT32, "INT32 elements must be integers"),
        ([*range(70_000), "1"], DataType.FP32, "FP32 elements must be numbers"),
        ([True] * 70_000 + [1], DataType.BOOL, "BOOL elements must be true or false"),
        ([*range(70_000), True], DataType.INT32, "INT32 elements must be numbers"),
        (["a"] * 70_000 + [1], DataType.BYTES, "BYTES elements must be strings"),
        ([*range(70_000), 300], DataType.INT8, "a value does not fit in INT8"),
        (list(range(70_002)), DataType.INT64, "unexpected number of elements 70002"),
    ],
)
def test_a_bad_element_past_the_first_run_is_refused(
    data: list[Any], dtype: DataType, message: str
) -> None:
    """An element of the wrong kind (or one too many) after tens of thousands of good ones
    is found, with the message a short tensor gets."""
    runs = json_slices.loads(json.dumps({"data": data}), runs=True)["data"]
    with pytest.raises(InvalidRequestError, match=message):
        _json_tensor(runs, dtype, [70_001], "X")


def test_a_large_infer_document_decodes_as_a_small_one_would() -> None:
    """`decode_http_request` of a 4 MB document (read in slices) gives the tensors, outputs
    and parameters the same document gives when read whole."""
    values = np.arange(300_000, dtype=np.float32) / 7
    document = {
        "id": "big",
        "parameters": {"sequence_id": 5, "sequence_start": True},
        "inputs": [
            {"name": "X", "datatype": "FP32", "shape": [3, 100_000], "data": values.tolist()},
            {"name": "T", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]},
        ],
        "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
    }
    body = json.dumps(document).encode()
    assert len(body) > json_slices.WINDOW
    wire = decode_http_request("m", "", body, None)
    np.testing.assert_array_equal(wire.inputs["X"], values.reshape(3, 100_000))
    assert wire.inputs["T"].tolist() == [b"a", b"b"]
    assert wire.options.request_id == "big"
    assert wire.options.sequence_id == 5
    assert wire.binary_outputs == {"Y": True}


def test_the_collector_pause_nests_and_restores() -> None:
    """Nested pauses keep the collector off until the outermost ends, then it runs as before
    (and stays off if it was off)."""
    import gc

    assert gc.isenabled()
    with json_slices.collector_paused():
        with json_slices.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with json_slices.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [DataType.BOOL, DataType.FP64, DataType.BYTES])
def test_a_huge_shape_over_little_data_is_refused_before_anything_is_allocated(
    dtype: DataType,
) -> None:
    """A shape of 2**40 elements with one element of data: a 400 counting the elements,
    not an attempt to allocate terabytes (the shape is the client's word)."""
    value: Any = "a" if dtype is DataType.BYTES else (True if dtype is DataType.BOOL else 1.5)
    with pytest.raises(InvalidRequestError, match="unexpected number of elements 1"):
        _json_tensor([value], dtype, [2**40], "X")
