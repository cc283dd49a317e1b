"""How `tokenizer.json` here was made: a small byte-level BPE tokenizer in Qwen2's shape (GPT-2's byte alphabet, its
special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` and the vision ones), with whole-word tokens for
QwenImagePipeline's and QwenImageEditPipeline's prompt templates, so that their system prefixes are 34 and 64 tokens
as with Qwen2.5-VL's own tokenizer (the pipelines drop that many), and for common caption words; anything else
falls back to bytes. qwen_image_tiny needs no download. `python make_tokenizer.py` writes it again, the same
bytes."""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.pre_tokenizers import ByteLevel

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
           "<|image_pad|>", "<|video_pad|>")
TEMPLATE = ("system user assistant Describe the image by detailing color shape size texture quantity text spatial "
            "relationships of objects and background key features input then explain how user's instruction "
            "should alter or modify Generate a new that meets requirements while maintaining consistency with "
            "original where appropriate").split()
WORDS = ("a an the of on in with and at to by for from is are photo picture painting drawing style red green blue "
         "yellow purple orange white black gray brown pink square bar block circle cube cat dog man woman person "
         "tree house car sky sea mountain city street light dark small large big old new bright soft sharp detailed "
         "portrait landscape close up view night day sun moon edit make change turn into").split()


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # Every word whole, with and without its leading space: merges learned from them alone
    words = list(dict.fromkeys([*TEMPLATE, *WORDS]))
    # and the templates' punctuation as it stands there (" (" and ")," one token each, as in Qwen's vocabulary)
    corpus = [" ".join(words), *words, *(w.capitalize() for w in words), " (color, background), "]
    trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=1, show_progress=False,
                                  initial_alphabet=ByteLevel.alphabet(), special_tokens=list(SPECIAL))
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


if __name__ == "__main__":
    build().save(str(Path(__file__).with_name("tokenizer.json")))
