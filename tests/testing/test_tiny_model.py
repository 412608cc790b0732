"""The offline tiny-model builder: determinism, caching, concurrency, tokenizer, template."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollq.testing import tiny_model
from rollq.testing.tiny_model import MARKER, build_tiny_model, default_model_dir, ensure_tiny_model

SMALL = dict(vocab_size=512, hidden=64, heads=2, kv_heads=1, layers=1)  # head size 32: still loadable


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


def test_files_and_marker(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", MARKER} <= names
    marker = json.loads((model_dir / MARKER).read_text())
    assert marker["seed"] == 0 and marker["vocab_size"] == 1024
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3, **SMALL)
    b = build_tiny_model(tmp_path / "b", seed=3, **SMALL)
    c = build_tiny_model(tmp_path / "c", seed=4, **SMALL)
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]


def test_cache_hit_and_force(tmp_path, monkeypatch):
    p = build_tiny_model(tmp_path / "m", **SMALL)
    inode = (p / MARKER).stat().st_ino

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(tiny_model, "_build_into", boom)
    assert build_tiny_model(tmp_path / "m", **SMALL) == p
    monkeypatch.undo()
    build_tiny_model(tmp_path / "m", force=True, **SMALL)
    assert (p / MARKER).stat().st_ino != inode


def test_other_params_rebuild(tmp_path):
    p = build_tiny_model(tmp_path / "m", **SMALL)
    build_tiny_model(p, **{**SMALL, "layers": 2})
    assert json.loads((p / MARKER).read_text())["layers"] == 2
    assert json.loads((p / "config.json").read_text())["num_hidden_layers"] == 2


def test_incomplete_folder_is_replaced(tmp_path):
    p = tmp_path / "m"
    p.mkdir()
    (p / "config.json").write_text("{half written")  # no marker: a crashed build
    build_tiny_model(p, **SMALL)
    assert json.loads((p / "config.json").read_text())["model_type"] == "qwen2"
    assert (p / MARKER).exists()


def test_concurrent_builders(tmp_path):
    target = tmp_path / "m"
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: build_tiny_model(target, **SMALL), range(4)))
    assert paths == [target] * 4
    assert tiny_model._is_complete(target, json.loads((target / MARKER).read_text()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp or trash folders left


def test_narrow_heads_refused(tmp_path):
    with pytest.raises(ValueError, match="narrower than 32"):
        build_tiny_model(tmp_path / "m", hidden=64, heads=4, kv_heads=2)


def test_default_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLQ_TINY_MODEL_DIR", str(tmp_path / "x"))
    assert default_model_dir() == tmp_path / "x"
    assert ensure_tiny_model(**SMALL) == tmp_path / "x"
    monkeypatch.delenv("ROLLQ_TINY_MODEL_DIR")
    assert default_model_dir() == Path.home() / ".cache" / "rollq" / "tiny-qwen2"


# -- tokenizer ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


TEXTS = ["hello world, the policy rollout 123!", "  two  spaces\nnew line\ttab", "ünïcödé 日本語 🎉",
         "it's 42; don't stop", ""]


def test_tokenizer_round_trip(tokenizer, model_dir):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert len(tokenizer) == 1024
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 3)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 2
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    plain = PreTrainedTokenizerFast.from_pretrained(model_dir)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == raw.encode(text).ids == plain.encode(text)  # every loader agrees
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("the policy")) < len("the policy")  # merges were learned
    # Every id the model can sample decodes to something.
    assert all(tokenizer.convert_ids_to_tokens(i) is not None for i in range(1024))


def test_chat_template(tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert text.startswith(no_gen) and not no_gen.endswith("assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 2 and ids.count(2) == 3 and ids.count(3) == 2  # specials stay single tokens


def test_model_loads_in_transformers(model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    assert model.config.num_attention_heads == 4 and model.config.hidden_size == 128
    with torch.no_grad():
        logits = model(torch.tensor([[2, 10, 20]])).logits
    assert logits.shape == (1, 3, 1024) and torch.isfinite(logits).all()
