"""Prometheus metrics and OpenTelemetry traces, as `orchestrion.protocols.Observer` implementations.

Empty until the telemetry work lands.
"""
