"""Byte-level BPE tokenizers trained on the Python reference topics every Python ships, in the
chat formats of the worlds' model families (Llama-style and Kimi-style).

Byte-level means every string encodes (no unknown tokens), which the targets, vLLM and the
drafter training all rely on. A format's special tokens come first, so their ids are fixed
whatever the vocabulary size: Llama <|system|>=0, <|user|>=1, <|assistant|>=2, <|end|>=3 (eos),
<|pad|>=4; Kimi <|im_system|>=0, <|im_user|>=1, <|im_assistant|>=2, <|im_middle|>=3,
<|im_end|>=4 (eos), <think>=5, </think>=6, [PAD]=7.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SYSTEM, USER, ASSISTANT, END, PAD = (
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|pad|>",
)
SPECIAL_TOKENS = [SYSTEM, USER, ASSISTANT, END, PAD]

# One turn renders as "<|role|>\n{content}<|end|>\n"; the generation prompt is "<|assistant|>\n".
# Newlines live inside string literals so Jinja whitespace handling cannot change them.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

KIMI_SPECIAL_TOKENS = (
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "[PAD]",
)
# Kimi-K2.5's shape: a turn is "<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>", past
# assistant turns open with an empty "<think></think>"; the generation prompt opens the
# assistant turn and then "<think>" (thinking, the default) or "<think></think>" (instant mode,
# `thinking=False`). `thinking` is read, never `set`: vLLM passes only the kwargs a template
# reads, found by Jinja's analysis of undeclared variables.
KIMI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' }}"
    "{%- if message['role'] == 'assistant' -%}{{ '<think></think>' }}{%- endif -%}"
    "{{ message['content'] + '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- if thinking is defined and not thinking -%}{{ '<think></think>' }}"
    "{%- else -%}{{ '<think>' }}{%- endif -%}"
    "{%- endif -%}"
)
# Instant mode: what the Kimi targets are trained on and the pipeline generates with.
KIMI_TEMPLATE_KWARGS: dict[str, Any] = {"thinking": False}


@dataclass(frozen=True)
class ChatFormat:
    """A family's special tokens and chat template, and what a user of its tokenizer must set."""

    special_tokens: tuple[str, ...]  # first in the vocabulary: token i has id i
    eos: str
    pad: str
    chat_template: str
    template_kwargs: dict[str, Any] | None  # rendering the targets learn and generation uses
    remote_code: bool  # saved as a custom class that loads only with trust_remote_code

    @property
    def additional_special_tokens(self) -> list[str]:
        return [token for token in self.special_tokens if token not in (self.eos, self.pad)]


LLAMA_CHAT = ChatFormat(tuple(SPECIAL_TOKENS), END, PAD, CHAT_TEMPLATE, None, remote_code=False)
KIMI_CHAT = ChatFormat(
    KIMI_SPECIAL_TOKENS,
    "<|im_end|>",
    "[PAD]",
    KIMI_CHAT_TEMPLATE,
    KIMI_TEMPLATE_KWARGS,
    remote_code=True,
)


def train_tokenizer(
    texts: list[str], vocab_size: int, out_dir: Path, chat: ChatFormat = LLAMA_CHAT
) -> None:
    """Train the BPE on `texts` and save it as a transformers fast tokenizer in `out_dir`.

    transformers 5 writes the chat template to chat_template.jinja only; it is also put into
    tokenizer_config.json (with the class name) for readers that look there.
    """
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(chat.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=chat.eos,
        pad_token=chat.pad,
        additional_special_tokens=chat.additional_special_tokens,
        chat_template=chat.chat_template,
        model_max_length=2048,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=chat.chat_template)
    if chat.remote_code:
        config.update(_as_remote_code(out_dir))
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _as_remote_code(out_dir: Path) -> dict[str, Any]:
    """Turn the saved tokenizer in `out_dir` into KimiMiniTokenizer remote code: its module
    beside it, the BPE under the class's own file name; returns the tokenizer_config.json
    entries that name the class and map AutoTokenizer to it."""
    from eagle3_assets.localdev import tokenization_kimi_mini as module

    (out_dir / "tokenizer.json").rename(out_dir / module.BPE_FILE)
    shutil.copy(module.__file__, out_dir / Path(module.__file__).name)
    class_name = module.KimiMiniTokenizer.__name__
    reference = f"{module.__name__.rsplit('.', 1)[-1]}.{class_name}"
    return {"tokenizer_class": class_name, "auto_map": {"AutoTokenizer": [reference, None]}}


# A world's family names its chat format here and its target architecture in targets.py.
CHAT_FORMATS = {"llama": LLAMA_CHAT, "kimi": KIMI_CHAT}
