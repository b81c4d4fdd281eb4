"""pytest with jaxcomm._ffi and the test harness jaxcomm._ffi_testing loaded
from $JAXCOMM_FFI_MODULE and $JAXCOMM_FFI_TESTING_MODULE (a sanitizer build, see
tools/sanitize.sh) instead of the installed extensions."""

import importlib.util
import os
import sys

import pytest


def _load(name, path):
    spec = importlib.util.spec_from_file_location(f"jaxcomm.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"jaxcomm.{name}"] = module
    spec.loader.exec_module(module)
    print(f"jaxcomm.{name} from {module.__file__}", flush=True)
    return module


if __name__ == "__main__":
    module = _load("_ffi", os.environ["JAXCOMM_FFI_MODULE"])
    testing = _load("_ffi_testing", os.environ["JAXCOMM_FFI_TESTING_MODULE"])
    import jaxcomm

    jaxcomm._ffi = module
    jaxcomm._ffi_testing = testing
    assert jaxcomm.collectives._extension.cpu_module() is module
    sys.exit(pytest.main(sys.argv[1:]))
