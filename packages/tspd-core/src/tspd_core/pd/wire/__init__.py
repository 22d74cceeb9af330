"""Codecs of every message that crosses a process boundary: ``frames`` (P <-> D over ZMQ,
wire.md §2, and the tspd staging frames), ``parse`` (the field parsers EPD's frames share too) and
``ipc`` (an engine-side peer <-> its transfer worker, over pipes)."""
