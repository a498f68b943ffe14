"""An error response under the code its input names; an unknown name: no code given."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "CODE").as_numpy()[0].decode()
            code = getattr(pb_utils.TritonError, name, None)
            if code is None:
                error = pb_utils.TritonError("no such code: " + name)
            else:
                error = pb_utils.TritonError(message="the code is " + name, code=code)
            responses.append(pb_utils.InferenceResponse(error=error))
        return responses
