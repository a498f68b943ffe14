"""Data types, and tensors checked against a model's declared inputs and outputs."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2

import orchestrion.protocols
from orchestrion.protocols import (
    DataType,
    InvalidRequestError,
    ModelConfig,
    Reshape,
    TensorConfig,
    apply_reshape,
    check_inputs,
    check_outputs,
    stored_outputs_problem,
)

PACKAGE_ROOT = pathlib.Path(orchestrion.protocols.__file__).parent.parent

TABLE = [
    (DataType.BOOL, "TYPE_BOOL", "BOOL", np.dtype(np.bool_)),
    (DataType.UINT8, "TYPE_UINT8", "UINT8", np.dtype(np.uint8)),
    (DataType.UINT16, "TYPE_UINT16", "UINT16", np.dtype(np.uint16)),
    (DataType.UINT32, "TYPE_UINT32", "UINT32", np.dtype(np.uint32)),
    (DataType.UINT64, "TYPE_UINT64", "UINT64", np.dtype(np.uint64)),
    (DataType.INT8, "TYPE_INT8", "INT8", np.dtype(np.int8)),
    (DataType.INT16, "TYPE_INT16", "INT16", np.dtype(np.int16)),
    (DataType.INT32, "TYPE_INT32", "INT32", np.dtype(np.int32)),
    (DataType.INT64, "TYPE_INT64", "INT64", np.dtype(np.int64)),
    (DataType.FP16, "TYPE_FP16", "FP16", np.dtype(np.float16)),
    (DataType.FP32, "TYPE_FP32", "FP32", np.dtype(np.float32)),
    (DataType.FP64, "TYPE_FP64", "FP64", np.dtype(np.float64)),
    (DataType.BF16, "TYPE_BF16", "BF16", np.dtype(ml_dtypes.bfloat16)),
    (DataType.BYTES, "TYPE_STRING", "BYTES", np.dtype(object)),
]


@pytest.mark.parametrize(("data_type", "config_name", "protocol_name", "dtype"), TABLE)
def test_data_type_mapping(
    data_type: DataType, config_name: str, protocol_name: str, dtype: np.dtype[Any]
) -> None:
    """Each data type maps to its config name, protocol name and numpy dtype, and back."""
    assert data_type.config_name == config_name
    assert DataType.from_config_name(config_name) is data_type
    assert data_type.value == protocol_name
    assert DataType(protocol_name) is data_type
    assert data_type.numpy_dtype == dtype
    assert DataType.from_numpy(dtype) is data_type


def test_table_covers_every_data_type() -> None:
    """The table above lists every DataType once."""
    assert [row[0] for row in TABLE] == list(DataType)


def test_every_triton_type_is_supported() -> None:
    """Every TYPE_* of Triton's schema (except TYPE_INVALID) is a DataType."""
    names = [
        v.name for v in model_config_pb2.DataType.DESCRIPTOR.values if v.name != "TYPE_INVALID"
    ]
    assert sorted(DataType.from_config_name(n).config_name for n in names) == sorted(names)
    assert len(names) == len(DataType)


@pytest.mark.parametrize("name", ["TYPE_INVALID", "TYPE_FLOAT", "FP32", ""])
def test_unknown_config_name(name: str) -> None:
    """A name that is not a TYPE_* data type is a ValueError naming it."""
    with pytest.raises(ValueError, match=f"unknown data_type '{name}'"):
        DataType.from_config_name(name)


def test_bf16_is_ml_dtypes_bfloat16() -> None:
    """BF16 arrays are ml_dtypes.bfloat16, the dtype JAX uses."""
    assert DataType.BF16.numpy_dtype.type is ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", [np.dtype(object), np.dtype("S3"), np.dtype("U5")])
def test_string_dtypes_are_bytes(dtype: np.dtype[Any]) -> None:
    """numpy object, bytes and str arrays are BYTES."""
    assert DataType.from_numpy(dtype) is DataType.BYTES


def test_numpy_dtype_without_triton_type() -> None:
    """A numpy dtype Triton has no type for is a ValueError."""
    with pytest.raises(ValueError, match="complex128"):
        DataType.from_numpy(np.dtype(np.complex128))


# check_inputs


def model(max_batch_size: int = 0, *inputs: TensorConfig, **kwargs: Any) -> ModelConfig:
    """A model 'm' with the given inputs (default IN, FP32 [2]) and one output OUT."""
    return ModelConfig(
        name="m",
        max_batch_size=max_batch_size,
        input=inputs or (TensorConfig(name="IN", data_type=DataType.FP32, dims=(2,)),),
        output=(TensorConfig(name="OUT", data_type=DataType.FP32, dims=(2,)),),
        **kwargs,
    )


def fp32(*shape: int) -> np.ndarray[Any, Any]:
    """A float32 array of zeros."""
    return np.zeros(shape, dtype=np.float32)


def test_check_inputs_accepts_matching_input() -> None:
    """A matching input comes back as the same numpy array."""
    array = fp32(2)
    assert check_inputs(model(), {"IN": array})["IN"] is array


def test_check_inputs_converts_sequences() -> None:
    """Nested lists become numpy arrays before checking."""
    config = model(0, TensorConfig(name="IN", data_type=DataType.INT64, dims=(2,)))
    out = check_inputs(config, {"IN": [1, 2]})
    assert out["IN"].dtype == np.int64


def test_check_inputs_missing_required() -> None:
    """A missing required input is an InvalidRequestError naming model and input."""
    with pytest.raises(InvalidRequestError, match=r"model 'm': missing required input 'IN'"):
        check_inputs(model(), {})


def test_check_inputs_optional_may_be_absent() -> None:
    """An optional input may be left out (or given as None)."""
    config = model(
        0,
        TensorConfig(name="IN", data_type=DataType.FP32, dims=(2,)),
        TensorConfig(name="MASK", data_type=DataType.BOOL, dims=(2,), optional=True),
    )
    assert set(check_inputs(config, {"IN": fp32(2)})) == {"IN"}
    assert set(check_inputs(config, {"IN": fp32(2), "MASK": None})) == {"IN"}


def test_check_inputs_unexpected() -> None:
    """An input the model does not declare is an error listing the declared ones."""
    with pytest.raises(InvalidRequestError, match=r"unexpected inputs 'EXTRA' \(inputs: IN\)"):
        check_inputs(model(), {"IN": fp32(2), "EXTRA": fp32(2)})


def test_check_inputs_wrong_dtype() -> None:
    """An input of another data type is an error naming both types."""
    with pytest.raises(InvalidRequestError, match=r"input 'IN' has data type FP64, expected FP32"):
        check_inputs(model(), {"IN": np.zeros(2)})


def test_check_inputs_non_bytes_for_bytes_input() -> None:
    """Numbers given for a BYTES input are a data type error."""
    config = model(0, TensorConfig(name="TEXT", data_type=DataType.BYTES, dims=(1,)))
    with pytest.raises(
        InvalidRequestError, match=r"input 'TEXT' has data type INT64, expected BYTES"
    ):
        check_inputs(config, {"TEXT": np.array([1])})


def test_check_inputs_object_array_of_ints_for_bytes_input() -> None:
    """An object array holding something other than bytes or str is an error."""
    config = model(0, TensorConfig(name="TEXT", data_type=DataType.BYTES, dims=(1,)))
    with pytest.raises(InvalidRequestError, match=r"input 'TEXT': BYTES elements must be bytes"):
        check_inputs(config, {"TEXT": np.array([3], dtype=object)})


@pytest.mark.parametrize("shape", [(3,), (2, 1), ()])
def test_check_inputs_wrong_shape(shape: tuple[int, ...]) -> None:
    """A shape that differs in a fixed dim or in rank is an error showing both."""
    with pytest.raises(InvalidRequestError, match=r"input 'IN' has shape .*, expected \[2\]"):
        check_inputs(model(), {"IN": fp32(*shape)})


def test_check_inputs_wildcard_dims() -> None:
    """-1 dims accept any size."""
    config = model(0, TensorConfig(name="IN", data_type=DataType.FP32, dims=(-1, 3)))
    for n in (1, 7):
        assert check_inputs(config, {"IN": fp32(n, 3)})["IN"].shape == (n, 3)
    with pytest.raises(InvalidRequestError, match=r"expected \[-1,3\]"):
        check_inputs(config, {"IN": fp32(7, 4)})


def test_check_inputs_batch_dimension() -> None:
    """With max_batch_size > 0, inputs carry a leading batch dimension."""
    assert check_inputs(model(4), {"IN": fp32(3, 2)})["IN"].shape == (3, 2)
    with pytest.raises(InvalidRequestError, match=r"has shape \[2\], expected \[-1,2\]"):
        check_inputs(model(4), {"IN": fp32(2)})


@pytest.mark.parametrize("batch", [0, 5])
def test_check_inputs_batch_size_out_of_range(batch: int) -> None:
    """A batch of 0 or above max_batch_size is an error showing the allowed range."""
    with pytest.raises(
        InvalidRequestError, match=rf"input 'IN' has batch size {batch}, expected 1 to 4"
    ):
        check_inputs(model(4), {"IN": fp32(batch, 2)})


def test_check_inputs_mismatched_batch_sizes() -> None:
    """Inputs with different batch sizes are an error listing them."""
    config = model(
        8,
        TensorConfig(name="A", data_type=DataType.FP32, dims=(2,)),
        TensorConfig(name="B", data_type=DataType.FP32, dims=(2,)),
    )
    with pytest.raises(InvalidRequestError, match=r"inputs disagree on the batch size: \[2, 3\]"):
        check_inputs(config, {"A": fp32(2, 2), "B": fp32(3, 2)})


def test_check_inputs_reports_every_problem() -> None:
    """All problems of one request are reported together."""
    config = model(
        0,
        TensorConfig(name="A", data_type=DataType.FP32, dims=(2,)),
        TensorConfig(name="B", data_type=DataType.INT32, dims=(2,)),
    )
    with pytest.raises(InvalidRequestError) as info:
        check_inputs(config, {"B": fp32(2), "C": fp32(1)}, model="alias")
    message = str(info.value)
    assert message.startswith("model 'alias': ")
    assert "unexpected inputs 'C'" in message
    assert "missing required input 'A'" in message
    assert "input 'B' has data type FP32, expected INT32" in message


@pytest.mark.parametrize(
    "value",
    [
        np.array([["a", "é"]]),
        np.array([[b"a", "é".encode()]]),
        np.array([[np.bytes_(b"a"), np.bytes_("é".encode())]], dtype=object),
        np.array([["a", "é".encode()]], dtype=object),
        [["a", "é"]],
        [[b"a", "é".encode()]],
    ],
)
def test_check_inputs_normalises_bytes(value: Any) -> None:
    """str, bytes and np.bytes_ BYTES inputs become object arrays of bytes (str as UTF-8)."""
    config = model(4, TensorConfig(name="TEXT", data_type=DataType.BYTES, dims=(2,)))
    array = check_inputs(config, {"TEXT": value})["TEXT"]
    assert array.dtype == object
    assert array.shape == (1, 2)
    assert [type(x) for x in array.flat] == [bytes, bytes]
    assert array.tolist() == [[b"a", "é".encode()]]


def test_check_inputs_keeps_object_array_of_bytes() -> None:
    """An object array that already holds bytes is passed through as is."""
    config = model(0, TensorConfig(name="TEXT", data_type=DataType.BYTES, dims=(1,)))
    array = np.array([b"x"], dtype=object)
    assert check_inputs(config, {"TEXT": array})["TEXT"] is array


def test_check_inputs_bf16() -> None:
    """BF16 inputs are ml_dtypes.bfloat16 arrays; float32 is rejected."""
    config = model(0, TensorConfig(name="IN", data_type=DataType.BF16, dims=(2,)))
    array = np.zeros(2, dtype=ml_dtypes.bfloat16)
    assert check_inputs(config, {"IN": array})["IN"] is array
    with pytest.raises(InvalidRequestError, match="expected BF16"):
        check_inputs(config, {"IN": fp32(2)})


# check_outputs


def test_check_outputs_accepts_declared_outputs() -> None:
    """Declared outputs of the right type and shape pass; missing ones are allowed."""
    assert check_outputs(model(), {"OUT": fp32(2)})["OUT"].shape == (2,)
    assert check_outputs(model(), {}) == {}


def test_check_outputs_not_a_mapping() -> None:
    """execute returning something other than a dict is an error."""
    with pytest.raises(ValueError, match="execute must return a dict of outputs, got list"):
        check_outputs(model(), [fp32(2)])  # type: ignore[arg-type]


def test_check_outputs_unknown_output() -> None:
    """An output the model does not declare is an error listing the declared ones."""
    with pytest.raises(ValueError, match=r"unknown output 'EXTRA' \(outputs: OUT\)"):
        check_outputs(model(), {"OUT": fp32(2), "EXTRA": fp32(2)})


def test_check_outputs_wrong_dtype() -> None:
    """An output of another data type is an error naming both types."""
    with pytest.raises(ValueError, match="output 'OUT' has data type INT32, expected FP32"):
        check_outputs(model(), {"OUT": np.zeros(2, dtype=np.int32)})


def test_check_outputs_wrong_shape() -> None:
    """An output of another shape is an error showing both shapes."""
    with pytest.raises(ValueError, match=r"output 'OUT' has shape \[3\], expected \[2\]"):
        check_outputs(model(), {"OUT": fp32(3)})


def test_check_outputs_bytes_normalised() -> None:
    """BYTES outputs given as str become object arrays of bytes."""
    config = ModelConfig(
        name="m", output=(TensorConfig(name="LABEL", data_type=DataType.BYTES, dims=(2,)),)
    )
    out = check_outputs(config, {"LABEL": np.array(["cat", "dog"])})
    assert out["LABEL"].dtype == object
    assert out["LABEL"].tolist() == [b"cat", b"dog"]


def test_reshape_applied_to_inputs_and_undone_on_outputs() -> None:
    """reshape: the model sees the reshaped input, and its output goes back to the dims."""
    config = ModelConfig(
        name="m",
        max_batch_size=4,
        input=(
            TensorConfig(
                name="IN", data_type=DataType.FP32, dims=(4,), reshape=Reshape(shape=(2, 2))
            ),
        ),
        output=(
            TensorConfig(
                name="OUT", data_type=DataType.FP32, dims=(4,), reshape=Reshape(shape=(2, 2))
            ),
        ),
    )
    inputs = check_inputs(config, {"IN": fp32(3, 4)})
    assert apply_reshape(config.input[0], inputs["IN"], config.max_batch_size).shape == (3, 2, 2)
    out = check_outputs(config, {"OUT": fp32(3, 2, 2)})
    assert out["OUT"].shape == (3, 4)
    with pytest.raises(ValueError, match="output 'OUT' cannot take its declared dims"):
        check_outputs(config, {"OUT": fp32(3, 3, 2)})


def test_reshape_to_scalar_without_batching() -> None:
    """A non-batching [1] tensor reshaped to [] is a scalar for the model and [1] outside."""
    tensor = TensorConfig(name="X", data_type=DataType.FP32, dims=(1,), reshape=Reshape(shape=()))
    config = ModelConfig(name="m", input=(tensor,), output=(tensor,))
    assert apply_reshape(tensor, fp32(1), 0).shape == ()
    assert check_outputs(config, {"X": np.float32(1.0)})["X"].shape == (1,)


def test_protocols_import_no_io_libraries() -> None:
    """Importing orchestrion.protocols pulls in no trio, redis, Prometheus, OTel or JAX."""
    code = (
        "import sys\n"
        "import orchestrion.protocols\n"
        "bad = ('trio', 'redis', 'prometheus_client', 'opentelemetry', 'jax')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(bad)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


# stored_outputs_problem


@pytest.mark.parametrize(
    ("outputs", "batch", "wanted", "problem"),
    [
        ({"OUT": fp32(3, 2)}, 3, None, None),
        ({}, 3, None, None),  # a model may leave outputs out
        ({"OUT": fp32(3, 2)}, 3, frozenset({"OUT"}), None),
        ({"EVIL": fp32(3, 2)}, 3, None, "an output 'EVIL' that the model does not have"),
        ({"OUT": fp32(3, 2)}, 3, frozenset({"X"}), "which the request did not ask for"),
        ({"OUT": np.zeros((3, 2), np.int32)}, 3, None, "data type INT32, expected FP32"),
        ({"OUT": fp32(3, 1)}, 3, None, "has shape [3, 1], expected [-1,2]"),
        ({"OUT": fp32(9, 2)}, 9, None, "has batch size 9, expected 1 to 8"),
        ({"OUT": fp32(2, 2)}, 3, None, "has a batch of 2, the request 3"),
        ({"OUT": [[0.0, 0.0]]}, 1, None, "is not an array"),
    ],
)
def test_stored_outputs_problem(
    outputs: dict[str, Any], batch: int, wanted: frozenset[str] | None, problem: str | None
) -> None:
    """A response read from a cache must fit the model and the request: names, data types,
    shapes and batch size; anything else says why."""
    found = stored_outputs_problem(model(8), outputs, batch, wanted)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found
