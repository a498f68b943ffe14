"""Control documents (load, unload, repository index, shared memory registration) as JSON
objects, including those nested too deeply for Python's parser.

How this works: `load_json_object` parses with ``json``; a document that exceeds Python's
recursion limit (a hostile ``{"ready": [[[[...]]]]}`` 250,000 deep) is read member by member
instead, iteratively: scalars parsed, arrays and objects skipped by counting brackets outside
strings and kept as `Nested`. The caller's type checks then answer for it as for any other
document (``Invalid value for 'ready': expected a boolean``), as Triton does.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from ._errors import InvalidRequestError


@attrs.frozen
class Nested:
    """A member of a JSON object too deeply nested to parse (`load_json_object`): an array or
    object, unread."""

    kind: str


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_SCALAR = re.compile(rb'\s*("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)\s*')
_SPACE = re.compile(rb"\s*")


def load_json_object(body: bytes) -> dict[str, Any]:
    """A request's JSON object (control endpoints). One too deeply nested for Python's parser
    is read member by member instead: scalars parsed, arrays and objects kept as `Nested`,
    so a check on a member's type answers as for any other document.

    Raises:
        InvalidRequestError: not JSON, or not an object.
    """
    try:
        document = json.loads(body)
    except RecursionError:
        document = _shallow_object(body)
    except ValueError as exc:
        raise InvalidRequestError(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidRequestError("the request JSON must be an object")
    return document


def _shallow_object(body: bytes) -> dict[str, Any]:
    """The top-level members of a JSON object, nested values skipped (iteratively)."""
    malformed = InvalidRequestError("failed to parse the request JSON: malformed document")
    at = _SPACE.match(body).end()  # type: ignore[union-attr]
    if body[at : at + 1] != b"{":
        raise InvalidRequestError("the request JSON must be an object")
    members: dict[str, Any] = {}
    at += 1
    while True:
        key = _SCALAR.match(body, at)
        if key is None or not key.group(1).startswith(b'"'):
            raise malformed
        at = key.end()
        if body[at : at + 1] != b":":
            raise malformed
        at = _SPACE.match(body, at + 1).end()  # type: ignore[union-attr]
        value, at = _member_value(body, at, malformed)
        members[json.loads(key.group(1))] = value
        at = _SPACE.match(body, at).end()  # type: ignore[union-attr]
        separator = body[at : at + 1]
        at += 1
        if separator == b"}":
            return members
        if separator != b",":
            raise malformed


def _member_value(body: bytes, at: int, malformed: InvalidRequestError) -> tuple[Any, int]:
    """The value that starts at ``at`` (a `Nested` marker for an array or an object, skipped
    to its end) and where it ends."""
    opening = body[at : at + 1]
    if opening not in (b"[", b"{"):
        scalar = _SCALAR.match(body, at)
        if scalar is None:
            raise malformed
        return json.loads(scalar.group(1)), scalar.end()
    depth = 0
    for token in _TOKEN.finditer(body, at):
        mark = token.group()
        if mark in (b"[", b"{"):
            depth += 1
        elif mark in (b"]", b"}"):
            depth -= 1
        if depth == 0:
            return Nested("array" if opening == b"[" else "object"), token.end()
    raise malformed
