"""Demonstrations: written episodes laid out as the multi-turn sampler lays out the episodes it samples.

A model too small to call a tool it has only been told about (SmolLM2-135M shown the calculator, docs/agents.md)
can be shown a few episodes first and fine-tuned on them (``ppojax.trainer.warm_start``). For that to teach what
the run samples, a demonstration's tokens must be those of an episode: the prompt as the run renders it (with the
tools and the generation prompt), each model message encoded alone and ended by the end-of-turn token, each
observation the tokens :meth:`ChatRenderer.observation_ids` adds (the template's framing and the next generation
prompt). Only the model's messages are trained (``trained`` 1); the prompt and the observations are context (0),
as the policy mask has them in a run.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ppojax.agents.episodes import ChatRenderer

__all__ = ["Turn", "episode_stream"]

#: (the model's message as text, the messages that answer it: tool results or an environment's reply; None or
#: empty after the last message), one per model turn
Turn = tuple[str, Optional[list]]


def episode_stream(renderer: ChatRenderer, prompt: list, turns: Sequence[Turn], *,
                   end_of_turn_id: int) -> tuple[list, list]:
    """One written episode -> (token ids, trained: 1 for the model's tokens and its end-of-turn token, else 0).

    prompt: the conversation the episode starts from (chat messages); turns: :data:`Turn` s. A model message with a
    tool call enters the conversation as text, as the run keeps the model's messages (the template renders the
    observation after it the same either way for templates that only append, which the run requires)."""
    ids = renderer.prompt_ids(prompt)
    trained = [0] * len(ids)
    conversation = [dict(m) for m in prompt]
    for index, (message, answer) in enumerate(turns):
        written = renderer.encode(message) + [end_of_turn_id]
        ids += written
        trained += [1] * len(written)
        conversation.append({"role": "assistant", "content": message})
        if answer and index < len(turns) - 1:
            observation = renderer.observation_ids(conversation, list(answer))
            ids += observation
            trained += [0] * len(observation)
            conversation += list(answer)
    return ids, trained
