"""Fixtures shared by the L3 suites (``store``: one Mooncake store per module, on ``master``;
``clients``: a :class:`common.Lender` of Mooncake clients on ``master``, closed with the module).

``master``: a Mooncake master of the test module's own on free loopback ports, with short leases
(200 ms) so that a test may remove or replace an object soon after reading it. One per module:
its objects are apart from other modules', and each test names its own keys. It skips the test
where Mooncake Store is not installed, unless ``HICACHE_REQUIRE_MOONCAKE=1`` (CI sets it)."""

import pytest

from common import Lender, make_store, mooncake_problem


@pytest.fixture(scope="module")
def master(request):
    problem = mooncake_problem()
    if problem is not None:
        pytest.skip(problem)
    from hicache_io.storage import LocalMaster

    # A module whose tests never wait for a lease to end may ask for longer ones (MASTER_LEASE_MS).
    m = LocalMaster(lease_ms=getattr(request.module, "MASTER_LEASE_MS", 200))
    yield m
    m.stop()


@pytest.fixture(scope="module")
def store(master):
    # Shared by pools of many shapes under one prefix (not a deployment): the namespace record
    # would rightly make every pool after the first foreign to sglang's names. Namespaces have
    # their own tests, on stores of their own.
    s = make_store(master, extra={"hicache_io_namespace_record": False})
    yield s
    s.close()


@pytest.fixture(scope="module")
def clients(master):
    lender = Lender(master)
    yield lender
    lender.close()
