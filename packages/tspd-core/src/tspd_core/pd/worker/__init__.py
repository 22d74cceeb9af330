"""Inside a transfer worker process, what both roles share: ``transfer_worker`` (the control
loop with the Mooncake engine, the sockets and the calls every worker answers)."""
