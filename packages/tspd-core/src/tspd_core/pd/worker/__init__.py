"""Inside a transfer worker process, what both roles share: ``spec`` (what the peer tells its
worker at start: WorkerSpec, WorkerRole, the worker kind) and ``transfer_worker`` (the control
loop with the Mooncake engine, the sockets and the calls every worker answers, holding the
role's half; the process entry's body)."""
