"""Offline assets: the SmolLM2 GGUF conversion (vs transformers' own GGUF loader), the movie-review prompts,
the GPT-2 tokenizer folder, and the cache's convert-once / reuse behaviour."""

import json
import os

import numpy as np
import pytest

from ppojax import assets
from ppojax.assets.gguf_convert import unpermute_qk

QUIET = dict(log=lambda *a, **k: None)


# ---------------------------------------------------------------------------------------------- fast


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf.py: w.reshape(h, 2, d/2, in).swapaxes(1, 2).reshape(w.shape)
    heads, head_dim, fan_in = 3, 8, 5
    w = np.random.default_rng(0).normal(size=(heads * head_dim, fan_in)).astype(np.float32)
    permuted = w.reshape(heads, 2, head_dim // 2, fan_in).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)
    bias = np.arange(heads * head_dim, dtype=np.float32)
    permuted_bias = bias.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(bias.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted_bias, heads), bias)


def test_convert_once_then_reuse(tmp_path, monkeypatch, capsys):
    """The cache logic with a stand-in converter: converts on the first call (atomically), reuses after."""
    import ppojax.assets.gguf_convert as gc

    calls = []

    def fake_convert(gguf_path, out_dir, *, pad_token_id=None, log=print):
        calls.append(str(out_dir))
        assert ".tmp-" in str(out_dir)  # written in a temp folder, renamed when complete
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out_dir / name).write_text("{}")
        return out_dir

    monkeypatch.setenv("PPOJAX_CACHE", str(tmp_path))
    monkeypatch.setattr(gc, "convert_gguf_to_hf", fake_convert)
    monkeypatch.setattr(assets, "_sha256", lambda path: assets.SMOLLM2_SHA256)
    first = assets.smollm2_checkpoint()
    out = capsys.readouterr().out
    assert "fetching SmolLM2" in out and "converting GGUF" in out and first.parent == tmp_path
    second = assets.smollm2_checkpoint()
    assert second == first and len(calls) == 1
    assert "reusing cached SmolLM2-135M-Instruct checkpoint" in capsys.readouterr().out
    assert assets.smollm2_checkpoint() == first and capsys.readouterr().out == ""  # said once per process
    assert sorted(p.name for p in tmp_path.iterdir()) == [assets.SMOLLM2_DIRNAME]  # no temp leftovers

    (first / "model.safetensors").unlink()  # a damaged cache is rebuilt, and the user is told
    assets.smollm2_checkpoint()
    assert len(calls) == 2 and "incomplete or outdated" in capsys.readouterr().out


def test_gpt2_tokenizer_dir():
    from transformers import AutoTokenizer

    folder = assets.gpt2_tokenizer_dir(**QUIET)
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok("Hello world").input_ids == [15496, 995]
    assert len(tok) == 50257 and tok.eos_token_id == 50256


def test_movie_review_prompts():
    prompts = assets.movie_review_prompts(**QUIET)
    assert len(prompts) > 10_000
    assert all(2 <= len(p.split()) <= 8 and p == p.strip() for p in prompts)
    assert prompts[:3] == ["The Rock is destined to", 'The gorgeously elaborate continuation of "The',
                           "Effective but too tepid"]
    # Deterministic: re-deriving from the source archive gives exactly the cached list.
    sdist = assets._vader_sdist(**QUIET)
    rows = assets._read_movie_snippets(sdist)
    assert len(rows) == 10_605
    rebuilt = [p for rid, _, s in rows if (p := assets._review_opening(rid, s)) is not None]
    assert rebuilt == prompts == assets.movie_review_prompts(**QUIET)


# ---------------------------------------------------------------------------------------------- SmolLM2 (slow-ish)


@pytest.fixture(scope="module")
def smollm2():
    """The converted checkpoint (converted once into the shared cache if missing) and transformers' own
    torch load of the same GGUF file — each loaded once for the module."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    folder = assets.smollm2_checkpoint()
    gguf_path = assets.smollm2_gguf_path(**QUIET)
    ref = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(folder)
    ref_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    our_tok = AutoTokenizer.from_pretrained(folder)
    return dict(folder=folder, ref=ref, ours=ours, ref_tok=ref_tok, our_tok=our_tok)


@pytest.mark.slow
def test_smollm2_config(smollm2):
    config = json.loads((smollm2["folder"] / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["vocab_size"]) == (30, 576, 9, 3, 64, 1536, 49152)
    assert config["rms_norm_eps"] == 1e-5
    tok_config = json.loads((smollm2["folder"] / "tokenizer_config.json").read_text())
    assert tok_config["pad_token"] == "<|endoftext|>" and "<|im_start|>" in tok_config["chat_template"]


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_load(smollm2):
    import torch

    ref, ours = smollm2["ref"].state_dict(), smollm2["ours"].state_dict()
    assert {k: tuple(v.shape) for k, v in ref.items()} == {k: tuple(v.shape) for k, v in ours.items()}
    assert sum(v.numel() for k, v in ours.items() if k != "lm_head.weight") == 134_515_008
    for name in ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.17.self_attn.o_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.layers.3.input_layernorm.weight"]:
        assert ours[name].dtype == torch.float32
        assert torch.equal(ref[name], ours[name]), name  # max abs diff 0.0
    tokens = torch.tensor([[1, 504, 7704, 436, 8264, 284, 260, 8947]])
    with torch.no_grad():  # same config too: RoPE theta, eps, tied head
        assert torch.equal(smollm2["ref"](tokens).logits, smollm2["ours"](tokens).logits)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_gguf(smollm2):
    ref, ours = smollm2["ref_tok"], smollm2["our_tok"]
    for text in ["The movie was wonderful and the acting was great.", " leading space and  two", "héllo ✓ 😀",
                 "<|im_start|>user\nhi<|im_end|>\n", "It cost 12345 dollars in 2024.", "don't\tstop\n\nnow"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours("Hello world").input_ids == [19556, 905]  # no bos, no prefix space
    assert (ours.pad_token_id, ours.eos_token_id, ours.bos_token_id) == (0, 2, 1)
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_second_call_reuses_cache(smollm2, capsys, monkeypatch):
    weights = smollm2["folder"] / "model.safetensors"
    before = os.stat(weights).st_mtime_ns
    monkeypatch.setattr(assets, "_ANNOUNCED", set())  # as in a fresh process
    assert assets.smollm2_checkpoint() == smollm2["folder"]
    assert "reusing cached SmolLM2-135M-Instruct checkpoint" in capsys.readouterr().out
    assert os.stat(weights).st_mtime_ns == before
