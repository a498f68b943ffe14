"""Helpers only the tests use (what the tests and ``bench/`` share is `orchestrion.testing`).

`support.served`: ``orchestrion serve`` on the tests' repository (``tests/kserve_models``)
and small requests to it; `support.raw_http`: raw-socket HTTP clients (floods, trickles,
replies read until the server closes); `support.decoupled`: the decoupled tests' generator
models; `support.metrics`: values read from the metrics text; `support.batching`: the dynamic
batching tests' models; `support.prometheus`: a real Prometheus; `support.reliability_report`:
the rows of the reliability report.
"""
