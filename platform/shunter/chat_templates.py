"""Chat templates the builtin models ship with, where the model's own says nothing about tools.

SmolLM2-Instruct's own template is plain ChatML: it renders no tool definitions (so a request's tools
never reached the prompt, nor counted toward its token limits) and fails on an assistant turn that holds
only tool calls (its content is null). `CHATML_TOOLS` renders every conversation without tools to the
same text as that template, token for token, and adds the ChatML tool convention Hermes 2 Pro
introduced and Qwen2.5 follows: the tools' JSON schemas inside `<tools></tools>` in the system turn, each
call the model makes as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, each tool result as
a user turn inside `<tool_response></tool_response>`. vLLM's `hermes` tool parser reads exactly that
format, which is why the catalog pairs the two (`shunter.catalog`).
"""

from __future__ import annotations

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Whitespace matters: outside {%- -%} tags every character is output. Conversations without tools
# render exactly as SmolLM2's own template (tests/unit/test_chat_templates.py).
CHATML_TOOLS = (
    "{%- set ns = namespace(system=none) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' + (ns.system if ns.system is not none else '" + SMOLLM2_SYSTEM + "') }}"
    "{{ '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '"
    " + '<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": '"
    " + '<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\n" + SMOLLM2_SYSTEM + "<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- if not tools %}{{ '<|im_start|>system\n' + message['content'] + '<|im_end|>\n' }}{%- endif -%}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set function = call['function'] if call.get('function') else call -%}"
    "{%- if message['content'] or not loop.first %}{{ '\n' }}{%- endif -%}"
    "{{ '<tool_call>\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{%- if function['arguments'] is string %}{{ function['arguments'] }}"
    "{%- else %}{{ function['arguments'] | tojson }}{%- endif -%}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\n<tool_response>\n' + (message['content'] or '') + '\n</tool_response><|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
