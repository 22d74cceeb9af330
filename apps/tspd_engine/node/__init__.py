"""A serving node: its replicas behind one HTTP endpoint, from the command line to a clean
stop.

``run`` starts a node (replicas, its bootstrap server on a prefill node, the endpoint) and
stops it; ``endpoint`` is the HTTP API; ``replicas`` dispatches requests to the replicas by
the node's role; ``metrics`` renders the replicas' counters; ``cliargs`` holds the flags the
engine, the launcher and the router share.
"""
