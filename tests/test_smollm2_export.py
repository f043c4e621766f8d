"""The real default policy (SmolLM2-135M-Instruct from its GGUF) through ppojax's export: transformers
loads it and writes the same greedy continuations as ppojax's sampler."""

import pytest
from flax import nnx

from ppojax.assets import smollm2_checkpoint
from ppojax.trainer.data import left_pad
from ppojax.trainer.export_check import greedy_continuations_agree
from ppojax.models import load_pretrained, load_tokenizer, save_pretrained


@pytest.mark.slow
def test_exported_smollm2_writes_ppojax_greedy_continuations(tmp_path):
    source = smollm2_checkpoint()
    model, cfg = load_pretrained(source)
    tokenizer = load_tokenizer(source)
    save_pretrained(model, cfg, tmp_path / "policy", tokenizer=tokenizer)
    graphdef, params = nnx.split(model)
    prompts = ["The movie was", "I did not expect the ending to be so", "Honestly, the acting"]
    queries = left_pad([tokenizer(p)["input_ids"] for p in prompts], 10, tokenizer.pad_token_id)
    result = greedy_continuations_agree(tmp_path / "policy", graphdef, params, queries, max_new_tokens=8,
                                        pad_token_id=tokenizer.pad_token_id,
                                        stop_token_id=tokenizer.eos_token_id)
    assert result["agree"], result
    assert all(len(row) > 0 for row in result["ppojax"])
