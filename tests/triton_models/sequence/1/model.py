"""A running sum per sequence, reset at START and dropped at END; CONTROLS echoes
START, END, READY and CORRID as the model received them, and correlation_id() and flags()
agree with them."""

import numpy as np
import triton_python_backend_utils as pb_utils

NAMES = ("START", "END", "READY", "CORRID", "X")
FLAG_START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
FLAG_END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            start, end, ready, corrid, x = (
                pb_utils.get_input_tensor_by_name(request, name).as_numpy().item() for name in NAMES
            )
            assert corrid == request.correlation_id()
            assert bool(start) == bool(request.flags() & FLAG_START)
            assert bool(end) == bool(request.flags() & FLAG_END)
            total = (0 if start else self.sums.get(corrid, 0)) + x
            if end:
                self.sums.pop(corrid, None)
            else:
                self.sums[corrid] = total
            sum_tensor = pb_utils.Tensor("SUM", np.array([total], np.int32))
            controls = pb_utils.Tensor("CONTROLS", np.array([start, end, ready, corrid], np.int64))
            responses.append(pb_utils.InferenceResponse([sum_tensor, controls]))
        return responses
