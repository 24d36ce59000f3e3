"""``chat_template`` of a mergekit recipe, resolved as mergekit 0.1.5 resolves it:

* ``auto``: the template most input models' tokenizers carry (whitespace-stripped; a tie goes to the first in
  recipe order); none carried: the output keeps its tokenizer's own;
* a known name (shorter than 256 characters, no newline, no ``{``): ``chatml``, ``llama3`` or ``mistral``.
  These are Alloy's own templates, written to render every conversation exactly as mergekit's templates of those
  names do under transformers' chat-template renderer (the differential test renders both). mergekit's
  ``alpaca`` and ``exaone`` templates emit whitespace that Alloy does not reproduce, so those names are refused
  (pass the template itself as a Jinja string instead);
* anything else must be a Jinja string of at least 20 characters containing ``{``; it is used verbatim.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from alloy.errors import AlloyError, ErrorCode

AUTO = "auto"

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{% for message in messages %}"
    "{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\\n\\n' ~ (message['content'] | trim) "
    "~ '<|eot_id|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

MISTRAL = (
    "{{- bos_token -}}"
    "{%- set offset = 1 if messages and messages[0]['role'] == 'system' else 0 -%}"
    "{%- for message in messages[offset:] -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 is even) -%}"
    "{{- raise_exception('After an optional system message, roles must alternate user/assistant') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- ' [INST] ' ~ (messages[0]['content'] ~ '\\n\\n' if offset and loop.first else '') ~ message['content'] "
    "~ ' [/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- ' ' ~ message['content'] ~ eos_token -}}"
    "{%- else -%}"
    "{{- raise_exception('Only user and assistant roles are supported, after an optional system message') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

KNOWN = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL}
REFUSED = {
    "alpaca": "mergekit's alpaca template emits whitespace Alloy does not reproduce; give the template as a Jinja string",
    "exaone": "mergekit's exaone template emits whitespace Alloy does not reproduce; give the template as a Jinja string",
}


def _refuse(message: str) -> AlloyError:
    return AlloyError(ErrorCode.VALIDATION_FAILED, f"chat_template: {message}", {"field": "chat_template"})


def check_chat_template(value: str) -> None:
    """Refuse what mergekit would refuse (or Alloy cannot reproduce) before anything is merged."""
    if value == AUTO:
        return
    if _is_name(value):
        if value in KNOWN:
            return
        if value in REFUSED:
            raise _refuse(REFUSED[value])
    if len(value) < 20 or "{" not in value:
        known = ", ".join(sorted(KNOWN))
        raise _refuse(f"{value[:40]!r} is neither a known template ({known}), 'auto' nor a Jinja template")


def _is_name(value: str) -> bool:
    return len(value) < 256 and "\n" not in value and "{" not in value


def resolve_chat_template(value: str, model_templates: Iterable[object]) -> str | None:
    """The template text to store, or None (``auto`` and no input carries one: leave the tokenizer's own).
    ``model_templates``: each input's tokenizer ``chat_template`` (a string, a dict of named ones, or None), in
    recipe order."""
    check_chat_template(value)
    if value == AUTO:
        found = []
        for template in model_templates:
            if isinstance(template, dict):
                template = template.get("default")
            if isinstance(template, str) and template:
                found.append(template.strip())
        return Counter(found).most_common(1)[0][0] if found else None
    if _is_name(value) and value in KNOWN:
        return KNOWN[value]
    return value
