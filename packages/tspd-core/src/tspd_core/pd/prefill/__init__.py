"""The prefill (P) side. ``peer`` runs in the engine process (PrefillPeer, PrefillOutbox); the
rest in P's transfer worker process: ``worker`` (P's half of the worker, wiring the parts below
and dispatching to them), ``sessions`` (D sessions: registrations, routes, staging grants),
``rooms`` (every room from its first sign to Success or Failed), ``jobs`` (where a chunk's
routes become write jobs), ``layerwise`` (armed chunks sent an interval at a time) and
``state`` (the records and wire.md §2.2's checks)."""
