"""execute raises: a name that is not defined."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        )
        undefined_name  # noqa: F821, B018
        return [pb_utils.InferenceResponse([out])]
