"""Byte-level tokenizer for the embedded tiny models.

Every UTF-8 byte is one token (ids 0..255, in byte order) and ``<|endoftext|>`` (id 256) marks
document boundaries; there are no merges, so any text round-trips exactly and word/byte perplexity
are well defined. It is a stock ``PreTrainedTokenizerFast`` (``tokenizers`` ByteLevel), saved into
each checkpoint folder so that ``AutoTokenizer.from_pretrained`` reloads it offline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 bytes + EOS


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: token id == byte value, EOS = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes, unordered
    chars = _byte_chars()  # byte b -> its ByteLevel stand-in character, so that id == byte value
    assert len(set(chars)) == 256 and set(chars) == set(alphabet)
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOS] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None, model_max_length=1 << 20
    )


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode table, in byte order (the mapping ByteLevel uses)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]
