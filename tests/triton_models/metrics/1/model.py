"""Mirrors python_backend's examples/custom_metrics: a counter of requests, a gauge of the
last input's sum and a histogram of it, shown on the server's /metrics. The model keeps
its families: as in Triton, a family whose every handle is gone leaves /metrics, and its
metrics then refuse every operation."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.families = [
            pb_utils.MetricFamily(
                name="custom_requests_total",
                description="Requests seen",
                kind=pb_utils.MetricFamily.COUNTER,
            ),
            pb_utils.MetricFamily(
                name="custom_last_sum",
                description="The last input's sum",
                kind=pb_utils.MetricFamily.GAUGE,
            ),
            pb_utils.MetricFamily(
                name="custom_sum", description="Input sums", kind=pb_utils.MetricFamily.HISTOGRAM
            ),
        ]
        self.requests = self.families[0].Metric(labels=labels)
        self.last = self.families[1].Metric(labels=labels)
        self.sums = self.families[2].Metric(labels=labels, buckets=[1.0, 10.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            self.requests.increment(1)
            self.last.set(float(x.sum()))
            self.sums.observe(float(x.sum()))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
