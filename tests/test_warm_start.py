"""The warm start before RL: written episodes laid out as the sampler lays out episodes, and the supervised steps.

- A calculator demonstration's stream is the chat template's rendering of the whole conversation (the call as a
  structured tool call, the result as a tool message), token for token, with SmolLM2's tokenizer and ppojax's
  ChatML tools template; exactly the model's two messages and their end-of-turn tokens are trained.
- Every arithmetic kind's working is one expression that the calculator evaluates to the record's answer.
- The masked loss equals a plain numpy cross-entropy over the trained positions; the warm start takes the steps
  its mini-batches make and teaches the tiny model a demonstrated message.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.agents import CHATML_TOOLS_TEMPLATE, ChatRenderer, ToolCall, parse_hermes, tool_schemas
from ppojax.agents.demonstrations import episode_stream
from ppojax.models import apply_causal_lm
from ppojax.tasks.arithmetic import KINDS, problems
from ppojax.tasks.calculator import calculate, demonstration, working_expression
from ppojax.trainer.warm_start import masked_nll, pad_streams, warm_start
from tests.tiny_setup import tiny_policy


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from ppojax.assets import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint(log=lambda *a, **k: None)))


def test_a_calculator_demonstration_is_the_templates_rendering_of_its_conversation():
    tokenizer = smollm2_tokenizer()
    renderer = ChatRenderer(tokenizer, end_of_turn="<|im_end|>", chat_template=CHATML_TOOLS_TEMPLATE,
                            tools=tool_schemas([calculate]))
    record = next(problems(3, 1, kinds=("two_steps",)))
    conversation = demonstration(record)
    ids, trained = episode_stream(renderer, conversation, end_of_turn_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))

    rendered = tokenizer.apply_chat_template(conversation, tools=tool_schemas([calculate]),
                                             chat_template=CHATML_TOOLS_TEMPLATE, tokenize=False)
    assert rendered.endswith("<|im_end|>\n")
    assert ids == tokenizer(rendered[:-1], add_special_tokens=False)["input_ids"]
    assert len(trained) == len(ids)
    pieces, run = [], []
    for token, flag in zip(ids, trained):
        if flag:
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    pieces.append(tokenizer.decode(run))
    expression = working_expression(record["answer"])
    result = record["answer"].split("#### ")[1]
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'
    assert pieces == [call + "<|im_end|>", f"{expression} = {result}\n#### {result}<|im_end|>"]
    assert parse_hermes(call).calls == (ToolCall("calculate", {"expression": expression}),)  # what the run parses


def test_a_demonstration_without_a_model_message_is_refused():
    renderer = ChatRenderer(smollm2_tokenizer(), end_of_turn="<|im_end|>", chat_template=CHATML_TOOLS_TEMPLATE)
    with pytest.raises(ValueError, match="needs an assistant message"):
        episode_stream(renderer, [{"role": "user", "content": "hi"}], end_of_turn_id=2)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kinds_working_is_one_expression_worth_the_answer(kind):
    for record in problems(7, 50, kinds=(kind,), max_number=999):
        assert calculate(working_expression(record["answer"])) == record["answer"].split("#### ")[1]


def _streams():
    return [([5, 3, 7, 2, 9, 4], [0, 0, 1, 1, 0, 1]), ([6, 8, 2], [0, 1, 1]), ([3, 3, 3, 3, 5], [0, 0, 0, 1, 1])]


def test_pad_streams_right_pads_and_refuses_mismatched_flags():
    batch = pad_streams(_streams(), pad_token_id=0)
    assert batch["ids"].tolist()[1] == [6, 8, 2, 0, 0, 0]
    assert batch["attention_mask"].sum(1).tolist() == [6, 3, 5]
    assert batch["trained"].tolist()[2] == [0, 0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="stream 0: 2 ids but 1 trained flags"):
        pad_streams([([1, 2], [1])], 0)


def test_the_masked_loss_is_the_cross_entropy_of_the_trained_tokens():
    graphdef, params = nnx.split(tiny_policy(seed=3))
    batch = pad_streams(_streams(), pad_token_id=0)
    loss = masked_nll(graphdef, params, *(jnp.asarray(batch[k]) for k in ("ids", "attention_mask", "trained")))
    logits = np.asarray(apply_causal_lm(graphdef, params, jnp.asarray(batch["ids"]),
                                        jnp.asarray(batch["attention_mask"]))[0], np.float64)
    terms = []
    for row, (ids, trained) in enumerate(_streams()):
        for t in range(1, len(ids)):
            if trained[t]:
                z = logits[row, t - 1]
                terms.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[ids[t]])
    assert float(loss) == pytest.approx(np.mean(terms), rel=1e-5)


def test_the_warm_start_teaches_a_demonstrated_message():
    graphdef, params = nnx.split(tiny_policy(seed=1))
    streams = [([2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 1, 1])] * 4
    batch = pad_streams(streams, pad_token_id=0)
    logged = []
    trained, losses = warm_start(graphdef, params, batch, learning_rate=1e-2, batch_size=2, epochs=15, seed=0,
                                 log=lambda step, loss: logged.append((step, loss)))
    assert len(losses) == 30 and logged == list(enumerate(losses, 1))  # 2 mini-batches an epoch
    assert losses[-1] < 0.05 * losses[0]
    logits = apply_causal_lm(graphdef, trained, jnp.asarray(batch["ids"][:1]),
                             jnp.asarray(batch["attention_mask"][:1]))[0]
    assert np.asarray(jnp.argmax(logits[0, 1:5], -1)).tolist() == [4, 5, 6, 7]  # the trained tokens, greedy
    untouched = jax.tree.leaves(params)
    assert any(not np.allclose(a, b) for a, b in zip(untouched, jax.tree.leaves(trained)))
    with pytest.raises(ValueError, match="batch_size=5: expected 1 to the 4 streams given"):
        warm_start(graphdef, params, batch, learning_rate=1e-2, batch_size=5, epochs=1)


@pytest.mark.parametrize("args, message", [
    (["--episodes", "0"], "--episodes 0: expected 1 to the 2000 problems"),
    (["--batch-size", "65"], r"--batch-size 65: expected 1 to --episodes \(64\)"),
    (["--epochs", "0"], "--epochs and --learning-rate must be positive"),
    (["--taken"], "already holds files that ppojax did not export"),
])
def test_the_warm_start_example_refuses_a_bad_value_before_loading_the_model(args, message, tmp_path, capsys,
                                                                             monkeypatch):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "calculator_warm_start", Path(__file__).parents[1] / "examples" / "calculator_warm_start.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(example, "load_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "out"
    if args == ["--taken"]:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        args = []
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--out", str(out), *args])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
