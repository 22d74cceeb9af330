"""Typed identifiers shared across tspd_core (NewType: zero cost at run time)."""

from typing import NewType

#: The rendezvous id of one request between P and D, chosen by the router (0 .. 2**63 - 1).
Room = NewType("Room", int)
#: An engine-side request id (the router's / engine's own string id).
RequestId = NewType("RequestId", str)
#: A physical KV page id in one rank's arena; 0 is the null page and is never handed out.
BlockId = NewType("BlockId", int)
#: A rank inside one attention-TP group (one replica).
Rank = NewType("Rank", int)

MAX_ROOM = (1 << 63) - 1
