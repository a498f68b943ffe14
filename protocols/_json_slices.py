"""JSON documents read in slices, so that no single call into C holds the GIL for long.

How this works: ``json.loads`` of a large infer request (millions of numbers in a tensor's
``data``) is one call into C that holds the GIL, and so every other thread, the event loop's
among them, for as long as it runs (half a second for 8M numbers here). `loads` gives the
same value, with the same errors, in slices: the structure (objects, and arrays that hold
objects or very large arrays) is walked in Python, which lets other threads run between its
steps, while the elements of arrays are read in runs. A run is as many whole elements
(scalars, or arrays of scalars nested a few deep) as fit in `WINDOW` characters, found by one
regular expression bounded to that window and parsed by one ``json.loads``; a string longer
than the window is read on its own. Each call into C thus works on at most a window's worth
of text. The value is exactly ``json.loads``'s: the same types, NaN and Infinity read, the
last of duplicate keys kept; malformed text raises `json.JSONDecodeError` with Python's
message and position. With ``runs=True``, an array read in more than one run comes back as
`Runs`, the list of its runs, instead of one list: a list of millions of elements would itself
hold the GIL while it grows (each reallocation copies it) and while it is freed, so a reader
of tensors (`orchestrion.protocols._kserve_http`) takes the runs one by one, freeing each.

Making millions of lists wakes Python's cyclic garbage collector, whose full collections walk
every live container while holding the GIL (half a second for a million small lists):
`collector_paused` holds it off while one large document is read and turned into tensors.
"""

from __future__ import annotations

import contextlib
import gc
import json
import json.decoder
import json.scanner
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

WINDOW = 1 << 16
"""Characters of text one call into C reads at most (a few milliseconds)."""
_RUN = 1 << 14
"""Elements one run holds at most."""
_NESTED = 64
"""Elements an array nested inside a run's element may hold (larger ones are walked)."""

_WS = r"[ \t\n\r]*"
_STRING = r'"(?:[^"\\\x00-\x1f]|\\.)*"'
_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
_SCALAR = rf"(?:{_STRING}|{_NUMBER}|true|false|null|NaN|-?Infinity)"


def _element(depth: int) -> str:
    """A scalar, or an array of at most `_NESTED` such elements ``depth`` levels deep."""
    if depth == 0:
        return _SCALAR
    inner = _element(depth - 1)
    array = rf"\[{_WS}(?:{inner}(?:{_WS},{_WS}{inner}){{0,{_NESTED - 1}}})?{_WS}\]"
    return rf"(?:{_SCALAR}|{array})"


_RUN_RE = re.compile(rf"(?:{_WS}{_element(3)}{_WS},){{1,{_RUN}}}")
_WS_RE = re.compile(_WS)
_DECODER = json.JSONDecoder()
# The C scanner (one value at an index) and string reader json.loads uses.
_SCAN: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(_DECODER)  # type: ignore[arg-type]
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


_pause = {"blocks": 0, "was_enabled": False}
_pause_lock = threading.Lock()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector for the block (process-wide, as the
    collector is; nested and concurrent blocks pause it until the last one ends, then it runs
    again if it ran before the first). Objects made meanwhile are freed by their reference
    counts as ever; only cycles wait."""
    with _pause_lock:
        if _pause["blocks"] == 0:
            _pause["was_enabled"] = gc.isenabled()
            gc.disable()
        _pause["blocks"] += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pause["blocks"] -= 1
            if _pause["blocks"] == 0 and _pause["was_enabled"]:
                gc.enable()


class Runs(list[list[Any]]):
    """A large array of a document read with ``runs=True`` (more than `_RUN` elements): its
    elements, in runs of about `_RUN` (lists), in order."""

    def elements(self) -> int:
        """How many elements the array has."""
        return sum(map(len, self))


def loads(document: bytes | bytearray | memoryview | str, *, runs: bool = False) -> Any:
    """``json.loads(document)``, read in slices (see the module docstring); with ``runs``,
    large arrays of scalars (or of small arrays) come back as `Runs`.

    Raises:
        json.JSONDecodeError: the text is not JSON (Python's message and position).
        RecursionError: it nests deeper than Python's recursion limit allows.
    """
    if isinstance(document, str):
        text = document
    else:
        raw = bytes(document)
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        if text.startswith("\ufeff"):  # as json.loads, which decodes with utf-8-sig
            text = text[1:]
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    if len(text) <= WINDOW:
        return json.loads(text)
    value, end = _Reader(text, runs).value(_skip(text, 0))
    end = _WS_RE.match(text, end).end()  # type: ignore[union-attr]
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _skip(text: str, at: int) -> int:
    return _WS_RE.match(text, at).end()  # type: ignore[union-attr]


class _Reader:
    """One document's reading: its text, and whether large arrays stay in runs."""

    def __init__(self, text: str, runs: bool) -> None:
        self.text = text
        self.runs = runs

    def value(self, at: int) -> tuple[Any, int]:
        """The value starting at ``at`` (no whitespace before it), and where it ends."""
        text = self.text
        char = text[at : at + 1]
        if char == "{":
            return self.object(at + 1)
        if char == "[":
            return self.array(at + 1)
        try:
            return _SCAN(text, at)
        except StopIteration as stop:
            raise json.JSONDecodeError("Expecting value", text, stop.value) from None

    def object(self, at: int) -> tuple[dict[str, Any], int]:
        """The members of an object whose ``{`` ends at ``at``."""
        text = self.text
        members: dict[str, Any] = {}
        at = _skip(text, at)
        if text[at : at + 1] == "}":
            return members, at + 1
        while True:
            if text[at : at + 1] != '"':
                raise json.JSONDecodeError(
                    "Expecting property name enclosed in double quotes", text, at
                )
            key, at = _scanstring(text, at + 1)
            at = _skip(text, at)
            if text[at : at + 1] != ":":
                raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
            at = _skip(text, at + 1)
            members[key], at = self.value(at)
            at = _skip(text, at)
            char = text[at : at + 1]
            if char == "}":
                return members, at + 1
            if char != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
            at = _skip(text, at + 1)

    def array(self, at: int) -> tuple[list[Any], int]:
        """The elements of an array whose ``[`` ends at ``at``: in runs where they are
        small (a `Runs` of them, with ``runs``, when there are several)."""
        text = self.text
        items: list[Any] = []
        done = Runs()
        at = _skip(text, at)
        if text[at : at + 1] == "]":
            return items, at + 1
        while True:
            run = _RUN_RE.match(text, at, min(len(text), at + WINDOW))
            if run is not None:
                try:
                    values = json.loads("[" + text[at : run.end() - 1] + "]")
                except json.JSONDecodeError:
                    pass  # (an escape the pattern let through): element by element, below
                else:
                    items.extend(values)
                    if self.runs and len(items) >= _RUN:
                        done.append(items)
                        items = []
                    at = _skip(text, run.end())
                    continue
            value, at = self.value(at)
            items.append(value)
            if self.runs and len(items) >= _RUN:
                done.append(items)
                items = []
            at = _skip(text, at)
            char = text[at : at + 1]
            if char == "]":
                if not done:
                    return items, at + 1
                if items:
                    done.append(items)
                return done, at + 1
            if char != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
            at = _skip(text, at + 1)
