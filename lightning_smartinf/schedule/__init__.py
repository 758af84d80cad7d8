"""Schedules: the order in which blocks and micro-batches run."""
