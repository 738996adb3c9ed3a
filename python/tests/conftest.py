"""Shared set-up: torch is needed by most tests; without it they skip on a developer's
machine and fail under CI=true (where nothing may skip)."""

from __future__ import annotations

import importlib.util
import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        msg = f"{module} is not installed (scripts/python-env.sh installs it)"
        if IN_CI:
            pytest.fail(msg + "; CI=true: nothing may skip")
        pytest.skip(msg)


@pytest.fixture
def torch_available() -> None:
    need("torch")
