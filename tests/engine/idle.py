"""Checks the engine tests share."""

from __future__ import annotations

from tunix_rt.engine.engine import Engine


def assert_idle(engine: Engine) -> None:
    """No request left, every KV block free and no adapter slot held: nothing leaked."""
    pool = engine.kv.pool
    assert not engine.has_unfinished_requests() and not engine._requests
    assert pool.num_free == pool.num_blocks and all(r == 0 for r in pool.ref_count)
    assert not engine.kv.blocks and not engine.kv.hashes
    stats = engine.stats()
    assert stats.kv_cache_usage == 0 and stats.num_running == 0 and stats.num_waiting == 0
    if engine.loras is not None:
        for adapter in [*engine.loras.adapters.values(), *filter(None, engine.loras.slots)]:
            assert adapter.pending == 0 and adapter.running == 0, (adapter.name, adapter.pending, adapter.running)
