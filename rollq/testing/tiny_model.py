r"""A tiny random-weight Qwen2 model that vLLM can load, built offline in about a second.

Tests, examples and CPU benchmarks need a real model folder but no network. This module
writes one:

- a byte-level BPE tokenizer trained with the ``tokenizers`` library on generated text, with
  Qwen2's pre-tokenizer, special tokens ``<|endoftext|>`` (id 0, pad), ``<|bos|>`` (1),
  ``<|im_start|>`` (2), ``<|im_end|>`` (3, eos) and a ChatML template
  (``<|im_start|>role\ncontent<|im_end|>\n``, ``add_generation_prompt`` supported). Its
  ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` so transformers 4.x and 5.x
  both load it (5.x as ``Qwen2Tokenizer``, with identical ids);
- a ``Qwen2ForCausalLM`` checkpoint: ``config.json``, ``generation_config.json`` and random
  float32 weights in ``model.safetensors`` under Hugging Face names, the files
  ``save_pretrained`` writes. They are written directly (numpy + safetensors) because
  importing transformers' model classes alone takes ~6 s; tests load the folder with
  ``AutoModelForCausalLM`` and check that no key is missing.

Everything is a function of the arguments, so two builds with the same seed are
byte-identical.

The build is cache-aware and safe against concurrent builders: files are written into a
private temporary folder, a marker file (:data:`MARKER`) is written last, and the folder is
renamed into place. A folder that has the marker with the same parameters is returned at
once; anything else at the path is replaced.

>>> from rollq.testing.tiny_model import ensure_tiny_model
>>> path = ensure_tiny_model()  # doctest: +SKIP
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
#: Qwen2's pre-tokenization regex (transformers' ``tokenization_qwen2.PRETOKENIZE_REGEX``).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
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
    ['.rollq-tiny-model.json', 'config.json', 'generation_config.json']
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


def _train_tokenizer(params: dict[str, int]):
    """Train the byte-level BPE on :func:`_corpus`; exactly ``vocab_size`` ids, specials 0..3."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # Qwen2's exact pipeline: transformers 5.x loads any ``model_type: qwen2`` tokenizer as
    # ``Qwen2Tokenizer``, which rebuilds this pre-tokenizer; matching it keeps raw
    # ``tokenizers``, transformers 4.x/5.x and vLLM on the same token ids.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
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
    if tok.get_vocab_size() != params["vocab_size"]:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {params['vocab_size']}")
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != [0, 1, 2, 3]:
        raise RuntimeError("special tokens did not get ids 0..3")
    return tok


def _tokenizer_config(params: dict[str, int]) -> dict[str, Any]:
    """What ``PreTrainedTokenizerFast.save_pretrained`` writes, in a form that transformers
    4.x and 5.x both read (5.x alone writes ``TokenizersBackend`` and a list-valued
    ``extra_special_tokens`` that 4.x rejects)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": params["max_position"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _model_config(params: dict[str, int]) -> dict[str, Any]:
    """``Qwen2Config(...).to_dict()`` for our sizes, with the keys every transformers reads."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": params["vocab_size"],
        "hidden_size": params["hidden"],
        "intermediate_size": params["hidden"] * 4,
        "num_hidden_layers": params["layers"],
        "num_attention_heads": params["heads"],
        "num_key_value_heads": params["kv_heads"],
        "max_position_embeddings": params["max_position"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": _INIT_STD,
        "attention_dropout": 0.0,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": params["layers"],
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 3,
        "pad_token_id": 0,
        "torch_dtype": "float32",  # read by transformers 4.x and 5.x, warns in neither
    }


_INIT_STD = 0.02


def _weights(params: dict[str, int]) -> dict[str, Any]:
    """Random float32 weights with Hugging Face names and Qwen2's init (normal(0, 0.02)
    matrices, zero biases, unit norms). numpy's PCG64 stream makes them a pure function of
    the seed without importing torch (which costs ~2 s; transformers' model classes ~6 s)."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(params["seed"]))
    v, h, i = params["vocab_size"], params["hidden"], params["hidden"] * 4
    kv = params["kv_heads"] * (h // params["heads"])

    def normal(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(_INIT_STD)).astype("<f4")

    def const(n: int, value: float) -> Any:
        return np.full((n,), value, dtype="<f4")

    w: dict[str, Any] = {"model.embed_tokens.weight": normal(v, h)}
    for layer in range(params["layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = const(h, 1.0)
        w[p + "self_attn.q_proj.weight"] = normal(h, h)
        w[p + "self_attn.q_proj.bias"] = const(h, 0.0)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h)
        w[p + "self_attn.k_proj.bias"] = const(kv, 0.0)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h)
        w[p + "self_attn.v_proj.bias"] = const(kv, 0.0)
        w[p + "self_attn.o_proj.weight"] = normal(h, h)
        w[p + "post_attention_layernorm.weight"] = const(h, 1.0)
        w[p + "mlp.gate_proj.weight"] = normal(i, h)
        w[p + "mlp.up_proj.weight"] = normal(i, h)
        w[p + "mlp.down_proj.weight"] = normal(h, i)
    w["model.norm.weight"] = const(h, 1.0)
    w["lm_head.weight"] = normal(v, h)
    return w


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _build_into(folder: Path, params: dict[str, int]) -> None:
    from safetensors.numpy import save_file

    tok = _train_tokenizer(params)
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(params))
    _write_json(folder / "special_tokens_map.json", {
        "bos_token": BOS, "eos_token": IM_END, "pad_token": PAD, "additional_special_tokens": [IM_START],
    })
    _write_json(folder / "config.json", _model_config(params))
    _write_json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [3, 0], "pad_token_id": 0})
    save_file(_weights(params), str(folder / "model.safetensors"), metadata={"format": "pt"})
