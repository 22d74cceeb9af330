"""Layerwise streaming (wire.md §7): ``schedule`` (producer steps and intervals) and
``step_counter`` (the forward's counter, its reader and the pacer)."""
