"""TokenSpeed's own PD code beside tspd's, for ``tests/interop`` and the transfer benchmark.

``env`` loads TokenSpeed's runtime (the interop fixture, or ``TSPD_TOKENSPEED_PYTHON``) and says
why it cannot when it is missing; ``contracts`` builds its cache contracts (and tspd's spec of
the same model); ``host`` runs its PD managers in a child process; ``tspd_side`` runs tspd's
peers the same way; ``pairs`` times whole P -> D pairs of either system. Importing
``contracts``, ``host``'s child or ``pairs`` loads TokenSpeed; ``env`` alone does not.
"""
