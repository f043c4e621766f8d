"""Chat templates and tools: whether a tokenizer's template shows the model its tools, and one that does for
ChatML models.

The tools reach the model through the chat template: ``tokenizer.apply_chat_template(messages, tools=[...])``
renders each tool's schema (``ppojax.agents.schemas``) into the prompt, and the model's calls and the tools' answers
into the conversation. A template that ignores ``tools`` (SmolLM2-135M-Instruct's own, bundled with ppojax, is one)
would train a model on tools it is never told about, so :func:`check_tool_template` refuses it with TRL's test
(``trl.chat_template_utils.supports_tool_calling``): a conversation user -> assistant with a tool call -> tool
result must render the call's name, its argument and the result.

``CHATML_TOOLS_TEMPLATE`` is a ChatML template with tools in the Hermes format (the layout of Qwen 2.5's template,
parsed by ppojax's ``hermes`` parser): without tools it renders exactly what SmolLM2's bundled template renders;
with tools the system message lists their schemas in ``<tools></tools>`` and asks for
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; tool results are a user turn of ``<tool_response>``
blocks. Appending messages never changes how earlier ones render (prefix-preserving), which a multi-turn
episode's growing prompt needs.
"""
from __future__ import annotations

from typing import Optional

from ppojax.errors import ConfigError

__all__ = ["CHATML_TOOLS_TEMPLATE", "SMOLLM2_SYSTEM_PROMPT", "check_tool_template", "supports_tool_calling"]

SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CHATML_TOOLS_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set rest = messages[1:] %}"
    "{%- else %}"
    "{%- set system_message = '" + SMOLLM2_SYSTEM_PROMPT + "' %}{%- set rest = messages %}"
    "{%- endif %}"
    "{{- '<|im_start|>system\\n' + system_message }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_NAME = "tool_name_a8f3e2b1"  # TRL's sentinels: each part of the exchange must survive the rendering
_ARG_KEY = "tool_arg_key_b9d4f5c2"
_ARG_VALUE = "tool_arg_val_d6e7a9f3"
_CONTENT = "tool_content_c4f9a8e2"


def supports_tool_calling(tokenizer, chat_template: Optional[str] = None) -> bool:
    """Whether the template (``chat_template``, else the tokenizer's) renders a tool-calling exchange: user ->
    assistant with a tool call -> tool result, with the call's name, argument key and value and the result all in
    the text (TRL's ``supports_tool_calling``)."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": _NAME, "arguments": {_ARG_KEY: _ARG_VALUE}}}]},
        {"role": "tool", "name": _NAME, "content": _CONTENT},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render the exchange does not support it
        return False
    return all(part in text for part in (_NAME, _ARG_KEY, _ARG_VALUE, _CONTENT))


def check_tool_template(tokenizer, chat_template: Optional[str] = None, *, model: str = "the model") -> None:
    """ConfigError when the template cannot show tools to the model (:func:`supports_tool_calling`)."""
    if not supports_tool_calling(tokenizer, chat_template):
        raise ConfigError(f"the chat template of {model} does not render tool calls and tool results (a tool call's "
                          "name, arguments and the tool's answer vanish from the prompt), so the model would never "
                          "see its tools. Fix: use a tool-capable template: for ChatML models such as SmolLM2, "
                          "ppojax.agents.CHATML_TOOLS_TEMPLATE.")
