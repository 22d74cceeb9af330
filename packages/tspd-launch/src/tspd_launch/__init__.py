"""tspd's launcher (``tspd-launch``): a PD cluster one role per process (``cli``), a whole one
on this machine as supervised children (``local``, ``supervisor``), the demo (``demo``), a
load generator (``loadgen``) and the replay of a request trace against a running cluster
(``replay``). See docs/OPERATIONS.md."""
