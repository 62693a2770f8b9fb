"""Every kernel variant this machine executes (kernels/isa.py), as a fixture: tests run once per
variant against fp64 and against the portable scalar reference. An AVX-512 machine runs the AVX2
variants too, so CI on either CPU checks them; NEON runs under qemu (test_neon.py)."""
from __future__ import annotations

import pytest

from edgellm import kernels
from edgellm.kernels.build import BuildError, compiler

VARIANTS = kernels.runnable()


def _library(variant):
    if compiler() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    try:
        return kernels.library_for(variant)
    except BuildError as e:
        pytest.fail(f"the {variant.label} kernels do not build: {e}")


@pytest.fixture(params=VARIANTS, ids=[v.label for v in VARIANTS])
def variant(request):
    return request.param


@pytest.fixture
def lib(variant):
    return _library(variant)


@pytest.fixture
def scalar():
    return _library(kernels.Variant("scalar"))
