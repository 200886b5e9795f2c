"""The hypothesis settings every fuzz of an untrusted file format shares."""

from __future__ import annotations

from typing import Any


def fuzz_settings(examples: int) -> Any:
    """A decorator: ``examples`` examples, no deadline, no example database (each run starts
    afresh), and the health checks that a file-writing fuzz trips by design turned off."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )
