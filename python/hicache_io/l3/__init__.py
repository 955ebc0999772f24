"""hicache-io's L3 tier: the parts every store shares (see :mod:`hicache_io.storage` for the
stores themselves)."""
