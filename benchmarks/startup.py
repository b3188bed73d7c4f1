"""First result: how long each command takes before its first token or first step, with an empty compilation
cache (cold) and with the cache the first run filled (warm), beside llama.cpp's load + first token on the same
GGUF, in one run.

Usage: python benchmarks/startup.py [--models default,1b] [--parts generate,serve,train] [--steps 5]
                                    [--repeats 3] [--llama-python PATH]

For each model: `tunix-rt generate --max-tokens 16` as a whole process (wall seconds), and a driver process
that times import, load, the first streamed token and the 16th (compile included); `tunix-rt serve` until
/health answers 200 (generate and llama.cpp: medians of --repeats runs, each cold one with a cache directory of
its own); `sft` (LoRA r8, examples/fact_sft.jsonl), `dpo` (pairs made from it) and `grpo`
(examples/arithmetic_grpo.jsonl) for --steps steps: step 1 against the median of the later steps, whose
difference is the step's compile. Every process starts with the cache directory it is given (cold: a new
empty one) and prints its peak RSS.
The 1B model is Llama-3.2-1B-shaped (16 layers, vocabulary 128,256, tied embeddings), random bf16 weights
written here, the default model's tokenizer. llama.cpp runs in --llama-python's interpreter (one with
llama-cpp-python installed; default: this one), on the default GGUF only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128_256, hidden_size=2048,
                intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=True,
                max_position_embeddings=131_072, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=1,
                eos_token_id=2)

DRIVER = """
import json, resource, sys, time
t0 = time.perf_counter()
from tunix_rt.engine.compile_cache import use_compile_cache
use_compile_cache(sys.argv[2])
from tunix_rt import Engine
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.engine.params import SamplingParams
t1 = time.perf_counter()
loaded = load_model(sys.argv[1])
t2 = time.perf_counter()
ids = loaded.tokenizer.encode(sys.argv[3])
engine = Engine(loaded.model, loaded.tokenizer, max_model_len=len(ids) + 16, max_num_seqs=1)
first = None
for out in engine.stream(ids, SamplingParams(max_tokens=16, temperature=0.0)):
    first = first or time.perf_counter()
t3 = time.perf_counter()
print(json.dumps(dict(imports=t1 - t0, load=t2 - t1, first_token=first - t2, all_16=t3 - t2,
                      rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)))
"""

LLAMA_DRIVER = """
import json, resource, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
t1 = time.perf_counter()
out = llm.create_completion(sys.argv[2], max_tokens=16, temperature=0.0)
t2 = time.perf_counter()
print(json.dumps(dict(load=t1 - t0, generate_16=t2 - t1, rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)))
"""


def _run(cmd: list[str], timeout: int = 1800, **kw) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc


def _json(proc) -> dict:
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def _tunix_rt() -> list[str]:
    """The `tunix-rt` console script of this interpreter's environment, as a user runs it (`python -m tunix_rt`,
    the same entry, where the script is not installed)."""
    script = Path(sys.executable).parent / "tunix-rt"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "tunix_rt"]


def _byte_compile() -> None:
    """Byte-compile tunix_rt (and the server) as pip does when it installs the wheel, so that a source checkout,
    or an environment with PYTHONDONTWRITEBYTECODE set, measures the start of what users install rather than
    ~0.1 s of compiling our modules' source on every run."""
    import compileall
    import importlib.util

    for package in ("tunix_rt", "serving"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                compileall.compile_dir(location, quiet=1)


def _cli(*args: str) -> list[str]:
    return ["/usr/bin/time", "-f", "RSS_KB %M", *_tunix_rt(), "-v", *args]


def _rss(proc) -> float:
    return int(re.findall(r"RSS_KB (\d+)", proc.stderr)[-1]) / 1e6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def generate(model: str, caches: list[Path]) -> dict:
    """Medians over one run per cache directory (cold: each a new empty one; warm: each the one a cold run filled)."""
    runs = []
    for cache in caches:
        wall, proc = _run(_cli("generate", "--model", model, "--prompt", PROMPT, "--max-tokens", "16",
                               "--compile-cache-dir", str(cache)))
        stats = re.search(r"compilation cache: (\d+) of (\d+) programs loaded, \d+ compiled; program store: (\d+) "
                          r"programs loaded whole", proc.stderr)
        _, driver = _run([sys.executable, "-c", DRIVER, model, str(cache) + "-driver", PROMPT])
        runs.append(dict(process=wall, rss_gb=_rss(proc), programs=int(stats.group(2)) + int(stats.group(3)),
                         loaded=int(stats.group(1)) + int(stats.group(3)),
                         **{f"driver_{k}": v for k, v in _json(driver).items()}))
    return _medians(runs)


def serve(model: str, cache: Path) -> dict:
    import urllib.error
    import urllib.request

    port = _free_port()
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([*_tunix_rt(), "-v", "serve", "--model", model, "--port", str(port),
                                 "--compile-cache-dir", str(cache)], stdout=log, stderr=subprocess.STDOUT)
        ready = None
        try:
            while time.perf_counter() - start < 900 and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                        if response.status == 200:
                            ready = time.perf_counter() - start
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        if ready is None:
            log.seek(0)
            sys.exit(f"serve did not come up:\n{log.read()[-3000:]}")
        log.seek(0)
        compiled = re.findall(r"compiled (\d+) engine step programs", log.read())
    return dict(health=ready, programs=int(compiled[-1]) if compiled else 0)


def _dpo_data(path: Path) -> Path:
    rows = [json.loads(line) for line in (ROOT / "examples" / "fact_sft.jsonl").read_text().splitlines()]
    with path.open("w") as f:
        for row in rows:
            if "messages" not in row:  # the file's prompt/completion rows
                continue
            user, answer = row["messages"][0]["content"], row["messages"][1]["content"]
            f.write(json.dumps({"prompt": [{"role": "user", "content": user}],
                                "chosen": [{"role": "assistant", "content": answer}],
                                "rejected": [{"role": "assistant", "content": "I do not know."}]}) + "\n")
    return path


def train(command: str, model: str, cache: Path, steps: int, work: Path) -> dict:
    data = {"sft": ROOT / "examples" / "fact_sft.jsonl", "dpo": _dpo_data(work / "pairs.jsonl"),
            "grpo": ROOT / "examples" / "arithmetic_grpo.jsonl"}[command]
    out = work / f"{command}-run"
    shutil.rmtree(out, ignore_errors=True)
    extra = ["--reward", "math"] if command == "grpo" else []
    wall, proc = _run(_cli(command, "--model", model, "--data", str(data), "--output", str(out), "--steps",
                           str(steps), "--lora-rank", "8", "--compile-cache-dir", str(cache), *extra))
    times = [json.loads(line)["step_time"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"step_time"' in line]
    steady = statistics.median(times[1:]) if len(times) > 1 else float("nan")
    return dict(process=wall, step1=times[0], steady=steady, ratio=times[0] / steady, rss_gb=_rss(proc))


def write_random_weights(config: dict, directory: Path) -> Path:
    """An HF directory's config.json and random bf16 safetensors (N(0, 0.02) matrices, unit norms) for a
    Llama-shaped `config`; the tokenizer is the caller's."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    c = config
    h, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv, d = c["num_key_value_heads"], c["head_dim"]
    rng = np.random.default_rng(0)
    rand = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    tensors = {"model.embed_tokens.weight": rand(c["vocab_size"], h), "model.norm.weight": np.ones(h, ml_dtypes.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
                        p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d),
                        p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                        p + "mlp.down_proj.weight": rand(h, inter),
                        p + "input_layernorm.weight": np.ones(h, ml_dtypes.bfloat16),
                        p + "post_attention_layernorm.weight": np.ones(h, ml_dtypes.bfloat16)})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(c))
    return directory


def make_1b(directory: Path) -> Path:
    """A Llama-3.2-1B-shaped HF directory with random bf16 weights and the default model's tokenizer."""
    from tunix_rt.checkpoints import default_model
    from tunix_rt.checkpoints.gguf_loader import open_gguf
    from tunix_rt.checkpoints.tokenizer import Tokenizer

    write_random_weights(LLAMA_1B, directory)
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model.default_model_path()))
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": tokenizer.bos_token,
                                                                 "eos_token": tokenizer.eos_token}))
    return directory


def llama_cpp(python: str, repeats: int) -> dict | None:
    from tunix_rt.checkpoints import default_model

    proc = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True)
    if proc.returncode:
        return None
    runs = []
    for _ in range(repeats):
        wall, proc = _run([python, "-c", LLAMA_DRIVER, str(default_model.default_model_path()), PROMPT])
        runs.append({"process": wall, **_json(proc)})
    return _medians(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="default,1b")
    parser.add_argument("--parts", default="generate,serve,train")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="generate and llama.cpp runs per figure (medians)")
    parser.add_argument("--llama-python", default=sys.executable)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print(f"host: {os.cpu_count()} cores", flush=True)
    _byte_compile()
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        work = Path(tmp)
        peer = llama_cpp(args.llama_python, args.repeats) if "generate" in parts else None
        if peer:
            print(f"llama.cpp (llama-cpp-python), default GGUF: whole process {peer['process']:.2f} s (load "
                  f"{peer['load']:.2f} s, 16 tokens {peer['generate_16']:.2f} s), peak RSS {peer['rss_gb']:.2f} GB",
                  flush=True)
        elif "generate" in parts:
            print("llama.cpp: llama-cpp-python not importable by --llama-python: no peer figures", flush=True)
        for name in args.models.split(","):
            model = "default" if name == "default" else str(make_1b(work / "llama-1b"))
            print(f"\n== {name}", flush=True)
            caches = [work / f"{name}-cache-{i}" for i in range(args.repeats)]
            for run in ("cold", "warm"):
                cache = caches[0]
                if "generate" in parts:
                    g = generate(model, caches)
                    ratio = f" = {g['process'] / peer['process']:.1f}x llama.cpp" if peer and name == "default" else ""
                    print(f"generate {run}: whole process {g['process']:.1f} s{ratio}, peak RSS {g['rss_gb']:.2f} GB, "
                          f"{g['loaded']} of {g['programs']} programs from the cache | driver: import "
                          f"{g['driver_imports']:.1f} s, load {g['driver_load']:.1f} s, first token "
                          f"{g['driver_first_token']:.1f} s, 16 tokens {g['driver_all_16']:.1f} s", flush=True)
                if "serve" in parts:
                    s = serve(model, Path(str(cache) + "-serve"))
                    print(f"serve {run}: /health 200 after {s['health']:.1f} s ({s['programs']} programs compiled "
                          f"before)", flush=True)
            if "train" in parts:
                for command in ("sft", "dpo", "grpo") if name == "default" else ("sft",):
                    t = train(command, model, work / f"{name}-{command}-cache", args.steps, work)
                    print(f"{command} (cold cache): step 1 {t['step1']:.1f} s, steady {t['steady']:.2f} s/step "
                          f"({t['ratio']:.1f}x), step-1 compile ~{t['step1'] - t['steady']:.1f} s, whole process "
                          f"{t['process']:.1f} s, peak RSS {t['rss_gb']:.2f} GB", flush=True)
    print(f"\npeak RSS of this driver {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
