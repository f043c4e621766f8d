"""The data section: where the prompts come from, how they are read, and which are held out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppojax.trainer.config.fields import MUST_MATCH, NON_EMPTY, at_least, setting


@dataclass
class DataSettings:
    """The prompts of a run."""

    dataset: str = setting("movie_reviews", static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """Prompts: 'movie_reviews' (bundled), 'arithmetic' (generated word problems with an answer column),
    'arithmetic_tools' (the same, each prompt opening with two worked calculator calls), 'guess_number' (the game),
    or a local json/jsonl/csv/parquet file or HF datasets directory. Its other columns reach reward_funcs."""
    eval_dataset: Optional[str] = setting(None, static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """Held-out prompts from another dataset (e.g. 'arithmetic:test', or a test.jsonl): its first
    num_eval_prompts prompts. None: num_eval_prompts are taken off the end of dataset."""
    dataset_text_field: str = setting("prompt", static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """Column holding the prompt text."""
    max_prompt_length: int = setting(32, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Prompts are left padded to this many tokens; longer ones are filtered out (and counted)."""
    chat_template: bool = setting(False, static=False, on_resume=MUST_MATCH)
    """Wrap each prompt in the tokenizer's chat template before tokenising."""
    num_eval_prompts: int = setting(0, static=False, on_resume=MUST_MATCH, rule=at_least(0))
    """Held-out prompts (taken off the end of the dataset, never trained on), scored before and after
    training with near-greedy decoding (T = 0.01) for summary.json. 0: no evaluation."""
