"""Request scheduler: block pool, prefix store, copy-on-write and ragged decode rounds."""
