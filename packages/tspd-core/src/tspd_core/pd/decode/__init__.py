"""The decode (D) side: ``peer`` runs in the engine process (DecodePeer, DecodeOutbox); the
rest runs in D's transfer worker process."""
