"""Sends a response, an error response, another response, then the final flag alone."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            sender.send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0], np.int32))])
            )
            error = pb_utils.TritonError("response 1 fails", pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error))
            sender.send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([2], np.int32))])
            )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
