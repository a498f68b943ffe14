"""A model that fails on request, in every way a python model's answer can be wrong."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        mode = int(pb_utils.get_input_tensor_by_name(requests[0], "MODE").as_numpy()[0])
        if mode == 1:
            raise pb_utils.TritonModelException("mode 1 raises")
        if mode == 2:
            return [
                pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("mode 2 is an error response")
                )
            ]
        if mode == 3:
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0.5]))])]
        if mode == 4:
            return [
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1, 2], np.int32))])
            ]
        if mode == 5:
            return []
        if mode == 6:
            return ["not a response"]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([mode], np.int32))])]
