"""Checks request.is_cancelled() between steps of 10 ms, as python_backend's README
recommends for long work."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = float(pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy()[0])
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                if request.is_cancelled():
                    pb_utils.Logger.log_info("sleeper: cancelled")
                    error = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
                    responses.append(pb_utils.InferenceResponse(error=error))
                    break
                time.sleep(0.01)
            else:
                slept = np.array([time.monotonic() - started], np.float32)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SLEPT", slept)]))
        return responses
