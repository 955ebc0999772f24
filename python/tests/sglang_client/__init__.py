"""sglang 0.5.23's own HiCache classes driving hicache-io (see README.md). A package so its
test modules do not collide with python/tests/test_*.py of the same names."""
