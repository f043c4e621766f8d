"""GGUF (llama.cpp) → Hugging Face Llama checkpoint directory, without torch.

`convert_gguf_to_hf(gguf_path, out_dir)` reads a llama-architecture GGUF file with `gguf.GGUFReader`,
dequantises every tensor to float32 with `gguf.quants.dequantize`, undoes llama.cpp's per-head row
permutation of the Q and K projections, and writes a standard HF checkpoint directory:

    config.json              LlamaConfig (model_type llama), incl. rope_theta, tie_word_embeddings, token ids
    generation_config.json   bos / eos / pad ids
    model.safetensors        float32, HF tensor names (model.embed_tokens.weight,
                             model.layers.N.self_attn.q_proj.weight, ...)
    tokenizer.json           byte-level BPE rebuilt from `tokenizer.ggml.*` with the `tokenizers` package only
    tokenizer_config.json    special tokens, chat template (from `tokenizer.chat_template`)

The result loads with `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and equals transformers'
own GGUF load (`from_pretrained(dir, gguf_file=...)`) tensor for tensor (tests/test_assets.py).

The pad token: a GGUF file often names eos as its padding token (SmolLM2 does). ppojax keys masks on
`token != pad`, so pad must differ from eos: by default the converter picks the file's padding id if it
differs from eos, else its unknown-token id (SmolLM2: `<|endoftext|>`, id 0, which the Instruct model
never produces inside its ChatML format), else token 0. Pass `pad_token_id` to choose another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

__all__ = ["convert_gguf_to_hf", "read_gguf_metadata", "unpermute_qk", "build_tokenizer", "GGUF_TO_HF"]

# llama.cpp tensor name (after "blk.N.") → HF Llama name (after "model.layers.N.").
GGUF_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}
_REQUIRED_PER_LAYER = [k for k in GGUF_TO_HF if k.endswith(".weight")]
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp stores that a HF checkpoint recomputes (precomputed RoPE tables).
_SKIPPED = {"rope_freqs.weight"}

# Pre-tokenizer splits (llama.cpp's `tokenizer.ggml.pre`). GPT-2's regex is what tokenizers' ByteLevel
# applies with use_regex=True. The "digits first" family isolates every digit (\p{N}) before that regex,
# which is tokenizers' Digits(individual_digits=True); SmolLM2's original tokenizer.json does exactly this.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2 = {"gpt2", "default", "gpt-2", "mpt", "olmo", "jais"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


# ---------------------------------------------------------------------------------------------- reading


def _field_value(field) -> Any:
    value = field.contents()
    return value


def read_gguf_metadata(reader) -> dict[str, Any]:
    """All key/value fields of a `gguf.GGUFReader` as python values (strings, numbers, lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = _field_value(field)
        except Exception:  # noqa: BLE001 - an odd field we do not need must not stop the conversion
            continue
    return out


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (`[n_heads * head_dim, in]` or a bias).

    llama.cpp's converter reorders each head's rows from HF's "rotate half" RoPE layout (first half, second
    half) to interleaved pairs: `w.reshape(h, 2, d/2, ...).swapaxes(1, 2)`. The inverse views each head as
    `(d/2, 2)` and swaps those axes back. K uses the key-value head count.
    """
    rows = weight.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot unpermute a tensor with {rows} rows for {n_heads} heads (head_dim must be even)")
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _dequantize(tensor) -> np.ndarray:
    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dims innermost-first
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32).reshape(shape))


# ---------------------------------------------------------------------------------------------- config


def _pick_pad(meta: dict, eos: int | None, pad_token_id: int | None, vocab_size: int) -> int:
    if pad_token_id is not None:
        pad = int(pad_token_id)
    else:
        candidates = [meta.get("tokenizer.ggml.padding_token_id"), meta.get("tokenizer.ggml.unknown_token_id"), 0]
        pad = next(int(c) for c in candidates if c is not None and int(c) != eos)
    if pad == eos:
        raise ValueError(f"pad_token_id {pad} equals eos_token_id {eos}; ppojax needs them different")
    if not 0 <= pad < vocab_size:
        raise ValueError(f"pad_token_id {pad} is outside the vocabulary (size {vocab_size})")
    return pad


def _llama_config(meta: dict, *, vocab_size: int, tied: bool, pad: int, has_bias: bool) -> dict:
    arch = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // n_heads)))
    rope_theta = float(get("rope.freq_base", 10000.0))
    if get("rope.scaling.type") not in (None, "none"):
        raise NotImplementedError(f"RoPE scaling {get('rope.scaling.type')!r} in the GGUF file is not supported")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length", 2048)),
        # The file stores eps as float32 (9.9999997e-06); print it back at float32 precision (1e-05).
        "rms_norm_eps": float(f"{float(get('attention.layer_norm_rms_epsilon', 1e-5)):.7g}"),
        # Both spellings: `rope_theta` (transformers < 5 and most loaders) and v5's `rope_parameters`.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": has_bias,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": tied,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": pad,
        "use_cache": True,
        "dtype": "float32",
    }


# ---------------------------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` (byte-level BPE, no prefix space) from GGUF `tokenizer.ggml.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') can be rebuilt"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if not merges:
        raise NotImplementedError("GGUF file has no tokenizer.ggml.merges; cannot rebuild the BPE tokenizer")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    else:
        if pre not in _GPT2:
            print(f"[ppojax] note: GGUF pre-tokenizer {pre!r} unknown to ppojax; using GPT-2's split regex")
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, token_types)
        if ty == _TOKEN_TYPE_CONTROL and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, token_types)
        if ty == _TOKEN_TYPE_USER_DEFINED and t in vocab
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    byte_post = processors.ByteLevel(trim_offsets=False)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.Sequence([
            byte_post,
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
            ),
        ])
    else:
        tok.post_processor = byte_post
    return tok


def _tokenizer_config(meta: dict, pad: int) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def name(key):
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else tokens[int(value)]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"),
        "pad_token": tokens[pad],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in config.items() if v is not None}


# ---------------------------------------------------------------------------------------------- convert


def convert_gguf_to_hf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    pad_token_id: int | None = None,
    log=print,
) -> Path:
    """Write a HF Llama checkpoint directory (float32 safetensors + config + tokenizer) for a GGUF file.

    `out_dir` must not exist or be empty; callers wanting atomicity (ppojax.assets) pass a temp dir and
    rename it. Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise NotImplementedError(
            f"{gguf_path.name}: GGUF architecture {arch!r} is not supported; only 'llama' can be converted"
        )
    n_heads = int(meta["llama.attention.head_count"])
    n_kv = int(meta.get("llama.attention.head_count_kv", n_heads))
    n_layers = int(meta["llama.block_count"])

    tensors: dict[str, np.ndarray] = {}
    unknown = []
    for t in reader.tensors:
        name = t.name
        if name in _SKIPPED:
            continue
        if name in _TOP_LEVEL:
            hf = _TOP_LEVEL[name]
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in GGUF_TO_HF:
                unknown.append(name)
                continue
            hf = f"model.layers.{int(layer)}.{GGUF_TO_HF[rest]}"
        else:
            unknown.append(name)
            continue
        array = _dequantize(t)
        if name.endswith("attn_q.weight") or name.endswith("attn_q.bias"):
            array = unpermute_qk(array, n_heads)
        elif name.endswith("attn_k.weight") or name.endswith("attn_k.bias"):
            array = unpermute_qk(array, n_kv)
        tensors[hf] = array
    if unknown:
        raise NotImplementedError(f"{gguf_path.name}: tensors with no HF Llama equivalent: {unknown[:8]}")
    missing = [f"model.layers.{i}.{GGUF_TO_HF[k]}" for i in range(n_layers) for k in _REQUIRED_PER_LAYER]
    missing = [k for k in ["model.embed_tokens.weight", "model.norm.weight", *missing] if k not in tensors]
    if missing:
        raise ValueError(f"{gguf_path.name}: missing tensors {missing[:8]}")

    vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    tied = "lm_head.weight" not in tensors
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = _pick_pad(meta, None if eos is None else int(eos), pad_token_id, vocab_size)
    has_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    config = _llama_config(meta, vocab_size=vocab_size, tied=tied, pad=pad, has_bias=has_bias)

    out_dir.mkdir(parents=True, exist_ok=True)
    n_params = sum(a.size for a in tensors.values())
    log(f"[ppojax] writing {len(tensors)} float32 tensors ({n_params / 1e6:.1f}M parameters) to {out_dir}")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(meta, pad), indent=2) + "\n")
    return out_dir
