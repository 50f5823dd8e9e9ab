"""Parallelism written by hand: FSDP with `shard_map`, pipeline schedules and their executor."""
