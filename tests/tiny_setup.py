"""A tiny word-level tokenizer and a tiny random Llama for trainer tests (no downloads)."""
import json
import os
from pathlib import Path

from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ppojax.models import CausalLM, CausalLMWithValueHead, ModelConfig

WORDS = ["good", "bad", "movie", "the", "was", "a", "very", "plot", "acting", "and", "it", "is", "not", "fun"]


def tiny_tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_config(vocab_size=len(WORDS) + 2):
    return ModelConfig.from_hf(dict(
        model_type="llama", vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0))


def tiny_policy(seed=0, value_head=False, **options):
    """options: the model classes' (dtype, param_dtype, remat, ...)."""
    cls = CausalLMWithValueHead if value_head else CausalLM
    return cls(tiny_config(), rngs=nnx.Rngs(seed), **options)


PROMPTS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 3)) for i in range(64)]


def write_tiny_run_inputs(root):
    """A tiny HF checkpoint directory (root/model) and a prompt file (root/prompts.jsonl) for `ppojax train`."""
    from ppojax.models import save_pretrained
    save_pretrained(tiny_policy(), tiny_config(), root / "model", tokenizer=tiny_tokenizer())
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def run_environment(torch: bool = False) -> dict:
    """The environment of a run the suite starts as a subprocess (`ppojax train`, a killed and resumed run): the CPU,
    the repository importable, and the suite's compilation cache and XLA flags (tests/conftest.py: every test file's
    runs share their programs), every program stored however quick to compile or small. The run sees a user's
    install, without torch (tests/without_torch), unless ``torch`` (a run that checks its export against
    transformers' torch model)."""
    tests = Path(__file__).resolve().parent
    path = [str(tests.parent)] + ([] if torch else [str(tests / "without_torch")])
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(path),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
