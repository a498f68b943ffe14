"""Step 2a for Triton's Python backend, in numpy: CLASS = softmax(PRE @ W + b).

W [16, 10] and b [10] are fixed: numpy's default_rng(0), as in orchestrion's copy.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        rng = np.random.default_rng(0)
        self.w = (rng.standard_normal((16, 10)) * 0.25).astype(np.float32)
        self.b = (rng.standard_normal(10) * 0.1).astype(np.float32)

    def execute(self, requests):
        responses = []
        for request in requests:
            pre = pb_utils.get_input_tensor_by_name(request, "PRE").as_numpy()
            logits = pre @ self.w + self.b
            e = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("CLASS", probs)]))
        return responses
