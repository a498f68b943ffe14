"""Declares OUTPUT0 and OUTPUT1, answers only OUTPUT0 = INPUT0 + INPUT1."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            total = pb_utils.Tensor("OUTPUT0", (a + b).astype(np.int32))
            responses.append(pb_utils.InferenceResponse([total]))  # no OUTPUT1
        return responses
