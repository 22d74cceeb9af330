"""Operator metrics: ``registry`` (counters, gauges, histograms, Prometheus text), ``worker``
(what a transfer worker records) and ``peer`` (what the engine-side peer records)."""
