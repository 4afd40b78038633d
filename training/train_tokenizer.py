"""Train the default model's byte-level BPE tokenizer on ``training/data/train.txt``.

Saves a ``transformers`` tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, loadable with
``AutoTokenizer.from_pretrained``) to ``--out`` (default ``training/data/tokenizer``).

Special tokens (ids fixed, first in the vocabulary):
    0 ``<|endoftext|>``  bos = eos = pad; separates documents
    1 ``<|im_start|>``   chat turn start
    2 ``<|im_end|>``     chat turn end

Usage:  python training/train_tokenizer.py [--vocab-size 4096]
"""
from __future__ import annotations

import argparse
import os

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML-style turns; `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(train_file: str, vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([train_file], trainer)
    # The training file separates books with a literal "<|endoftext|>" which, being a special
    # token, is matched whole before pre-tokenization.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-file", default=os.path.join(HERE, "data", "train.txt"))
    ap.add_argument("--out", default=os.path.join(HERE, "data", "tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args()
    fast = build_tokenizer(args.train_file, args.vocab_size)
    fast.save_pretrained(args.out)
    ids = [fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == [0, 1, 2], ids
    print(f"saved tokenizer ({len(fast)} tokens) to {args.out}")


if __name__ == "__main__":
    main()
