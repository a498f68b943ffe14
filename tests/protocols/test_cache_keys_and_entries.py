"""Cache keys, the stored-entry format and the cache settings (the pure core; synchronous)."""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from orchestrion.protocols import (
    CacheConfig,
    CacheEntry,
    ConfigError,
    cache_key,
    decode_entry,
    encode_entry,
    frozen_outputs,
    parse_cache_config,
    shared_outputs,
)

DTYPES = [np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_, np.float16]

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=4))
)
inputs = st.dictionaries(st.text(min_size=1, max_size=8), arrays, min_size=1, max_size=4)


def key(inputs: dict[str, Any], name: str = "m", version: int = 1) -> bytes:
    return cache_key(name, version, inputs).digest


@settings(max_examples=60, deadline=None)
@given(inputs, st.randoms())
def test_input_order_does_not_matter(tensors: dict[str, Any], rng: Any) -> None:
    """The same inputs in any order give the same key and signature."""
    items = list(tensors.items())
    rng.shuffle(items)
    first, second = cache_key("m", 1, tensors), cache_key("m", 1, dict(items))
    assert first == second
    assert [s[0] for s in first.signature] == sorted(tensors)


@settings(max_examples=60, deadline=None)
@given(inputs, st.data())
def test_any_byte_change_changes_the_key(tensors: dict[str, Any], data: Any) -> None:
    """Flipping any bit of any input changes the key."""
    name = data.draw(st.sampled_from(sorted(tensors)))
    array = tensors[name]
    if array.nbytes == 0:
        return
    raw = bytearray(np.ascontiguousarray(array).tobytes())
    position = data.draw(st.integers(0, len(raw) - 1))
    raw[position] ^= 1 << data.draw(st.integers(0, 7))
    changed = dict(tensors)
    changed[name] = np.frombuffer(bytes(raw), dtype=array.dtype).reshape(array.shape)
    assert key(changed) != key(tensors)


def test_dtype_shape_name_model_and_version_are_in_the_key() -> None:
    """Same bytes, but another dtype, shape, input name, model or version: another key."""
    x = np.arange(8, dtype=np.float32)
    base = key({"X": x})
    assert key({"X": x.view(np.int32)}) != base
    assert key({"X": x.reshape(2, 4)}) != base
    assert key({"Y": x}) != base
    assert key({"X": x}, name="other") != base
    assert key({"X": x}, version=2) != base
    assert key({"X": x.view(ml_dtypes.bfloat16)}) != key({"X": x.view(np.float16)})
    # Material cannot slide between inputs: ("ab", "c") vs ("a", "bc").
    a, b = np.frombuffer(b"ab", np.uint8), np.frombuffer(b"c", np.uint8)
    c, d = np.frombuffer(b"a", np.uint8), np.frombuffer(b"bc", np.uint8)
    assert key({"P": a, "Q": b}) != key({"P": c, "Q": d})
    assert len(base) == 16


def test_views_and_copies_hash_alike() -> None:
    """A non-contiguous view hashes like its contiguous copy (the key is about values)."""
    grid = np.arange(64, dtype=np.float32).reshape(8, 8)
    view = grid[:, ::2]
    assert not view.flags.c_contiguous
    assert key({"X": view}) == key({"X": np.ascontiguousarray(view)})
    assert key({"X": grid.T}) == key({"X": np.ascontiguousarray(grid.T)})


def test_bytes_tensors_in_the_key() -> None:
    """BYTES elements are length-prefixed: splitting them differently changes the key."""
    one = np.array([b"ab", b"c"], dtype=object)
    two = np.array([b"a", b"bc"], dtype=object)
    assert key({"S": one}) != key({"S": two})
    assert key({"S": one}) == key({"S": np.array([b"ab", "c"], dtype=object)})
    assert cache_key("m", 1, {"S": one}).signature == (("S", "BYTES", (2,), 11),)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=6), arrays, max_size=3))
def test_entry_format_round_trip(outputs: dict[str, Any]) -> None:
    """encode_entry/decode_entry keep the key (revision included), names, dtypes, shapes and
    values."""
    entry = CacheEntry(
        key=cache_key("m", 3, {"X": np.zeros(2, np.float32)}, revision="r3"),
        outputs=frozen_outputs(outputs),
    )
    back = decode_entry(encode_entry(entry))
    assert back == entry  # the key
    assert back.key.revision == "r3"
    assert back.matches(entry.key)
    assert list(back.outputs) == list(outputs)
    for name, array in outputs.items():
        assert back.outputs[name].dtype == array.dtype
        assert back.outputs[name].shape == array.shape
        np.testing.assert_array_equal(back.outputs[name], array)
        assert not back.outputs[name].flags.writeable


def test_entry_format_bytes_and_bf16() -> None:
    """BYTES (empty elements included) and BF16 outputs survive the format."""
    strings = np.array([[b"", b"x"], [b"\x00\xff", b"long" * 100]], dtype=object)
    bf16 = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    entry = CacheEntry(key=cache_key("m", 1, {}), outputs=frozen_outputs({"S": strings, "B": bf16}))
    back = decode_entry(encode_entry(entry))
    assert back.outputs["S"].tolist() == strings.tolist()
    assert back.outputs["B"].dtype == bf16.dtype
    np.testing.assert_array_equal(back.outputs["B"], bf16)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b"garbage", "not an orchestrion cache entry"),
        (lambda b: b[:10], "truncated"),
        (lambda b: b[:-1], "truncated in output"),
        (lambda b: b + b"!", "trailing bytes"),
        (lambda b: b.replace(b'"FP32"', b'"FP99"'), "unknown type"),
        (lambda b: b.replace(b'"version":1', b'"version":"x"'), "malformed header"),
    ],
)
def test_damaged_entries_are_refused(mangle: Any, message: str) -> None:
    """A damaged or foreign value is a clear ValueError, never a wrong array."""
    entry = CacheEntry(
        key=cache_key("m", 1, {}), outputs=frozen_outputs({"Y": np.ones(4, np.float32)})
    )
    with pytest.raises(ValueError, match=message):
        decode_entry(mangle(encode_entry(entry)))


def test_entry_outputs_are_frozen_and_hits_get_views() -> None:
    """Stored arrays are read-only copies; a hit's views cannot be made writable."""
    y = np.ones(4, np.float32)
    stored = frozen_outputs({"Y": y, "Z": y})
    y[0] = 5  # the caller keeps its own array
    assert stored["Y"][0] == 1
    entry = CacheEntry(key=cache_key("m", 1, {}), outputs=stored)
    view = shared_outputs(entry, frozenset({"Y"}))
    assert list(view) == ["Y"]
    with pytest.raises(ValueError, match="read-only"):
        view["Y"][0] = 3
    with pytest.raises(ValueError, match="WRITEABLE"):
        view["Y"].flags.writeable = True


def test_signature_mismatch_is_not_a_match() -> None:
    """An entry answers only a key with the same digest *and* signature."""
    a = cache_key("m", 1, {"X": np.zeros(4, np.float32)})
    b = cache_key("m", 1, {"X": np.zeros((2, 2), np.float32)})
    entry = CacheEntry(key=a, outputs={})
    assert entry.matches(a)
    forged = CacheEntry(
        key=type(a)(digest=a.digest, model_name="m", model_version=1, signature=b.signature),
        outputs={},
    )
    assert not forged.matches(a)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.text(max_size=40))
def test_the_revision_is_key_material(first: str, second: str) -> None:
    """Another revision (another reload or deploy of the code) gives another digest, and an
    entry of one revision never answers a key of another, whatever the inputs."""
    inputs = {"X": np.arange(4, dtype=np.float32)}
    a = cache_key("m", 1, inputs, revision=first)
    b = cache_key("m", 1, inputs, revision=second)
    assert (a.digest == b.digest) == (first == second)
    stolen = CacheEntry(key=attrs.evolve(a, digest=b.digest), outputs={})
    assert stolen.matches(b) == (first == second)
    assert CacheEntry(key=a, outputs={}).matches(a)


# -- settings ---------------------------------------------------------------------------


def test_cache_config_flags() -> None:
    """Triton's flag format; a single string is allowed; values keep commas and '='."""
    assert parse_cache_config(None) is None
    assert parse_cache_config([]) is None
    assert parse_cache_config("local,size=1048576") == CacheConfig(
        name="local", options={"size": "1048576"}
    )
    config = parse_cache_config(["redis,host=h", "redis,port=1", "redis,password=a=b"])
    assert config == CacheConfig(
        name="redis", options={"host": "h", "port": "1", "password": "a=b"}
    )


def test_deprecated_byte_size_flag() -> None:
    """--response-cache-byte-size N is local,size=N with a deprecation warning."""
    with pytest.warns(DeprecationWarning, match="--cache-config local,size=4096"):
        config = parse_cache_config(None, response_cache_byte_size=4096)
    assert config == CacheConfig(name="local", options={"size": "4096"})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["local"], "malformed; expected <name>,<key>=<value>"),
        (["local,size"], "malformed; expected <name>,<key>=<value>"),
        ([",size=3"], "malformed"),
        (["local,=3"], "malformed"),
        (["local,size=1", "redis,host=x"], "names two caches, 'local' and 'redis'"),
        (["local,size=1", "local,size=2"], "'size' is given twice"),
        (["redis,host=a,port=1"], "one <key>=<value> per flag"),
    ],
)
def test_cache_config_errors(flags: list[str], message: str) -> None:
    """Malformed flags are start-up errors that show the expected format."""
    with pytest.raises(ConfigError, match=message):
        parse_cache_config(flags)


def test_both_cache_flags_at_once() -> None:
    """The deprecated flag and --cache-config together are an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match="cannot be used together"):
            parse_cache_config("local,size=4096", response_cache_byte_size=4096)
