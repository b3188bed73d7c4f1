"""Nothing the user owns is lost (checkpoints/output_dir.py), through the CLI as a user runs it: a command never
writes into its own input, never replaces a non-empty directory without --overwrite (a training run recognises
its own run directory and resumes), and an --output naming a file is one clear line. Each refused case leaves
the original bytes intact."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.models.hf_tiny import make_tiny_model_dir
from tests.terminal import python_from_a_terminal
from tests.train.test_train_cli import cli, write_jsonl
from tunix_rt.checkpoints.output_dir import staged_output_dir
from tunix_rt.train.metrics import read_events, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fast_compiles")]

SFT = ("--steps", "1", "max_length=64", "progress=false", "save_steps=1")


def snapshot(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def leftovers(directory) -> list[str]:
    """Staging siblings (.NAME.partial-*, .NAME.old-*) left beside a directory."""
    return [p.name for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}.")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("source") / "model"
    make_tiny_model_dir(path)
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl",
                       [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"the {i}"}]}
                        for i in range(4)])


def test_quantize_into_its_own_source_is_refused_before_anything_is_written(model, capsys):
    before = snapshot(model)
    for output, extra in ((model, ()), (model, ("--overwrite",)), (model / "q8", ())):
        assert cli("quantize", "--model", model, "--format", "q8_0", "--output", output, *extra) == 2
        assert "overlaps the input" in capsys.readouterr().err
    assert snapshot(model) == before


def test_export_and_quantize_replace_a_directory_only_with_overwrite(model, tmp_path, capsys):
    final = tmp_path / "run" / "final"
    assert cli("export", "--model", model, "--output", final) == 0
    before = snapshot(final)
    for command in (("quantize", "--format", "q8_0"), ("export",)):
        assert cli(*command, "--model", model, "--output", final) == 2
        err = capsys.readouterr().err
        assert "non-empty directory" in err and "--overwrite" in err
        assert snapshot(final) == before
    assert cli("quantize", "--format", "q8_0", "--model", model, "--output", final, "--overwrite") == 0
    assert json.loads((final / "config.json").read_text())["quantization_config"]["format"] == "q8_0"
    assert not leftovers(final)


def test_a_failed_write_leaves_the_old_directory_intact(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "weights").write_bytes(b"old")
    with pytest.raises(RuntimeError, match="crash"):
        with staged_output_dir(target, overwrite=True) as staging:
            (staging / "weights").write_bytes(b"new, half written")
            raise RuntimeError("crash")
    assert snapshot(target) == {"weights": b"old"} and not leftovers(target)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_a_writer_killed_between_its_two_renames_gets_its_old_directory_back(tmp_path):
    """The old target is moved aside before the new one is renamed in: a kill between the two leaves no target,
    and the next writer puts the old one back (and, without overwrite, refuses to replace it)."""
    target = tmp_path / "out"
    old = tmp_path / f".out.old-{dead_pid()}-abcd"
    old.mkdir()
    (old / "weights").write_bytes(b"old")
    (tmp_path / f".out.partial-{dead_pid()}-efgh").mkdir()  # and the new one, complete or not
    with pytest.raises(FileExistsError, match="non-empty directory"):
        with staged_output_dir(target):
            pass
    assert snapshot(target) == {"weights": b"old"} and not leftovers(target)


def test_an_output_naming_a_file_is_one_line(model, chats, tmp_path, capsys):
    """So are an empty --output (not the current directory) and one that cannot be created."""
    (tmp_path / "file").write_text("mine")
    for command in (("export",), ("quantize", "--format", "q8_0"), ("sft", "--data", chats, *SFT)):
        for output, message in ((tmp_path / "file", "exists and is not a directory"), ("", "is empty"),
                                (tmp_path / "file" / "sub" / "dir", "cannot create the directory: Not a directory")):
            assert cli(*command, "--model", model, "--output", output) == 2
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err and "Errno" not in err, err
    assert (tmp_path / "file").read_text() == "mine"


def test_training_refuses_a_directory_it_did_not_write(model, chats, tmp_path, capsys):
    out = tmp_path / "d"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"a": 1}\n')
    assert cli("sft", "--model", model, "--data", chats, "--output", out, *SFT) == 2
    assert "holds no tunix-rt run" in capsys.readouterr().err
    assert snapshot(out) == {"metrics.jsonl": b'{"a": 1}\n'}

    assert cli("sft", "--model", model, "--data", chats, "--output", out, "--overwrite", *SFT) == 0
    assert (out / "final" / "config.json").is_file() and [r["step"] for r in read_metrics(out)] == [1]
    # batch_size 8 over 4 rows: said, not silent
    assert "each step takes 8 items but the data holds 4" in capsys.readouterr().err
    # a command that fails (here on its data) leaves the run's record as it was
    stored = (out / "config.yaml").read_bytes()
    (out.parent / "bad.jsonl").write_text("{not json\n")
    assert cli("sft", "--model", model, "--data", out.parent / "bad.jsonl", "--output", out, *SFT,
               "learning_rate=0.5") == 2
    assert (out / "config.yaml").read_bytes() == stored and "bad.jsonl" in capsys.readouterr().err
    # now a run directory: a second run resumes it (nothing left to do at step 1 of 1), and says what changed ...
    capsys.readouterr()
    assert cli("sft", "--model", model, "--data", chats, "--output", out, *SFT, "learning_rate=0.001") == 0
    assert "with changed options: learning_rate None -> 0.001" in capsys.readouterr().err
    assert read_events(out) == [{"step": 1, "event": "resumed",
                                 "changed": {"learning_rate": {"from": None, "to": 0.001}}}]  # in the run's record
    assert cli("sft", "--model", f"{model}/.", "--data", chats, "--output", out, *SFT, "learning_rate=0.001") == 0
    assert "changed options" not in capsys.readouterr().err  # the same model, spelled otherwise
    # ... but not under options its checkpoints cannot hold
    stored = (out / "config.yaml").read_bytes()
    assert cli("sft", "--model", model, "--data", chats, "--output", out, *SFT, "--lora-rank", "4") == 2
    err = capsys.readouterr().err
    assert "a run with lora_rank=0; this run has lora_rank=4" in err and len(err.strip().splitlines()) == 1
    assert (out / "config.yaml").read_bytes() == stored  # the run's record still says what its checkpoints hold
    # ... resume=false would mix two runs, unless --overwrite starts over in place
    assert cli("sft", "--model", model, "--data", chats, "--output", out, *SFT, "resume=false") == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli("sft", "--model", model, "--data", chats, "--output", out, *SFT, "resume=false", "--overwrite") == 0
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_ctrl_c_stops_a_run_with_one_line_and_keeps_its_checkpoint(model, chats, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(python_from_a_terminal("-m", "tunix_rt.cli", "sft", "--model", str(model), "--data", chats,
                                                   "--output", str(out), "--steps", "100000", "max_length=64",
                                                   "progress=false", "save_steps=1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, metrics = time.monotonic() + 300, out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().endswith("\n")):  # a step done and saved (save_steps=1)
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "hung"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert re.fullmatch(r"tunix-rt sft: interrupted at step \d+ of 100000; the checkpoint at step \d+ is kept: "
                        r"re-run the same command to resume", err.strip().splitlines()[-1]), err


def test_a_killed_export_leaves_the_old_directory_intact_and_the_next_one_completes(tmp_path):
    """SIGKILL while the weights are being written (the default model's 540 MB take a moment)."""
    from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path

    try:
        default = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(f"exports the default model: {e}")
    target = tmp_path / "final"
    target.mkdir()
    (target / "config.json").write_text("{}")
    command = [sys.executable, "-m", "tunix_rt.cli", "export", "--model", str(default), "--output", str(target),
               "--overwrite"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not any(tmp_path.glob(".final.partial-*/*")):  # writing into the staging directory
            assert proc.poll() is None and time.monotonic() < deadline, "the export ended before it was killed"
            time.sleep(0.01)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert snapshot(target) == {"config.json": b"{}"}
    assert subprocess.run(command, capture_output=True, timeout=600).returncode == 0
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert not leftovers(target)  # the killed export's staging directory went with the next one


def test_plot_replaces_only_its_own_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"mine")
    assert cli("plot", run, "--output", mine) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert mine.read_bytes() == b"mine"
    for output, message in ((run / "metrics.jsonl", "is the input"), (tmp_path, "is a directory")):
        assert cli("plot", run, "--output", output, "--overwrite") == 2
        assert message in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text().startswith('{"step": 1')
    assert cli("plot", run, "--output", mine, "--overwrite") == 0
    assert mine.read_bytes().startswith(b"\x89PNG")
    for _ in range(2):  # RUN_DIR/metrics.png is the run's own plot: redrawn each time
        assert cli("plot", run) == 0 and (run / "metrics.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "metrics.png"]  # no staging file left


# Runs the CLI with safetensors' writer replaced by one that writes part of the file, says so (touching the
# file named first), and waits to be killed: a SIGKILL while the weights are half written, at a known moment.
_KILLED_WHILE_WRITING = """
import pathlib, sys, time
import safetensors.numpy
def save_file(tensors, path, metadata=None):
    pathlib.Path(path).write_bytes(b"half a safetensors file")
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(600)
safetensors.numpy.save_file = save_file
from tunix_rt.cli import main
sys.exit(main(sys.argv[2:]))
"""


def kill_while_writing(tmp_path, *argv) -> None:
    marker = tmp_path / "writing"
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WHILE_WRITING, str(marker), *map(str, argv)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, f"exited with {proc.returncode} before writing: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "never started writing"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_quantize_leaves_the_old_directory_intact_and_the_next_one_completes(model, tmp_path):
    out = tmp_path / "q"
    assert cli("quantize", "--model", model, "--format", "q8_0", "--output", out) == 0
    before = snapshot(out)
    kill_while_writing(tmp_path, "quantize", "--model", model, "--format", "int8", "--output", out, "--overwrite")
    assert snapshot(out) == before and leftovers(out)  # the killed one's staging directory is still there
    assert cli("quantize", "--model", model, "--format", "int8", "--output", out, "--overwrite") == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "int8"
    assert not leftovers(out)


def test_a_run_killed_in_its_final_save_keeps_the_old_final_and_the_next_run_completes(model, chats, tmp_path):
    out = tmp_path / "run"
    argv = ("sft", "--model", model, "--data", chats, "--output", out, *SFT)
    assert cli(*argv) == 0
    before = snapshot(out / "final")
    kill_while_writing(tmp_path, *argv, "--steps", "2")  # resumes at step 1, trains step 2, dies writing final/
    assert snapshot(out / "final") == before
    assert cli(*argv, "--steps", "2") == 0  # resumes at step 2 (its checkpoint was saved) and writes final/
    assert snapshot(out / "final") != before and not leftovers(out / "final")
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
