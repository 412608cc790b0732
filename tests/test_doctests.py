"""The docstring examples of every rollq module run (``>>>`` lines marked ``+SKIP`` need a
live Redis, engine or GPU and are skipped by doctest itself)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import rollq

MODULES = sorted(m.name for m in pkgutil.walk_packages(rollq.__path__, "rollq."))


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    try:
        module = importlib.import_module(name)
    except ImportError as e:  # an optional extra (torchrl, ray, dashboard) not installed
        pytest.skip(f"{name}: {e}")
    res = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.failed == 0, f"{res.failed} of {res.attempted} doctest examples of {name} failed (run pytest --doctest-modules {name.replace('.', '/')}.py)"
