"""The OuterStep protocol: both outer steps follow it, and diloco takes either
(or an optax optimizer), refusing anything else by its argument's name.
(That diloco imports no outer step's module is tests/test_layers.py's.)"""

import optax
import pytest

import jaxcomm
from jaxcomm.transforms.outer_step import OptaxOuter, OuterStep, as_outer_step


def test_both_outer_steps_follow_the_protocol():
    assert isinstance(OptaxOuter(optax.sgd(1.0)), OuterStep)
    assert isinstance(jaxcomm.sparse_outer(), OuterStep)
    assert isinstance(jaxcomm.sparse_outer(), jaxcomm.OuterStep)
    assert not isinstance(optax.sgd(1.0), OuterStep)


def test_outer_accepts_an_optimizer_or_an_outer_step():
    assert isinstance(as_outer_step(optax.sgd(1.0), error_feedback=False), OptaxOuter)
    rule = OptaxOuter(optax.sgd(1.0))
    assert as_outer_step(rule, error_feedback=False) is rule
    jaxcomm.diloco(optax.sgd(0.1), rule, "data", sync_every=4)
    jaxcomm.diloco(optax.sgd(0.1), jaxcomm.sparse_outer(), "data", sync_every=4)


@pytest.mark.parametrize("outer", ["sgd", 1.0, None, object()])
def test_outer_of_another_type_is_a_type_error(outer):
    with pytest.raises(TypeError, match="outer="):
        jaxcomm.diloco(optax.sgd(0.1), outer, "data", sync_every=4)


def test_error_feedback_belongs_to_the_optax_outer_step():
    with pytest.raises(ValueError, match="keeps its own error-feedback"):
        jaxcomm.diloco(
            optax.sgd(0.1), jaxcomm.sparse_outer(), "data", sync_every=4, error_feedback=True
        )
    with pytest.raises(ValueError, match="OptaxOuter"):
        jaxcomm.diloco(
            optax.sgd(0.1), OptaxOuter(optax.sgd(1.0)), "data", sync_every=4, error_feedback=True
        )
