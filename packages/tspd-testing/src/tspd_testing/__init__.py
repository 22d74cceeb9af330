"""Harnesses for tests, benchmarks and demos: ``identity`` (identity-tagged arenas, the
byte-exact oracle), ``loopback`` and ``layerwise_loopback`` (a P instance and a D replica in
one process), ``replicas`` and ``replica_rank`` (real multi-process replicas), ``netns``
(hosts on one machine: network namespaces joined by a bridge, as root), ``interop`` (TokenSpeed's
own PD code beside tspd's: the interop tests' and the transfer benchmark's pairs)."""
