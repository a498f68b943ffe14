"""How a Triton python-backend model's answers reach the runtime: the responses ``execute``
returns, the ones it sends through a request's sender, and a decoupled request's stream.

How this works: an answer's outputs are taken in the data types the config declares where
the values convert exactly, in the shapes the model gave (`Declared.outputs_of`); an error
response is the model's own error with its code (`reported`), and the parameters of a
response travel with its outputs. A request of a model that is not decoupled and
answers through its sender has an `Answer` waiting for that one response (a decoupled
request's responses: ``_triton_streams.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import trio

from ..protocols import (
    ERROR_CODES,
    ModelConfig,
    ModelReportedError,
    ParameterizedOutputs,
)
from ._triton_api import InferenceResponse, TritonError, TritonModelException, tensor_array
from ._triton_calls import cancelled_here

_log = logging.getLogger("orchestrion")
_ANSWERS = threading.Lock()


def _as_declared(array: np.ndarray[Any, Any], dtype: np.dtype[Any] | None) -> Any:
    """An output in the config's data type when all its values convert exactly (Triton
    passes a python model's outputs on in whatever type they have: ``np.array([0])`` is
    INT64 for a TYPE_INT32 output); else as it is, for the output check to refuse."""
    if dtype is None or array.dtype == dtype or "O" in (array.dtype.kind, dtype.kind):
        return array
    if array.dtype.kind in "SU":
        return array
    converted = array.astype(dtype)
    floating = array.dtype.kind in "fc"
    if np.array_equal(converted.astype(array.dtype), array, equal_nan=floating):
        return converted
    return array


def reported(error: TritonError, model_name: str) -> ModelReportedError:
    """A response's ``TritonError`` as the error the client is shown: its message as the
    model wrote it, its code (an unknown number is Triton's UNKNOWN)."""
    code = error.code()
    name = ERROR_CODES[code] if 0 <= code < len(ERROR_CODES) else "UNKNOWN"
    return ModelReportedError(error.message(), model_name=model_name, code=name)


@attrs.frozen
class Declared:
    """What a python-backend model's config declares of its outputs, to take its answers
    as Triton passes them on: each output's numpy dtype (its state outputs' too)."""

    model_name: str
    dtypes: Mapping[str, np.dtype[Any]]

    @classmethod
    def of(cls, config: ModelConfig) -> Declared:
        """The outputs ``config`` declares (the config the model's code sees)."""
        return cls(
            model_name=config.name,
            dtypes={t.name: t.data_type.numpy_dtype for t in config.output},
        )

    def outputs_of(self, response: InferenceResponse) -> Mapping[str, Any] | Exception:
        """A response's outputs (in the declared types, see `_as_declared`; in the shapes
        the model gave, as Triton passes them on), or its error."""
        error = response.error()
        if error is not None:
            return reported(error, self.model_name)
        outputs = {}
        for tensor in response.output_tensors():
            name = tensor.name()
            outputs[name] = _as_declared(tensor_array(tensor), self.dtypes.get(name))
        parameters = response.parameter_values()
        return ParameterizedOutputs(outputs, parameters) if parameters else outputs


class Answer:
    """A request of a model that is not decoupled, answered through its sender: the one
    response, and the final flag as a thread's event and a trio event (sent from any
    thread; a synchronous execute's thread waits on the first, an async one's task on the
    second)."""

    def __init__(self, token: trio.lowlevel.TrioToken | None, declared: Declared) -> None:
        self.token = token
        self.declared = declared
        self.response: InferenceResponse | None = None
        self._done: threading.Event | None = None
        self.trio_done = trio.Event()

    @property
    def done(self) -> threading.Event:
        """Set by the final flag (made when first needed: most models return their
        responses and never use the sender)."""
        with _ANSWERS:
            if self._done is None:
                self._done = threading.Event()
            return self._done

    def deliver(self, response: InferenceResponse | None, final: bool) -> None:
        """A sender's response (from any thread). The first one sent is the request's
        answer, whatever ``execute`` does after (as Triton's: a client already has it).

        Raises:
            TritonModelException: a second response, or the final flag before a response
                (Triton's words).
        """
        if response is not None:
            if self.response is not None:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send more than one "
                    "response."
                )
            self.response = response
        elif final and self.response is None:
            raise TritonModelException(
                "Unable to send response. Non-decoupled model cannot send complete final "
                "before sending a response."
            )
        if final:
            self.done.set()
            if self.token is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    self.token.run_sync_soon(self.trio_done.set)

    def wait(self) -> Mapping[str, Any] | Exception:
        """Wait (in a worker thread) for the final flag: the outcome; an error if the
        request is cancelled first."""
        while not self.done.wait(0.05):
            if cancelled_here():
                return TritonModelException("the request was cancelled before its response")
        return self.outcome()

    def outcome(self) -> Mapping[str, Any] | Exception:
        """The sent response's outputs (or its error)."""
        if self.response is None:
            return TritonModelException(  # Triton's words
                "Non-decoupled model cannot send complete final before sending a response"
            )
        return self.declared.outputs_of(self.response)


def never() -> bool:
    """A request's cancellation check where cancellation cannot be seen."""
    return False
