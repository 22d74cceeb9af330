"""Layerwise streaming on a P rank of the reference engine (wire.md §7, docs/layerwise.md).

A prefill forward whose batch holds PD rows is armed before it runs (``arm_layerwise``: one
reservation of the forward's producer steps, one chunk per row) and advances the rank's step
counter once per layer, right after that layer's KV writes; the transfer worker sends each
interval of layers as the counter passes it::

    PrefillLink.before_prefill(rows) ─ arm_layerwise(PD rows) ─► CounterStream
    model layer 0: write KV ─ stream.after_layer(0) ─ counter.advance()   ─► worker: layer 0
    model layer 1: write KV ─ stream.after_layer(1) ─ counter.advance()   ─► worker: layer 1
    forward ends (or raises) ─ stream.close(): advance what is still reserved
    final chunk's first token ─ hand_over_remote_decode({rid: token}) ─► Success to D

The reference model has no draft layers, so producer steps = layers. ``close`` keeps the
counter aligned when an armed forward does not run to its end (an exception in a layer):
the next forward's reservation starts where the counter will be.

Threading: the rank's engine thread (the forward runs on it).
"""

from __future__ import annotations

from tspd_core.pd.layerwise.step_counter import StepCounter, behind


class CounterStream:
    """One armed forward's layers, as counter steps (a
    :class:`~tspd_engine.loop.hooks.LayerStream`)."""

    def __init__(self, counter: StepCounter) -> None:
        self.counter = counter

    def after_layer(self, layer: int) -> None:
        self.counter.advance()

    def close(self) -> None:
        # Steps reserved but not issued: the layers an interrupted forward never reached.
        missing = behind(self.counter.issued, self.counter.reserved)
        if missing > 0:
            self.counter.advance(missing)
