"""Demonstrations: written episodes laid out as the multi-turn sampler lays out the episodes it samples.

A model too small to call a tool it has only been told about (SmolLM2-135M shown the calculator, docs/agents.md)
can be shown a few episodes first and fine-tuned on them (``ppojax.trainer.warm_start``). A demonstration is a
chat conversation, tool calls as structured ``tool_calls`` as in a chat dataset; for it to teach what the run
samples, its tokens must be those of an episode: the prompt as the run renders it (with the tools and the
generation prompt), each model message as the template writes it, encoded alone and ended by the end-of-turn
token, each observation the tokens :meth:`ChatRenderer.observation_ids` adds (the template's framing and the next
generation prompt). Only the model's messages are trained (``trained`` 1); the prompt and the observations are
context (0), as the policy mask has them in a run.
"""
from __future__ import annotations

from ppojax.agents.episodes import ChatRenderer

__all__ = ["episode_stream"]


def _model_text(renderer: ChatRenderer, before: list, message: dict) -> str:
    """What the model writes for ``message`` after the conversation ``before``: the template's rendering of it
    between the generation prompt and the end-of-turn text."""
    prompt = renderer.render(before, generation_prompt=True)
    whole = renderer.render(before + [message], generation_prompt=False)
    if not whole.startswith(prompt) or renderer.end_of_turn not in whole[len(prompt):]:
        raise ValueError("the chat template does not write an assistant message after its generation prompt, ended "
                         f"by {renderer.end_of_turn!r}: its episodes cannot be laid out as the run samples them")
    return whole[len(prompt):].split(renderer.end_of_turn)[0]


def episode_stream(renderer: ChatRenderer, conversation: list, *, end_of_turn_id: int) -> tuple[list, list]:
    """One written episode -> (token ids, trained: 1 for the model's tokens and their end-of-turn tokens, else 0).

    conversation: chat messages; those before the first assistant message are the prompt, each assistant message
    is a model turn, and the messages between two of them (tool results, an environment's reply) the observation
    the run appends. The episode ends with its last assistant message."""
    first = next((i for i, m in enumerate(conversation) if m.get("role") == "assistant"), None)
    if first is None or conversation[-1].get("role") != "assistant":
        raise ValueError("a demonstration needs an assistant message after its prompt and ends with one")
    ids = renderer.prompt_ids(conversation[:first])
    trained = [0] * len(ids)
    index = first
    while index < len(conversation):
        written = renderer.encode(_model_text(renderer, conversation[:index], conversation[index])) + [end_of_turn_id]
        ids += written
        trained += [1] * len(written)
        following = index + 1
        while following < len(conversation) and conversation[following].get("role") != "assistant":
            following += 1
        if following < len(conversation):
            observation = renderer.observation_ids(conversation[:index + 1], conversation[index + 1:following])
            ids += observation
            trained += [0] * len(observation)
        index = following
    return ids, trained
