"""The prefill (P) side: ``peer`` runs in the engine process (PrefillPeer, PrefillOutbox); the
rest runs in P's transfer worker process."""
