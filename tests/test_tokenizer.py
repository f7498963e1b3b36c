"""The local tokenizer must reload identically through transformers 5's AutoTokenizer,
with and without a qwen2 config.json next to it (the tiny policy model lives in the same folder)."""

import shutil

import pytest
from transformers import AutoTokenizer, Qwen2Config, Qwen2Tokenizer

from nemo_dapo.model.tokenizer import DEFAULT_VOCAB_SIZE, EOS_TOKEN, IM_START_TOKEN, PAD_TOKEN, build_tokenizer

ROUND_TRIP_TEXTS = [
    "hello world",
    "two  spaces   three    four",
    " leading space",
    "trailing space ",
    "line one\nline two\n\n\nafter blank lines\n",
    "  \n indented\n    code",
    "tab\tseparated\r\nwindows line",
    "digits 0123456789 and 3.14159",
    "Answer: 42",
    "$\\frac{m}{n}$ where $x^2 - 5x + 6 = 0$",
    "unicode: é ü 数学 ∑",
    f"{IM_START_TOKEN}user\nWhat is 2+2?{EOS_TOKEN}\n",
]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """The built tokenizer, plus two saved folders: tokenizer only, and tokenizer with a qwen2 config.json."""
    plain_dir = tmp_path_factory.mktemp("tokenizer")
    built = build_tokenizer(plain_dir)
    with_model_dir = tmp_path_factory.mktemp("tokenizer_with_model")
    shutil.copytree(plain_dir, with_model_dir, dirs_exist_ok=True)
    Qwen2Config(vocab_size=len(built), hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        with_model_dir
    )
    return built, plain_dir, with_model_dir


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dirs):
    built, plain_dir, with_model_dir = tokenizer_dirs
    return {
        "built": built,
        "reloaded": AutoTokenizer.from_pretrained(plain_dir),
        "reloaded_with_qwen2_config": AutoTokenizer.from_pretrained(with_model_dir),
    }


def test_transformers_loads_qwen2_tokenizer_class(tokenizers):
    # With model_type qwen2 transformers 5 forces Qwen2Tokenizer; the design relies on that being our class too.
    for tokenizer in tokenizers.values():
        assert type(tokenizer) is Qwen2Tokenizer


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_ids_and_text(tokenizers, text):
    built = tokenizers["built"]
    expected_ids = built(text, add_special_tokens=False)["input_ids"]
    for name, tokenizer in tokenizers.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == expected_ids, name
        assert tokenizer.decode(ids) == text, name


def test_spaces_and_digits_are_tokenized_qwen_style(tokenizers):
    tokens = tokenizers["reloaded_with_qwen2_config"].tokenize("Answer: 42\n")
    assert tokens[-3:] == ["4", "2", "Ċ"]  # digits are split one by one, newline is byte-level 'Ċ'
    assert "".join(tokens) == "Answer:Ġ42Ċ"


def test_special_tokens(tokenizers):
    for name, tokenizer in tokenizers.items():
        assert tokenizer.pad_token == PAD_TOKEN, name
        assert tokenizer.eos_token == EOS_TOKEN, name
        assert tokenizer.pad_token_id != tokenizer.eos_token_id, name
        for special in (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN):
            ids = tokenizer(special, add_special_tokens=False)["input_ids"]
            assert ids == [tokenizer.convert_tokens_to_ids(special)], (name, special)
        # Encoding plain text adds no BOS/EOS of its own.
        assert tokenizer("hi")["input_ids"] == tokenizer("hi", add_special_tokens=False)["input_ids"], name
    text = f"{IM_START_TOKEN}assistant\n7{EOS_TOKEN}"
    ids = tokenizers["reloaded"](text, add_special_tokens=False)["input_ids"]
    assert tokenizers["reloaded"].decode(ids, skip_special_tokens=True) == "assistant\n7"


def test_chat_template(tokenizers):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is  6 * 7?\nThink."},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is  6 * 7?\nThink.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    built_ids = tokenizers["built"](expected, add_special_tokens=False)["input_ids"]
    for name, tokenizer in tokenizers.items():
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == expected, name
        no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        assert no_prompt == expected.removesuffix("<|im_start|>assistant\n"), name
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == built_ids, name
        assert tokenizer.decode(ids) == expected, name
        assert ids.count(tokenizer.convert_tokens_to_ids(IM_START_TOKEN)) == 3, name


def test_vocab_is_small_and_covers_all_bytes(tokenizers):
    tokenizer = tokenizers["reloaded_with_qwen2_config"]
    assert 256 + 3 <= len(tokenizer) <= DEFAULT_VOCAB_SIZE
    all_bytes = bytes(range(256)).decode("latin-1")
    ids = tokenizer(all_bytes, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == all_bytes


def test_corpus_argument_shapes_the_merges(tmp_path):
    tokenizer = build_tokenizer(tmp_path, corpus=["zebra quagga zebra quagga"] * 50, vocab_size=300)
    assert tokenizer.tokenize(" quagga") == ["Ġquagga"]
    assert len(tokenizer) <= 300


def test_rejects_vocab_smaller_than_byte_alphabet(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(tmp_path, vocab_size=200)


def test_every_learned_merge_is_reachable(tokenizers):
    # Merges learned with a pre-tokenizer other than Qwen2's (e.g. across digits) would be dead vocabulary.
    tokenizer = tokenizers["reloaded_with_qwen2_config"]
    specials = set(tokenizer.all_special_tokens)
    merged = [token for token in tokenizer.get_vocab() if len(token) > 1 and token not in specials]
    assert len(merged) > 100
    unreachable = [
        token for token in merged if tokenizer.tokenize(tokenizer.convert_tokens_to_string([token])) != [token]
    ]
    assert unreachable == []
