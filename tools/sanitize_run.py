"""pytest with jaxcomm._ffi loaded from $JAXCOMM_FFI_MODULE (a sanitizer
build, see tools/sanitize.sh) instead of the installed extension."""

import importlib.util
import os
import sys

import pytest

if __name__ == "__main__":
    path = os.environ["JAXCOMM_FFI_MODULE"]
    spec = importlib.util.spec_from_file_location("jaxcomm._ffi", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["jaxcomm._ffi"] = module
    spec.loader.exec_module(module)
    import jaxcomm

    jaxcomm._ffi = module
    assert jaxcomm.collectives._ffi._extension() is module
    print(f"jaxcomm._ffi from {module.__file__}", flush=True)
    sys.exit(pytest.main(sys.argv[1:]))
