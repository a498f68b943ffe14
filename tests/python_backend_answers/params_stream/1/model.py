"""One response per parameters object of its input's list, then the final flag alone; an
object with "with_final": true is sent with the final flag instead (and ends the list)."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "PARAMETERS").as_numpy()[0]
            sender = request.get_response_sender()
            for each in json.loads(text):
                out = pb_utils.Tensor("OUT", [json.dumps(each).encode()])
                last = bool(each.get("with_final"))
                sender.send(pb_utils.InferenceResponse([out], parameters=each), last * final)
                if last:
                    break
            else:
                sender.send(flags=final)
        return None
