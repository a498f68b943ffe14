"""Answers each request from a thread of its own, in the order of the requests' values:
the thread of request n sends once request n-1's response is sent (waiting at most 10 s),
whichever execution (batch) each came in."""

import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sent = -1  # the value whose response was sent last
        self.turn = threading.Condition()
        self.threads = []

    def execute(self, requests):
        started = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0, 0])
            sender = request.get_response_sender()
            started.append(threading.Thread(target=self.answer, args=(sender, n)))
        for thread in reversed(started):  # started last first: the order is the turn's
            thread.start()
        self.threads = [t for t in self.threads if t.is_alive()] + started
        return None

    def answer(self, sender, n):
        with self.turn:
            self.turn.wait_for(lambda: self.sent >= n - 1, timeout=10)
            if n % 3 == 0:
                error = pb_utils.TritonError(f"request {n} fails")
                sender.send(pb_utils.InferenceResponse(error=error))
            else:
                value = pb_utils.Tensor("OUT", np.array([[n]], np.float32))
                sender.send(pb_utils.InferenceResponse([value]))
            self.sent = max(self.sent, n)
            self.turn.notify_all()
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=10)
