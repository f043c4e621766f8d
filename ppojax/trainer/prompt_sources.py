"""Where prompts come from: a prompt table read from a list, a Hugging Face ``Dataset`` or a local file (json,
jsonl, csv, tsv, parquet, a saved dataset folder), and the built-in datasets (the bundled movie reviews, the
generated arithmetic problems and guess-the-number games, written into the asset cache the first time).

    texts = load_prompt_dataset("prompts.jsonl", column="prompt")        # the prompts
    texts, columns = load_prompt_table("prompts.jsonl", column="prompt")  # and every column, for reward functions

``ppojax.trainer.data`` turns the prompts into tokenized, left-padded batches.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ppojax.assets import cache_dir, movie_review_prompts
from ppojax.io.strict_json import write_text_atomic
from ppojax.tasks.arithmetic import INSTRUCTION, write_splits
from ppojax.tasks.calculator import TOOL_EXAMPLES, with_tool_examples
from ppojax.tasks.guess_number import HIGH as GAME_HIGH
from ppojax.tasks.guess_number import LOW as GAME_LOW
from ppojax.tasks.guess_number import PROMPT as GAME_PROMPT
from ppojax.tasks.guess_number import write_splits as write_games

__all__ = [
    "BUILTIN_ARITHMETIC",
    "BUILTIN_GUESS_NUMBER",
    "BUILTIN_MOVIE_REVIEWS",
    "arithmetic_split",
    "guess_number_split",
    "load_prompt_dataset",
    "load_prompt_table",
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
