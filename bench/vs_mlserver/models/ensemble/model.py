"""The vs_triton ensemble as one MLServer model (MLServer has no ensembles), in numpy.

The three steps of ``bench/vs_triton/*_models`` in one ``predict``, with the same formulas and
fixed weights, so that ``bench/vs_triton/check_same.py``'s reference applies unchanged:

    PRE   = INPUT * 2 + 1                      (preprocess)
    CLASS = softmax(PRE @ W + b)               (classify; W [16, 10], b [10], numpy seed 0)
    SEG   = tanh(PRE) * 0.5                    (segment)

INPUT is FP32 [B, 16]; CLASS [B, 10] and SEG [B, 16] come back as FP32. Served by
``bench/vs_mlserver.sh``.
"""

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import InferenceError
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput


class Pipeline(MLModel):
    async def load(self) -> bool:
        rng = np.random.default_rng(0)
        self._w = (rng.standard_normal((16, 10)) * 0.25).astype(np.float32)
        self._b = (rng.standard_normal(10) * 0.1).astype(np.float32)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {i.name: i for i in payload.inputs}
        if "INPUT" not in inputs:
            raise InferenceError("expected one input named INPUT")
        x = NumpyCodec.decode_input(inputs["INPUT"]).astype(np.float32, copy=False)
        x = x.reshape(-1, 16)
        pre = x * np.float32(2) + np.float32(1)
        logits = pre @ self._w + self._b
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
        seg = (np.tanh(pre) * np.float32(0.5)).astype(np.float32)
        return InferenceResponse(
            model_name=self.name,
            outputs=[_output("CLASS", probs), _output("SEG", seg)],
        )


def _output(name: str, value: np.ndarray) -> ResponseOutput:
    # No "parameters" (NumpyCodec.encode_output adds content_type): perf_analyzer 2.51's HTTP
    # client takes an output with parameters but no binary_data_size for an error.
    return ResponseOutput(
        name=name, shape=list(value.shape), datatype="FP32", data=value.ravel().tolist()
    )
