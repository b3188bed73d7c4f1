"""`tunix-rt sft|dpo|distill|export|plot` end to end on a tiny llama directory (tokenizer + chat template):
exit codes, metrics.jsonl, checkpoints and resume, option precedence, HF exports that our loader,
transformers and `generate` take, LoRA merging, QLoRA, every preference loss, distillation, and the one-line
errors bad inputs get.

Each training run compiles one train step; the runs are module fixtures shared by the tests, and XLA's costly
optimisation passes are off for this module (they would triple the compile time of every run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from tests.models.hf_tiny import make_tiny_model_dir
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.checkpoints.peft_adapter import load_adapter
from tunix_rt.cli import main
from tunix_rt.models.lora import LoRALinear, apply_lora, has_lora, merge_lora
from tunix_rt.models.quant_layers import QuantLinear, QuantWeight
from tunix_rt.train import run as run_module
from tunix_rt.train.metrics import read_events, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fast_compiles")]

LOG2 = math.log(2.0)
COMMON = ("max_length=64", "progress=false")  # progress bars off: stderr stays readable
TOKENS = np.random.default_rng(0).integers(3, 100, (2, 12))  # > 4 rows: quantized matmuls run exact f32 products


@contextlib.contextmanager
def logger_restored():
    """Undo what main() does to the 'tunix_rt' logger (a handler per call, its level, propagate), so handlers do
    not pile up or outlive a capsys stream, and later tests see the logger as it was."""
    logger = logging.getLogger("tunix_rt")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    try:
        yield logger
    finally:
        for h in logger.handlers[:]:
            if h not in handlers:
                logger.removeHandler(h)
        logger.setLevel(level)
        logger.propagate = propagate


def cli(*argv) -> int:
    with logger_restored():
        return main([str(a) for a in argv])


@contextlib.contextmanager
def recording_trainers():
    """Every Trainer run() builds, kept for inspection after the command returns."""
    made = []

    class Recording(run_module.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    with pytest.MonkeyPatch.context() as mp:
        for name, algorithm in run_module.ALGORITHMS.items():
            if algorithm.trainer is run_module.Trainer:
                mp.setitem(run_module.ALGORITHMS, name, dataclasses.replace(algorithm, trainer=Recording))
        yield made


def logits(model, tokens=TOKENS) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions)))


def write_jsonl(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


# --- fixtures: the tiny models and datasets ------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_data(root):
    """The three SFT row formats, short enough that packing puts several into one 64-token row."""
    rows = []
    for i in range(4):
        rows.append({"messages": [{"role": "user", "content": f"hi {i}"},
                                  {"role": "assistant", "content": f"the {i}"}]})
        rows.append({"prompt": f"the {i}", "completion": " the theme"})
        rows.append({"text": f"the theme {i}"})
    return write_jsonl(root / "sft" / "data.jsonl", rows)


@pytest.fixture(scope="module")
def dpo_strings(root):
    return write_jsonl(root / "dpo_str" / "data.jsonl",
                       [{"prompt": f"the {i}", "chosen": " the theme", "rejected": f" no {i}"} for i in range(6)])


@pytest.fixture(scope="module")
def dpo_chat(root):
    """Conversational pairs: explicit prompts, and TRL's implicit prompt (the shared first messages)."""
    user = lambda i: [{"role": "user", "content": f"hi {i}"}]
    said = lambda text: [{"role": "assistant", "content": text}]
    rows = [{"prompt": user(i), "chosen": said("the theme"), "rejected": said(f"no {i}")} for i in range(4)]
    rows += [{"chosen": user(i) + said("the"), "rejected": user(i) + said("nope")} for i in range(4, 6)]
    return write_jsonl(root / "dpo_chat" / "data.jsonl", rows)


# --- SFT: full fine-tuning -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_run(root, tiny, sft_data):
    out = root / "sft_out"
    argv = ["sft", "--model", tiny, "--data", sft_data, "--output", out, "--steps", "3", "batch_size=2", *COMMON]
    with recording_trainers() as trainers:
        assert cli(*argv) == 0
    return argv, out, trainers[0]


@pytest.mark.accelerator_path
def test_sft_writes_metrics_checkpoint_and_final(sft_run):
    _, out, trainer = sft_run
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and math.isfinite(r["grad_norm"]) for r in records)
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()] == ["3"]
    assert trainer.step == trainer.steps == 3 and not trainer.lora
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["steps"], saved["batch_size"], saved["max_length"], saved["lora_rank"]) == (3, 2, 64, 0)
    assert np.allclose(logits(load_model(out / "final").model), logits(trainer.model()), atol=1e-5)


def test_sft_final_loads_in_transformers(sft_run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, out, _ = sft_run
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(TOKENS)).logits.numpy()
    assert np.abs(theirs - logits(load_model(out / "final").model)).max() < 1e-4
    assert transformers.AutoTokenizer.from_pretrained(out / "final")("the")["input_ids"] == \
        load_model(out / "final").tokenizer.encode("the")


def test_sft_final_generates(sft_run, capsys):
    _, out, _ = sft_run
    capsys.readouterr()
    assert cli("generate", "--model", out / "final", "--prompt", "hi", "--max-tokens", "3", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_token_ids"] == load_model(out / "final").tokenizer.encode("hi")
    assert 1 <= len(result["token_ids"]) <= 3 and result["finish_reason"] in ("length", "stop")


def test_rerun_on_a_finished_run_resumes_at_the_end(sft_run, capsys):
    argv, out, _ = sft_run
    before = read_metrics(out)
    final_before = logits(load_model(out / "final").model)
    with recording_trainers() as trainers:
        assert cli(*argv) == 0
    assert trainers[0].step == 3 and trainers[0].compiles == 0  # restored at step 3: no step ran
    assert read_metrics(out) == before
    assert read_events(out)[-1] == {"step": 3, "event": "resumed", "changed": {}}
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()] == ["3"]
    assert np.array_equal(logits(load_model(out / "final").model), final_before)
    assert "resumed" in capsys.readouterr().err


def test_resume_false_refuses_a_directory_with_checkpoints(sft_run, root, capsys):
    """Orbax never saves a step at or below its latest, so restarting over old checkpoints would mix two runs."""
    argv, out, _ = sft_run
    fresh = root / "sft_restart"
    shutil.copytree(out, fresh)
    argv = [fresh if a == out else a for a in argv]
    capsys.readouterr()
    assert cli(*argv, "resume=false", "learning_rate=0.01") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    message = err.strip().splitlines()[-1]  # after the INFO lines of loading
    assert message.startswith("tunix-rt sft: error: ") and "checkpoints" in message and "step 3" in message
    assert np.array_equal(logits(load_model(fresh / "final").model), logits(load_model(out / "final").model))


# --- SFT: LoRA + packing from a YAML file; option precedence -----------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(root, tiny, sft_data):
    out = root / "lora_out"
    config = root / "lora.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tiny), "data": str(sft_data), "steps": 10, "batch_size": 4, "max_length": 64, "packing": True,
        "lora_rank": 8, "lora_alpha": 8.0, "progress": False, "shuffle": False, "seed": 3,
    }) + "learning_rate: 1e-3\n")  # YAML 1.1 reads 1e-3 as a string: the config takes it as a float
    with recording_trainers() as trainers:
        assert cli("sft", "--config", config, "--output", out, "--steps", "2", "--lora-rank", "4",
                   "learning_rate=0.005", "steps=5", "seed=7") == 0
    return out, trainers[0]


def test_flags_beat_key_value_beat_yaml(lora_run):
    out, trainer = lora_run
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["steps"] == 2 and saved["lora_rank"] == 4  # flags over key=value and YAML
    assert saved["learning_rate"] == 0.005 and saved["seed"] == 7  # key=value over YAML
    assert saved["batch_size"] == 4 and saved["packing"] is True and saved["lora_alpha"] == 8.0  # YAML
    assert saved["shuffle"] is False and saved["dequantize"] is False  # LoRA keeps a quantized base by default
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert trainer.lora and trainer.cfg.lr == 0.005


def test_packing_packs_several_examples_per_row(lora_run):
    _, trainer = lora_run
    n = trainer.objective.num_items
    assert n < 12  # 12 rows of ~10-35 tokens in 64-token rows
    idx = np.arange(n)
    batch = trainer.objective.host_batch(idx, np.ones(n, bool), trainer.objective.batch_lengths(idx))
    assert batch["segment_ids"].max() >= 2


def test_lora_final_is_the_adapter_on_its_base(lora_run, tiny, capsys):
    """A LoRA run's DIR/final is its adapter alone (no float copy of the model), which --model takes: the loader
    puts it on the base its adapter_config.json names, and that is the trainer's model."""
    out, trainer = lora_run
    model = trainer.model()
    assert has_lora(model)
    b = model.layers.locate(0)[0].attn.q_proj.lora_b[...]
    assert np.abs(np.asarray(b)).max() > 0  # the adapters trained
    assert sorted(p.name for p in (out / "final").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    final = load_model(out / "final")
    assert has_lora(final.model) and final.source == out / "final"
    assert final.tokenizer.encode("the theme") == load_model(tiny).tokenizer.encode("the theme")
    np.testing.assert_allclose(logits(final.model), logits(model), atol=1e-5)
    assert cli("generate", "--model", out / "final", "--prompt", "the", "--max-tokens", "3", "--json") == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] in ("stop", "length")


def test_an_adapter_as_model_names_a_base_that_loads(lora_run, root, capsys):
    """--model on an adapter whose base is gone, unnamed or itself an adapter: a one-line error saying so."""
    out, _ = lora_run
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    for base, message in (("/nonexistent/base", "cannot be loaded here"), ("", "names no base model"),
                          (str(out / "adapter"), "is itself an adapter")):
        bad = root / f"bad_adapter_{len(message)}"
        shutil.copytree(out / "final", bad, dirs_exist_ok=True)
        (bad / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
        assert cli("score", "--model", bad, "--text", "the theme") == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def merged_run(root, tiny, sft_data):
    out = root / "merged_out"
    assert cli("sft", "--model", tiny, "--data", sft_data, "--output", out, "--steps", "2", "--lora-rank", "4",
               "learning_rate=0.005", "save_merged=true", *COMMON) == 0
    return out


def test_save_merged_writes_the_merged_model(merged_run):
    final = load_model(merged_run / "final")
    assert not has_lora(final.model) and (merged_run / "final" / "config.json").is_file()
    on_base = load_model(merged_run / "adapter")
    assert has_lora(on_base.model)
    delta = np.abs(logits(final.model) - logits(on_base.model)).max()
    assert delta < 1e-4, f"max |delta logits| = {delta:.2e}"


def test_lora_final_loads_in_transformers(merged_run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged_run / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(TOKENS)).logits.numpy()
    assert np.abs(theirs - logits(load_model(merged_run / "final").model)).max() < 1e-4


def test_lora_run_writes_its_adapter_in_peft_layout(lora_run, tiny, capsys):
    """DIR/adapter (what --lora and serve --lora-modules take): on the base it is the trained model (ours, and HF
    peft's on the base's HF directory); `--lora` applies it in generate and score."""
    out, trainer = lora_run
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == \
        ("LORA", 4, 8.0, str(tiny))
    base = load_model(tiny).model
    load_adapter(base, out / "adapter")
    np.testing.assert_allclose(logits(base), logits(trainer.model()), atol=1e-5)
    assert cli("score", "--model", tiny, "--lora", out / "adapter", "--text", "the theme", "--json") == 0
    with_adapter = json.loads(capsys.readouterr().out)
    assert cli("score", "--model", out / "final", "--text", "the theme", "--json") == 0
    merged = json.loads(capsys.readouterr().out)
    assert with_adapter["token_ids"] == merged["token_ids"]
    np.testing.assert_allclose(with_adapter["logprobs"][1:], merged["logprobs"][1:], atol=1e-4)
    assert cli("generate", "--model", tiny, "--lora", out / "adapter", "--prompt", "the", "--max-tokens", "3",
               "--json") == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] in ("stop", "length")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
                                        out / "adapter").eval()
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.tensor(TOKENS)).logits, -1).numpy()
    assert np.abs(theirs - np.asarray(jax.nn.log_softmax(logits(trainer.model()), -1))).max() < 1e-4


def test_training_starts_from_an_adapter(lora_run, root, tiny, sft_data, capsys):
    """--lora PATH: the run trains that adapter on (its rank and alpha are the run's); at a learning rate of 1e-12
    the result is the adapter's model. A --lora-rank that differs is a one-line error; so is a missing adapter."""
    out, trainer = lora_run
    again = root / "from_adapter"
    with recording_trainers() as trainers:
        assert cli("sft", "--model", tiny, "--data", sft_data, "--output", again, "--steps", "1", "--lora",
                   out / "adapter", "learning_rate=1e-12", *COMMON) == 0
    saved = yaml.safe_load((again / "config.yaml").read_text())
    assert (saved["lora_rank"], saved["lora_alpha"], saved["lora"]) == (4, 8.0, str(out / "adapter"))
    np.testing.assert_allclose(logits(trainers[0].model()), logits(trainer.model()), atol=1e-5)
    np.testing.assert_allclose(logits(load_model(again / "final").model), logits(trainer.model()), atol=1e-4)
    capsys.readouterr()
    for extra, message in ((["--lora-rank", "2"], "lora_rank=2 differs from the rank 4"),
                           ([], "is not a peft adapter directory")):
        adapter = out / "adapter" if extra else tiny
        assert cli("sft", "--model", tiny, "--data", sft_data, "--output", root / "refused", "--lora", adapter,
                   *extra, *COMMON) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def _nonzero_adapters(model, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    for _, module in nnx.iter_modules(model):
        if isinstance(module, LoRALinear):
            module.lora_b.set_value(0.05 * jax.random.normal(next(keys), module.lora_b[...].shape))


def test_merge_lora_keeps_the_function(tiny):
    model = apply_lora(load_model(tiny).model, rank=4, alpha=8.0)
    base = logits(load_model(tiny).model)
    assert np.allclose(logits(model), base, atol=1e-6)  # B = 0: the adapters add nothing yet
    _nonzero_adapters(model)
    adapted = logits(model)
    assert np.abs(adapted - base).max() > 1e-2
    merged = merge_lora(model)
    assert not has_lora(merged) and has_lora(model)  # a copy
    assert isinstance(merged.layers.locate(1)[0].mlp.down_proj, nnx.Linear)
    delta = np.abs(logits(merged) - adapted).max()
    assert delta < 1e-4, f"max |delta logits| = {delta:.2e}"


# --- QLoRA ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(root, tiny):
    q = root / "tiny_int8"
    assert cli("quantize", "--model", tiny, "--format", "int8", "--output", q) == 0
    return q


@pytest.fixture(scope="module")
def qlora_run(root, quantized):
    data = write_jsonl(root / "qlora" / "data.jsonl", [{"prompt": "the", "completion": " the theme"}] * 4)
    out = root / "qlora_out"
    with recording_trainers() as trainers:
        assert cli("sft", "--model", quantized, "--data", data, "--output", out, "--steps", "4", "--lora-rank", "4",
                   "batch_size=2", "learning_rate=0.02", "lr_scheduler_type=constant", "save_merged=true",
                   *COMMON) == 0
    return out, trainers[0]


def _quant_leaves(model):
    return jax.tree.leaves(nnx.state(model, QuantWeight))


def test_qlora_trains_adapters_over_a_frozen_quantized_base(qlora_run, quantized):
    out, trainer = qlora_run
    curve = losses(out)
    assert len(curve) == 4 and curve[-1] < curve[0] - 0.5, curve
    model = trainer.model()
    assert isinstance(model.layers.locate(0)[0].attn.q_proj.base, QuantLinear)
    before, after = _quant_leaves(load_model(quantized).model), _quant_leaves(model)
    assert before and len(before) == len(after)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(before, after))


def test_qlora_final_exports_merged_float_weights(qlora_run):
    out, trainer = qlora_run
    final = load_model(out / "final")
    assert "quantization_config" not in json.loads((out / "final" / "config.json").read_text())
    assert not _quant_leaves(final.model) and not has_lora(final.model)
    delta = np.abs(logits(final.model) - logits(trainer.model())).max()
    assert delta < 1e-3, f"max |delta logits| = {delta:.2e}"


def test_merge_lora_of_a_quantized_base(quantized):
    model = apply_lora(load_model(quantized).model, rank=4, alpha=8.0)
    _nonzero_adapters(model, seed=1)
    merged = merge_lora(model)
    assert isinstance(merged.layers.locate(0)[0].attn.q_proj, nnx.Linear)
    delta = np.abs(logits(merged) - logits(model)).max()
    assert delta < 1e-3, f"max |delta logits| = {delta:.2e}"


def test_full_fine_tuning_of_a_quantized_model_keeps_its_reference_packed(root, quantized, dpo_strings):
    """The reference of a full fine-tune is the initial weights: for a quantized source, the packed weights as
    loaded (what the dequantized policy computes at step 1, in a fraction of an f32 copy's memory)."""
    out = root / "dpo_full_quantized"
    with recording_trainers() as trainers:
        assert cli("dpo", "--model", quantized, "--data", dpo_strings, "--output", out, "--steps", "2",
                   "batch_size=2", "learning_rate=1e-3", "precompute_ref_log_probs=false", *COMMON) == 0
    records = read_metrics(out)
    assert records[0]["loss"] == pytest.approx(LOG2, abs=1e-5)  # the reference computes the initial policy
    assert records[1]["loss"] != pytest.approx(LOG2, abs=1e-5)
    trainer = trainers[0]
    assert not trainer.lora and not _quant_leaves(trainer.model())  # the policy trains dequantized weights
    reference = jax.tree.leaves(trainer.initial_params)
    assert any(x.dtype == jnp.int8 for x in reference)
    nbytes = lambda leaves: sum(x.nbytes for x in leaves)
    assert nbytes(reference) < nbytes(jax.tree.leaves(trainer.params)) / 2


# --- DPO ------------------------------------------------------------------------------------------------------


LOSS_TYPES = {"sigmoid": (), "ipo": (), "hinge": (), "robust": ("label_smoothing=0.1",), "orpo": (), "simpo": ()}
# At step 1 with LoRA (B = 0) the policy is the reference, so the DPO margin is 0:
STEP1 = {"sigmoid": LOG2, "robust": LOG2, "hinge": 1.0, "ipo": (1 / (2 * 0.1)) ** 2}


@pytest.mark.parametrize("loss_type", [pytest.param(t, marks=pytest.mark.accelerator_path) if t == "sigmoid" else t
                                       for t in sorted(LOSS_TYPES)])
def test_dpo_loss_types_with_lora(loss_type, root, tiny, dpo_chat):
    out = root / f"dpo_{loss_type}"
    assert cli("dpo", "--model", tiny, "--data", dpo_chat, "--output", out, "--steps", "2", "--lora-rank", "4",
               "batch_size=2", f"loss_type={loss_type}", *LOSS_TYPES[loss_type], *COMMON) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            assert math.isfinite(r[key]), (key, r)
        assert 0.0 <= r["rewards/accuracies"] <= 1.0
    if loss_type in STEP1:
        assert records[0]["loss"] == pytest.approx(STEP1[loss_type], rel=1e-6, abs=1e-6)
        assert records[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-7)
    assert (out / "final" / "adapter_config.json").is_file()


def test_dpo_full_fine_tuning_reference_is_the_initial_weights(root, tiny, dpo_strings):
    out = root / "dpo_full"
    with recording_trainers() as trainers:
        assert cli("dpo", "--model", tiny, "--data", dpo_strings, "--output", out, "--steps", "2", "batch_size=2",
                   "learning_rate=1e-3", *COMMON) == 0
    records = read_metrics(out)
    assert records[0]["loss"] == pytest.approx(LOG2, abs=1e-5)
    assert records[1]["loss"] != pytest.approx(LOG2, abs=1e-5)  # the policy moved away from the reference
    # The reference's log-probs were precomputed from the initial weights, then their copy was freed.
    assert not trainers[0].lora and trainers[0].objective.ref_logps is not None and trainers[0].initial_params is None


def test_dpo_precomputed_reference_equals_the_in_step_one(root, tiny, dpo_strings):
    """precompute_ref_log_probs (the default) scores every pair once before training; the in-step reference
    forward gives the same losses, and the precomputed table holds the reference's sums."""
    runs = {}
    for precompute in (True, False):
        out = root / f"dpo_precompute_{precompute}"
        with recording_trainers() as trainers:
            assert cli("dpo", "--model", tiny, "--data", dpo_strings, "--output", out, "--steps", "3", "--lora-rank",
                       "4", "batch_size=2", "learning_rate=1e-2", f"precompute_ref_log_probs={str(precompute).lower()}",
                       *COMMON) == 0
        runs[precompute] = (losses(out), trainers[0].objective)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    assert runs[True][0][0] == pytest.approx(LOG2, abs=1e-5) and runs[True][0][2] != pytest.approx(LOG2, abs=1e-3)
    table, objective = runs[True][1].ref_logps, runs[True][1]
    assert table.shape == (objective.num_items, 2) and (table < 0).all()
    assert runs[False][1].ref_logps is None


def test_dpo_with_an_explicit_ref_model(root, tiny, dpo_strings):
    out = root / "dpo_ref"
    with recording_trainers() as trainers:
        assert cli("dpo", "--model", tiny, "--data", dpo_strings, "--output", out, "--steps", "2", "--lora-rank", "4",
                   "batch_size=2", f"ref_model={tiny}", *COMMON) == 0
    assert read_metrics(out)[0]["loss"] == pytest.approx(LOG2, abs=1e-5)
    assert trainers[0].objective.ref is not None and not trainers[0].objective.needs_reference


# --- distillation ------------------------------------------------------------------------------------------------


def test_distill_top_k_from_a_second_model(root, tiny, teacher, sft_data, sft_run):
    out = root / "distill"
    assert cli("distill", "--model", tiny, "--teacher", teacher, "--data", sft_data, "--output", out, "--steps", "2",
               "batch_size=2", "alpha=0.5", "temperature=2.0", "top_k=5", *COMMON) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["kd"] > 0 for r in records)
    first = records[0]
    assert first["loss"] == pytest.approx(0.5 * first["kd"] + 0.5 * first["ce"], rel=1e-5)
    # The CE half is SFT's loss: same data, seed and batch at step 1 as the SFT run.
    assert first["ce"] == pytest.approx(read_metrics(sft_run[1])[0]["loss"], rel=1e-5)
    assert (out / "final" / "config.json").is_file()


def test_distill_from_itself_has_zero_kl(root, tiny, sft_data):
    out = root / "distill_self"
    assert cli("distill", "--model", tiny, "--teacher", tiny, "--data", sft_data, "--output", out, "--steps", "2",
               "batch_size=2", "alpha=1.0", *COMMON) == 0
    first = read_metrics(out)[0]
    assert first["loss"] == pytest.approx(0.0, abs=1e-5) and first["kd"] == pytest.approx(0.0, abs=1e-5)
    assert first["grad_norm"] < 1e-3


def test_distill_teacher_with_another_vocabulary(root, tiny, sft_data, capsys):
    other = root / "teacher_v128"
    make_tiny_model_dir(other, vocab_size=128)
    capsys.readouterr()
    assert cli("distill", "--model", tiny, "--teacher", other, "--data", sft_data, "--output", root / "distill_bad",
               "--steps", "1", "batch_size=2", *COMMON) == 2
    err = capsys.readouterr().err
    assert err.startswith("tunix-rt distill: error: ") and "Traceback" not in err
    assert "vocabulary" in err and "128" in err and "256" in err


# --- bad inputs: exit 2, one line, no traceback -------------------------------------------------------------------


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tunix-rt {command}: error: "), err
    return lines[0]


SFT_ROWS_OK = [{"text": "the"}]
BAD_DATA = {  # rows -> what the message must say besides data.jsonl:LINE
    "missing_field": (SFT_ROWS_OK + [{"prompt": "the"}], 2, ['"completion"', "missing"]),
    "wrong_type": (SFT_ROWS_OK * 2 + [{"text": 5}], 3, ['"text"', "string", "int"]),
    "invalid_json": (SFT_ROWS_OK + ['{"text": "the"'], 2, ["invalid JSON"]),
    "not_an_object": (SFT_ROWS_OK + ['["the"]'], 2, ["JSON object"]),
    "bad_role": ([{"messages": [{"role": "robot", "content": "hi"}]}], 1, ['"messages[0].role"', "robot"]),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_sft_rows(case, tmp_path, tiny, capsys):
    rows, line, words = BAD_DATA[case]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    capsys.readouterr()
    assert cli("sft", "--model", tiny, "--data", data, "--output", tmp_path / "out", "batch_size=2", *COMMON) == 2
    message = _one_line_error(capsys, "sft")
    assert f"data.jsonl:{line}:" in message
    for word in words:
        assert word in message, message


def test_bad_dpo_row(tmp_path, tiny, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                                 {"prompt": "a", "chosen": "b"}])
    capsys.readouterr()
    assert cli("dpo", "--model", tiny, "--data", data, "--output", tmp_path / "out", *COMMON) == 2
    message = _one_line_error(capsys, "dpo")
    assert "data.jsonl:2:" in message and '"rejected"' in message


BAD_OPTIONS = {  # extra argv -> words the message must hold
    "unknown_option": (["learning_rat=1e-4"], ["unknown option(s) learning_rat", "valid:", "learning_rate",
                                               "batch_size"]),
    "bad_float": (["learning_rate=abc"], ["learning_rate", "float", "'abc'"]),
    "bad_int": (["batch_size=1.5"], ["batch_size", "int", "1.5"]),
    "batch_size_zero": (["batch_size=0"], ["batch_size must be a positive integer"]),
    "batch_size_negative": (["batch_size=-2"], ["batch_size must be a positive integer"]),
    "steps_zero": (["--steps", "0"], ["steps must be a positive integer"]),
    "not_key_value": (["learning_rate"], ["key=value"]),
    "bad_schedule": (["lr_scheduler_type=triangle"], ["lr_scheduler_type", "cosine"]),
    "bad_lora_target": (["--lora-rank", "2", "lora_targets=[q_proj,qq_proj]"], ["lora_targets", "q_proj"]),
    "missing_config_file": (["--config", "/nonexistent/run.yaml"], ["cannot read config file"]),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_options(case, tmp_path, tiny, sft_data, capsys):
    extra, words = BAD_OPTIONS[case]
    capsys.readouterr()
    assert cli("sft", "--model", tiny, "--data", sft_data, "--output", tmp_path / "out", *extra, *COMMON) == 2
    message = _one_line_error(capsys, "sft")
    for word in words:
        assert word in message, message


def test_missing_data(tmp_path, tiny, capsys):
    assert cli("sft", "--model", tiny, "--output", tmp_path / "out") == 2
    assert "missing required option(s): data" in _one_line_error(capsys, "sft")
    assert cli("sft", "--model", tiny, "--data", tmp_path / "nope.jsonl", "--output", tmp_path / "out", *COMMON) == 2
    assert "nope.jsonl" in _one_line_error(capsys, "sft")


def test_distill_needs_a_teacher(tmp_path, tiny, sft_data, capsys):
    assert cli("distill", "--model", tiny, "--data", sft_data, "--output", tmp_path / "out") == 2
    assert "missing required option(s): teacher" in _one_line_error(capsys, "distill")


def test_nonexistent_model(tmp_path, sft_data, capsys):
    assert cli("sft", "--model", tmp_path / "no_model", "--data", sft_data, "--output", tmp_path / "out", *COMMON) == 2
    assert "no_model" in _one_line_error(capsys, "sft")
    assert cli("dpo", "--model", tmp_path, "--data", sft_data, "--output", tmp_path / "out2", *COMMON) == 2
    assert "config.json" in _one_line_error(capsys, "dpo")


def test_unknown_loss_type(tmp_path, tiny, dpo_strings, capsys):
    assert cli("dpo", "--model", tiny, "--data", dpo_strings, "--output", tmp_path / "out", "loss_type=kto",
               *COMMON) == 2
    message = _one_line_error(capsys, "dpo")
    assert "kto" in message and "sigmoid" in message


def test_bad_preference_options_fail_before_the_model_loads(tmp_path, dpo_strings, capsys):
    """The loss's options are checked with the config: a model path that does not exist is never reached."""
    capsys.readouterr()
    for extra, word in ((["loss_type=kto"], "kto"), (["beta=0"], "beta"),
                        (["loss_type=robust", "label_smoothing=0.7"], "label_smoothing")):
        assert cli("dpo", "--model", tmp_path / "no_model", "--data", dpo_strings, "--output", tmp_path / "out",
                   *extra, *COMMON) == 2
        message = _one_line_error(capsys, "dpo")
        assert word in message and "no_model" not in message, message
    assert not (tmp_path / "out").exists()


def test_output_that_is_a_file(tmp_path, tiny, sft_data, capsys):
    (tmp_path / "taken").write_text("mine")
    capsys.readouterr()
    assert cli("sft", "--model", tiny, "--data", sft_data, "--output", tmp_path / "taken", *COMMON) == 2
    assert "taken" in _one_line_error(capsys, "sft")


# --- export and plot ------------------------------------------------------------------------------------------


def test_export_round_trips(tiny, tmp_path):
    assert cli("export", "--model", tiny, "--output", tmp_path / "x") == 0
    first, again = load_model(tiny), load_model(tmp_path / "x")
    assert np.array_equal(logits(again.model), logits(first.model))
    assert again.tokenizer.encode("the theme") == first.tokenizer.encode("the theme")
    assert again.tokenizer.chat_template == first.tokenizer.chat_template


def test_export_of_a_quantized_dir_is_float(quantized, tmp_path):
    assert cli("export", "--model", quantized, "--output", tmp_path / "x") == 0
    again = load_model(tmp_path / "x")
    assert not _quant_leaves(again.model)
    assert np.abs(logits(again.model) - logits(load_model(quantized).model)).max() < 1e-4


def test_export_into_a_non_empty_directory(tiny, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert cli("export", "--model", tiny, "--output", tmp_path) == 2
    assert "non-empty directory" in _one_line_error(capsys, "export")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_plot(sft_run, tmp_path, capsys):
    _, out, _ = sft_run
    assert cli("plot", out) == 0
    png = (out / "metrics.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    assert cli("plot", out, "--metrics", "loss", "grad_norm", "--output", tmp_path / "two.png") == 0
    assert (tmp_path / "two.png").read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()
    assert cli("plot", out, "--metrics", "loss", "accuracy") == 2
    message = _one_line_error(capsys, "plot")
    assert "accuracy" in message and "loss" in message  # names the unknown one, lists the available
    assert cli("plot", tmp_path) == 2
    assert "metrics.jsonl" in _one_line_error(capsys, "plot")


# --- main() called more than once in a process ---------------------------------------------------------------------


def test_main_does_not_pile_up_log_handlers(tmp_path):
    with logger_restored() as logger:
        before = len(logger.handlers)
        for _ in range(3):
            main(["plot", str(tmp_path)])
        assert len(logger.handlers) <= before + 1
