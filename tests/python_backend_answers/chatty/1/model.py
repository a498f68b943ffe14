"""Sends COUNT responses from execute, one every 50 ms, whether or not anyone still reads
them."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                value = pb_utils.Tensor("OUT", np.array([i], np.int32))
                sender.send(pb_utils.InferenceResponse([value]))
                time.sleep(0.05)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
