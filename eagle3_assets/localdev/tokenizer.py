"""A byte-level BPE tokenizer trained on the Python reference topics every Python ships.

Byte-level means every string encodes (no unknown tokens), which the targets, vLLM and the
drafter training all rely on. The special tokens come first, so their ids are fixed whatever the
vocabulary size: <|system|>=0, <|user|>=1, <|assistant|>=2, <|end|>=3 (eos), <|pad|>=4.
"""

import json
from pathlib import Path

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


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> None:
    """Train the BPE on `texts` and save it as a transformers fast tokenizer in `out_dir`.

    transformers 5 writes the chat template to chat_template.jinja only; it is also put into
    tokenizer_config.json (with the portable class name) for readers that look there.
    """
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
