"""The Kimi-shaped world's tokenizer class, shipped as remote code inside its tokenizer and model
folders, as Kimi ships tokenization_kimi.py: they load only with trust_remote_code.

The BPE lives in a file no built-in transformers class reads (not tokenizer.json), so a loader
that ignores the custom class (transformers 5.19 does, for deepseek_v3 model folders, without
trust_remote_code) fails instead of silently loading another tokenizer. This file imports only
transformers and tokenizers: it runs in whichever venv loads the tokenizer.
"""

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

BPE_FILE = "kimi_mini_bpe.json"


class KimiMiniTokenizer(PreTrainedTokenizerFast):
    """A byte-level BPE read from BPE_FILE; everything else is PreTrainedTokenizerFast."""

    vocab_files_names = {"bpe_file": BPE_FILE}

    def __init__(self, bpe_file: str | None = None, **kwargs) -> None:
        if bpe_file is not None:
            kwargs["tokenizer_object"] = Tokenizer.from_file(bpe_file)
        super().__init__(**kwargs)
