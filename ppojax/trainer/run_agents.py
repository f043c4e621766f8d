"""A run's tools and environment (the config's agents section) as the host's ``EpisodeHost`` and the program's
``EpisodeSource`` (docs/agents.md).

Built before the prompts are tokenized: an agent run's prompts are rendered with its chat template and the tools'
schemas (``template_kwargs``). Before each update the trainer starts the batch's episodes (:meth:`RunAgents.begin`:
one environment reset per episode with its dataset row); after it, an environment's error is raised
(:meth:`RunAgents.raise_pending`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ppojax.agents import CHATML_TOOLS_TEMPLATE, ChatRenderer, EpisodeHost, check_tool_template
from ppojax.agents.environments import EnvironmentFactory
from ppojax.agents.loading import load_environment, load_tool_call_parser, load_tools
from ppojax.errors import ConfigError, EnvironmentCallError
from ppojax.rl.episodes import EpisodeSource, host_callback
from ppojax.rl.rewards import ColumnTable
from ppojax.trainer.config import PPOConfig
from ppojax.trainer.data import left_pad

__all__ = ["RunAgents", "NoEnvironment"]


class NoEnvironment:
    """The environment of a run with standalone ``tools`` only: no state, no reward."""

    def reset(self, **row):
        return None


def _template(config: PPOConfig) -> Optional[str]:
    spec = config.tool_chat_template
    if spec is None:
        return None
    if spec == "chatml":
        return CHATML_TOOLS_TEMPLATE
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"tool_chat_template={spec!r} is neither 'chatml' nor a template file; name a .jinja file "
                          "or use 'chatml' (ppojax's ChatML template with tools).")
    return path.read_text()


class RunAgents:
    """config: a run's PPOConfig with tools or an environment_factory; tokenizer: the run's; stop_token_id: the end
    of a model turn (the run's stop token); pad_token_id: the run's."""

    def __init__(self, config: PPOConfig, tokenizer, *, stop_token_id: Optional[int], pad_token_id: int):
        if stop_token_id is None:
            raise ConfigError("an agent run (tools or environment_factory) needs a stop token that ends each of the "
                              "model's turns: set stop_token: eos (e.g. ChatML's <|im_end|>) or stop_token_id.")
        if not config.chat_template:
            raise ConfigError("an agent run (tools or environment_factory) renders its conversations with a chat "
                              "template: set chat_template: true.")
        self.config = config
        tools = load_tools(config.tools or [])
        parser = load_tool_call_parser(config.tool_call_parser)
        if config.environment_factory is not None:
            self.environments = load_environment(config.environment_factory, tools=tools, parser=parser,
                                                 tool_timeout=config.tool_timeout,
                                                 max_tool_calling_iterations=config.max_tool_calling_iterations)
        else:
            self.environments = EnvironmentFactory(NoEnvironment, name="tools", tools=tools, parser=parser,
                                                   tool_timeout=config.tool_timeout,
                                                   max_tool_calling_iterations=config.max_tool_calling_iterations)
        template = _template(config)
        schemas = self.environments.tool_schemas or None
        if schemas:
            check_tool_template(tokenizer, template, model=config.model_name_or_path or "the model")
        end_of_turn = tokenizer.convert_ids_to_tokens(stop_token_id)
        self.renderer = ChatRenderer(tokenizer, end_of_turn=end_of_turn, chat_template=template, tools=schemas)
        self.template_kwargs = {"tools": schemas, **({"chat_template": template} if template is not None else {})}
        shape_turns = config.max_tool_calling_iterations + 1
        self.host = EpisodeHost(self.environments, self.renderer, tokenizer, stop_token_id=stop_token_id,
                                pad_token_id=pad_token_id, observation_length=config.observation_length,
                                episode_length=config.response_length, max_turns=shape_turns)
        self.table: Optional[ColumnTable] = None
        self.texts: Optional[list] = None
        # a TRL environment rewards through get_reward(); a protocol one may also reward its turns (Step.reward)
        rewards = self.environments.owns_reward or self.environments.kind == "protocol"
        self.reward_name = (self.environments.label.rpartition(":")[2]
                            if config.environment_factory is not None and rewards else None)
        if self.reward_name is None and not (config.reward_model_path or config.reward_function or
                                             config.reward_funcs):
            raise ConfigError(f"nothing rewards the episodes: {self.environments.label} has no get_reward() and "
                              "no reward_funcs, reward_function or reward_model_path is set. Fix: give the "
                              "environment a get_reward() method, or set reward_funcs.")

    def source(self, shape, mesh) -> EpisodeSource:
        """The program's ``EpisodeSource``: the host's turns through a host callback, and the environment's reward."""
        return EpisodeSource(host_callback(self.host.turn, shape, mesh), self.reward_name)

    def attach(self, texts: list, table: Optional[ColumnTable], shared_prefix: Sequence[int] = ()) -> None:
        """The kept prompts (what the user wrote, in prompt-table order), their dataset columns and the tokens every
        prompt starts with where ``shared_prompt_prefix`` is on (a prompt rendered again must keep them)."""
        self.texts, self.table, self.shared_prefix = texts, table, list(shared_prefix)

    def begin(self, rows, prompt_ids, group_size: int = 1) -> np.ndarray:
        """Start the episodes of an update: rows i32[B] (the prompt-table rows of its episodes, each prompt's G =
        ``group_size`` consecutive), prompt_ids i32[B / G, P] their prompts as tokenized before training -> the
        prompts to play: the same, except where an environment's ``reset`` returned text, which TRL appends to the
        last user message: that prompt is rendered again with it and left padded to the same P."""
        rows = [int(r) for r in np.asarray(rows)]
        columns = self.table.rows(np.asarray(rows)) if self.table is not None else {}
        records = [{name: values[i] for name, values in columns.items()} for i in range(len(rows))]
        for record, row in zip(records, rows):
            record.setdefault(self.config.dataset_text_field, self.texts[row])
        messages = [[{"role": "user", "content": self.texts[row]}] if isinstance(self.texts[row], str)
                    else list(self.texts[row]) for row in rows]
        started = self.host.begin(records, rows, messages)
        if all(conversation == original for conversation, original in zip(started, messages)):
            return prompt_ids
        out = np.array(prompt_ids, dtype=np.int32, copy=True)
        width = out.shape[1]
        for prompt in range(len(rows) // group_size):
            group = started[prompt * group_size:(prompt + 1) * group_size]
            row = rows[prompt * group_size]
            if any(conversation != group[0] for conversation in group[1:]):
                raise EnvironmentCallError(
                    f"environment {self.environments.label}.reset returned different text for the {group_size} "
                    f"episodes of prompt row {row} (num_generations={group_size}); a group's episodes share one "
                    "prompt. Fix: make the text reset returns depend on the dataset row only.")
            if group[0] == messages[prompt * group_size]:
                continue
            ids = self.renderer.prompt_ids(group[0])
            if len(ids) > width:
                raise ConfigError(
                    f"prompt row {row} with the text {self.environments.label}.reset appended has {len(ids)} "
                    f"tokens, more than max_prompt_length={width}. Fix: raise max_prompt_length to at least "
                    f"{len(ids)}, or shorten the text reset returns.")
            if list(ids[:len(self.shared_prefix)]) != self.shared_prefix:
                raise ConfigError(
                    f"prompt row {row} with the text {self.environments.label}.reset appended no longer starts with "
                    f"the {len(self.shared_prefix)} tokens every prompt of the dataset starts with, which "
                    "shared_prompt_prefix=True runs once for all. Fix: set shared_prompt_prefix: false.")
            out[prompt] = left_pad([ids], width, self.host.pad_token_id)[0]
        return out

    def raise_pending(self) -> None:
        self.host.raise_pending()

    def metrics(self) -> dict:
        return self.host.metrics()
