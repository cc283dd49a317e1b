"""How `tokenizer.json` here was made: a small T5-style Unigram tokenizer (Metaspace pieces, `</s>` appended, pad 0,
eos 1, unk 2) that covers any ASCII caption (whole words for the common ones, else single characters), so sd3_tiny
needs neither a download nor sentencepiece. `python make_tokenizer.py` writes it again, the same bytes."""

import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

WORDS = ("a an the of on in with and at to by for from is are photo picture image painting drawing style "
         "red green blue yellow purple orange white black gray brown pink square bar block circle background "
         "cat dog man woman person tree house car sky sea mountain city street light dark small large big "
         "old new bright soft sharp detailed portrait landscape close up view night day sun moon").split()


def build() -> Tokenizer:
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *(("\u2581" + w, -5.0) for w in WORDS),
              ("\u2581", -8.0), *((c, -10.0) for c in chars), *(("\u2581" + c, -9.0) for c in chars)]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Replace("  ", " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    return tokenizer


if __name__ == "__main__":
    build().save(str(Path(__file__).with_name("tokenizer.json")))
