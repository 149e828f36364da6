"""Shared test configuration.

Every async test runs on asyncio and on trio through anyio's pytest plugin (the ``anyio_backend`` fixture below
is parametrized); tests that embed aelastic in a plain asyncio program use pytest-asyncio in strict mode.
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
