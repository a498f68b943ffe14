"""Echoes its input, but answers every second request with an error."""

import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.count = 0
        self.lock = threading.Lock()

    def execute(self, requests):
        responses = []
        for request in requests:
            with self.lock:
                self.count += 1
                failing = self.count % 2 == 0
            if failing:
                error = pb_utils.TritonError(f"request number {self.count} fails")
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
        return responses
