"""The console script pauses Python's cyclic collector while a command starts; every command resumes it."""

from __future__ import annotations

import gc

import pytest

from tunix_rt import cli, console


@pytest.fixture
def collector():
    """Leaves the collector on and nothing frozen, whatever the test did."""
    yield
    gc.enable()
    gc.unfreeze()


def test_pause_then_resume_freezes_what_lives(collector, monkeypatch):
    assert gc.isenabled()
    console.pause_gc()
    assert not gc.isenabled()
    alive = [object() for _ in range(10)]
    console.resume_gc()
    assert gc.isenabled() and gc.get_freeze_count() >= len(alive)
    frozen = gc.get_freeze_count()
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    console.resume_gc()  # nothing paused: nothing to do
    # No second freeze. The count itself can only fall: another thread freeing a frozen object takes it out of
    # the permanent generation (a CI run saw it fall by 4 here).
    assert gc.isenabled() and not freezes and gc.get_freeze_count() <= frozen


def test_a_collector_turned_off_by_the_caller_stays_off(collector):
    gc.disable()
    console.pause_gc()
    console.resume_gc()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("argv", [["info"], ["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"]])
def test_every_command_resumes_the_collector(collector, capsys, argv):
    """A command that loads no model, and one that fails before its model is in, both end with collection on."""
    console.pause_gc()
    code = cli.main(argv)
    assert code == (0 if argv == ["info"] else 2)
    assert gc.isenabled()
    if code:
        assert "does not exist" in capsys.readouterr().err
