"""Streams the words of its prompt, one response each, as an LLM streams tokens."""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _text(values):
    return pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", np.array(values, dtype=object))])


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            self._answer(request)
        return None

    def _answer(self, request):
        options = json.loads(request.parameters())
        sender = request.get_response_sender()
        prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
        streaming = bool(pb_utils.get_input_tensor_by_name(request, "STREAM").as_numpy().flat[0])
        limit = pb_utils.get_input_tensor_by_name(request, "LIMIT")
        if options.get("NOTHING"):
            sender.send(
                _text(np.zeros((1, 0), object)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            )
            return
        if not streaming:
            sender.send(_text(prompt), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        words = prompt.flat[0].decode().split()
        if limit is not None:
            words = words[: int(limit.as_numpy().flat[0])]
        for _ in range(int(options.get("ROUNDS", 1))):
            for word in words:
                time.sleep(float(options.get("PAUSE", 0)))
                if sender.is_cancelled():
                    pb_utils.Logger.log_info("words: cancelled")
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return
                sender.send(_text([[word.encode()]]))
        last = None
        if options.get("BREAK"):
            last = pb_utils.InferenceResponse(error=pb_utils.TritonError("the words ran out"))
        sender.send(last, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
