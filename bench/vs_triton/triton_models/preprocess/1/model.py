"""Step 1 for Triton's Python backend, in numpy: PRE = INPUT * 2 + 1."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            pre = (x * np.float32(2) + np.float32(1)).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PRE", pre)]))
        return responses
