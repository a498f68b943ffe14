"""Streams the letters of its prompt, one response each, the last with the final flag; its
responses are cached (a server with a cache replays the whole stream)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            letters = prompt[0].decode()
            for at, letter in enumerate(letters):
                tensor = pb_utils.Tensor("LETTER", np.array([letter.encode()], dtype=object))
                last = at == len(letters) - 1
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
                sender.send(pb_utils.InferenceResponse([tensor]), flags=flags)
            if not letters:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
