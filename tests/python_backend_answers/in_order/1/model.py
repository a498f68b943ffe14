"""Answers each request from a thread of its own, in the order of the requests' values:
the thread of request n sends its response once request n-1's is sent, then its final flag
at once or, when the request's parameter ``round`` is a size, once every response of its
round (``round`` requests from a multiple of it) and the final flag of n-1 are sent (waiting
at most 10 s each time), whichever execution (batch) each came in."""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sent = -1  # the value whose response was sent last
        self.finished = -1  # the value whose final flag was sent last (by rounds)
        self.turn = threading.Condition()
        self.threads = []

    def execute(self, requests):
        started = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0, 0])
            size = json.loads(request.parameters() or "{}").get("round", 0)
            sender = request.get_response_sender()
            started.append(threading.Thread(target=self.answer, args=(sender, n, size)))
        for thread in reversed(started):  # started last first: the order is the turn's
            thread.start()
        self.threads = [t for t in self.threads if t.is_alive()] + started
        return None

    def answer(self, sender, n, size):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        with self.turn:
            self.turn.wait_for(lambda: self.sent >= n - 1, timeout=10)
            if n % 3 == 0:
                error = pb_utils.TritonError(f"request {n} fails")
                sender.send(pb_utils.InferenceResponse(error=error))
            else:
                value = pb_utils.Tensor("OUT", np.array([[n]], np.float32))
                sender.send(pb_utils.InferenceResponse([value]))
            if not size:
                sender.send(flags=final)
            self.sent = max(self.sent, n)
            self.turn.notify_all()
            if size:
                last = n // size * size + size - 1
                self.turn.wait_for(lambda: self.sent >= last and self.finished >= n - 1, timeout=10)
                sender.send(flags=final)
                self.finished = max(self.finished, n)
                self.turn.notify_all()

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=10)
