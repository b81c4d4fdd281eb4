"""Optax gradient transformations that communicate: dense allreduce and chunk-sparse."""

from jaxcomm.transforms._buckets import plan_buckets

__all__ = ["plan_buckets"]
