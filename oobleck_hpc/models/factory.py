"""The user's model factory (`model.factory: package.module:function`), imported by name.

One function, so that every command says the same thing when it cannot be imported: the
workers (`base.build_model`), `oobleck-hpc run` before it starts any process, and `oobleck-hpc
plan` / `profile` before they look for a profile. No torch here: importing the user's module
imports whatever it imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from oobleck_hpc.errors import ConfigError


def load_factory(factory: str, source: str) -> Callable:
    """The function `factory` names; ConfigError (file `source`, key model.factory) with the
    exception its import raised, or naming the missing function."""
    module_name, _, attr = factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while it is imported
        raise ConfigError(source, "model.factory",
                          f"value {factory!r} cannot be imported: {type(e).__name__}: {e}",
                          "put the module's package on PYTHONPATH (the workers inherit it) and "
                          "install what the module imports") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(source, "model.factory",
                          f"value {factory!r}: module {module_name!r} "
                          f"({getattr(module, '__file__', None) or 'no file'}) has no function "
                          f"{attr!r}", f"name a function defined in {module_name!r}")
    return fn
