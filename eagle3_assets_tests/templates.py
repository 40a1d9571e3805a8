"""A target whose chat template reads a kwarg, as Kimi's reads `thinking`: the test world's
template, with instant mode (thinking false) opening the answer with an empty think block. The
same prompts render differently with and without the kwarg, which is what the rendering
checks must catch."""

import json
from pathlib import Path

from eagle3_assets.localdev.tokenizer import CHAT_TEMPLATE

GENERATION_PROMPT = "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    GENERATION_PROMPT,
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}"
    "{%- if thinking is defined and not thinking -%}{{ '<think></think>' }}{%- endif -%}"
    "{%- endif -%}",
)
KWARGS = {"thinking": False}
# Every role and a past assistant turn: what the worlds' exact-rendering tests render.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a loop?"},
    {"role": "assistant", "content": "A repeated block."},
    {"role": "user", "content": 'And "for"?'},
]


def thinking_target(target: Path, out: Path) -> Path:
    """The target's files, its chat template swapped for one that reads `thinking`."""
    assert THINKING_TEMPLATE != CHAT_TEMPLATE
    out.mkdir()
    for file in target.iterdir():
        if file.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (out / file.name).symlink_to(file.resolve())
    config = json.loads((target / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": THINKING_TEMPLATE})
    )
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return out
