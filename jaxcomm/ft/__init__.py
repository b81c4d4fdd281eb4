"""Fault-tolerant replica groups."""
