"""A BLS call to sleeper (python_backend's examples/bls shape): the caller's cancellation
reaches the called model."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        seconds = pb_utils.get_input_tensor_by_name(requests[0], "SECONDS")
        call = pb_utils.InferenceRequest(
            model_name="sleeper", inputs=[seconds], requested_output_names=["SLEPT"]
        )
        response = call.exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        return [pb_utils.InferenceResponse(response.output_tensors())]
