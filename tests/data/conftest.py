"""Keep the data tests' shard caches out of the user's ~/.cache/megaloop."""

from __future__ import annotations

import pytest

from tests.conftest import isolated_cache

# keep shard caches of these tests out of the user's ~/.cache/megaloop
_isolated_megaloop_cache = pytest.fixture(scope="session", autouse=True)(isolated_cache)
