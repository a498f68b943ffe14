"""Mirrors python_backend's examples/bls_decoupled/sync_model.py: exec(decoupled=True) on
the square model, the responses summed (as an INT64 numpy array, which the config declares
INT32, as the example does)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        in_tensor = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        infer_request = pb_utils.InferenceRequest(
            model_name="square", inputs=[in_tensor], requested_output_names=["OUT"]
        )
        total = np.array([0])
        for response in infer_request.exec(decoupled=True):
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            if response.output_tensors():
                total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)])]
