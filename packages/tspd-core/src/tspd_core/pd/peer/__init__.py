"""The engine-side peer, shared by both roles: ``transfer_peer`` (register, poll, abort),
``tracked`` (one request's record and how the worker's news folds in), ``agreement`` (the
replica's MIN all-reduce and its rules), ``link`` (the worker's notes routed to the peer and to
callers), ``worker_handle`` (start, talk to and stop the transfer worker process) and ``start``
(what starting either role's peer shares)."""
