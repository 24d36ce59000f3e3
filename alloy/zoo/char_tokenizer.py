"""A character-level tokenizer built in-process (no hub), saved as a normal ``tokenizer.json`` folder.

The tiny preset's random models need a tokenizer whose vocabulary fits their 128-entry embedding table:
four special tokens plus the 95 printable ASCII characters.
"""

from __future__ import annotations

from typing import Literal

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
CHARACTERS = [chr(c) for c in range(32, 127)]


def char_tokenizer(style: Literal["encoder", "causal_lm"]):
    # lazy: transformers costs seconds to import; only model loading needs it
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIALS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if style == "encoder":
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
        )
    # Causal LM: "[CLS]" doubles as the beginning-of-text token so the first character is predicted too.
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", vocab["[CLS]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", bos_token="[CLS]", eos_token="[SEP]"
    )
