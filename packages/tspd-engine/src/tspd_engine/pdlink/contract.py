"""What a PD link reads off a rank's cache contract: the bytes of a page, how many ranks hold
distinct slices of it, and the bootstrap server's check of the layouts ranks register."""

from __future__ import annotations

from tspd_core.layout import CacheContract, canonical_layout_text


def distinct_shards(contract: CacheContract) -> int:
    """How many ranks hold distinct slices of a page (KV heads split across TP; ranks that
    replicate a KV head hold the same bytes): a replica's page is this many rank pages."""
    for f in contract.plan.fields:
        part = contract.partition(f.field_id)
        if part is not None:
            return int(part.global_extent // f.shape[part.axis])
    return 1


def page_bytes(contract: CacheContract) -> int:
    """Payload bytes of one page on this rank, every field of every group."""
    return sum(f.payload_bytes for f in contract.plan.fields)


def canonical_layout(text: str) -> str:
    """The bootstrap server's layout canonicaliser for tspd peers: tspd_core's strict
    contract parser (the one canonical form every tspd KV server uses), so a P rank with a
    malformed contract is refused at registration."""
    return canonical_layout_text(text)
