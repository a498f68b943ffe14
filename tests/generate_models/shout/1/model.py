"""Upper-cases its text, and says how long it was in a response parameter."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            loud = np.array(
                [[item.decode().upper().encode() for item in row] for row in text], dtype=object
            )
            length = sum(len(item) for item in text.flat)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("LOUD", loud)], parameters={"length": length}
                )
            )
        return responses
