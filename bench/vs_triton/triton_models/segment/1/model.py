"""Step 2b for Triton's Python backend, in numpy: SEG = tanh(PRE) * 0.5."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            pre = pb_utils.get_input_tensor_by_name(request, "PRE").as_numpy()
            seg = (np.tanh(pre) * np.float32(0.5)).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEG", seg)]))
        return responses
