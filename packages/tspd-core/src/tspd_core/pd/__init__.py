"""PD transfer peers: Mooncake engine, ZMQ control plane, prefill and decode peers."""
