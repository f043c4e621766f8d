"""The prompt pipeline: a dataset → tokenized, filtered, LEFT-padded prompts → resumable, seeded batches.

    texts = load_prompt_dataset("prompts.jsonl", column="prompt")       # list / Dataset / json / csv / parquet
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

import csv
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from ppojax.assets import cache_dir, movie_review_prompts
from ppojax.io.strict_json import write_text_atomic
from ppojax.tasks.arithmetic import INSTRUCTION, write_splits
from ppojax.tasks.calculator import TOOL_EXAMPLES, with_tool_examples
from ppojax.tasks.guess_number import HIGH as GAME_HIGH
from ppojax.tasks.guess_number import LOW as GAME_LOW
from ppojax.tasks.guess_number import PROMPT as GAME_PROMPT
from ppojax.tasks.guess_number import write_splits as write_games

__all__ = [
    "load_prompt_dataset",
    "load_prompt_table",
    "check_tokenizer",
    "tokenize_prompts",
    "left_pad",
    "prepare_prompts",
    "PromptSet",
    "PromptBatch",
    "PromptBatches",
]

BUILTIN_MOVIE_REVIEWS = "builtin:movie_reviews"
BUILTIN_ARITHMETIC = {"arithmetic": "train", "arithmetic:test": "test",
                      "arithmetic_tools": "train", "arithmetic_tools:test": "test"}
"""Dataset names of the generated arithmetic word problems (``ppojax.tasks.arithmetic``) -> their split; the
``arithmetic_tools`` ones are the same problems, each prompt a conversation opening with two worked problems that
call the calculator (``ppojax.tasks.calculator.with_tool_examples``)."""
ARITHMETIC_SETTINGS = {"seed": 0, "train": 2000, "test": 200, "max_number": 20}
"""The built-in arithmetic task's problems (the cache folder's name changes with them)."""


BUILTIN_GUESS_NUMBER = {"guess_number": "train", "guess_number:test": "test"}
"""Dataset names of the guess-the-number games (``ppojax.tasks.guess_number``) -> their split."""
GUESS_NUMBER_SETTINGS = {"seed": 0, "train": 2000, "test": 200}


def guess_number_split(name: str, *, log: Optional[Callable[..., None]] = None) -> Path:
    """The JSONL file of a built-in guess-the-number split, written into the asset cache the first time."""
    # the folder's name changes with the games' text and range, so that a cached file is never a stale version
    version = hashlib.sha1(f"{GAME_PROMPT}|{GAME_LOW}|{GAME_HIGH}".encode()).hexdigest()[:8]
    folder = cache_dir() / ("guess_number-" + "-".join(f"{k}{v}" for k, v in GUESS_NUMBER_SETTINGS.items())
                            + f"-{version}")
    path = folder / f"{BUILTIN_GUESS_NUMBER[name]}.jsonl"
    if not path.is_file():
        (log or _log)(f"[ppojax] writing the guess-the-number games to {folder}")
        write_games(folder, **GUESS_NUMBER_SETTINGS)
    return path


def arithmetic_split(name: str, *, log: Optional[Callable[..., None]] = None) -> Path:
    """The JSONL file of a built-in arithmetic split ('arithmetic' or 'arithmetic:test'), written into the
    asset cache the first time (seeded: every machine writes the same problems)."""
    log = log or _log
    settings = ARITHMETIC_SETTINGS
    folder = cache_dir() / ("arithmetic-" + "-".join(f"{k}{v}" for k, v in settings.items()))
    path = folder / f"{BUILTIN_ARITHMETIC[name]}.jsonl"
    if not path.is_file():
        log(f"[ppojax] writing the arithmetic word problems ({settings['train']} train, {settings['test']} test, "
            f"seed {settings['seed']}) to {folder}")
        write_splits(folder, **settings)
    if not name.startswith("arithmetic_tools"):
        return path
    # the folder's name changes with the worked examples, so that a cached file is never a stale version
    version = hashlib.sha1(json.dumps([TOOL_EXAMPLES, INSTRUCTION]).encode()).hexdigest()[:8]
    tools_path = folder.with_name(f"{folder.name}-tool_examples-{version}") / path.name
    if not tools_path.is_file():
        records = [with_tool_examples(json.loads(line), INSTRUCTION) for line in path.read_text().splitlines()]
        tools_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(tools_path, "".join(json.dumps(r) + "\n" for r in records))  # never half-written
    return tools_path


def _log(*args, **kwargs):
    print(*args, flush=True, **kwargs)


# ---------------------------------------------------------------------------------------------- loading


def _records_table(records: list, column: str, where: str) -> dict:
    """Records (dicts) -> {column: values}; every record must hold the prompt ``column`` (others may be absent:
    None there)."""
    if not records:
        return {column: []}
    if not isinstance(records[0], dict):
        raise ValueError(f"{where}: expected records (objects with a {column!r} field), "
                         f"got {type(records[0]).__name__}")
    if column not in records[0]:
        raise ValueError(
            f"{where} has no column {column!r}; available columns: {sorted(records[0])}. "
            f"Pass column=<name> (config: dataset_text_field / prompt column)."
        )
    missing = next((i for i, r in enumerate(records) if not isinstance(r, dict) or column not in r), None)
    if missing is not None:
        raise ValueError(f"{where}: row {missing} has no {column!r} field (it is {records[missing]!r:.80})")
    names = list(dict.fromkeys(name for r in records for name in r))
    return {name: [r.get(name) for r in records] for name in names}


def _table_column(columns: Sequence[str], column: str, where: str) -> None:
    if column not in columns:
        raise ValueError(
            f"{where} has no column {column!r}; available columns: {list(columns)}. "
            f"Pass column=<name> (config: dataset_text_field / prompt column)."
        )


def _read_text(path: Path) -> str:
    """The whole file as UTF-8 text; a byte that is not UTF-8 is reported with the file and its line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                         f"{err.start}); save the file as UTF-8") from None


def _parse_json(text: str, where: str):
    """`json.loads` whose error names the file (or `file line N`) and the place in it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None


def _parse_jsonl(text: str, where: str) -> list:
    """One JSON value per non-blank line; an error names the line of the file."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: line {number} is not valid JSON (column {err.colno}: {err.msg}); "
                                 "a .jsonl file holds one JSON object per line") from None
    return records


def _load_file(path: Path, column: str) -> dict:
    """A local file -> {column: values} (every column of the file)."""
    suffix = "".join(path.suffixes[-2:]) if path.suffix in (".gz", ".bz2") else path.suffix
    where = str(path)
    if suffix in (".jsonl", ".ndjson", ".json", ".csv", ".tsv"):
        text = _read_text(path)
    if suffix in (".jsonl", ".ndjson") or (suffix == ".json" and _looks_like_jsonl(text)):
        return _records_table(_parse_jsonl(text, where), column, where)
    if suffix == ".json":
        data = _parse_json(text, where)
        if isinstance(data, dict):
            if column in data and isinstance(data[column], list):  # column-oriented {"prompt": [...]}
                return {k: list(v) for k, v in data.items()
                        if isinstance(v, list) and len(v) == len(data[column])}
            for key in ("data", "rows", "train"):
                if isinstance(data.get(key), list):
                    return _records_table(data[key], column, f"{where}[{key!r}]")
            _table_column(list(data), column, where)
        if not isinstance(data, list):
            raise ValueError(f"{where}: expected a JSON list of records, got {type(data).__name__}")
        return _records_table(data, column, where)
    if suffix in (".csv", ".tsv"):
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if suffix == ".tsv" else ",")
        _table_column(reader.fieldnames or [], column, where)
        rows = list(reader)
        return {name: [row[name] for row in rows] for name in reader.fieldnames}
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415 - datasets' dependency, slow to import; parquet files only

        schema_names = pq.read_schema(path).names
        _table_column(schema_names, column, where)
        return pq.read_table(path).to_pydict()
    raise ValueError(f"{where}: unsupported file type {suffix!r}; use .json, .jsonl, .csv, .tsv or .parquet")


def _looks_like_jsonl(text: str) -> bool:
    lines = [line.strip() for line in text.splitlines()[:2]] + ["", ""]
    first, second = lines[0], lines[1]
    return first.startswith("{") and first.endswith("}") and second.startswith("{")


def _from_hf_dataset(ds, column: str, split: str) -> dict:
    if hasattr(ds, "column_names") and isinstance(ds.column_names, dict):  # DatasetDict
        if split not in ds:
            raise ValueError(f"dataset has no split {split!r}; available splits: {list(ds)}. Pass split=<name>.")
        ds = ds[split]
    _table_column(ds.column_names, column, f"dataset ({len(ds)} rows)")
    return {name: list(ds[name]) for name in ds.column_names}


def load_prompt_dataset(source: Any, column: str = "prompt", *, split: str = "train",
                        name: str = "prompt dataset") -> list:
    """The prompts of a dataset, as a list (each a string, or a conversation: a list of
    `{"role", "content"}` messages, which `tokenize_prompts` renders with the chat template).
    ``load_prompt_table`` gives the dataset's other columns too."""
    return load_prompt_table(source, column, split=split, name=name)[0]


def load_prompt_table(source: Any, column: str = "prompt", *, split: str = "train",
                      name: str = "prompt dataset") -> tuple[list, dict]:
    """(prompts, columns): the prompts as ``load_prompt_dataset`` gives them, and every column of the dataset
    ({name: one value per prompt}, the prompt column included; {} for a plain list of prompts or the bundled
    movie reviews). The columns reach Python reward functions as keyword arguments.

    source: a python list (of strings, or of records holding `column`); a Hugging Face `datasets.Dataset` or
      `DatasetDict` (uses `split`); a local .json / .jsonl / .csv / .tsv / .parquet file; a folder written by
      `Dataset.save_to_disk`; or "builtin:movie_reviews" (`ppojax.assets.movie_review_prompts()`).
    Errors: a missing column (the message lists the available ones); an empty dataset; a non-text prompt. name:
    what the messages call the source (e.g. the config field that named it, ``eval_dataset``).
    """
    table = None
    if isinstance(source, str) and source == BUILTIN_MOVIE_REVIEWS:
        prompts = movie_review_prompts()
    elif isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.is_dir():
            import datasets  # noqa: PLC0415 - over a second to import; only a saved dataset folder needs it

            table = _from_hf_dataset(datasets.load_from_disk(str(path)), column, split)
        elif path.is_file():
            table = _load_file(path, column)
        else:
            raise FileNotFoundError(
                f"{name} {str(source)!r} is not a local file or folder (nor {BUILTIN_MOVIE_REVIEWS!r}). "
                "ppojax does not download datasets: load a hub dataset yourself with datasets.load_dataset(...) "
                "and pass the Dataset, or give a .json/.jsonl/.csv/.parquet path."
            )
    elif hasattr(source, "column_names"):
        table = _from_hf_dataset(source, column, split)
    elif isinstance(source, (list, tuple)):
        prompts = list(source)
        if prompts and isinstance(prompts[0], dict):
            table = _records_table(prompts, column, "prompt list")
    else:
        raise TypeError(
            f"cannot load prompts from a {type(source).__name__}; pass a list, a datasets.Dataset or a file path"
        )
    if table is not None:
        prompts = list(table[column])
    if not prompts:
        raise ValueError(f"{name} {_describe(source)} is empty; it needs at least one prompt")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or _is_conversation(p)):
            raise ValueError(
                f"prompt {i} of {_describe(source)} is a {type(p).__name__} ({p!r:.60}); prompts must be strings "
                "or conversations (lists of {'role', 'content'} messages)"
            )
    return prompts, table or {}


def _is_conversation(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(m, dict) and "content" in m for m in p)


def _describe(source) -> str:
    if isinstance(source, (str, Path)):
        return repr(str(source))
    if isinstance(source, (list, tuple)):
        return f"(a {type(source).__name__} of {len(source)})"
    return f"({type(source).__name__})"


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
