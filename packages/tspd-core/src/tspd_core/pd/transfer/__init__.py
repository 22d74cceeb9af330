"""The data path: how bytes move from P's arena into D's pages. ``mooncake`` wraps the transfer
engine, ``write_stream`` is one thread's windowed writes, ``pool`` holds P's transfer queues and
their write jobs, ``staging`` / ``stage_plan`` stage small runs through D's slots (P's side),
``scatter`` is D's side (the staging memory and the scatter thread), and ``byterows`` zeroes,
gathers and scatters byte ranges."""
