"""RedisSettings refuses values no client could work with, naming the field."""

from __future__ import annotations

import pytest

from rollq.settings import RedisSettings


@pytest.mark.parametrize("field, value", [
    ("max_connections", 0), ("max_connections", -3), ("max_connections", 2.5), ("max_connections", True),
    ("connect_timeout", 0), ("command_timeout", -1.0), ("command_timeout", float("nan")),
    ("pool_timeout", -0.5), ("pool_timeout", "30"), ("connect_timeout", float("inf")),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"RedisSettings.{field}"):
        RedisSettings(**{field: value})
    with pytest.raises(ValueError, match=f"RedisSettings.{field}"):
        RedisSettings.from_url("redis://127.0.0.1:6379/0", **{field: value})


def test_good_values_are_kept():
    s = RedisSettings(max_connections=1, connect_timeout=0.1, command_timeout=1, pool_timeout=None)
    assert (s.max_connections, s.pool_timeout) == (1, None)
    assert RedisSettings(pool_timeout=0).pool_timeout == 0  # fail at once when the pool is full, as redis-py does
