"""The public API imports and says what it exports."""

import jaxcomm


def test_public_api():
    for name in jaxcomm.__all__:
        assert hasattr(jaxcomm, name), name
    assert callable(jaxcomm.allreduce)
    assert jaxcomm.ffi_available("cpu")
    assert not jaxcomm.ffi_available("tpu")
