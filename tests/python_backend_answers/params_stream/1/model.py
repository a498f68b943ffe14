"""One response per parameters object of its input's list, then the final flag alone."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "PARAMETERS").as_numpy()[0]
            sender = request.get_response_sender()
            for each in json.loads(text):
                out = pb_utils.Tensor("OUT", [json.dumps(each).encode()])
                sender.send(pb_utils.InferenceResponse([out], parameters=each))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
