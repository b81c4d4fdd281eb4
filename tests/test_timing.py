"""jaxcomm.costmodel's timing loop: call order, warm-up, one call in flight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxcomm.costmodel import time_rounds


def test_rounds_rotate_the_order_and_skip_the_warmup():
    calls = []

    def fn(name):
        def call():
            calls.append(name)
            return jnp.zeros(())

        return call

    samples = time_rounds([fn("a"), fn("b"), fn("c")], reps=2, warmup=1)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [len(s) for s in samples] == [2, 2, 2]
    assert all(t > 0 for s in samples for t in s)


def test_each_call_is_finished_before_the_next_starts():
    ready = []

    def call():
        # The previous call's result must already be ready when the next starts.
        assert all(x.is_ready() for x in ready)
        out = jax.jit(lambda v: v @ v)(jnp.ones((256, 256)))
        ready.append(out)
        return out

    time_rounds([call, call], reps=3, warmup=1)
    assert len(ready) == 8


@pytest.mark.parametrize("reps, warmup", [(0, 0), (1, -1)])
def test_bad_counts(reps, warmup):
    with pytest.raises(ValueError, match="must be >= "):
        time_rounds([lambda: jnp.zeros(())], reps=reps, warmup=warmup)
