"""Sends a response, an error response, another response, then the final flag alone; with
IN = 2, a response, then an error response with the final flag."""

import numpy as np
import triton_python_backend_utils as pb_utils


def _value(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])


class TritonPythonModel:
    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            last = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0]) == 2
            sender.send(_value(0))
            error = pb_utils.TritonError("response 1 fails", pb_utils.TritonError.INVALID_ARG)
            if last:
                sender.send(pb_utils.InferenceResponse(error=error), flags=final)
                continue
            sender.send(pb_utils.InferenceResponse(error=error))
            sender.send(_value(2))
            sender.send(flags=final)
        return None
