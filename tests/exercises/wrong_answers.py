"""Plausible wrong answers, graded: a grader must reject each one and name its cause.

`answers(module, **wrong)` installs a package whose chapter module is the reference solution with some functions
replaced by wrong ones, and returns the package's name: a grader test called with it as `impl` grades the wrong
answer. `rejects(test, impl, hint)` runs the grader test and checks that it fails with `hint` in its message.
"""

import importlib
import itertools
import sys
import types
from collections.abc import Callable

import pytest

_COUNTER = itertools.count()


def answers(module: str, **wrong: object) -> str:
    """A package named `wrong_N` whose `module` is solutions' with `wrong` replacing some of its names."""
    reference = importlib.import_module(f"solutions.{module}")
    name = f"wrong_{next(_COUNTER)}"
    package = types.ModuleType(name)
    package.__path__ = []
    chapter = types.ModuleType(f"{name}.{module}")
    chapter.__dict__.update({k: v for k, v in vars(reference).items() if not k.startswith("__")})
    chapter.__dict__.update(wrong)
    sys.modules[name], sys.modules[f"{name}.{module}"] = package, chapter
    return name


def rejects(test: Callable[..., None], impl: str, hint: str, *args: object) -> None:
    """The grader `test` fails on `impl`, and its message carries `hint`."""
    with pytest.raises((AssertionError, pytest.fail.Exception)) as failure:
        test(impl, *args)
    assert hint in str(failure.value), f"{test.__name__} rejected the wrong answer, but said: {failure.value}"
