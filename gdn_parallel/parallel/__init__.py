"""Parallelism applied to the single-device model from outside: mesh, tensor, pipeline, data and
context parallelism, activation checkpointing; `parallelize` is the entry point."""
