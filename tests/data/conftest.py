"""Keep the data tests' shard caches out of the user's ~/.cache/megaloop."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_megaloop_cache(tmp_path_factory: pytest.TempPathFactory):
    old = os.environ.get("MEGALOOP_CACHE")
    os.environ["MEGALOOP_CACHE"] = str(tmp_path_factory.mktemp("megaloop_cache"))
    yield
    if old is None:
        os.environ.pop("MEGALOOP_CACHE", None)
    else:
        os.environ["MEGALOOP_CACHE"] = old
