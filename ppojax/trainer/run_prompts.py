"""A run's tokenizer and prompts: the token ids the run keys on (pad, stop), the prompt texts read from its dataset(s),
held-out prompts split off the training ones (the last ``num_eval_prompts``, or ``eval_dataset``'s), their token
ids, the dataset's columns for Python rewards, and the resumable batches of training prompts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np

from ppojax.models import load_tokenizer
from ppojax.rl.rewards import ColumnTable
from ppojax.trainer.config import ConfigError, PPOConfig
from ppojax.trainer.data import PromptBatches, check_tokenizer, prepare_prompts, prompt_display_text
from ppojax.trainer.prompt_sources import load_prompt_table
from ppojax.trainer.preflight import dataset_source, model_config_of
from ppojax.trainer.run_rewards import as_config_error


def with_eval_dataset(config, texts: list, columns: dict) -> tuple[list, dict, int]:
    """The training prompts followed by eval_dataset's first num_eval_prompts ones (and their columns, None where
    a dataset lacks a column) -> (texts, columns, number of training prompts)."""
    eval_texts, eval_columns = as_config_error(load_prompt_table, dataset_source(config, config.eval_dataset),
                                               column=config.dataset_text_field, name="eval_dataset")
    eval_texts = eval_texts[:config.num_eval_prompts]
    n_train, n_eval = len(texts), len(eval_texts)
    merged = {name: list(columns.get(name, [None] * n_train)) + list(eval_columns.get(name, [None] * n_eval))[:n_eval]
              for name in dict.fromkeys([*columns, *eval_columns])}
    return texts + eval_texts, merged, n_train


def split_eval(ids, num_eval):
    """Held-out prompts come off the END of the prompt set; the rest are for training."""
    if num_eval >= len(ids):
        raise ConfigError(f"num_eval_prompts={num_eval} leaves no training prompts out of {len(ids)}.")
    return (ids[:len(ids) - num_eval], ids[len(ids) - num_eval:]) if num_eval else (ids, None)



@dataclass(frozen=True)
class TokenIds:
    """The tokenizer and the ids a run keys on. stop_token_id: None when responses never stop early."""

    tokenizer: Any
    pad_token_id: int
    stop_token_id: Optional[int]
    vocab_size: int


def token_ids(config: PPOConfig, model, model_path, processing_class, uses_critic: bool) -> TokenIds:
    """The tokenizer (given, or the policy checkpoint's) and the pad and stop ids, checked against the policy's
    vocabulary (its config.json: no weights yet). model: a policy module the caller passed, else None."""
    policy_cfg = model.cfg if model is not None else model_config_of("policy", model_path)
    if processing_class is None:
        if model_path is None:
            raise ConfigError("processing_class (the tokenizer) is required when `model` is given.")
        processing_class = as_config_error(load_tokenizer, model_path)
    pad_token_id = as_config_error(check_tokenizer, processing_class, policy_cfg.vocab_size)
    stop_token_id = config.stop_token_id
    if stop_token_id is None and config.stop_token_is_eos:
        stop_token_id = processing_class.eos_token_id
    if stop_token_id is not None and stop_token_id == pad_token_id:
        raise ConfigError(f"stop token id {stop_token_id} equals the pad token id; ppojax keys its masks on "
                          "`token != pad`. Give the tokenizer a distinct pad token.")
    if uses_critic and config.value_head == "policy" and model is not None and not hasattr(model, "value"):
        raise ConfigError("value_head='policy' needs a CausalLMWithValueHead policy (load it with "
                          "kind='value_head'), or set value_head='separate'.")
    if config.shared_prompt_prefix and any(policy_cfg.sliding_layers):
        raise ConfigError("shared_prompt_prefix=True moves each prompt's shared start to the first slots, which a "
                          f"sliding attention window (the policy's sliding_window={policy_cfg.sliding_window}) would "
                          "see at other distances; set shared_prompt_prefix: false for this model.")
    if config.missing_eos_penalty is not None and stop_token_id is None:
        raise ConfigError("missing_eos_penalty is set but there is no stop token: every response would be "
                          "penalised. Set stop_token: eos (or stop_token_id).")
    return TokenIds(processing_class, pad_token_id, stop_token_id, policy_cfg.vocab_size)


def read_prompt_texts(config: PPOConfig, train_dataset) -> tuple[Optional[list], dict, Optional[int]]:
    """(texts, columns, how many of the texts are training prompts or None): the training dataset (given, or the
    config's), followed by eval_dataset's prompts when it is set; (None, {}, None) without a dataset."""
    if train_dataset is None and not config.dataset:
        return None, {}, None
    texts, columns = as_config_error(load_prompt_table,
                                     train_dataset if train_dataset is not None else dataset_source(config),
                                     column=config.dataset_text_field)
    if config.eval_dataset is None:
        return texts, columns, None
    return with_eval_dataset(config, texts, columns)


@dataclass
class RunPrompts:
    """train_queries / eval_queries: np i32[N, P] left-padded prompt ids (eval: held out, or None); table: the kept
    prompts' dataset columns (None without any); batches: the resumable prompt-batch iterator (None without a
    dataset: the legacy ``step()`` API); num_updates: the run's PPO updates; texts: what the user wrote of each
    kept prompt, training rows then held-out ones (``prompt_display_text``; None without a dataset);
    shared_prefix: the tokens every prompt, training and held-out, starts with where ``shared_prompt_prefix`` is on
    (:func:`shared_prefix_length` of them), else none."""

    train_queries: Optional[np.ndarray]
    eval_queries: Optional[np.ndarray]
    table: Optional[ColumnTable]
    batches: Optional[PromptBatches]
    num_updates: int
    texts: Optional[list] = None
    raw_texts: Optional[list] = None  # the kept prompts as the dataset holds them (a string or chat messages)
    shared_prefix: tuple = ()


def shared_prefix_length(prompt_ids: np.ndarray, pad_token_id: int) -> int:
    """The tokens every prompt of ``prompt_ids`` i32[N, P] (left padded) starts with (``shared_prompt_prefix``: a
    system message, a tool's schema): the longest common run of real tokens from each row's first one, at most
    the shortest prompt's length less one (each row keeps a token of its own for its next-token logits)."""
    real = prompt_ids != pad_token_id
    if len(prompt_ids) == 0 or not real.any(axis=1).all():
        return 0
    first = real.argmax(axis=1)
    width = int((prompt_ids.shape[1] - first).min())
    starts = np.stack([row[f:f + width] for row, f in zip(prompt_ids, first)])  # [N, width]
    same = (starts == starts[0]).all(axis=0) & (starts[0] != pad_token_id)
    common = width if same.all() else int(same.argmin())
    return max(0, min(common, width - 1))


def prompt_data(config: PPOConfig, texts, columns: dict, n_train_texts, tokens: TokenIds,
                data_parallel: int, template_kwargs: Optional[dict] = None) -> RunPrompts:
    """The prompt texts (:func:`read_prompt_texts`) as the run's token ids, held-out split, columns and batches.
    template_kwargs: more arguments of the chat template (an agent run's tools and template)."""
    train_queries = eval_queries = batches = table = shown = raw = None
    shared_prefix = ()
    if texts is not None:
        prompts = as_config_error(prepare_prompts, texts, tokens.tokenizer, config.max_prompt_length,
                                  chat_template=config.chat_template, stop_token_id=tokens.stop_token_id,
                                  pad_token_id=tokens.pad_token_id, template_kwargs=template_kwargs)
        num_eval = config.num_eval_prompts
        if n_train_texts is not None:  # held-out prompts from eval_dataset: those that survived the length filter
            num_eval = sum(i >= n_train_texts for i in prompts.indices)
            if num_eval == 0:
                raise ConfigError(f"eval_dataset={config.eval_dataset!r}: none of its prompts fits "
                                  f"max_prompt_length={config.max_prompt_length}; raise it.")
        train_queries, eval_queries = split_eval(prompts.input_ids, num_eval)
        if config.shared_prompt_prefix:
            ids = np.asarray(prompts.input_ids)
            first = int(np.argmax(ids[0] != tokens.pad_token_id))
            shared_prefix = tuple(ids[0, first:first + shared_prefix_length(ids, tokens.pad_token_id)].tolist())
        shown = [prompt_display_text(text) for text in prompts.texts]
        raw = list(prompts.texts)
        if columns:  # the kept prompts' rows, in prompt-table order (training rows first, then held-out ones)
            table = ColumnTable({name: [values[i] for i in prompts.indices] for name, values in columns.items()})
    sizes = config.derived(data_parallel)
    num_updates = config.num_updates(len(train_queries) if train_queries is not None else sizes.prompts_per_batch)
    if train_queries is not None:
        if len(train_queries) < sizes.prompts_per_batch:
            per_update = (f"batch_size={sizes.batch_size}" if config.num_generations == 1 else
                          f"the {sizes.prompts_per_batch} prompts an update takes (batch_size={sizes.batch_size} / "
                          f"num_generations={config.num_generations})")
            raise ConfigError(f"The dataset has {len(train_queries)} training prompts after filtering and "
                              f"holding out num_eval_prompts={config.num_eval_prompts}, fewer than "
                              f"{per_update}; lower batch_size or add prompts.")
        if len(train_queries) < sizes.prompts_per_round:
            raise ConfigError(f"The dataset has {len(train_queries)} training prompts after filtering and holding out "
                              f"num_eval_prompts={config.num_eval_prompts}, fewer than the {sizes.prompts_per_round} "
                              f"prompts of a generation round (gen_batch_size); lower gen_batch_size or add prompts.")
        # dynamic sampling: one batch per generation round; an update takes as many as it used
        batches = PromptBatches(train_queries, sizes.prompts_per_round, seed=config.seed,
                                process_index=jax.process_index(), process_count=jax.process_count())
    return RunPrompts(train_queries, eval_queries, table, batches, num_updates, shown, raw, shared_prefix)
