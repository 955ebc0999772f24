"""Fixtures shared by the L3 suites.

``master``: a Mooncake master of the test module's own on free loopback ports, with short leases
(200 ms) so that a test may remove or replace an object soon after reading it. One per module:
its objects are apart from other modules', and each test names its own keys. It skips the test
where Mooncake Store is not installed, unless ``HICACHE_REQUIRE_MOONCAKE=1`` (CI sets it)."""

import pytest

from common import mooncake_problem


@pytest.fixture(scope="module")
def master():
    problem = mooncake_problem()
    if problem is not None:
        pytest.skip(problem)
    from hicache_io.storage import LocalMaster

    m = LocalMaster(lease_ms=200)
    yield m
    m.stop()
