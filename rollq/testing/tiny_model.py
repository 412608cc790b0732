"""A tiny random-weight Qwen2 model that vLLM can load, built offline in a few seconds.

Tests, examples and CPU benchmarks need a real model folder but no network. This module
writes one: a byte-level BPE tokenizer trained with the ``tokenizers`` library on generated
text (special tokens ``<|endoftext|>`` (pad), ``<|bos|>``, ``<|im_start|>``,
``<|im_end|>`` (eos) and a Qwen-like chat template), wrapped as a
``transformers.PreTrainedTokenizerFast``, plus a ``Qwen2ForCausalLM`` with random float32
weights saved as safetensors. Everything is a function of the arguments, so two builds with
the same seed are byte-identical.

The build is cache-aware and safe against concurrent builders: files are written into a
private temporary folder, a marker file (:data:`MARKER`) is written last, and the folder is
renamed into place. A folder that has the marker with the same parameters is returned at
once; anything else at the path is replaced.

>>> from rollq.testing.tiny_model import ensure_tiny_model
>>> path = ensure_tiny_model()          # ~/.cache/rollq/tiny-qwen2, built once
>>> # AsyncEngineArgs(model=str(path), dtype="float32", enforce_eager=True, ...)

Attention heads narrower than 32 fail on vLLM's CPU backend, so ``hidden // heads`` must be
at least 32 (the default 128 / 4 = 32).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["build_tiny_model", "default_model_dir", "ensure_tiny_model", "MARKER", "CHAT_TEMPLATE"]

#: Written last into a finished model folder; holds the build parameters.
MARKER = ".rollq-tiny-model.json"
#: Bump when the builder's output changes, so stale caches are rebuilt.
BUILDER_VERSION = 1
#: Environment variable that overrides :func:`default_model_dir`.
ENV_DIR = "ROLLQ_TINY_MODEL_DIR"

PAD, BOS, IM_START, IM_END = "<|endoftext|>", "<|bos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, IM_END]  # ids 0..3, in this order

#: Qwen-like ChatML template: ``<|im_start|>role\ncontent<|im_end|>\n`` per message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part hello world model "
    "token prompt answer question reward policy value rollout queue redis stream job worker sample "
    "assistant user system train learn step batch loss weight version engine cache memory"
).split()
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "st", "th", "tr", "sh", "pl", "gr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ee", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "ng", "ck"]
_PUNCT = [".", ",", "!", "?", ":", ";", " -", "'s", "()", "[]", "{}", '"', "/", "="]


def default_model_dir() -> Path:
    """``$ROLLQ_TINY_MODEL_DIR`` if set, else ``~/.cache/rollq/tiny-qwen2``."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rollq" / "tiny-qwen2"


def ensure_tiny_model(path: str | Path | None = None, **kwargs: Any) -> Path:
    """Return a built tiny model folder (default: :func:`default_model_dir`), building it once.

    Keyword arguments go to :func:`build_tiny_model`.

    >>> p = ensure_tiny_model()  # doctest: +SKIP
    >>> (p / "config.json").exists()  # doctest: +SKIP
    True
    """
    return build_tiny_model(path if path is not None else default_model_dir(), **kwargs)


def build_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_position: int = 2048,
    force: bool = False,
) -> Path:
    """Build (or reuse) a tiny random Qwen2 model with its tokenizer in ``path``.

    Returns the folder, ready for ``transformers.AutoTokenizer.from_pretrained`` and
    ``vllm`` (``dtype="float32"`` on CPU). A folder already holding a complete build with
    the same parameters is returned immediately unless ``force``.

    >>> p = build_tiny_model("/tmp/tiny", seed=1)  # doctest: +SKIP
    >>> sorted(x.name for x in p.iterdir())[:3]  # doctest: +SKIP
    ['.rollq-tiny-model.json', 'chat_template.jinja', 'config.json']
    """
    path = Path(path).expanduser().absolute()
    params = dict(
        builder_version=BUILDER_VERSION, seed=seed, vocab_size=vocab_size, hidden=hidden,
        layers=layers, heads=heads, kv_heads=kv_heads, max_position=max_position,
    )
    _check_params(params)
    if not force and _is_complete(path, params):
        logger.debug("tiny model cache hit: %s", path)
        return path

    t0 = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _build_into(tmp, params)
        # The marker goes in last: a folder without it is never taken for a finished build.
        (tmp / MARKER).write_text(json.dumps(params, sort_keys=True, indent=1) + "\n")
        _install(tmp, path, params, force=force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model in %.1fs -> %s", time.perf_counter() - t0, path)
    return path


# ----------------------------------------------------------------------------------------
# Cache and install
# ----------------------------------------------------------------------------------------
def _check_params(p: dict[str, int]) -> None:
    if p["hidden"] % p["heads"] or p["heads"] % p["kv_heads"]:
        raise ValueError("hidden must be divisible by heads, and heads by kv_heads")
    if p["hidden"] // p["heads"] < 32:
        raise ValueError(
            f"head size {p['hidden'] // p['heads']} < 32: vLLM's CPU backend cannot load heads "
            "narrower than 32; raise hidden or lower heads"
        )
    if p["vocab_size"] < 300:
        raise ValueError("vocab_size must be >= 300 (256 byte tokens + specials + merges)")


def _is_complete(path: Path, params: dict[str, int]) -> bool:
    try:
        found = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return found == params and all(
        (path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")
    )


def _install(tmp: Path, path: Path, params: dict[str, int], *, force: bool) -> None:
    """Move the finished ``tmp`` folder to ``path`` with renames only."""
    for _ in range(5):
        try:
            os.rename(tmp, path)  # atomic; fails if path exists and is not empty
            return
        except FileNotFoundError:
            raise
        except OSError:
            if not path.exists():
                continue  # someone moved it away between our calls: retry
        if not force and _is_complete(path, params):
            return  # a concurrent builder won the race with an identical build
        # Stale, partial or different build (or force): move it aside, then retry.
        trash = path.parent / f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        force = False  # ours replaces the old one now; a newer one from a racer is fine too
    raise RuntimeError(f"could not install the tiny model at {path} (concurrent builders?)")


# ----------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------
def _corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Deterministic pseudo-text: English words, made-up words, numbers, punctuation."""
    rng = random.Random(seed)
    made_up = [
        "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
        for _ in range(1500)
    ]
    lines = []
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.55:
                w = rng.choice(_WORDS)
            elif r < 0.9:
                w = rng.choice(made_up)
            else:
                w = str(rng.randint(0, 10 ** rng.randint(1, 4)))
            if rng.random() < 0.1:
                w = w.capitalize()
            if rng.random() < 0.08:
                w += rng.choice(_PUNCT)
            words.append(w)
        lines.append(" ".join(words) + rng.choice([".", ".", "?", "!", "\n"]))
    return lines


def _build_tokenizer(params: dict[str, int]):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=params["vocab_size"],
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(params["seed"]), trainer=trainer)
    short = params["vocab_size"] - tok.get_vocab_size()
    if short > 0:  # every id the model can sample must decode: pad the vocabulary
        tok.add_special_tokens([f"<|extra_{i}|>" for i in range(short)])
    assert tok.get_vocab_size() == params["vocab_size"], tok.get_vocab_size()

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=params["max_position"],
        clean_up_tokenization_spaces=False,
    )


def _build_into(folder: Path, params: dict[str, int]) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _build_tokenizer(params)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert [ids[t] for t in SPECIAL_TOKENS] == [0, 1, 2, 3], ids
    tokenizer.save_pretrained(folder)

    config = Qwen2Config(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden"],
        intermediate_size=params["hidden"] * 4,
        num_hidden_layers=params["layers"],
        num_attention_heads=params["heads"],
        num_key_value_heads=params["kv_heads"],
        max_position_embeddings=params["max_position"],
        bos_token_id=ids[BOS],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
        use_sliding_window=False,
        initializer_range=0.02,
    )
    config.torch_dtype = "float32"  # transformers 4.x name; 5.x reads/writes ``dtype``
    config.dtype = "float32"

    # Seed the initialisation only, without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[IM_END], ids[PAD]], pad_token_id=ids[PAD]
    )
    model.save_pretrained(folder, safe_serialization=True)
