"""The engine loop of one rank: requests in, scheduler rounds, tokens out.

``core`` runs the rounds; ``prefill`` and ``decoders`` (with ``rows``) drive the scheduler's
prefill chunks and decode rounds through ``runner`` (the model and the device feed);
``sequence`` is a request's host state, ``limits`` and ``digest`` what the core checks;
``hooks`` is how the PD links join the loop (they see it only through ``LoopControl``);
``engine`` drives one rank from the caller's thread.
"""
