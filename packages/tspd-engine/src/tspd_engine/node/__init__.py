"""A serving node: its replicas behind one HTTP endpoint, from the command line to a clean
stop.

``run`` starts a node (replicas, its bootstrap server on a prefill node, the endpoint) and
stops it; ``endpoint`` is the HTTP API; ``replicas`` dispatches requests to the replicas by
the node's role; ``metrics`` renders the replicas' counters; ``allow`` decides which
bootstrap servers a request may name; ``cliargs`` holds the engine's flags, which the launcher
shares (the flags every serving program shares, and the HTTP limits, are tspd_serving's).
"""
