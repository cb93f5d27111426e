"""A character-level tokenizer for tiny test models (``shardload run`` needs the checkpoint's
tokenizer files): built with the ``tokenizers`` package and wrapped by transformers, saved
beside a checkpoint with ``save_pretrained``."""

import string


def char_tokenizer():
    """``<pad>`` 0, ``<eos>`` 1, then letters, digits and a little punctuation (70 tokens)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = string.ascii_letters + string.digits + " .,?!'"
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>"
    )
