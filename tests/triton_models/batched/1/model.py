"""add_sub under dynamic batching (python_backend's add_sub with a dynamic_batching
config): one InferenceResponse per request, in order, one of them possibly an error."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if a[0, 0] < 0:
                error = pb_utils.TritonError(
                    "INPUT0 must not be negative", pb_utils.TritonError.INVALID_ARG
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            count = np.full((a.shape[0], 1), len(requests), np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("REQUESTS", count)]
                )
            )
        return responses
