"""The decode (D) side. ``peer`` runs in the engine process (DecodePeer, DecodeOutbox: zeroing
and publishing D's pages); the rest in D's transfer worker process: ``worker`` (D's half of the
worker, wiring the parts below), ``directory`` (where a room's P ranks are), ``exchange`` (what D
sends P: registrations, staging grants, the manifest, scatter acknowledgements), ``rooms`` (every
room and how it ends), ``state`` (the room record) and ``heartbeat``."""
