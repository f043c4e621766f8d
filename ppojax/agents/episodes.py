"""A batch of episodes on the host: an environment per episode, its conversation as chat messages, and each
observation as the tokens the chat template adds after the model's message, rendered and tokenized once.

The compiled turn loop (``ppojax.rl.episodes``) calls :meth:`EpisodeHost.turn` after every model turn with the turn's
tokens; the host decodes each message (the model's tokens themselves stay in the trained stream, never
re-tokenized), steps the episode's environment, and answers with the observation's token ids.

The observation's tokens. With ``before`` the conversation rendered up to the model's message and ``after`` the
conversation with the observation's messages and the generation prompt, the tokens appended are those of

    the text after the model's end-of-turn token in ``before`` (e.g. ChatML's newline)  +  after[len(before):]

so the prompt, the model's tokens and the observations' tokens together are the template's rendering of the whole
conversation (tests/test_episode_host.py, for ChatML, Llama 3 and Qwen 2.5 templates). A template that rewrites
earlier messages when one is added (``before`` is not a prefix of ``after``, e.g. one that drops earlier reasoning)
is refused with :class:`TemplateRewritesHistory`.

An episode ends when its environment says ``done`` (a TRL environment: a message without tool calls, or the call
after ``max_tool_calling_iterations``), when the model's turn did not end with its end-of-turn token (truncated:
the environment is not stepped), when the observation does not fit (more than ``observation_length`` tokens, or no
room left in the stream for another model token: counted as ``episodes/observation_overflow``), or after the last
turn. When it ends, the environment's ``get_reward()`` (where it has one) is added to its turn rewards.

An environment that raises never raises inside the compiled program: the batch's episodes end, the error is kept,
and :meth:`EpisodeHost.raise_pending` re-raises it (one ``EnvironmentCallError`` naming the environment, the method
and the dataset row) once the program has returned.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import numpy as np

from ppojax.agents.environments import EnvironmentFactory, final_reward, reset_all, step_all
from ppojax.errors import ConfigError

__all__ = ["ChatRenderer", "EpisodeHost", "TemplateRewritesHistory"]


class TemplateRewritesHistory(ConfigError):
    """The chat template renders earlier messages differently once a message is added: an episode's tokens could
    not stay the model's own."""


class ChatRenderer:
    """Prompts and observations through one chat template, with the run's tools.

    tokenizer: a Hugging Face tokenizer; chat_template: a template to use instead of the tokenizer's (None: its
    own); tools: the tool schemas the prompt shows (None: none); end_of_turn: the text of the token that ends the
    model's messages (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``)."""

    def __init__(self, tokenizer, *, end_of_turn: str, chat_template: Optional[str] = None,
                 tools: Optional[list] = None):
        self.tokenizer, self.end_of_turn = tokenizer, end_of_turn
        self.chat_template, self.tools = chat_template, tools or None

    def render(self, messages: list, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, chat_template=self.chat_template,
                                                  add_generation_prompt=generation_prompt, tokenize=False)

    def encode(self, text: str) -> list:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list) -> list:
        """A conversation's prompt: the messages and the generation prompt, as token ids."""
        return self.encode(self.render(messages, generation_prompt=True))

    def observation_ids(self, conversation: list, observation: list) -> list:
        """The token ids the template adds after the model's last message (the last of ``conversation``) for the
        ``observation`` messages and the next generation prompt (module docstring)."""
        before = self.render(conversation, generation_prompt=False)
        after = self.render(conversation + observation, generation_prompt=True)
        if not after.startswith(before):
            raise TemplateRewritesHistory(
                "the chat template renders the earlier messages of a conversation differently once a message is "
                "added, so a multi-turn episode's tokens could not stay those the model sampled. Use a template "
                "that only appends (e.g. ppojax.agents.CHATML_TOOLS_TEMPLATE for ChatML models).")
        cut = before.rfind(self.end_of_turn)
        if cut < 0:
            raise ConfigError(f"the chat template does not end the model's messages with {self.end_of_turn!r} (the "
                              "stop token): set stop_token to the token that ends an assistant message.")
        return self.encode(before[cut + len(self.end_of_turn):] + after[len(before):])


class EpisodeHost:
    """The host side of a run's episodes (module docstring).

    environments: the run's ``EnvironmentFactory``; renderer: its ``ChatRenderer``; tokenizer: decodes the model's
    messages; stop_token_id / pad_token_id: the end-of-turn and padding ids; observation_length, episode_length:
    the ``EpisodeShape``'s O and T; max_turns: its turns (the last turn's observation is never appended)."""

    def __init__(self, environments: EnvironmentFactory, renderer: ChatRenderer, tokenizer, *, stop_token_id: int,
                 pad_token_id: int, observation_length: int, episode_length: int, max_turns: int):
        self.environments, self.renderer, self.tokenizer = environments, renderer, tokenizer
        self.stop_token_id, self.pad_token_id = stop_token_id, pad_token_id
        self.observation_length, self.episode_length, self.max_turns = observation_length, episode_length, max_turns
        self.overflows = 0
        self._lock = threading.Lock()
        self._errors: list = []
        self._envs, self._rows, self._conversations, self._open = [], [], [], []

    # -- the batch's start (before its prompts are tokenized) ---------------------------------------------------
    def begin(self, rows: Sequence[dict], row_ids: Sequence[int], messages: Sequence[list]) -> list:
        """Reset one environment per episode with its dataset row (TRL's ``reset(**row)``) -> each episode's prompt
        messages: ``messages`` with the text ``reset`` returned appended to the last user message (TRL)."""
        self._envs = self.environments.take(len(rows))
        self._rows = list(row_ids)
        starts = reset_all(self._envs, [dict(r) for r in rows], self._rows)
        self._conversations = []
        for conversation, start in zip(messages, starts):
            conversation = [dict(m) for m in conversation]
            if start:
                users = [i for i, m in enumerate(conversation) if m.get("role") == "user"]
                if not users:
                    conversation.append({"role": "user", "content": start})
                else:
                    conversation[users[-1]]["content"] = str(conversation[users[-1]]["content"]) + start
            self._conversations.append(conversation)
        self._open = [True] * len(rows)
        self._errors = []
        self.environments.runner.counters.reset()  # the counters are the batch's
        self.overflows = 0
        return [list(c) for c in self._conversations]

    def prompt_ids(self) -> list:
        """The batch's prompts as token ids (after :meth:`begin`)."""
        return [self.renderer.prompt_ids(c) for c in self._conversations]

    def conversation(self, episode: int) -> list:
        """Episode ``episode``'s chat messages so far (the model's messages as decoded text)."""
        return list(self._conversations[episode])

    # -- a turn, called from the compiled program ---------------------------------------------------------------
    def turn(self, turn, episode, tokens, ended, running, stream_length):
        """The compiled loop's ``host_turn`` on the host (``ppojax.rl.episodes.HostTurn``), for the rows of one
        device: numpy arrays in, (observation i32[n, O], observation_length i32[n], goes_on bool[n], reward
        f32[n]) out. Never raises: an environment's error is kept for :meth:`raise_pending`."""
        n, width = len(episode), self.observation_length
        observation = np.full((n, width), self.pad_token_id, np.int32)
        lengths = np.zeros(n, np.int32)
        goes_on = np.zeros(n, bool)
        reward = np.full(n, np.nan, np.float32)
        with self._lock:
            failed = bool(self._errors)
        if failed:  # an environment raised earlier in this batch: the batch's episodes end as their turns do
            return observation, lengths, goes_on, reward
        try:
            self._turn(np.asarray(turn), np.asarray(episode), np.asarray(tokens), np.asarray(ended),
                       np.asarray(running), np.asarray(stream_length), observation, lengths, goes_on, reward)
        except Exception as err:  # noqa: BLE001 - re-raised by raise_pending() after the program returns
            with self._lock:
                self._errors.append(err)
            goes_on[:] = False
        return observation, lengths, goes_on, reward

    def _turn(self, turn, episode, tokens, ended, running, stream_length, observation, lengths, goes_on, reward):
        width = self.observation_length
        live = [i for i in range(len(episode)) if running[i]]
        messages = {i: self._message(tokens[i]) for i in live}
        stepped = [i for i in live if ended[i]]  # a truncated message is not an action: the episode just ends
        steps = step_all([self._envs[episode[i]] for i in stepped], [messages[i] for i in stepped],
                         [self._rows[episode[i]] for i in stepped]) if stepped else []
        outcome = dict(zip(stepped, steps))
        for i in live:
            e, last_turn = int(episode[i]), turn[i] + 1 >= self.max_turns
            self._conversations[e].append({"role": "assistant", "content": messages[i]})
            step = outcome.get(i)
            turn_reward = None if step is None else step.reward
            keeps_going = step is not None and not step.done and not last_turn and step.observation is not None
            if keeps_going:
                observed = ([{"role": "user", "content": step.observation}] if isinstance(step.observation, str)
                            else list(step.observation))
                ids = self.renderer.observation_ids(self._conversations[e], observed)
                if len(ids) <= width and stream_length[i] + len(ids) < self.episode_length:
                    observation[i, width - len(ids):] = ids
                    lengths[i] = len(ids)
                    self._conversations[e].extend(observed)
                else:
                    keeps_going = False
                    with self._lock:
                        self.overflows += 1
            goes_on[i] = keeps_going
            if not keeps_going:
                self._open[e] = False
                final = final_reward(self._envs[e], self._rows[e])
                if final is not None:
                    turn_reward = final if turn_reward is None else turn_reward + final
            reward[i] = np.nan if turn_reward is None else turn_reward

    def _message(self, tokens) -> str:
        """A turn's tokens as the message text: up to the end-of-turn token, pad cut, special tokens kept (a
        template's ``<tool_call>`` may be one)."""
        ids = [int(t) for t in tokens if t != self.pad_token_id]
        if self.stop_token_id in ids:
            ids = ids[:ids.index(self.stop_token_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- after the program ---------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """The batch's tool counters and the observations that did not fit (``tools/*``, ``episodes/*``), since
        the last :meth:`begin`."""
        out = self.environments.runner.counters.metrics()
        out["episodes/observation_overflow"] = float(self.overflows)
        return out

    def raise_pending(self) -> None:
        """Re-raise the first error an environment raised during the last program (EnvironmentCallError)."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

