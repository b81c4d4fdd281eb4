"""The integer codes the extension modules export (``codes()``), built from
the C++ enums of xla_ffi/common/ so that Python never spells them again: every
table names what Python passes, with distinct codes, and the CPU and CUDA
modules (where the CUDA one is built) export the same tables."""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

_ffi = pytest.importorskip("jaxcomm._ffi")

TABLES = {
    "dtype": {"float32", "float16", "bfloat16", "float64"},
    "algorithm": {"ring", "hierarchical", "direct", "alltoall"},
    "unselected": {"local", "zero"},
    "op": {"allreduce", "reduce_scatter", "all_gather", "allreduce_parts", "allreduce_start"},
}


@pytest.fixture(autouse=True)
def _enough_devices():
    """Overrides conftest's 8-device rule: nothing here runs on a device."""


def test_codes_name_exactly_the_tables_python_needs():
    codes = _ffi.codes()
    assert set(codes) == set(TABLES)
    for table, names in TABLES.items():
        assert set(codes[table]) == names, table


@pytest.mark.parametrize("table", sorted(TABLES))
def test_each_table_has_distinct_integer_codes(table):
    values = list(_ffi.codes()[table].values())
    assert all(type(v) is int for v in values), values
    assert len(set(values)) == len(values), values


def test_dtype_names_are_numpy_dtypes_the_collectives_take():
    for name in _ffi.codes()["dtype"]:
        assert np.dtype(getattr(jnp, name)).name == name


def test_codes_is_a_fresh_copy_each_call():
    codes = _ffi.codes()
    codes["dtype"]["float32"] = -1
    assert _ffi.codes()["dtype"]["float32"] != -1


def test_cuda_module_exports_the_same_codes():
    if importlib.util.find_spec("jaxcomm._ffi_cuda") is None:
        pytest.skip("jaxcomm._ffi_cuda is not built")
    from jaxcomm import _ffi_cuda

    assert _ffi_cuda.codes() == _ffi.codes()


_NUMPY_OF = {"int32_t": np.int32, "int64_t": np.int64, "double": np.float64}


def test_python_passes_the_attribute_lists_the_handlers_decode():
    """_ffi_calls writes each shared attribute list once, as
    xla_ffi/common/attr_lists.h does: the same names, of the types the
    handlers decode."""
    from types import SimpleNamespace

    from jaxcomm.collectives import _ffi_calls

    place = SimpleNamespace(size=8, shape=(2, 4), axes=("node", "local"))
    x = jnp.zeros((8,), jnp.float32)
    written = {
        "reduction": _ffi_calls._reduction_attributes(
            x, place, {}, "hierarchical", jnp.bfloat16, 1.0, 0.125
        ),
        "chunk_mask": _ffi_calls._chunk_mask_attributes(4, None, zero_unselected=True),
    }
    lists = _ffi.attributes()
    assert set(lists) == set(written)
    for name, attrs in written.items():
        assert list(attrs) == list(lists[name]), name
        for attr, value in attrs.items():
            assert type(value) is _NUMPY_OF[lists[name][attr]], (name, attr)
