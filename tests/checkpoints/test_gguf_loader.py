"""GGUF import checked against transformers' own GGUF loader, for every dense family.

Each tiny HF model (tests/models/hf_tiny.py) is written to a GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes it -- gguf-py's tensor names and metadata keys, Llama's Q/K row
permutation, Gemma's norm weights stored +1 -- and that one file is loaded twice: by our
`load_model` and by `transformers.AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, whose
GGUF loader (transformers/modeling_gguf_pytorch_utils.py) undoes those conventions with its own code.
Both must give the same weights (bit for bit, quantized tensors included) and the same teacher-forced
log-probs; the F32 files must also reproduce the original HF model.
"""

from __future__ import annotations

import math
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models import hf_tiny
from tunix_rt.checkpoints import gguf_loader
from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.models.decoder import record_router_logits
from tunix_rt.models.quant_layers import QuantLinear
from tunix_rt.ops import QuantizedTensor, dequantize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SEQ = 40  # longer than the Gemma sliding window (8)
TOL = 1e-4
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3"}
# MoE families: transformers' GGUF loader reads no expert sizes from these files, so they are checked
# against the original HF model instead.
MOE_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}

# hf_tiny's configs, adjusted only where a GGUF file cannot say what the HF config says:
# - llama: rope_type llama3 becomes a `rope_freqs.weight` tensor in llama.cpp, which transformers' GGUF loader
#   drops (ours reads it: tested below); linear scaling has metadata keys (rope.scaling.type / .factor).
# - gemma2: llama.cpp has no key for query_pre_attn_scalar; it scales queries by head_dim ** -0.5
#   (n_embd / n_head for the 27B), so the model must use query_pre_attn_scalar == head_dim.
GGUF_FAMILIES = {
    **{family: cfg for family, cfg in hf_tiny.FAMILIES.items() if family in GGUF_ARCH},
    "llama": {**hf_tiny.FAMILIES["llama"], "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "gemma2": {**hf_tiny.FAMILIES["gemma2"], "query_pre_attn_scalar": 16},
}


def _make_hf_model(family, out_dir, families=GGUF_FAMILIES):
    with mock.patch.dict(hf_tiny.FAMILIES, {family: families[family]}):
        return hf_tiny.make_hf_model(family, out_dir)


# --- a GGUF writer following llama.cpp's convert_hf_to_gguf.py ---------------------------------------


def _byte_vocab() -> list[str]:
    """GPT-2's byte -> printable-character map: a byte-level BPE vocabulary of exactly 256 tokens."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's rotate-half Q/K rows -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_source_tensors(hf):
    """(HF name, float32 array) as llama.cpp's converter sees them: experts stacked per projection
    (transformers 5 holds gate and up fused), the shared-expert gate as llama.cpp's 1-D (hidden,)."""
    for hf_name, tensor in hf.state_dict().items():
        data = tensor.detach().float().numpy().copy()
        if hf_name.endswith("mlp.experts.gate_up_proj"):
            half = data.shape[1] // 2
            yield hf_name.replace("gate_up_proj", "gate_proj.weight"), data[:, :half]
            yield hf_name.replace("gate_up_proj", "up_proj.weight"), data[:, half:]
        elif hf_name.endswith("mlp.experts.down_proj"):
            yield hf_name + ".weight", data
        elif hf_name.endswith("shared_expert_gate.weight"):
            yield hf_name, data[0]
        else:
            yield hf_name, data


def write_gguf(hf, path, qtype=None):
    """Write `hf` as llama.cpp would; 2-D weights quantized to `qtype` (a GGMLQuantizationType) if given."""
    cfg = hf.config
    family = cfg.model_type
    arch = {**GGUF_ARCH, **MOE_GGUF_ARCH}[family]
    rope = cfg.rope_parameters
    full_rope = rope.get("full_attention", rope)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is not None:  # TextModel.set_gguf_parameters writes these only when config.json has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch != "gemma2":  # Gemma2Model.set_gguf_parameters writes no rope base (llama.cpp's default 10000)
        w.add_rope_freq_base(full_rope["rope_theta"])
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim or cfg.hidden_size // cfg.num_attention_heads)
    if full_rope.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full_rope["factor"])
    elif full_rope.get("rope_type", "default") == "yarn":  # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full_rope["factor"])
        w.add_rope_scaling_orig_ctx_len(full_rope["original_max_position_embeddings"])
    elif full_rope.get("rope_type", "default") == "llama3":  # LlamaModel.generate_extra_tensors
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    elif full_rope.get("rope_type", "default") != "default":
        raise NotImplementedError(full_rope)
    if family in MOE_GGUF_ARCH:
        w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if "sliding_attention" in rope:  # TextModel.set_gguf_parameters: the sliding layers' own base
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3" and cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is None else gguf.LlamaFileType[f"MOSTLY_{qtype.name}"])
    # A minimal byte-level BPE tokenizer the size of the model's vocabulary (tokenizers are tested elsewhere):
    # one token per byte, except that DEL's slot holds "ab" so that there is one merge to list -- the writer
    # drops an empty merges array, and our byte-level tokenizer requires one.
    tokens = _byte_vocab()
    tokens[0x7F] = "ab"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    for hf_name, data in _gguf_source_tensors(hf):
        if hf_name == "lm_head.weight" and (cfg.tie_word_embeddings or arch.startswith("gemma")):
            continue  # tied: the safetensors file has no lm_head (and llama.cpp skips Gemma's anyway)
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, cfg.num_key_value_heads)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if qtype is not None and data.ndim in (2, 3) and data.shape[-1] % 32 == 0:  # else F32, as llama.cpp falls back
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama3_rope_factors(cfg) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: llama3 rope scaling as per-frequency factors (`rope_freqs.weight`)."""
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.asarray(factors, dtype=np.float32)


# --- the reference: transformers' GGUF loader ----------------------------------------------------------


def _transformers_from_gguf(path):
    """transformers' model of the GGUF file, in float32.

    Its GGUF config mapping (transformers/integrations/ggml.py) leaves some keys unread, falling back to
    the config class defaults; those few are filled in here from the file's metadata, as llama.cpp reads
    them. Everything else -- the other config fields and every weight -- is transformers' own reading.
    """
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()

    def meta(key, default=None):
        f = reader.fields.get(f"{arch}.{key}")
        return default if f is None else f.contents()

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if arch == "qwen3":  # no attention.key_length mapping for qwen3: Qwen3Config's default head_dim is 128
        config.head_dim = meta("attention.key_length")
    if arch == "llama" and meta("rope.scaling.type") == "linear":  # rope.scaling.* are not mapped for llama
        config.rope_parameters = {**config.rope_parameters, "rope_type": "linear",
                                  "factor": meta("rope.scaling.factor")}
    if meta("rope.scaling.type") == "yarn":  # rope.scaling.* are not mapped
        config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": meta("rope.scaling.factor"),
                                  "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
    if arch.startswith("gemma"):  # no GGUF key: llama.cpp uses head_dim (these are not 27B models)
        config.query_pre_attn_scalar = config.head_dim
    if arch == "gemma2":  # softcapping keys are not mapped: Gemma2Config's defaults are 50 and 30
        config.attn_logit_softcapping = meta("attn_logit_softcapping")
        config.final_logit_softcapping = meta("final_logit_softcapping")
    if arch == "gemma3":  # rope.freq_base_swa is not mapped: Gemma3TextConfig's default local base is 10000
        config.rope_parameters["sliding_attention"]["rope_theta"] = meta("rope.freq_base_swa")
        config.final_logit_softcapping = meta("final_logit_softcapping")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()


# --- fixtures ------------------------------------------------------------------------------------------


class Case:
    def __init__(self, family, hf, path):
        self.family, self.hf, self.path = family, hf, path
        self.ref = _transformers_from_gguf(path)
        self.ours = load_model(path)


@pytest.fixture(scope="module", params=sorted(GGUF_FAMILIES))
def f32(request, tmp_path_factory):
    """Each family as an F32 GGUF file (lossless), loaded by us and by transformers."""
    family = request.param
    out = tmp_path_factory.mktemp(f"gguf-{family}")
    hf = _make_hf_model(family, out / "hf")
    write_gguf(hf, out / f"{family}.gguf")
    return Case(family, hf, out / f"{family}.gguf")


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0"])
def quantized(request, tmp_path_factory):
    """Llama with every 2-D weight quantized (the Q/K permutation applied before quantizing, as llama.cpp does)."""
    qtype = gguf.GGMLQuantizationType[request.param]
    out = tmp_path_factory.mktemp(f"gguf-llama-{request.param}")
    hf = _make_hf_model("llama", out / "hf")
    write_gguf(hf, out / f"llama-{request.param}.gguf", qtype)
    return Case("llama", hf, out / f"llama-{request.param}.gguf"), qtype


# --- helpers -------------------------------------------------------------------------------------------


def _tokens(seed=1):
    return np.random.default_rng(seed).integers(0, 256, (2, SEQ))


def _next_logprobs(logits, tokens):
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1))
    return np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]


def _ours_logprobs(case, tokens):
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return _next_logprobs(case.ours.model(jnp.asarray(tokens), jnp.asarray(positions)), tokens)


def _torch_logprobs(model, tokens):
    with torch.no_grad():
        return _next_logprobs(model(torch.tensor(tokens)).logits.float().numpy(), tokens)


def _our_tensors(case, keep_quantized=False):
    reader = gguf_loader.open_gguf(case.path)
    return dict(gguf_loader.iter_tensors(reader, gguf_loader.hf_config(reader), keep_quantized=keep_quantized))


# --- tests ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(MOE_GGUF_ARCH))
def moe_gguf(request, tmp_path_factory):
    family = request.param
    out = tmp_path_factory.mktemp(f"gguf-{family}")
    # llama.cpp's qwen2moe has no dense-layer tensors (mlp_only_layers): every layer routed here
    hf = hf_tiny.make_hf_model(family, out / "hf", **({"mlp_only_layers": []} if family == "qwen2_moe" else {}))
    write_gguf(hf, out / f"{family}.gguf")
    write_gguf(hf, out / f"{family}-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    return family, hf, out


@pytest.mark.slow
def test_moe_gguf_reproduces_the_hf_model(moe_gguf):
    """Stacked ffn_*_exps, the router (ffn_gate_inp), Qwen2-MoE's shared expert with its 1-D gate,
    Mixtral as a llama file with experts."""
    family, hf, out = moe_gguf
    case = Case.__new__(Case)
    case.ours = load_model(out / f"{family}.gguf")
    cfg = case.ours.model.config
    assert cfg.architecture == family and cfg.num_experts == (getattr(hf.config, "num_experts", None)
                                                             or hf.config.num_local_experts)
    assert all(cfg.moe_layers) and cfg.norm_topk_prob == (family != "qwen2_moe")
    tokens = _tokens(3)
    delta = np.abs(_ours_logprobs(case, tokens) - _torch_logprobs(hf, tokens)).max()
    print(f"\n{family} F32 GGUF: max |delta log p| vs original HF model = {delta:.2e}")
    assert delta <= TOL, f"{family}: max |delta log p| = {delta:.2e}"


def test_moe_gguf_quantized_experts_dequantize_as_ggml(moe_gguf):
    """Q8_0 experts (3-D) are dequantized on load with gguf.quants, bit for bit."""
    family, hf, out = moe_gguf
    reader = gguf_loader.open_gguf(out / f"{family}-q8.gguf")
    ours = dict(gguf_loader.iter_tensors(reader, gguf_loader.hf_config(reader)))
    checked = 0
    for t in reader.tensors:
        if t.name.endswith("_exps.weight"):
            base = f"model.layers.{t.name.split('.')[1]}.mlp.experts.{t.name.split('.')[2][4:-5]}_proj.weight"
            want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            np.testing.assert_array_equal(ours[base], want)
            checked += 1
    assert checked == 3 * sum(1 for name in ours if name.endswith("mlp.gate.weight"))
    # the 2-D weights kept quantized (router included) compute what the dequantized file does
    tokens = _tokens(5)
    positions = jnp.asarray(np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape))
    kept, flat = (load_model(out / f"{family}-q8.gguf", dequantize=d).model for d in (False, True))
    assert isinstance(kept.layers.locate(0)[0].mlp.router, QuantLinear)
    # Rounding-level differences must not flip an expert choice: the tokens keep every router's k-th and
    # (k+1)-th logits apart (a near-tie, as _tokens(4) makes in Mixtral's first layer, would turn
    # 1e-7 of f32 noise into a different expert).
    record_router_logits(flat)
    _, recorded = nnx.capture(lambda m: m(jnp.asarray(tokens), positions), nnx.Intermediate)(flat)
    record_router_logits(flat, False)
    k = flat.config.num_experts_per_tok
    for logits in jax.tree.leaves(recorded):
        top = np.sort(np.asarray(logits), -1)[:, ::-1]
        assert (top[:, k - 1] - top[:, k]).min() > 1e-5
    got, want = (_next_logprobs(m(jnp.asarray(tokens), positions), tokens) for m in (kept, flat))
    assert np.abs(got - want).max() <= TOL


def test_logprobs_match_transformers_gguf_loader(f32):
    tokens = _tokens()
    delta = np.abs(_ours_logprobs(f32, tokens) - _torch_logprobs(f32.ref, tokens)).max()
    print(f"\n{f32.family} F32: max |delta log p| vs transformers GGUF = {delta:.2e}")
    assert delta <= TOL, f"{f32.family}: max |delta log p| = {delta:.2e}"


def test_f32_file_reproduces_the_original_hf_model(f32):
    """The writer and our loader's inverse transforms cancel: the F32 file is the HF model again."""
    tokens = _tokens(2)
    delta = np.abs(_ours_logprobs(f32, tokens) - _torch_logprobs(f32.hf, tokens)).max()
    print(f"\n{f32.family} F32: max |delta log p| vs original HF model = {delta:.2e}")
    assert delta <= TOL, f"{f32.family}: max |delta log p| = {delta:.2e}"


def test_tensors_equal_transformers_gguf_loader(f32):
    """Same names, same layout, same values, bit for bit (Q/K un-permuted, Gemma norms -1)."""
    ours, ref = _our_tensors(f32), f32.ref.state_dict()
    expected = set(ref) - ({"lm_head.weight"} if f32.ref.config.tie_word_embeddings else set())
    assert set(ours) == expected
    for name, array in ours.items():
        np.testing.assert_array_equal(array, ref[name].numpy(), err_msg=name)


def test_loaded_tensors_do_not_map_the_file(f32):
    """F32 tensors are copied out of the reader's memory map: a view would keep the whole file resident."""
    for name, array in _our_tensors(f32).items():
        chain = []
        while array is not None:
            chain.append(array)
            array = array.base
        assert not any(isinstance(a, np.memmap) for a in chain), name


def test_hf_config_round_trips(f32):
    reader = gguf_loader.open_gguf(f32.path)
    got, cfg = gguf_loader.hf_config(reader), f32.hf.config
    assert got["model_type"] == cfg.model_type
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        want = getattr(cfg, key, None)
        if key == "head_dim" and want is None:  # Qwen2Config has none
            want = cfg.hidden_size // cfg.num_attention_heads
        assert got[key] == want, key
    assert got["rms_norm_eps"] == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    rope = cfg.rope_parameters
    full = rope.get("full_attention", rope)
    assert got["rope_theta"] == full["rope_theta"]
    if full.get("rope_type", "default") == "linear":
        assert got["rope_scaling"] == {"rope_type": "linear", "factor": full["factor"]}
    elif full.get("rope_type", "default") == "yarn":
        assert got["rope_scaling"] == {"rope_type": "yarn", "factor": full["factor"],
                                       "original_max_position_embeddings": full["original_max_position_embeddings"]}
    else:
        assert "rope_scaling" not in got
    if cfg.model_type.startswith("gemma"):
        assert got["sliding_window"] == cfg.sliding_window
        assert got["query_pre_attn_scalar"] == cfg.query_pre_attn_scalar
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            assert got.get(key) == getattr(cfg, key), key
    if cfg.model_type == "gemma3_text":
        assert got["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]
    assert got.get("attention_bias", False) == (cfg.model_type == "qwen2")


def test_quantized_tensors_dequantize_like_gguf(quantized):
    """Each 2-D weight is gguf.quants.dequantize of its blocks (then un-permuted): what transformers loads too."""
    case, qtype = quantized
    reader = gguf_loader.open_gguf(case.path)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {qtype}
    ours, ref, cfg = _our_tensors(case), case.ref.state_dict(), case.hf.config
    assert set(ours) == set(ref)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for name, tensor in case.hf.state_dict().items():
        w = tensor.numpy()
        if w.ndim == 2:
            proj = name.split(".")[-2]
            permuted = _permute(w, heads[proj]) if proj in heads else w
            expected = gguf.quants.dequantize(gguf.quants.quantize(permuted, qtype), qtype)
            if proj in heads:
                expected = gguf_loader._unpermute_rope(expected, heads[proj])
            assert 0 < np.abs(expected - w).max() < 0.1, name  # really quantized, and not garbage
        else:
            expected = w
        np.testing.assert_array_equal(ours[name], expected, err_msg=name)
        np.testing.assert_array_equal(ours[name], ref[name].numpy(), err_msg=name)


def test_quantized_tensors_stay_packed_and_dequantize_identically(quantized):
    """By default Q8_0/Q4_0 weights are kept as QuantizedTensors (no dequantize-on-load); their
    dequantization equals gguf.quants' bit for bit, and the loaded model runs on QuantLinear layers."""
    case, qtype = quantized
    packed, floats = _our_tensors(case, keep_quantized=True), _our_tensors(case)
    quantized_names = [n for n, v in packed.items() if isinstance(v, QuantizedTensor)]
    assert quantized_names and all(packed[n].fmt == qtype.name.lower() for n in quantized_names)
    for name in quantized_names:
        got = np.asarray(dequantize(packed[name])).T  # (in, out) -> HF (out, in)
        np.testing.assert_array_equal(got.view(np.uint32), floats[name].view(np.uint32), err_msg=name)
    assert isinstance(case.ours.model.layers.locate(0)[0].attn.q_proj, QuantLinear)


def test_quantized_logprobs_match_transformers_gguf_loader(quantized):
    case, qtype = quantized
    tokens = _tokens()
    delta = np.abs(_ours_logprobs(case, tokens) - _torch_logprobs(case.ref, tokens)).max()
    print(f"\nllama {qtype.name}: max |delta log p| vs transformers GGUF = {delta:.2e}")
    assert delta <= TOL, f"llama {qtype.name}: max |delta log p| = {delta:.2e}"


# --- metadata-only files: what hf_config does with what llama.cpp would write ---------------------------


def _metadata_file(path, arch, layers, hidden, heads, head_dim, tensors=(), **extra):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(heads // 2)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(256)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    for name, value in tensors:
        w.add_tensor(name, np.asarray(value, np.float32))
    w.add_tensor("token_embd.weight", np.zeros((256, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_loader.open_gguf(path)


@pytest.mark.parametrize(("arch", "layers", "hidden", "heads", "head_dim", "scalar"), [
    ("gemma2", 26, 2304, 8, 256, 256),  # Gemma 2 2B
    ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads, as in its config.json
    ("gemma3", 34, 2560, 8, 256, 256),  # Gemma 3 4B
    ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B
])
def test_gemma_query_scale_follows_llama_cpp(tmp_path, arch, layers, hidden, heads, head_dim, scalar):
    reader = _metadata_file(tmp_path / "m.gguf", arch, layers, hidden, heads, head_dim, sliding_window=512)
    assert gguf_loader.hf_config(reader)["query_pre_attn_scalar"] == scalar


def test_gemma3_rope_local_base_and_no_sliding_window(tmp_path):
    reader = _metadata_file(tmp_path / "a.gguf", "gemma3", 6, 64, 4, 16, sliding_window=8)
    config = gguf_loader.hf_config(reader)
    assert config["rope_local_base_freq"] == 10000.0 and "layer_types" not in config  # older converters
    reader = _metadata_file(tmp_path / "b.gguf", "gemma3", 6, 64, 4, 16, rope_freq_base_swa=500.0)
    config = gguf_loader.hf_config(reader)
    assert config["rope_local_base_freq"] == 500.0
    assert config["layer_types"] == ["full_attention"] * 6 and "sliding_window" not in config


def test_llama3_rope_freqs_file_reproduces_the_hf_model(tmp_path):
    """Llama 3.1+ rope scaling is stored as per-frequency factors (rope_freqs.weight); the loader recovers HF's
    llama3 parameters from them, so the file is the HF model again (transformers' own GGUF loader drops them)."""
    hf = _make_hf_model("llama", tmp_path / "hf", families=hf_tiny.FAMILIES)
    rope = hf.config.rope_parameters
    assert rope["rope_type"] == "llama3"
    write_gguf(hf, tmp_path / "llama3.gguf")
    reader = gguf_loader.open_gguf(tmp_path / "llama3.gguf")
    assert gguf_loader.hf_config(reader)["rope_scaling"] == {
        k: rope[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings")}
    ours = load_model(tmp_path / "llama3.gguf")
    tokens = _tokens(2)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    got = _next_logprobs(ours.model(jnp.asarray(tokens), jnp.asarray(positions)), tokens)
    assert np.abs(got - _torch_logprobs(hf, tokens)).max() <= TOL


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 / 3.3 and Llama 3.2's scaling on their real shapes
def test_llama3_rope_scaling_recovered_for_real_llama_shapes(factor):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = types.SimpleNamespace(rope_parameters=rope, head_dim=128)
    got = gguf_loader.llama3_rope_scaling(_llama3_rope_factors(cfg), 500000.0, 128)
    assert got == {k: v for k, v in rope.items() if k != "rope_theta"}


@pytest.mark.parametrize("extra,match", [
    (dict(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=4.0), "original_context_length"),
    (dict(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=4.0, rope_scaling_orig_ctx_len=64,
          rope_scaling_yarn_log_mul=0.1), "yarn_log_multiplier"),
    (dict(rope_scaling_type=gguf.RopeScalingType.LONGROPE), "unsupported GGUF rope scaling 'longrope'"),
])
def test_unreadable_rope_scaling_is_refused_by_name(tmp_path, extra, match):
    reader = _metadata_file(tmp_path / "y.gguf", "qwen3", 2, 64, 4, 16, **extra)
    with pytest.raises(CheckpointError, match=match):
        gguf_loader.hf_config(reader)


def test_llama3_rope_freqs_without_a_blended_band():
    """Factors only 1 and `factor` (no frequency between the bands): any pretraining length the band edges
    allow gives them; all 1: plain rope."""
    factors = gguf_loader.llama3_rope_factors(10000.0, 8, 8.0, 40.0)
    assert set(factors.tolist()) == {1.0, 8.0}
    got = gguf_loader.llama3_rope_scaling(factors.astype(np.float32), 10000.0, 8)
    np.testing.assert_array_equal(
        gguf_loader.llama3_rope_factors(10000.0, 8, 8.0, got["original_max_position_embeddings"]), factors)
    assert gguf_loader.llama3_rope_scaling(np.ones(4, np.float32), 10000.0, 8) is None


@pytest.mark.parametrize("factors,match", [
    (np.linspace(1.0, 3.0, 8), "not Llama 3's rope scaling"),  # a ramp over every frequency: no llama3 bands
    (np.full(5, 8.0), "must hold head_dim / 2 = 8 factors, got 5"),
    (np.r_[np.ones(7), np.nan], "non-finite or non-positive"),
    (np.ones((2, 8)), "1-D F32 vector"),
])
def test_other_rope_freqs_are_refused_by_name(tmp_path, factors, match):
    reader = _metadata_file(tmp_path / "r.gguf", "llama", 2, 64, 4, 16, tensors=[("rope_freqs.weight", factors)])
    with pytest.raises(CheckpointError, match=match):
        gguf_loader.hf_config(reader)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K])
def test_k_quant_tensors_dequantize_like_gguf(tmp_path, qtype):
    """K-quants are not kept packed: they load as gguf.quants' own dequantization, bit for bit."""
    rows, cols = 8, 512  # two 256-element super-blocks per row
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    half = np.array([0.01], np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin lead the block
        raw[..., 0:2], raw[..., 2:4] = half, half
    else:  # Q6_K: d closes the block
        raw[..., -2:] = half
    raw = raw.reshape(rows, -1)
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)  # shape in bytes, as gguf wants
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf_loader.open_gguf(path)
    (name, got), = gguf_loader.iter_tensors(reader, {"model_type": "llama"})
    assert name == "model.layers.0.mlp.down_proj.weight" and got.shape == (rows, cols)
    want = gguf.quants.dequantize(reader.tensors[0].data, qtype)
    np.testing.assert_array_equal(got, want)
