"""OUTPUT0 = INPUT0 (+ INPUT1 when given); PRESENT says whether it was (1) or not (0)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            total = a if b is None else (a + b.as_numpy()).astype(np.int32)
            present = np.full(a.shape, 0 if b is None else 1, np.int32)
            outputs = [pb_utils.Tensor("OUTPUT0", total), pb_utils.Tensor("PRESENT", present)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
