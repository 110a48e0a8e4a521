"""A byte-level tokenizer for the tiny random models: ids 0..255 are bytes, 256 is <eos>,
and ids above that (up to the model's vocabulary) are word-like tokens ``<w257>``...

Any text round-trips, so engine tests can use string prompts, stop strings and the
chat template without a real vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS_ID = 256

# Eight prompts of different lengths (1 to 47 bytes) that the engine tests batch together.
SAMPLE_PROMPTS = [
    "hello world",
    "the tide comes in and the tide goes out",
    "a",
    "0123456789" * 4,
    "tidal engines sleep when idle",
    "xyz",
    "paged attention reads keys through block tables",
    "continuous batching",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map, which ByteLevel expects."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def save_byte_tokenizer(folder: Path, vocab_size: int = 257) -> PreTrainedTokenizerFast:
    vocab = {char: byte for byte, char in _byte_to_char().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    assert fast.convert_tokens_to_ids("<eos>") == EOS_ID
    # A random model emits every id; give each one text so outputs are visible.
    fast.add_tokens([f"<w{i}>" for i in range(EOS_ID + 1, vocab_size)])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast
