"""The prompt pipeline: prompts (``ppojax.trainer.prompt_sources``) → tokenized, filtered, LEFT-padded prompts →
resumable, seeded batches.

    texts = load_prompt_dataset("prompts.jsonl", column="prompt")       # ppojax.trainer.prompt_sources
    pad_id = check_tokenizer(tokenizer, vocab_size=model_vocab_size)    # pad != eos, vocab fits the model
    prompts = prepare_prompts(texts, tokenizer, max_prompt_length=64, stop_token_id=eos)  # PromptSet
    batches = PromptBatches(prompts.input_ids, batch_size=16, seed=0, texts=prompts.texts)
    batch = next(batches)              # PromptBatch: input_ids i32[b, P], texts, indices, epoch, step
    state = batches.state_dict()       # → checkpoint; PromptBatches(...).load_state_dict(state) resumes exactly

Shapes are static (DESIGN principle 2): every prompt is left-padded to `max_prompt_length`, and an epoch
yields `len(prompts) // batch_size` full batches (the remainder of each epoch's shuffle is not used; the
next epoch reshuffles everything). Prompts longer than `max_prompt_length` are dropped, counted and reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

__all__ = [
    "check_tokenizer",
    "tokenize_prompts",
    "left_pad",
    "prepare_prompts",
    "PromptSet",
    "PromptBatch",
    "PromptBatches",
]


def _log(*args, **kwargs):
    print(*args, flush=True, **kwargs)


# ---------------------------------------------------------------------------------------------- tokenizer


def check_tokenizer(tokenizer, vocab_size: int) -> int:
    """Check a tokenizer against ppojax's needs and the model; return its pad token id.

    Errors: no pad token, or pad == eos (everything keys on `token != pad`, so an eos would be taken for
    padding; each message says how to fix it); a tokenizer with more tokens than the model's `vocab_size`
    (ids past the embedding table: the wrong tokenizer for this model, or added tokens without resizing).
    A tokenizer SMALLER than the model's vocabulary is fine (models often pad their vocab).
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    fix = (
        "Fix: give the tokenizer a pad token that the model never generates and that differs from eos, e.g. "
        "an existing unused special token (`tokenizer.pad_token = '<|endoftext|>'` for SmolLM2-Instruct), or "
        "`tokenizer.add_special_tokens({'pad_token': '[PAD]'})` and grow the model's vocabulary to match."
    )
    if pad is None:
        raise ValueError(f"the tokenizer has no pad token; ppojax pads prompts and responses with one. {fix}")
    if eos is not None and pad == eos:
        raise ValueError(
            f"the tokenizer's pad token {tokenizer.pad_token!r} (id {pad}) is also its eos token; ppojax needs "
            f"pad != eos, since it tells padding from real tokens by `token != pad`. {fix}"
        )
    size = len(tokenizer)
    if size > vocab_size:
        raise ValueError(
            f"the tokenizer has {size} tokens but the model's vocab_size is {vocab_size}: ids >= {vocab_size} "
            "have no embedding. Use the tokenizer saved with this model, or resize the model's embeddings after "
            "adding tokens."
        )
    if not 0 <= pad < vocab_size:
        raise ValueError(f"pad token id {pad} is outside the model's vocabulary (size {vocab_size}). {fix}")
    return int(pad)


def _encode_all(texts: Sequence, tokenizer, chat_template: bool | None,
                template_kwargs: dict | None = None) -> list[list[int]]:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_template = has_template if chat_template is None else chat_template
    if use_template and not has_template:
        raise ValueError(
            "chat_template=True but the tokenizer has no chat template; pass chat_template=False for raw prompts"
        )
    conversations = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if conversations and not use_template:
        raise ValueError(
            f"prompt {conversations[0]} is a conversation (list of messages), which needs a chat template; "
            "the tokenizer has none or chat_template=False was passed"
        )
    if not use_template:
        return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
    rendered = [
        tokenizer.apply_chat_template(
            t if not isinstance(t, str) else [{"role": "user", "content": t}],
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
        for t in texts
    ]
    # The template writes any bos itself: do not add special tokens twice.
    return [list(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]


def _unreadable_ids(tokenizer) -> dict[int, str]:
    """{id: what it is} of the tokens that carry nothing of a prompt's text: the unknown token (what a word outside
    the vocabulary encodes to) and the pad token (which ppojax reads as padding wherever it stands)."""
    out = {}
    for what, token_id in (("pad", tokenizer.pad_token_id), ("unknown", getattr(tokenizer, "unk_token_id", None))):
        if token_id is not None:
            out.setdefault(int(token_id), what)
    return out


def _check_readable(i: int, text, ids: Sequence[int], tokenizer, unreadable: dict[int, str]) -> None:
    """Refuse prompt ``i`` when none of its tokens carries its text: every token is unknown, pad or another special
    token (a bos, a chat template's markers) -- the model would be trained on prompts it cannot read."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ()) - set(unreadable)
    bad = [t for t in ids if t in unreadable]
    if not bad or any(t not in unreadable and t not in special for t in ids):
        return
    kinds = " or ".join(sorted({f"{unreadable[t]} ({tokenizer.convert_ids_to_tokens(int(t))!r}, id {t})"
                                for t in bad}))
    raise ValueError(
        f"prompt {i} ({_short(text)}) encodes to nothing the model can read: {len(bad)} of its {len(ids)} tokens "
        f"({len(bad) / len(ids):.0%}) are the tokenizer's {kinds} token and the rest are special tokens. Its words "
        "are outside the tokenizer's vocabulary: use the tokenizer saved with this model, or rewrite or remove the "
        "prompt."
    )


def tokenize_prompts(
    texts: Sequence,
    tokenizer,
    max_prompt_length: int,
    *,
    chat_template: bool | None = None,
    stop_token_id: int | None = None,
    log: Callable[..., None] = _log,
    template_kwargs: dict | None = None,
) -> tuple[list[list[int]], list[int], int]:
    """Tokenize prompts, dropping those longer than `max_prompt_length` tokens.

    chat_template: True renders each prompt as one user message of the tokenizer's chat template with the
      generation prompt appended (conversations are rendered as given); False encodes the raw text (with the
      tokenizer's own special tokens, e.g. a bos); None (default) = True iff the tokenizer has a chat template.
      For "continue this text" prompts on an instruct model (the movie-review demo) pass False.
    template_kwargs: more arguments of ``apply_chat_template`` (an agent run's ``tools`` and ``chat_template``).
    Returns (token ids of the kept prompts, their indices in `texts`, number filtered). The filtered count is
    printed (never silent). Errors: an empty dataset; a prompt that tokenizes to nothing, or only to unknown, pad
    and special tokens (nothing the model can read); a prompt ending with
    `stop_token_id` (the response would be over before it starts); every prompt too long.
    """
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
    if len(texts) == 0:
        raise ValueError("the prompt dataset is empty; it needs at least one prompt")
    encoded = _encode_all(texts, tokenizer, chat_template, template_kwargs)
    unreadable = _unreadable_ids(tokenizer)
    kept_ids, kept, too_long = [], [], []
    for i, ids in enumerate(encoded):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} ({texts[i]!r}) tokenizes to no tokens; remove empty prompts from the dataset")
        _check_readable(i, texts[i], ids, tokenizer, unreadable)
        if stop_token_id is not None and ids[-1] == stop_token_id:
            token = tokenizer.convert_ids_to_tokens(int(stop_token_id))
            raise ValueError(
                f"prompt {i} ({_short(texts[i])}) ends with the stop token {token!r} (id {stop_token_id}): its "
                "response would be over before it starts. Strip the stop token from the end of your prompts."
            )
        if len(ids) > max_prompt_length:
            too_long.append(len(ids))
        else:
            kept_ids.append(ids)
            kept.append(i)
    if too_long:
        log(
            f"[ppojax] filtered {len(too_long)} of {len(texts)} prompts longer than max_prompt_length="
            f"{max_prompt_length} tokens (longest {max(too_long)}); raise max_prompt_length to keep them"
        )
    if not kept:
        raise ValueError(
            f"all {len(texts)} prompts are longer than max_prompt_length={max_prompt_length} tokens (shortest "
            f"{min(too_long)}); raise max_prompt_length"
        )
    return kept_ids, kept, len(too_long)


def _short(text, limit: int = 60) -> str:
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def left_pad(ids_list: Sequence[Sequence[int]], max_prompt_length: int, pad_id: int) -> np.ndarray:
    """Left-pad token id lists to i32[B, max_prompt_length] with `pad_id` (the prompt ends at the last column)."""
    out = np.full((len(ids_list), max_prompt_length), pad_id, dtype=np.int32)
    for row, ids in enumerate(ids_list):
        n = len(ids)
        if n > max_prompt_length:
            raise ValueError(
                f"prompt {row} has {n} tokens, more than max_prompt_length={max_prompt_length}; filter it first "
                "(tokenize_prompts does)"
            )
        if n:
            out[row, max_prompt_length - n:] = np.asarray(ids, dtype=np.int32)
    return out


@dataclass
class PromptSet:
    """Tokenized prompts. input_ids: i32[N, P] left-padded; texts: the N kept prompts; indices: their rows
    in the source dataset; n_filtered: prompts dropped as too long."""

    input_ids: np.ndarray
    texts: list
    indices: list[int]
    n_filtered: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def prepare_prompts(
    texts: Sequence,
    tokenizer,
    max_prompt_length: int,
    *,
    pad_token_id: int | None = None,
    chat_template: bool | None = None,
    stop_token_id: int | None = None,
    log: Callable[..., None] = _log,
    template_kwargs: dict | None = None,
) -> PromptSet:
    """`tokenize_prompts` + `left_pad` in one call (pad defaults to the tokenizer's pad token)."""
    pad = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
    if pad is None:
        raise ValueError("no pad token id: pass pad_token_id or give the tokenizer a pad token (see check_tokenizer)")
    ids, kept, n_filtered = tokenize_prompts(
        texts, tokenizer, max_prompt_length, chat_template=chat_template, stop_token_id=stop_token_id, log=log,
        template_kwargs=template_kwargs)
    return PromptSet(left_pad(ids, max_prompt_length, pad), [texts[i] for i in kept], kept, n_filtered)


def prompt_display_text(prompt) -> str:
    """What the user wrote of a prompt, for sample tables and evaluation files: a text prompt itself (without the
    chat template a run may wrap it in), or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"] or list(prompt)
    return str(users[-1].get("content", ""))


# ---------------------------------------------------------------------------------------------- batches


@dataclass
class PromptBatch:
    """This process's share of one global batch. input_ids: i32[b, P] (b = batch_size // process_count);
    texts: their prompts (None if none were given); indices: their rows in the prompt set; epoch and step
    (global batch number within the epoch) of the batch."""

    input_ids: np.ndarray
    indices: np.ndarray
    texts: list | None
    epoch: int
    step: int


@dataclass
class PromptBatches(Iterator[PromptBatch]):
    """Endless, seeded, resumable iterator over global prompt batches; each process takes its own share.

    Each epoch is a fresh permutation from `np.random.default_rng([seed, epoch])` (never numpy's global RNG),
    cut into `len // batch_size` global batches (the remainder is skipped that epoch). Process `process_index`
    of `process_count` gets rows `[process_index * b, (process_index + 1) * b)` of every global batch,
    b = batch_size // process_count, so the processes' shares are disjoint and together are the global batch.
    `state_dict()` is (epoch, position in epoch); a new iterator built with the same data, batch size and
    seed, after `load_state_dict(state)`, yields exactly the batches the old one would have.
    """

    input_ids: np.ndarray = field(repr=False)
    batch_size: int
    seed: int
    texts: Sequence | None = field(default=None, repr=False)
    process_index: int = 0
    process_count: int = 1
    shuffle: bool = True
    epoch: int = field(default=0, init=False)
    position: int = field(default=0, init=False)

    def __post_init__(self):
        self.input_ids = np.asarray(self.input_ids)
        n = self.num_prompts
        if self.input_ids.ndim != 2:
            raise ValueError(f"input_ids must be i32[N, P], got shape {self.input_ids.shape}")
        if self.texts is not None and len(self.texts) != n:
            raise ValueError(f"{len(self.texts)} texts for {n} prompts")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.process_count < 1 or not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index {self.process_index} is not in [0, process_count={self.process_count})")
        if self.batch_size % self.process_count:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by process_count {self.process_count}; each process "
                "takes an equal share of every global batch"
            )
        if n < self.batch_size:
            raise ValueError(
                f"the prompt set has {n} prompts (after filtering), fewer than batch_size {self.batch_size}; "
                "use more prompts or a smaller batch_size"
            )
        self._order_epoch, self._order = None, None

    @property
    def num_prompts(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batches_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([int(self.seed), int(epoch)]).permutation(self.num_prompts)
            else:
                self._order = np.arange(self.num_prompts)
            self._order_epoch = epoch
        return self._order

    def global_indices(self, epoch: int, step: int) -> np.ndarray:
        """Rows of the prompt set in global batch `step` of `epoch` (all processes together)."""
        return self._epoch_order(epoch)[step * self.batch_size:(step + 1) * self.batch_size]

    def __iter__(self):
        return self

    def __next__(self) -> PromptBatch:
        batch = self._batch_at(self.epoch, self.position)
        self.epoch, self.position = batch.epoch, batch.step + 1
        return batch

    def _batch_at(self, epoch: int, position: int) -> PromptBatch:
        """This process's share of the batch at (epoch, position), a position past the epoch's last batch being
        the next epoch's first."""
        if position >= self.batches_per_epoch:
            epoch, position = epoch + 1, 0
        rows = self.global_indices(epoch, position)
        b = self.local_batch_size
        rows = rows[self.process_index * b:(self.process_index + 1) * b]
        texts = None if self.texts is None else [self.texts[i] for i in rows]
        return PromptBatch(self.input_ids[rows], rows.copy(), texts, epoch, position)

    def peek(self, count: int) -> PromptBatch:
        """The next ``count`` batches without taking them (dynamic sampling's rounds: an update takes as many as
        it used, :meth:`take`), stacked: input_ids i32[count, b, P], indices [count, b], texts [count][b]; epoch
        and step of the first."""
        batches, epoch, position = [], self.epoch, self.position
        for _ in range(count):
            batch = self._batch_at(epoch, position)
            batches.append(batch)
            epoch, position = batch.epoch, batch.step + 1
        texts = None if self.texts is None else [b.texts for b in batches]
        return PromptBatch(np.stack([b.input_ids for b in batches]), np.stack([b.indices for b in batches]), texts,
                           batches[0].epoch, batches[0].step)

    def take(self, count: int) -> "PromptBatches":
        """Move past the next ``count`` batches (those :meth:`peek` showed)."""
        for _ in range(count):
            if self.position >= self.batches_per_epoch:
                self.epoch, self.position = self.epoch + 1, 0
            self.position += 1
        return self

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume: epoch and position (plus seed/sizes, checked on load)."""
        return {
            "epoch": int(self.epoch),
            "position": int(self.position),
            "seed": int(self.seed),
            "num_prompts": self.num_prompts,
            "batch_size": int(self.batch_size),
        }

    def load_state_dict(self, state: dict) -> "PromptBatches":
        for key in ("seed", "num_prompts", "batch_size"):
            if key in state and int(state[key]) != int(getattr(self, key)):
                raise ValueError(
                    f"cannot resume the prompt iterator: checkpoint has {key}={state[key]}, this run has "
                    f"{getattr(self, key)}; the batches would differ. Use the same data, seed and batch_size."
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        return self
