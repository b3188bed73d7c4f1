"""Checks the engine tests share."""

from __future__ import annotations

from tunix_rt.engine.engine import Engine


def assert_idle(engine: Engine) -> None:
    """No request left, every KV block free and no adapter slot held: nothing leaked."""
    assert not engine.has_unfinished_requests() and not engine._requests
    for group in engine.kv.groups:  # every KV group's blocks
        assert group.pool.num_free == group.pool.num_blocks and all(r == 0 for r in group.pool.ref_count)
        assert not group.blocks and not group.hashes and not group.freed
    stats = engine.stats()
    assert stats.kv_cache_usage == 0 and stats.num_running == 0 and stats.num_waiting == 0
    if engine.loras is not None:
        for adapter in [*engine.loras.adapters.values(), *filter(None, engine.loras.slots)]:
            assert adapter.pending == 0 and adapter.running == 0, (adapter.name, adapter.pending, adapter.running)
