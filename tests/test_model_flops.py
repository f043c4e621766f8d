"""The model-shape FLOPs count (ppojax/models/flops.py, what `ppojax plan` prints beside XLA's count and the
benchmarks divide by time for MFU): SmolLM2-135M's published parameter count, ~2N FLOPs per token, torch's own
FLOP counter on the same model, and the same dims from a ModelConfig as from its config.json."""
import pytest

from ppojax.models import ModelConfig
from ppojax.models.flops import (Dims, attention, backbone_forward, layer_matmul_params, lm_head, param_count,
                                 ppo_update_flops)

#: SmolLM2-135M's config.json (the shapes only)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu")
#: a 2-layer Llama with grouped-query attention (the benchmarks' tiny size)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False, hidden_act="silu")


def test_flops_smollm2_shape():
    d = Dims.from_config(SMOLLM2)
    assert param_count(d) == 134_515_008  # SmolLM2-135M
    f = ppo_update_flops(d, 8, 16, 32, 4)
    # update = 4 epochs × 3 (fwd+bwd) × (policy + value forwards); rollout ≈ 4 forwards' worth
    assert 5 < f["update"] / f["rollout"] < 7
    per_token_2n = 2 * (param_count(d) - d.vocab * d.hidden)  # non-embedding matmuls, ~2N per token
    assert f["value_forward"] / (8 * 48) == pytest.approx(per_token_2n, rel=0.05)
    assert ppo_update_flops(d, 8, 16, 32, 4, lm_head_positions="all")["total"] > f["total"]


def test_flops_match_torch_flop_counter():
    """Our count of a full forward equals torch's own FLOP counter on the same transformers model (eager
    attention computes the whole S×S score matrix, so the non-causal half is added for the comparison)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attn_implementation="eager")).eval()
    B, S = 2, 48
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(3, TINY["vocab_size"], (B, S)))
    d = Dims.from_config(TINY)
    ours = backbone_forward(d, S) + lm_head(d, S) + attention(d, 1) * (S * S - S * (S + 1) // 2)
    assert counter.get_total_flops() == B * ours


def test_a_model_config_gives_the_dims_of_its_config_json():
    """`ppojax plan` counts from the ModelConfig it compiled (any family): a Llama's equal its config.json's; a
    GPT-2's MLP has two matrices, not three."""
    llama = ModelConfig.from_hf(dict(SMOLLM2, model_type="llama"))
    assert Dims.from_model_config(llama) == Dims.from_config(SMOLLM2)
    gpt2 = ModelConfig.from_hf(dict(model_type="gpt2", vocab_size=512, n_embd=64, n_layer=2, n_head=4,
                                    n_positions=128))
    d = Dims.from_model_config(gpt2)
    assert not d.gated_mlp and (d.layers, d.hidden, d.heads, d.kv_heads, d.head_dim) == (2, 64, 4, 4, 16)
    assert layer_matmul_params(d) == 4 * 64 * 64 + 2 * 64 * d.mlp  # q, k, v, o + up, down
