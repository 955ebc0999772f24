"""hicache-io's L3 tier: :class:`hicache_io.l3.store.PageStore` and the parts it is made of (keys,
placements, pipelines, transports, the trailer); :mod:`hicache_io.storage` builds it as
``MooncakeStore`` or ``LocalStore``."""
