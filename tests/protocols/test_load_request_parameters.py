"""Load requests' ``config`` and ``file:`` parameters (`protocols/_model_load.py`): how each
front end's parameters are read, the config override's JSON, and which file paths may be
written."""

from __future__ import annotations

import base64
import json
import posixpath

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from orchestrion.protocols import ConfigError, InstanceKind, InvalidRequestError
from orchestrion.protocols._model_load import (
    UploadLimits,
    load_override_from_grpc,
    load_override_from_http,
    parse_config_override,
    upload_problems,
)


def test_http_parameters_decode_base64_files() -> None:
    """HTTP: ``config`` is text, each ``file:`` base64 text decoded to its bytes."""
    override = load_override_from_http(
        {"config": "{}", "file:1/model.py": base64.b64encode(b"x = 1\n").decode()}
    )
    assert override.config == "{}"
    assert dict(override.files) == {"1/model.py": b"x = 1\n"}
    assert not override.empty
    assert load_override_from_http({}).empty


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"unload_dependents": True}, "unrecognized load parameter 'unload_dependents'"),
        ({"config": {"max_batch_size": 4}}, "'config' must be a string"),
        ({"file:1/model.py": 12}, r"must be a string \(base64\)"),
        ({"file:1/model.py": "not base64!"}, "is not base64"),
    ],
)
def test_http_parameters_refused(parameters: dict[str, object], message: str) -> None:
    """Another parameter, a config that is not text, a file that is not base64: refused."""
    with pytest.raises(InvalidRequestError, match=message):
        load_override_from_http(parameters)


def _grpc_parameters(**values: object) -> object:
    request = service_pb2.RepositoryModelLoadRequest()
    for name, value in values.items():
        key = name.replace("__", ":").replace("_slash_", "/")
        if isinstance(value, bytes):
            request.parameters[key].bytes_param = value
        elif isinstance(value, bool):
            request.parameters[key].bool_param = value
        else:
            request.parameters[key].string_param = str(value)
    return request.parameters


def test_grpc_parameters_take_string_config_and_bytes_files() -> None:
    """gRPC: ``config`` a string_param, files bytes_param (Triton's kinds)."""
    override = load_override_from_grpc(
        _grpc_parameters(config="{}", file__1_slash_model_py=b"\x00\xff")
    )
    assert override.config == "{}"
    assert dict(override.files) == {"1/model_py": b"\x00\xff"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"config": b"{}"}, "load parameter 'config', expected string_param"),
        ({"file__1_slash_m": "text"}, "load parameter 'file:1/m', expected bytes_param"),
        ({"other": True}, "unrecognized load parameter 'other'"),
    ],
)
def test_grpc_parameters_of_the_wrong_kind_are_refused(
    values: dict[str, object], message: str
) -> None:
    """Triton's answers to a parameter of the wrong kind or an unknown one."""
    with pytest.raises(InvalidRequestError, match=message):
        load_override_from_grpc(_grpc_parameters(**values))


def test_config_override_reads_tritons_json() -> None:
    """Numbers as strings and enum names in any case, as Triton's parser takes them."""
    config = parse_config_override(
        json.dumps(
            {
                "max_batch_size": "16",
                "instance_group": [{"count": 3, "kind": "kind_cpu"}],
                "input": [{"name": "A", "data_type": "type_fp32", "dims": ["4"]}],
            }
        )
    )
    assert config.max_batch_size == 16
    assert config.instance_group[0].count == 3
    assert config.instance_group[0].kind is InstanceKind.KIND_CPU
    assert config.input[0].dims == (4,)
    assert config.name == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"parameters": {"config": {{"max_batch_size": "16"}}}', "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"max_batch_size": 1, "max_batch_size": 2}', "duplicate key 'max_batch_size'"),
        ('{"max_batch_size": "x"}', "max_batch_size"),
        ('{"no_such_field": 1}', 'no field named "no_such_field"'),
        ('{"input": [{"name": "A", "data_type": "TYPE_NOPE"}]}', "TYPE_NOPE"),
        ('{"batch_input": [{"kind": "BATCH_ELEMENT_COUNT"}]}', "batch_input: not supported"),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_malformed_config_overrides_name_the_field(text: str, message: str) -> None:
    """Malformed JSON, a field Triton does not know or orchestrion does not support, a
    value of the wrong kind: a ConfigError naming the load parameter and the field."""
    with pytest.raises(ConfigError, match="load parameter 'config'") as refused:
        parse_config_override(text)
    assert message in str(refused.value)


LIMITS = UploadLimits(max_size=1000, max_files=8)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../outside.py", "'..'"),
        ("1/../../outside.py", "'..'"),
        ("/etc/passwd", "absolute"),
        ("1\\model.py", "backslash"),
        ("1/model\0.py", "NUL"),
        ("1/model\n.py", "control character"),
        ("1//model.py", "empty"),
        ("./1/model.py", "'.'"),
        ("1/", "empty"),
        ("", "empty"),
        ("A" * 256, "longer than 255 bytes"),
        ("/".join(["a"] * 17), "levels"),
        ("config.pbtxt", "comes from the 'config' parameter"),
        ("1/\udc80.py", "not valid UTF-8"),
    ],
)
def test_paths_that_would_leave_the_model_folder_are_refused(path: str, why: str) -> None:
    """Every path that is not a plain relative path inside the folder is refused, saying why."""
    problems = upload_problems({path: b"x"}, LIMITS)
    assert len(problems) == 1
    assert why in problems[0]


def test_counts_sizes_and_clashes_are_refused() -> None:
    """Too many files, too many bytes, a file that is also a folder, uploads turned off."""
    assert upload_problems({"1/model.py": b"x" * 1000}, LIMITS) == []
    assert "1001 bytes" in upload_problems({"1/model.py": b"x" * 1001}, LIMITS)[0]
    many = {f"1/f{i}": b"" for i in range(9)}
    assert "9 files sent; at most 8" in upload_problems(many, LIMITS)[0]
    assert "also the folder of a file" in upload_problems({"1": b"", "1/m": b""}, LIMITS)[0]
    off = UploadLimits(max_size=0)
    assert "turned off" in upload_problems({"1/model.py": b""}, off)[0]
    shown = upload_problems({f"../{i}": b"" for i in range(12)}, UploadLimits(max_size=1))
    assert len(shown) == 11
    assert shown[-1] == "... and 2 more"


names = st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=8)


@given(st.lists(names, min_size=1, max_size=6))
def test_an_accepted_path_never_leaves_the_folder(parts: list[str]) -> None:
    """Whatever the parts, a path that is accepted normalises to itself, inside the folder."""
    path = "/".join(parts)
    if not upload_problems({path: b""}, LIMITS):
        normal = posixpath.normpath(path)
        assert normal == path
        assert not normal.startswith(("/", ".."))
