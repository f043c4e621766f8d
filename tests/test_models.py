"""Parity of ppojax's Flax models with transformers' torch models, on tiny random checkpoints.

For every architecture: HF (torch) -> save_pretrained -> ppojax logits on left-padded prompts (1e-4);
ppojax -> save_pretrained -> transformers reload (1e-5); KV-cached decoding == full forward.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from ppojax.models import (
    CausalLM,
    ModelConfig,
    ScoreModel,
    UnsupportedModelError,
    apply_causal_lm,
    apply_causal_lm_with_value,
    init_cache,
    last_token_scores,
    load_config,
    load_pretrained,
    load_tokenizer,
    logical_axes,
    position_ids_from_mask,
    save_pretrained,
)

V = 256
PAD = 0

# name -> (config class, kwargs); tiny: 2 layers, hidden 64
ARCHS = {
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    # SmolLM2-like: GQA, tied embeddings, rope_theta 1e5
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True, rope_theta=100000.0)),
    # Llama-3 RoPE scaling, biases everywhere, untied
    "llama3": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                                   max_position_embeddings=64, rope_theta=500000.0,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=16))),
    # a sliding window shorter than the sequences, so it matters
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, sliding_window=4)),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True)),
    # head_dim from the config (not hidden / heads), q/k RMSNorm
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32)),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, rotary_pct=0.5, use_parallel_residual=True)),
}


def hf_config(name, **extra):
    cls_name, kw = ARCHS[name]
    return getattr(transformers, cls_name)(vocab_size=V, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                                           **kw, **extra)


def randomize(model, seed=0):
    """Large-ish random weights everywhere (norm scales around 1, biases non-zero) so that every tensor matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            is_norm = p.ndim == 1 and ("norm" in name or ".ln" in name or "ln_f" in name)
            p.copy_(noise + 1.0 if is_norm and name.endswith("weight") else noise)
    return model.eval()


def make_hf(name, tmp_path, kind="causal_lm", num_labels=1, **extra):
    cfg = hf_config(name, **extra)
    cls = {"causal_lm": transformers.AutoModelForCausalLM,
           "score": transformers.AutoModelForSequenceClassification}[kind]
    if kind == "score":
        cfg.num_labels = num_labels
    torch.manual_seed(0)
    model = randomize(cls.from_config(cfg))
    path = tmp_path / f"{name}_{kind}_hf"
    model.save_pretrained(path)
    return model, path


def left_padded_batch(lengths, seq_len, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, V, size=(len(lengths), seq_len))
    mask = np.arange(seq_len)[None, :] >= (seq_len - np.asarray(lengths))[:, None]
    ids = np.where(mask, ids, PAD)
    return ids.astype(np.int32), mask


def torch_forward(model, ids, mask):
    ids_t, mask_t = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    pos = mask_t.cumsum(-1) - mask_t
    with torch.no_grad():
        return model(input_ids=ids_t, attention_mask=mask_t, position_ids=pos)


_forward = jax.jit(lambda graphdef, params, ids, mask: apply_causal_lm(graphdef, params, ids, mask)[0],
                   static_argnums=0)


def max_diff_live(a, b, mask):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))[np.asarray(mask)]))


@pytest.mark.parametrize("name", list(ARCHS))
def test_causal_lm_parity_export_and_cache(name, tmp_path):
    hf_model, path = make_hf(name, tmp_path)
    model, cfg = load_pretrained(path)
    assert cfg.model_type == hf_model.config.model_type
    graphdef, params = nnx.split(model)

    # 1. logits on left-padded prompts of different lengths (live positions only)
    ids, mask = left_padded_batch([12, 7, 3], 12)
    ref = torch_forward(hf_model, ids, mask).logits.numpy()
    ours = np.asarray(_forward(graphdef, params, jnp.asarray(ids), jnp.asarray(mask)))
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    assert max_diff_live(ours, ref, mask) < 1e-4

    # 2. KV-cached decoding: prefill 8 slots, then 4 single-token steps == full forward
    prompt_len, steps = 8, 4
    cache = init_cache(cfg, ids.shape[0], prompt_len + steps)
    ids_p, mask_p = left_padded_batch([8, 5, 2], prompt_len, seed=1)
    cont = np.random.default_rng(2).integers(3, V, size=(3, steps)).astype(np.int32)
    full_ids = np.concatenate([ids_p, cont], 1)
    full_mask = np.concatenate([mask_p, np.ones_like(cont, bool)], 1)
    full = np.asarray(_forward(graphdef, params, jnp.asarray(full_ids), jnp.asarray(full_mask)))
    pos = np.asarray(position_ids_from_mask(jnp.asarray(full_mask)))
    step = jax.jit(lambda g, p, i, m, ps, c: apply_causal_lm(g, p, i, m, ps, c)[::2], static_argnums=0)
    logits, cache = step(graphdef, params, ids_p, mask_p, pos[:, :prompt_len], cache)
    got = [np.asarray(logits)]
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = step(graphdef, params, full_ids[:, t:t + 1], full_mask[:, t:t + 1], pos[:, t:t + 1], cache)
        got.append(np.asarray(logits))
    assert int(cache.index) == prompt_len + steps
    assert max_diff_live(np.concatenate(got, 1), full, full_mask) < 1e-5

    # 3. export -> transformers reload: same logits as the original torch model
    out = save_pretrained(model, cfg, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf_model)
    again = torch_forward(reloaded, ids, mask).logits.numpy()
    assert max_diff_live(again, ref, mask) < 1e-5
    assert load_config(out) == cfg


@pytest.mark.parametrize("name,extra", [("llama", {}), ("gpt2", {"scale_attn_by_inverse_layer_idx": True})])
def test_score_model_parity(name, extra, tmp_path):
    hf_model, path = make_hf(name, tmp_path, kind="score", **extra)
    model, cfg = load_pretrained(path, kind="score")
    assert isinstance(model, ScoreModel)
    ids, mask = left_padded_batch([10, 6, 1], 10, seed=3)
    with torch.no_grad():
        ids_t, mask_t = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
        pos = mask_t.cumsum(-1) - mask_t
        base = getattr(hf_model, hf_model.base_model_prefix)
        hidden = base(input_ids=ids_t, attention_mask=mask_t, position_ids=pos).last_hidden_state
        ref_per_pos = hf_model.score(hidden)[..., 0].numpy()
        ref_pooled = hf_model(input_ids=ids_t, attention_mask=mask_t, position_ids=pos).logits[:, 0].numpy()
    scores = jax.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids), jnp.asarray(mask))
    assert scores.shape == ids.shape and scores.dtype == jnp.float32
    assert max_diff_live(scores, ref_per_pos, mask) < 1e-4
    np.testing.assert_allclose(last_token_scores(scores, jnp.asarray(mask)), ref_pooled, atol=1e-4)

    out = save_pretrained(model, cfg, tmp_path / "export")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        again = reloaded(input_ids=ids_t, attention_mask=mask_t, position_ids=pos).logits[:, 0].numpy()
    np.testing.assert_allclose(again, ref_pooled, atol=1e-5)


def test_a_classifier_scores_with_the_chosen_label(tmp_path):
    """A 3-label classifier as a score model: `score_label=i` gives transformers' logit i at the last token; no
    label is refused with the fix named (the config field reward_model_label reaches it)."""
    hf_model, path = make_hf("llama", tmp_path, kind="score", num_labels=3)
    ids, mask = left_padded_batch([10, 6, 1], 10, seed=4)
    ref = torch_forward(hf_model, ids, mask).logits.numpy()  # [B, 3], pooled at the last non-pad token
    assert ref.shape == (3, 3)
    for label in (1, 2):
        model, cfg = load_pretrained(path, kind="score", score_label=label)
        assert model.score["kernel"][...].shape == (cfg.hidden_size, 1)
        assert cfg.extra.to_dict()["id2label"] == {"0": f"LABEL_{label}"}
        scores = jax.jit(lambda m, i, a: m(i, a))(model, jnp.asarray(ids), jnp.asarray(mask))
        np.testing.assert_allclose(last_token_scores(scores, jnp.asarray(mask)), ref[:, label], atol=1e-4)
    with pytest.raises(ValueError, match="classifier with 3 labels.*score_label"):
        load_pretrained(path, kind="score")
    with pytest.raises(ValueError, match="score_label=3 is not an output"):
        load_pretrained(path, kind="score", score_label=3)


_forward_value = jax.jit(apply_causal_lm_with_value, static_argnums=0)


def test_value_head_round_trip(tmp_path):
    hf_model, path = make_hf("llama", tmp_path)
    model, cfg = load_pretrained(path, kind="value_head", seed=3)
    ids, mask = left_padded_batch([6, 4], 6)
    logits, values, _ = _forward_value(*nnx.split(model), ids, mask)
    assert values.shape == ids.shape and values.dtype == jnp.float32
    assert max_diff_live(logits, torch_forward(hf_model, ids, mask).logits.numpy(), mask) < 1e-4
    out = save_pretrained(model, cfg, tmp_path / "export")
    again, _ = load_pretrained(out, kind="value_head", seed=99)  # v_head read back, not re-initialised
    np.testing.assert_array_equal(_forward_value(*nnx.split(again), ids, mask)[1], values)
    # transformers loads the policy part (the extra v_head.summary.* tensors are ignored)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert max_diff_live(torch_forward(reloaded, ids, mask).logits.numpy(), logits, mask) < 1e-4
    # a score (value) model may start from a causal-LM checkpoint: fresh score head, as transformers does
    score_model, _ = load_pretrained(path, kind="score")
    assert score_model.score["kernel"].shape == (cfg.hidden_size, 1)
    assert np.abs(np.asarray(score_model.score["kernel"][...])).max() > 0
    # head_init="zeros": a missing head starts at zero (every value 0), the rest of the model as read
    zeroed, _ = load_pretrained(path, kind="value_head", seed=3, head_init="zeros")
    zero_logits, zero_values, _ = _forward_value(*nnx.split(zeroed), ids, mask)
    np.testing.assert_array_equal(zero_values, np.zeros(ids.shape, np.float32))
    np.testing.assert_array_equal(zero_logits, logits)
    zero_score, _ = load_pretrained(path, kind="score", head_init="zeros")
    np.testing.assert_array_equal(zero_score.score["kernel"][...], np.zeros((cfg.hidden_size, 1), np.float32))


def test_sharded_checkpoints_both_ways(tmp_path):
    hf_model, _ = make_hf("qwen3", tmp_path)
    sharded = tmp_path / "sharded_hf"
    hf_model.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists()
    model, cfg = load_pretrained(sharded)
    ids, mask = left_padded_batch([5, 3], 5)
    ref = torch_forward(hf_model, ids, mask).logits.numpy()
    assert max_diff_live(_forward(*nnx.split(model), ids, mask), ref, mask) < 1e-4
    out = save_pretrained(model, cfg, tmp_path / "export", max_shard_bytes=50_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert max_diff_live(torch_forward(reloaded, ids, mask).logits.numpy(), ref, mask) < 1e-5


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>", "the", "movie", "was", "great", "awful"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


def test_bfloat16_unrolled_and_tokenizer(tmp_path):
    hf_model, path = make_hf("llama", tmp_path)
    ids, mask = left_padded_batch([9, 4], 9)
    ref = torch_forward(hf_model, ids, mask).logits.numpy()
    # unrolled layers == scanned layers
    model, cfg = load_pretrained(path, scan_layers=False)
    assert max_diff_live(_forward(*nnx.split(model), ids, mask), ref, mask) < 1e-4
    # bfloat16 compute and storage: close, finite, float32 logits; export in bfloat16 loads in transformers
    model16, _ = load_pretrained(path, dtype=jnp.bfloat16)
    logits16, hidden16, _ = jax.jit(apply_causal_lm, static_argnums=0)(*nnx.split(model16), ids, mask)
    assert hidden16.dtype == jnp.bfloat16
    assert logits16.dtype == jnp.float32 and np.isfinite(np.asarray(logits16)).all()
    assert max_diff_live(logits16, ref, mask) < 0.1 * np.abs(ref).max()
    out = save_pretrained(model16, cfg, tmp_path / "export16", tokenizer=tiny_tokenizer())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    tok = load_tokenizer(out)
    assert tok("the movie was great")["input_ids"] == [4, 5, 6, 7] and tok.pad_token_id == 0


def test_logical_axes_cover_every_parameter():
    cfg = ModelConfig.from_hf(hf_config("qwen3").to_dict())
    _, params = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    axes = logical_axes(params)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_params = jax.tree.leaves(params)
    assert len(flat_axes) == len(flat_params)
    known = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "norm", "positions", None}
    for names, p in zip(flat_axes, flat_params):
        assert len(names) == p.ndim and set(names) <= known
    assert axes["backbone"]["layers"]["attn"]["k"]["kernel"].get_value() == ("layers", "embed", "kv_heads",
                                                                             "head_dim")
    # the tree maps onto the parameters' structure (what a sharding rule table needs)
    specs = jax.tree.map(lambda n: jax.sharding.PartitionSpec(*[None for _ in n]), axes,
                         is_leaf=lambda x: isinstance(x, tuple))
    assert jax.tree.structure(specs) == jax.tree.structure(params)
    hash(cfg)  # static-arg friendly


def test_clear_errors(tmp_path):
    with pytest.raises(UnsupportedModelError, match="gpt2, llama, mistral, qwen2, qwen3, gpt_neox"):
        ModelConfig.from_hf({"model_type": "bert", "vocab_size": 10})
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing / "config.json")):
        load_pretrained(missing)

    hf_model, path = make_hf("llama", tmp_path)
    no_weights = tmp_path / "config_only"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(no_weights)

    bad = json.loads((path / "config.json").read_text())
    bad["vocab_size"] = V + 1
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*\(256, 64\).*\(257, 64\)"):
        load_pretrained(path)
    bad["vocab_size"] = V
    bad["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(KeyError, match=r"tensor .gpt_neox\..* is missing from the checkpoint"):
        load_pretrained(path)
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        ModelConfig.from_hf({**hf_config("llama").to_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})



def test_config_reads_transformers4_fields():
    # SmolLM2-135M's config.json (transformers 4 layout)
    smol = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5, "rope_theta": 100000, "rope_scaling": None, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 8192, "hidden_act": "silu",
        "torch_dtype": "bfloat16"})
    assert (smol.head_dim, smol.num_kv_heads, smol.rope_theta, smol.tie_word_embeddings) == (64, 3, 1e5, True)
    assert smol.rope_scaling is None and smol.norm_eps == 1e-5
    assert ModelConfig.from_hf(smol.to_hf()) == smol and hash(smol) == hash(ModelConfig.from_hf(smol.to_hf()))
    # Pythia (rotary_pct, rotary_emb_base)
    pythia = ModelConfig.from_hf({"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 512,
                                  "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 8,
                                  "rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True})
    assert (pythia.rotary_dim, pythia.parallel_residual, pythia.qkv_bias) == (16, True, True)
    # Llama 3.1's legacy rope_scaling with "rope_type", and a list of eos ids
    l3 = ModelConfig.from_hf({**smol.to_hf(), "rope_parameters": None, "eos_token_id": [128001, 128009],
                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert l3.rope_scaling_dict["rope_type"] == "llama3" and l3.eos_token_ids == (128001, 128009)
    assert l3.to_hf()["rope_parameters"]["factor"] == 8.0


def _file_mappings(path):
    """[(start, end)] of this process's memory maps of `path` (/proc/self/maps)."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    return spans


def _align_tensors(file, to=64):
    """Rewrite a safetensors file with its header padded (with spaces, as the format allows) so that every
    tensor's data starts at a multiple of `to` bytes in the file."""
    import struct
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = raw[8:8 + n].rstrip(b" "), raw[8 + n:]
    header += b" " * (-(8 + len(header)) % to)
    file.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_loaded_weights_are_the_models_own_memory_not_the_checkpoint_files(tmp_path):
    """The checkpoint is read through a memory map; no loaded weight may stay a view of it, or the weights
    would change with the file and keep it mapped. On the CPU jax adopts a 64-byte-aligned host array as a
    device buffer without copying, so a float32 tensor of a float32 model, unconverted and aligned in the file,
    is the case where a view could pass through."""
    cfg = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, intermediate_size=256)
    save_pretrained(CausalLM(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path / "ckpt")
    weights = (tmp_path / "ckpt" / "model.safetensors").resolve()
    _align_tensors(weights)
    model, _ = load_pretrained(tmp_path / "ckpt")
    mapped = _file_mappings(weights)
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        pointer = leaf.unsafe_buffer_pointer()
        assert not any(start <= pointer < end for start, end in mapped), jax.tree_util.keystr(path)
    import gc
    gc.collect()
    assert _file_mappings(weights) == [], "the checkpoint file stays mapped after the load"
