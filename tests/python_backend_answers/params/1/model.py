"""Answers with the parameters its input names (digit keys made ints, to be refused); a
refusal is its INVALID_ARG error response, in the words of pb_utils' check."""

import json

import triton_python_backend_utils as pb_utils


def _wanted(request):
    text = pb_utils.get_input_tensor_by_name(request, "PARAMETERS").as_numpy()[0].decode()
    wanted = json.loads(text)
    if isinstance(wanted, dict):
        wanted = {int(k) if k.isdigit() else k: v for k, v in wanted.items()}
    return text, wanted


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text, wanted = _wanted(request)
            out = pb_utils.Tensor("OUT", [text.encode()])
            try:
                response = pb_utils.InferenceResponse([out], parameters=wanted)
            except Exception as exc:
                error = pb_utils.TritonError(
                    message=str(exc), code=pb_utils.TritonError.INVALID_ARG
                )
                response = pb_utils.InferenceResponse(error=error)
            responses.append(response)
        return responses
