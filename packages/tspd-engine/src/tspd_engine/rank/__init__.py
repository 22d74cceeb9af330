"""A replica's rank processes: launch them, talk to them, and the body each one runs.

``launch`` spawns the ranks (or one in a thread) and returns a handle with a ``client``;
``client`` submits and streams over ZMQ to rank 0's ``intake``, which broadcasts each round's
events to the other ranks; ``process`` is a rank's entry point and serve loop.
"""
