"""Exports (`save_pretrained`, `save_peft_adapter`, `ppojax export`) are written whole or not at all, replace only
an earlier export, and never write into (or delete from) a directory of other files (`ppojax/io/export_dir.py`)."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

from ppojax.io.export_dir import MARKER, ExportDirError
from ppojax.models import CausalLM, load_pretrained, save_pretrained
from ppojax.models import hf_io
from tests.tiny_setup import tiny_config, tiny_tokenizer


def _files(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _policy(seed):
    return CausalLM(tiny_config(), rngs=nnx.Rngs(seed))


def test_a_directory_of_other_files_is_refused_and_left_as_it_was(tmp_path):
    """The mistake: exporting into a model directory that is not an export (here the base model, written by
    another tool). Nothing there is deleted or overwritten, and the error names the directory and the fix."""
    base = tmp_path / "base-model"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}\n')
    (base / "model.safetensors").write_bytes(b"the base model's weights")
    (base / "notes.txt").write_text("mine\n")
    before = _files(base)
    with pytest.raises(ExportDirError, match=r"base-model already holds files that ppojax did not export "
                                             r"\(config.json, model.safetensors, notes.txt\).*new or empty directory"):
        save_pretrained(_policy(0), tiny_config(), base)
    assert _files(base) == before
    assert [p.name for p in tmp_path.iterdir()] == ["base-model"]  # no temp directory left beside it
    with pytest.raises(ExportDirError, match="is a file, not a directory"):
        save_pretrained(_policy(0), tiny_config(), base / "notes.txt")


def test_an_export_replaces_an_earlier_export_whole(tmp_path):
    """A second export into the same directory: the new weights, and none of the earlier export's files
    (here its tokenizer and its shards) mixed in; an empty directory is a fine target too."""
    out = tmp_path / "policy"
    save_pretrained(_policy(0), tiny_config(), out, tokenizer=tiny_tokenizer(), max_shard_bytes=20_000)
    first = set(_files(out))
    assert {"tokenizer.json", "model.safetensors.index.json", MARKER} <= first
    save_pretrained(_policy(1), tiny_config(), out)
    assert set(_files(out)) == {"config.json", "model.safetensors", MARKER}
    assert json.loads((out / MARKER).read_text())["kind"] == "model"
    reloaded, _ = load_pretrained(out)
    expected = nnx.to_pure_dict(nnx.state(_policy(1)))
    for a, b in zip(jax_leaves(nnx.to_pure_dict(nnx.state(reloaded))), jax_leaves(expected)):
        np.testing.assert_array_equal(a, b)
    empty = tmp_path / "empty"
    empty.mkdir()
    save_pretrained(_policy(1), tiny_config(), empty)
    assert (empty / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "policy"]


def jax_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_an_export_that_fails_half_way_leaves_the_earlier_one_intact(tmp_path, monkeypatch):
    out = tmp_path / "policy"
    save_pretrained(_policy(0), tiny_config(), out)
    before = _files(out)
    calls = []

    def write_then_fail(path, tensors, metadata=None):
        calls.append(path)
        path.write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_io, "write_safetensors", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(_policy(1), tiny_config(), out)
    assert calls and _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # the half-written temp directory is gone


def test_ppojax_export_refuses_a_directory_of_other_files_before_loading_anything(tmp_path, capsys):
    """`ppojax export CHECKPOINT OUT_DIR` with OUT_DIR a directory of other files: exit 2 and the message, before
    the checkpoint is even looked at (it does not exist here)."""
    from ppojax.trainer.cli import main
    target = tmp_path / "my-project"
    target.mkdir()
    (target / "train.py").write_text("print('hi')\n")
    code = main(["export", str(tmp_path / "no-such-run"), str(target)])
    assert code == 2
    err = capsys.readouterr().err
    assert "my-project already holds files that ppojax did not export (train.py)" in err
    assert (target / "train.py").read_text() == "print('hi')\n" and len(list(target.iterdir())) == 1


def test_a_runs_own_output_dir_takes_the_export_beside_the_runs_files_as_in_trl(tmp_path):
    """TRL's idiom `trainer.save_model(args.output_dir)`: the model's files go beside the run's (no name is
    shared), transformers' loader finds them there, the run's files stay as they were, and a second export
    replaces exactly the first one's files."""
    from tests.test_trainer import make_trainer
    trainer = make_trainer(tmp_path, total_episodes=16)
    trainer.train(progress=False)
    run_dir = tmp_path / "run"
    run_files = _files(run_dir)
    assert "run.json" in run_files and "metrics.jsonl" in run_files
    trainer.save_model(run_dir)
    exported = set(_files(run_dir)) - set(run_files)
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= exported
    assert {name: data for name, data in _files(run_dir).items() if name in run_files} == run_files
    assert json.loads((run_dir / MARKER).read_text())["files"] == sorted(exported - {MARKER})
    reloaded, _ = load_pretrained(run_dir)
    for a, b in zip(jax_leaves(nnx.to_pure_dict(nnx.state(reloaded))), jax_leaves(trainer.policy_params)):
        np.testing.assert_array_equal(a, b)

    # the second export: sharded and without a tokenizer, so none of the first one's weights or tokenizer linger
    save_pretrained(reloaded, tiny_config(), run_dir, max_shard_bytes=20_000)
    now = set(_files(run_dir)) - set(run_files)
    assert "model.safetensors.index.json" in now
    assert "model.safetensors" not in now and "tokenizer.json" not in now
    assert {name: data for name, data in _files(run_dir).items() if name in run_files} == run_files
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".export.tmp-")]


def test_a_run_directory_file_an_export_would_replace_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text('{"status": "finished"}\n')
    (run_dir / "config.json").write_text('{"mine": true}\n')  # not an export's: never overwritten
    before = _files(run_dir)
    with pytest.raises(ExportDirError, match=r"is a ppojax run's directory and already holds config.json, which "
                                             r"no earlier export wrote; export into a new directory instead"):
        save_pretrained(_policy(0), tiny_config(), run_dir)
    assert _files(run_dir) == before and sorted(p.name for p in run_dir.iterdir()) == ["config.json", "run.json"]
