"""The host side of multi-turn episodes (ppojax.agents.episodes) and its bridge into the compiled turn loop.

- For three chat templates given as text (ChatML with tools as SmolLM2 uses it, Llama 3.1, Qwen 2.5), an episode's
  prompt, the model's tokens and the observations' tokens are the template's rendering of the whole conversation
  (tool calls as structured ``tool_calls``, tool results as tool messages), when the model's messages are the
  canonical tokens of their text: token for token for the ChatML templates, whose tokenizer SmolLM2's is; as text
  for Llama 3.1 (its special tokens added to SmolLM2's tokenizer, whose pre-tokenizer splits the prompt's final
  "\n\n" from the text after it differently from Llama 3's own, at the prompt's end only).
- A tool that raises, one that hangs, a malformed call and a call to no tool come back as observations, counted;
  an environment that raises ends the batch's episodes and is re-raised after the program, naming the environment,
  the method and the row; an observation that does not fit ends its episode, counted.
- A template that rewrites earlier messages is refused.
- Through ``io_callback`` inside the compiled loop, a host gives the episodes the traced version of it gives.
"""
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.agents import CHATML_TOOLS_TEMPLATE, EnvironmentFactory
from ppojax.agents.episodes import ChatRenderer, EpisodeHost, TemplateRewritesHistory
from ppojax.errors import EnvironmentCallError
from ppojax.rl.episodes import EpisodeShape, HostAnswer, generate_episodes, host_callback
from tests.tiny_setup import tiny_policy

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
LLAMA3_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from ppojax.assets import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint(log=lambda *a, **k: None)))


class Calculator:
    """A TRL-style environment: its public methods are the tools."""

    def reset(self, **row):
        self.calls = 0
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    def divide(self, a: int, b: int) -> float:
        """Divide a by b.

        Args:
            a: The dividend.
            b: The divisor.
        """
        return a / b

    def wait(self, seconds: float) -> str:
        """Wait a while.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "waited"


# (template, end-of-turn token, how the model writes a call, the parser)
def chatml_call(name, args):
    import json
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + '}\n</tool_call>'


def llama3_call(name, args):
    import json
    return '{"name": "' + name + '", "parameters": ' + json.dumps(args) + '}'


CASES = {
    "chatml": (CHATML_TOOLS_TEMPLATE, "<|im_end|>", chatml_call, "hermes"),
    "qwen2.5": ((TEMPLATES / "qwen2.5.jinja").read_text(), "<|im_end|>", chatml_call, "hermes"),
    "llama3.1": ((TEMPLATES / "llama3.1.jinja").read_text(), "<|eot_id|>", llama3_call, "llama3"),
}

# each episode: the model's messages, turn by turn ((tool name, arguments) for a call, a string for prose)
SCRIPTS = [
    [("multiply", {"a": 3, "b": 4}), "The answer is 12."],
    [("divide", {"a": 1, "b": 0}), ("multiply", {"a": 6, "b": 7}), "It is 42."],
    ["No tool needed: 5."],
]


def tokenizer_for(case):
    tok = smollm2_tokenizer()
    if case == "llama3.1":
        tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
    return tok


def make_host(case, tok, shape, **factory):
    template, end, _, parser = CASES[case]
    environments = EnvironmentFactory(Calculator, parser=parser, **factory)
    renderer = ChatRenderer(tok, end_of_turn=end, chat_template=template, tools=environments.tool_schemas)
    stop = tok.convert_tokens_to_ids(end)
    host = EpisodeHost(environments, renderer, tok, stop_token_id=stop, pad_token_id=tok.pad_token_id,
                       observation_length=shape.observation_length, episode_length=shape.episode_length,
                       max_turns=shape.max_turns)
    return host, stop


def play(host, stop, pad, scripts, write, shape):
    """The compiled loop's bookkeeping in plain Python, the model replaced by scripted messages (their canonical
    tokens and the end-of-turn token): -> each episode's stream and environment mask."""
    n, Rt = len(scripts), shape.turn_length
    streams, masks = [[] for _ in range(n)], [[] for _ in range(n)]
    running = np.ones(n, bool)
    for turn in range(shape.max_turns):
        tokens = np.full((n, Rt), pad, np.int32)
        for e in range(n):
            if running[e]:
                message = scripts[e][turn]
                text = message if isinstance(message, str) else write(*message)
                ids = host.tokenizer(text, add_special_tokens=False)["input_ids"] + [stop]
                assert len(ids) <= Rt
                tokens[e, :len(ids)] = ids
                streams[e] += ids
                masks[e] += [False] * len(ids)
        ended = running.copy()
        lengths = np.array([len(s) for s in streams], np.int32)
        observation, observed, goes_on, _ = host.turn(np.full(n, turn, np.int32), np.arange(n, dtype=np.int32), tokens,
                                                      ended, running,
                                                      lengths)
        for e in np.flatnonzero(goes_on):
            ids = observation[e, shape.observation_length - observed[e]:].tolist()
            streams[e] += ids
            masks[e] += [True] * len(ids)
        running = goes_on
        if not running.any():
            break
    return streams, masks


def conversation(prompt, script, results, write_call):
    """The whole conversation as a chat library writes it: structured tool calls, tool messages."""
    messages = [{"role": "user", "content": prompt}]
    for message, result in zip(script, results + [None]):
        if isinstance(message, str):
            messages.append({"role": "assistant", "content": message})
        else:
            name, args = message
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
            messages.append({"role": "tool", "name": name, "content": result})
    return messages


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_trained_tokens_are_the_templates_rendering_of_the_conversation(case):
    tok = tokenizer_for(case)
    shape = EpisodeShape(turn_length=48, observation_length=48, max_turns=3, episode_length=200)
    host, stop = make_host(case, tok, shape)
    prompts = ["What is 3 times 4?", "Compute 6 times 7.", "What is 2 plus 3?"]
    chats = host.begin([{"prompt": p} for p in prompts], [10, 11, 12], [[{"role": "user", "content": p}]
                                                                        for p in prompts])
    prompt_ids = host.prompt_ids()
    assert chats[0] == [{"role": "user", "content": prompts[0]}]  # reset returned None: the prompt unchanged
    _, end, write, _ = CASES[case]
    streams, masks = play(host, stop, tok.pad_token_id, SCRIPTS, write, shape)
    results = [["12"], ["{'error': 'division by zero'}", "42"], []]
    for e, script in enumerate(SCRIPTS):
        full = tok.apply_chat_template(conversation(prompts[e], script, results[e], write),
                                       tools=host.environments.tool_schemas, chat_template=CASES[case][0],
                                       tokenize=False)
        full = full[:full.rfind(end) + len(end)]  # the stream ends at the model's last end-of-turn token
        assert tok.decode(prompt_ids[e] + streams[e]) == full, case
        if case != "llama3.1":  # SmolLM2's tokenizer is ChatML's: token for token too
            assert prompt_ids[e] + streams[e] == tok(full, add_special_tokens=False)["input_ids"], case
        # the environment's tokens are the tool results' framing, never the model's
        env_text = tok.decode([t for t, m in zip(streams[e], masks[e]) if m])
        for result in results[e]:
            assert result.strip("'") in env_text or result in env_text
        assert sum(not m for m in masks[e]) == sum(
            len(tok((m if isinstance(m, str) else write(*m)), add_special_tokens=False)["input_ids"]) + 1
            for m in script)
    assert host.metrics()["tools/calls"] == 3 and host.metrics()["tools/errors"] == 1
    host.begin([{"prompt": prompts[0]}], [13], [[{"role": "user", "content": prompts[0]}]])  # the next batch
    assert host.metrics()["tools/calls"] == host.metrics()["tools/errors"] == 0  # counts are per batch


def test_failures_are_observations_and_counted():
    tok = tokenizer_for("chatml")
    shape = EpisodeShape(turn_length=64, observation_length=160, max_turns=2, episode_length=400)
    host, stop = make_host("chatml", tok, shape, tool_timeout=0.5)
    scripts = [[("wait", {"seconds": 5}), "ok"], ["<tool_call>\n{\"name\": \"multiply\", \"arguments\": 3}\n"
                                                   "</tool_call>", "ok"], [("square", {"x": 2}), "ok"]]
    host.begin([{}] * 3, [0, 1, 2], [[{"role": "user", "content": "go"}]] * 3)
    streams, masks = play(host, stop, tok.pad_token_id, scripts, chatml_call, shape)
    observations = [tok.decode([t for t, m in zip(s, k) if m]) for s, k in zip(streams, masks)]
    assert "timed out after 0.5 s" in observations[0]
    assert "Malformed tool call" in observations[1]
    assert "Tool square not found." in observations[2]
    metrics = host.metrics()
    assert (metrics["tools/calls"], metrics["tools/timeouts"], metrics["tools/malformed"],
            metrics["tools/errors"]) == (3, 1, 1, 1)


def test_an_observation_that_does_not_fit_ends_the_episode():
    tok = tokenizer_for("chatml")
    shape = EpisodeShape(turn_length=64, observation_length=8, max_turns=2, episode_length=300)
    host, stop = make_host("chatml", tok, shape)
    host.begin([{}], [0], [[{"role": "user", "content": "go"}]])
    streams, masks = play(host, stop, tok.pad_token_id, [[("multiply", {"a": 2, "b": 3}), "6"]], chatml_call,
                          shape)
    assert not any(masks[0]) and host.metrics()["episodes/observation_overflow"] == 1


class Broken:
    def reset(self, **row):
        return None

    def step(self, action):
        raise KeyError("guess")


def test_an_environment_that_raises_ends_the_batch_and_is_raised_after():
    from ppojax.agents import Environment

    class Game(Broken, Environment):
        pass

    tok = tokenizer_for("chatml")
    environments = EnvironmentFactory(Game)
    renderer = ChatRenderer(tok, end_of_turn="<|im_end|>", chat_template=CHATML_TOOLS_TEMPLATE)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    host = EpisodeHost(environments, renderer, tok, stop_token_id=stop, pad_token_id=tok.pad_token_id,
                       observation_length=8, episode_length=40, max_turns=2)
    host.begin([{}, {}], [7, 8], [[{"role": "user", "content": "guess"}]] * 2)
    tokens = np.full((2, 8), tok.pad_token_id, np.int32)
    tokens[:, :2] = [tok("5")["input_ids"][0], stop]
    _, _, goes_on, _ = host.turn(np.zeros(2, np.int32), np.arange(2), tokens, np.ones(2, bool), np.ones(2, bool),
                                 np.full(2, 2))
    assert not goes_on.any()
    with pytest.raises(EnvironmentCallError, match=r"environment Game\.step raised KeyError: 'guess' on row 7"):
        host.raise_pending()


def test_after_an_environment_raised_the_other_episodes_end_at_their_next_turn_unstepped():
    """Rows answer at their own steps: once one environment raised, a later call for another episode ends it
    without stepping its environment (the batch's episodes end), and the first error is the one raised after."""
    from ppojax.agents import Environment

    stepped = []

    class Game(Environment):
        def reset(self, **row):
            self.row = row["n"]

        def step(self, action):
            stepped.append(self.row)
            if self.row == 0:
                raise KeyError("guess")
            return "again"

    tok = tokenizer_for("chatml")
    renderer = ChatRenderer(tok, end_of_turn="<|im_end|>", chat_template=CHATML_TOOLS_TEMPLATE)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    host = EpisodeHost(EnvironmentFactory(Game), renderer, tok, stop_token_id=stop, pad_token_id=tok.pad_token_id,
                       observation_length=16, episode_length=60, max_turns=3)
    host.begin([{"n": 0}, {"n": 1}], [7, 8], [[{"role": "user", "content": "guess"}]] * 2)
    tokens = np.full((2, 8), tok.pad_token_id, np.int32)
    tokens[:, :2] = [tok("5")["input_ids"][0], stop]
    first, second = np.array([True, False]), np.array([False, True])
    _, _, goes_on, _ = host.turn(np.zeros(2, np.int32), np.arange(2), tokens, np.ones(2, bool), first, np.full(2, 2))
    assert not goes_on.any() and stepped == [0]
    _, _, goes_on, _ = host.turn(np.zeros(2, np.int32), np.arange(2), tokens, np.ones(2, bool), second, np.full(2, 2))
    assert not goes_on.any() and stepped == [0]  # episode 1's environment is not stepped
    with pytest.raises(EnvironmentCallError, match=r"environment Game\.step raised KeyError: 'guess' on row 7"):
        host.raise_pending()


def test_a_template_that_rewrites_history_is_refused():
    tok = tokenizer_for("chatml")
    rewriting = ("{%- for m in messages %}{%- if loop.last %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                 "'<|im_end|>\\n' }}{%- else %}{{ '<|im_start|>' + m['role'] + '\\n<|im_end|>\\n' }}{%- endif %}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
    renderer = ChatRenderer(tok, end_of_turn="<|im_end|>", chat_template=rewriting)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(TemplateRewritesHistory, match="renders the earlier messages"):
        renderer.observation_ids(chat, [{"role": "user", "content": "again"}])


# ---------------------------------------------------------------------------------------- through io_callback
def test_a_host_reached_through_io_callback_gives_the_traced_hosts_episodes():
    B, P, pad = 6, 4, 0
    shape = EpisodeShape(turn_length=5, observation_length=3, max_turns=3, episode_length=20)
    prompts = jnp.asarray(np.random.default_rng(2).integers(2, 16, size=(B, P)), jnp.int32)

    def numpy_host(turn, episode, tokens, ended, running, stream_length):  # on the host: numpy arrays
        n = len(episode)
        obs = np.full((n, 3), pad, np.int32)
        obs[:, 1:] = (np.asarray(episode)[:, None] + np.asarray(turn)[:, None] + np.arange(2)) % 14 + 2
        return (obs, np.full(n, 2, np.int32), np.asarray(running) & (np.asarray(episode) % 2 == 1),
                np.where(running, np.asarray(turn, np.float32), np.nan).astype(np.float32))

    def traced_host(turn, episode, tokens, ended, running, stream_length):
        obs = jnp.concatenate([jnp.full((B, 1), pad, jnp.int32),
                               (episode[:, None] + turn[:, None] + jnp.arange(2)) % 14 + 2], axis=1)
        return HostAnswer(obs, jnp.full((B,), 2, jnp.int32), running & (episode % 2 == 1),
                          jnp.where(running, turn.astype(jnp.float32), jnp.nan))

    graphdef, params = nnx.split(tiny_policy(0))

    def episodes(host):
        return jax.jit(lambda p, x, k: generate_episodes(graphdef, p, x, k, shape=shape, host_turn=host,
                                                         pad_token_id=pad, stop_token_id=5, temperature=1.0,
                                                         top_k=3))(params, prompts, jax.random.key(1))

    through_host = episodes(host_callback(numpy_host, shape))
    traced = episodes(traced_host)
    for a, b in zip(through_host, traced):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(jnp.max(traced.turns)) > 1
