"""Chat templates by Axolotl's names, so a config's `chat_template: llama3` renders conversations the way that model
family does. `tokenizer_default` keeps the tokenizer's own; `tokenizer_default_fallback_<name>` uses it where it has
one, else `<name>`; `jinja` takes the template given (or a file holding it). Axolotl's names for the templates that
a model family's tokenizers ship (`cohere`, `llama4`, `deepseek_v3`, ...) take the tokenizer's own, with a notice.

Each template renders an assistant turn as its generation prompt followed by the answer, so a conversation renders
turn by turn (what masking prompts needs: `Formatter.chat_template`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshkit.core.errors import MeshkitError


class ChatTemplateError(MeshkitError):
    """A chat template name meshkit does not know, or a tokenizer without the template asked for."""


_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen3's: ChatML, and an assistant turn's reasoning (`reasoning_content`, or a `<think>` block in its content) written
# only for the turns after the last user message; `enable_thinking: false` opens the reply with an empty block.
_QWEN3 = (
    "{%- set ns = namespace(last=messages|length - 1, searching=true) -%}"
    "{%- for m in messages[::-1] -%}{%- if ns.searching and m['role'] == 'user' -%}"
    "{%- set ns.last = messages|length - 1 - loop.index0 -%}{%- set ns.searching = false -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'assistant' -%}{%- set reasoning = m.get('reasoning_content') or '' -%}"
    "{%- if not reasoning and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last and reasoning -%}"
    "{{ '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else -%}{{ '<|im_start|>assistant\n' + content.lstrip('\n') if reasoning else '<|im_start|>assistant\n' + "
    "content }}{%- endif -%}{{ '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}"
    "{%- endif -%}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
    "m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_PHI3 = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
_GEMMA = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% else %}{{ m['content'] + '\\n\\n' }}"
    "{% endif %}{% endfor %}"
)
_ALPACA = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '### Instruction: ' + m['content'] + '\\n\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ '### Response: ' + m['content'] + eos_token + '\\n\\n' }}"
    "{% else %}{{ m['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response: ' }}{% endif %}"
)
TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "qwen_25": _CHATML,
    "qwen3": _QWEN3,
    "llama3": _LLAMA3,
    "phi_3": _PHI3,
    "phi_35": _PHI3,
    "gemma": _GEMMA,
    "gemma3": _GEMMA,
    "mistral": _MISTRAL,
    "mistral_v1": _MISTRAL,
    "mistral_v2v3": _MISTRAL,
    "mistral_v3_tekken": _MISTRAL,
    "alpaca": _ALPACA,
}
# Axolotl's other template names: each the template its model family's tokenizers ship (in tokenizer_config.json).
# meshkit carries none of them: it takes the tokenizer's own, and says so.
SHIPPED_BY_TOKENIZERS = frozenset(
    {
        "cohere", "command_a", "command_a_tool_use", "command_a_rag", "aya", "llama3_2_vision", "llama4",
        "deepseek_v2", "deepseek_v3", "jamba", "qwen3_5", "falcon_h1", "nemotron_h", "exaone", "exaone4",
        "metharme", "pixtral", "llava", "qwen2_vl", "gemma3n", "gemma4", "gemma4_unified", "mistral_v7_tekken",
    }
)  # fmt: skip
NAMES = ("tokenizer_default", *TEMPLATES, "tokenizer_default_fallback_<name>", "jinja")


def template_note(name: str | None) -> str | None:
    """The notice for a template name that means the tokenizer's own (None for any other)."""
    if name not in SHIPPED_BY_TOKENIZERS:
        return None
    return f"chat_template: {name} is the template {name}'s tokenizers ship: the tokenizer's own is used"


def chat_template(name: str | None, jinja: str | None, tokenizer: Any) -> str | None:
    """The Jinja template `name` asks for (None: the tokenizer's own, possibly none)."""
    if name is None and jinja:
        name = "jinja"
    if name in (None, "tokenizer_default"):
        return tokenizer.chat_template
    if name == "jinja":
        if not jinja:
            raise ChatTemplateError("chat_template: jinja needs chat_template_jinja (a template or a file)")
        path = Path(jinja).expanduser()
        return path.read_text() if "{" not in jinja and path.is_file() else jinja
    if name.startswith("tokenizer_default_fallback_"):
        fallback = name.removeprefix("tokenizer_default_fallback_")
        return tokenizer.chat_template or chat_template(fallback, None, tokenizer)
    if name in SHIPPED_BY_TOKENIZERS:
        if not tokenizer.chat_template:
            raise ChatTemplateError(
                f"chat_template: {name} is the template {name}'s tokenizers ship, and this tokenizer has none: give "
                "it as chat_template: jinja with chat_template_jinja (the template, or a file holding it)"
            )
        return tokenizer.chat_template
    if name not in TEMPLATES:
        raise ChatTemplateError(f"chat_template: '{name}' is not one meshkit knows; choose one of {', '.join(NAMES)}")
    return TEMPLATES[name]
