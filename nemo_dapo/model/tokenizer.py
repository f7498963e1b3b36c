"""A small, locally trained Qwen2-compatible tokenizer.

Tests and smoke runs need a tokenizer without network access, and it has to
live in the same folder as a tiny Qwen2-architecture model. In transformers 5,
``AutoTokenizer.from_pretrained`` on a folder whose ``config.json`` says
``model_type: qwen2`` always instantiates ``Qwen2Tokenizer`` (qwen2 is listed in
``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``, so a ``tokenizer_class`` written in
``tokenizer_config.json`` is overridden). ``Qwen2Tokenizer.__init__`` keeps only
the vocab and merges of ``tokenizer.json`` and rebuilds the normalizer,
pre-tokenizer and decoder itself, so any other pipeline (e.g. a GPT-2 style
byte-level one) silently changes token ids after reloading. We therefore wrap
the trained vocab and merges in ``Qwen2Tokenizer`` ourselves: with or without a
qwen2 ``config.json``, every loading path builds that same class from the same
files. The BPE is trained with the pipeline of a fresh ``Qwen2Tokenizer`` so
that the merges it learns are ones that pipeline can actually apply.
"""

import json
import random
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)

DEFAULT_VOCAB_SIZE = 512

# ChatML as used by Qwen2: one block per message; the generation prompt opens
# an assistant turn so the policy writes only the answer.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_PROMPT_SENTENCES = (
    "Solve the following math problem step by step.",
    "The last line of your response should be of the form Answer: $Answer "
    "(without quotes) where $Answer is the answer to the problem.",
    'Remember to put your answer on its own line after "Answer:".',
    "Let $x$ be a real number such that $x^2 - 5x + 6 = 0$. Find the sum of all possible values of $x$.",
    "Find the remainder when $N$ is divided by 1000.",
    "The probability can be written as $\\frac{m}{n}$, where $m$ and $n$ are relatively prime positive integers.",
    "First, we compute the total. Then we subtract the cases that do not work.",
    "Therefore the answer is the number of integers that satisfy the condition.",
)


def default_corpus(num_arithmetic_lines: int = 400, seed: int = 0) -> list[str]:
    """Maths-flavoured text so that common prompt words and answer formats get merged tokens."""
    rng = random.Random(seed)
    lines = list(_PROMPT_SENTENCES)
    for _ in range(num_arithmetic_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, result = rng.choice((("+", a + b), ("-", a - b), ("*", a * b)))
        lines.append(f"What is {a} {op} {b}?\nWe compute {a} {op} {b} = {result}.\nAnswer: {result}")
    return lines


def _train_bpe(corpus: Iterable[str], vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train byte-level BPE with the exact normalizer/pre-tokenizer Qwen2Tokenizer rebuilds on load."""
    qwen_pipeline = Qwen2Tokenizer().backend_tokenizer
    bpe = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    bpe.normalizer = qwen_pipeline.normalizer
    bpe.pre_tokenizer = qwen_pipeline.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable: no unknown tokens
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    # The Python BPE model does not expose its merges; the serialized form does.
    merges = [tuple(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]]
    return bpe.get_vocab(with_added_tokens=True), merges


def build_tokenizer(
    output_dir: str | Path,
    corpus: Iterable[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_max_length: int = 32768,
) -> Qwen2Tokenizer:
    """Train a small Qwen2-compatible tokenizer, save it to ``output_dir`` and return it.

    ``vocab_size`` is an upper bound: a small corpus yields fewer merges.
    The padding token is ``<|endoftext|>`` and the end-of-sequence token ``<|im_end|>``.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is too small: the byte alphabet and special tokens need 259")
    vocab, merges = _train_bpe(default_corpus() if corpus is None else corpus, vocab_size)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START_TOKEN],
        model_max_length=model_max_length,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(output_dir))
    return tokenizer


def load_tokenizer(model_path: str):
    """The model folder's tokenizer, with a pad token: batches are padded (the masks make the pad
    value irrelevant), and tokenizers such as Llama 3's or Mistral's declare none. Those pad with
    their EOS token, chosen here once for the whole run and said in the log. One without a chat
    template is refused: every prompt is a list of chat messages, which only a template makes text."""
    import logging

    from transformers import AutoTokenizer

    from nemo_dapo.errors import InputError

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not tokenizer.chat_template:
        raise InputError(
            f"{model_path}: its tokenizer has no chat template, and the prompts (each row's 'prompt') are chat "
            "messages, which only a template turns into the model's text: give model.path (eval: --model) a folder "
            "whose tokenizer has one (the model's chat or instruct release), or add the template to this folder "
            "(a chat_template.jinja file, or 'chat_template' in tokenizer_config.json)"
        )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise InputError(f"{model_path}: the tokenizer has neither a pad nor an EOS token; add a pad token to it")
        tokenizer.pad_token = tokenizer.eos_token
        logging.getLogger(__name__).info(
            "the tokenizer of %s has no pad token: padding with its EOS token %r", model_path, tokenizer.eos_token
        )
    return tokenizer
