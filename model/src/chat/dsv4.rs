//! DeepSeek-V4's prompt format, built in.
//!
//! DeepSeek-V4 checkpoints ship no Jinja chat template but a Python encoder,
//! `encoding_dsv4.py` (`encode_messages`). This module produces the same
//! text; `model/tests/tokenizers.rs` compares it with that file's output.
//!
//! How a request maps onto the encoder's parameters (the same way
//! OpenAI-compatible servers drive DeepSeek's Python encoders):
//! - thinking mode when `extra.thinking` or `extra.enable_thinking` is truthy;
//! - tools go into a system message inserted first;
//! - earlier reasoning is dropped when the conversation ends with a user
//!   turn (`extra.drop_thinking` overrides);
//! - `extra.reasoning_effort` ("max", "high" or absent) passes through;
//! - text content parts are joined with "\n" (other parts are an error),
//!   except in tool results, whose blocks the encoder renders itself;
//! - `add_generation_prompt` changes nothing: the format always opens the
//!   assistant turn after a final user message.
//!
//! Where the Python raises (unknown role, malformed tool call, ...), this
//! returns an error with the same meaning.

use serde_json::{Map, Value, json};

use super::RenderOptions;
use super::pyfmt::{self, JsonOptions};

const BOS: &str = "<｜begin▁of▁sentence｜>";
const EOS: &str = "<｜end▁of▁sentence｜>";
const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";
const USER: &str = "<｜User｜>";
const ASSISTANT: &str = "<｜Assistant｜>";
const LATEST_REMINDER: &str = "<｜latest_reminder｜>";

/// Internal classification tasks and their tokens.
const TASKS: [(&str, &str); 6] = [
    ("action", "<｜action｜>"),
    ("query", "<｜query｜>"),
    ("authority", "<｜authority｜>"),
    ("domain", "<｜domain｜>"),
    ("title", "<｜title｜>"),
    ("read_url", "<｜read_url｜>"),
];

const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

const TOOLS_HEAD: &str = r#"## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"#;

const TOOLS_TAIL: &str = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

const RESPONSE_FORMAT_HEAD: &str =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

type Msg = Map<String, Value>;

/// Renders a conversation; errors are plain messages (the caller adds the
/// template's origin).
pub fn encode(messages: &[Value], opts: &RenderOptions) -> Result<String, String> {
    let mut msgs = Vec::with_capacity(messages.len() + 1);
    for (i, m) in messages.iter().enumerate() {
        let mut m = m
            .as_object()
            .cloned()
            .ok_or_else(|| format!("message {i} is not an object"))?;
        // Tool results keep their blocks: the encoder renders those itself.
        if let Some(Value::Array(parts)) = m.get("content")
            && m.get("role") != Some(&json!("tool"))
        {
            let text = join_text_parts(parts).map_err(|e| format!("message {i}: {e}"))?;
            m.insert("content".into(), Value::String(text));
        }
        msgs.push(m);
    }
    if let Some(tools) = opts.tools.as_ref().filter(|t| truthy(t)) {
        let mut system = Msg::new();
        system.insert("role".into(), json!("system"));
        system.insert("tools".into(), tools.clone());
        msgs.insert(0, system);
    }
    let extra = &opts.extra;
    let thinking = extra.get("thinking").is_some_and(truthy)
        || extra.get("enable_thinking").is_some_and(truthy);
    let drop_thinking = match extra.get("drop_thinking") {
        Some(v) => truthy(v),
        None => msgs.last().and_then(|m| m.get("role")) == Some(&json!("user")),
    };
    let effort = match extra.get("reasoning_effort") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "max" || s == "high" => Some(s.as_str()),
        Some(other) => return Err(format!("invalid reasoning_effort {other}")),
    };
    encode_messages(msgs, thinking, drop_thinking, effort)
}

fn join_text_parts(parts: &[Value]) -> Result<String, String> {
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
            (kind, _) => {
                return Err(format!(
                    "content part of type {} is not supported by DeepSeek-V4's text format",
                    kind.unwrap_or("(none)")
                ));
            }
        }
    }
    Ok(texts.join("\n"))
}

/// Python truthiness of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

fn get<'a>(m: &'a Msg, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

fn role(m: &Msg) -> Option<&str> {
    m.get("role").and_then(Value::as_str)
}

/// `str(value)` of the JSON value as Python would print it.
fn py_str(v: &Value) -> String {
    pyfmt::py_str(&pyfmt::from_json(v)).unwrap_or_default()
}

/// Python's `value or ""` followed by string formatting.
fn or_empty(v: Option<&Value>) -> String {
    match v {
        Some(v) if truthy(v) => py_str(v),
        _ => String::new(),
    }
}

/// `json.dumps(value, ensure_ascii=False)`.
fn to_json(v: &Value) -> Result<String, String> {
    pyfmt::dumps(&pyfmt::from_json(v), &JsonOptions::new(None)).map_err(|e| e.to_string())
}

fn encode_messages(
    messages: Vec<Msg>,
    thinking: bool,
    drop_thinking: bool,
    effort: Option<&str>,
) -> Result<String, String> {
    let mut messages = merge_tool_messages(messages);
    sort_tool_results_by_call_order(&mut messages);
    // With tools anywhere, earlier reasoning is kept (the model needs it to
    // follow its own tool use).
    let drop_thinking =
        drop_thinking && !messages.iter().any(|m| m.get("tools").is_some_and(truthy));
    if thinking && drop_thinking {
        messages = drop_thinking_messages(messages);
    }
    let mut prompt = BOS.to_string();
    for index in 0..messages.len() {
        prompt += &render_message(index, &messages, thinking, drop_thinking, effort)?;
    }
    Ok(prompt)
}

fn last_user_index(messages: &[Msg]) -> Option<usize> {
    messages
        .iter()
        .rposition(|m| matches!(role(m), Some("user" | "developer")))
}

/// V4 has no tool role: tool results become `tool_result` blocks of a user
/// message, and consecutive user texts join that message.
fn merge_tool_messages(messages: Vec<Msg>) -> Vec<Msg> {
    let mut merged: Vec<Msg> = Vec::with_capacity(messages.len());
    for msg in messages {
        let open_user_blocks = |merged: &mut Vec<Msg>, needs_no_task: bool| -> bool {
            merged.last().is_some_and(|last| {
                role(last) == Some("user")
                    && last.contains_key("content_blocks")
                    && (!needs_no_task || get(last, "task").is_none())
            })
        };
        match role(&msg) {
            Some("tool") => {
                let block = json!({
                    "type": "tool_result",
                    "tool_use_id": msg.get("tool_call_id").cloned().unwrap_or(json!("")),
                    "content": msg.get("content").cloned().unwrap_or(json!("")),
                });
                if open_user_blocks(&mut merged, false) {
                    push_block(merged.last_mut(), block);
                } else {
                    let mut m = Msg::new();
                    m.insert("role".into(), json!("user"));
                    m.insert("content_blocks".into(), json!([block]));
                    merged.push(m);
                }
            }
            Some("user") => {
                let content = msg.get("content").cloned().unwrap_or(json!(""));
                let block = json!({"type": "text", "text": content.clone()});
                if open_user_blocks(&mut merged, true) {
                    push_block(merged.last_mut(), block);
                } else {
                    let mut m = Msg::new();
                    m.insert("role".into(), json!("user"));
                    m.insert("content".into(), content);
                    m.insert("content_blocks".into(), json!([block]));
                    for key in ["task", "wo_eos", "mask"] {
                        if let Some(v) = msg.get(key) {
                            m.insert(key.into(), v.clone());
                        }
                    }
                    merged.push(m);
                }
            }
            _ => merged.push(msg),
        }
    }
    merged
}

fn push_block(msg: Option<&mut Msg>, block: Value) {
    if let Some(Value::Array(blocks)) = msg.and_then(|m| m.get_mut("content_blocks")) {
        blocks.push(block);
    }
}

/// Tool results are put in the order of the assistant's tool calls (by
/// call id), whatever order the client sent them in.
fn sort_tool_results_by_call_order(messages: &mut [Msg]) {
    let mut order: Vec<(String, usize)> = Vec::new();
    for msg in messages.iter_mut() {
        if role(msg) == Some("assistant") && msg.get("tool_calls").is_some_and(truthy) {
            order.clear();
            if let Some(Value::Array(calls)) = msg.get("tool_calls") {
                for (idx, tc) in calls.iter().enumerate() {
                    let id = tc
                        .get("id")
                        .filter(|v| truthy(v))
                        .or_else(|| tc.get("function").and_then(|f| f.get("id")))
                        .map(py_str)
                        .unwrap_or_default();
                    if !id.is_empty() {
                        // A repeated id keeps its last position, like a dict.
                        order.retain(|(k, _)| *k != id);
                        order.push((id, idx));
                    }
                }
            }
        } else if role(msg) == Some("user")
            && !order.is_empty()
            && let Some(Value::Array(blocks)) = msg.get_mut("content_blocks")
        {
            let is_result = |b: &Value| b.get("type") == Some(&json!("tool_result"));
            let mut results: Vec<Value> = blocks.iter().filter(|b| is_result(b)).cloned().collect();
            if results.len() < 2 {
                continue;
            }
            let rank = |b: &Value| {
                let id = b.get("tool_use_id").map(py_str).unwrap_or_default();
                order.iter().find(|(k, _)| *k == id).map_or(0, |(_, i)| *i)
            };
            results.sort_by_key(rank); // stable, as Python's sorted
            let mut sorted = results.into_iter();
            for b in blocks.iter_mut().filter(|b| is_result(b)) {
                if let Some(next) = sorted.next() {
                    *b = next;
                }
            }
        }
    }
}

/// Before the last user turn: assistant reasoning is removed and developer
/// (and other non-kept) messages are dropped.
fn drop_thinking_messages(messages: Vec<Msg>) -> Vec<Msg> {
    let last_user = last_user_index(&messages);
    let keep = [
        "user",
        "system",
        "tool",
        "latest_reminder",
        "direct_search_results",
    ];
    let mut out = Vec::with_capacity(messages.len());
    for (idx, mut msg) in messages.into_iter().enumerate() {
        let r = role(&msg).unwrap_or_default();
        if keep.contains(&r) || last_user.is_none_or(|lu| idx >= lu) {
            out.push(msg);
        } else if r == "assistant" {
            msg.remove("reasoning_content");
            out.push(msg);
        }
    }
    out
}

fn render_tools(tools: &[Value]) -> Result<String, String> {
    let schemas = tools.iter().map(to_json).collect::<Result<Vec<_>, _>>()?;
    Ok(format!("{TOOLS_HEAD}{}{TOOLS_TAIL}", schemas.join("\n")))
}

/// OpenAI tools (`{"type": "function", "function": {...}}`) to the bare
/// function schemas the format lists.
fn functions_of(tools: &Value) -> Result<Vec<Value>, String> {
    let list = tools.as_array().ok_or("tools must be a list")?;
    list.iter()
        .map(|t| {
            t.get("function")
                .cloned()
                .ok_or_else(|| "tool without `function`".to_string())
        })
        .collect()
}

/// `name="..." string="true|false"` parameters of one tool call. Arguments
/// are a JSON object in a string; anything else is passed as one parameter
/// named `arguments`, as the reference does.
fn encode_arguments(arguments: &Value) -> Result<String, String> {
    let parsed = match arguments {
        Value::String(s) => {
            serde_json::from_str::<Value>(s).unwrap_or_else(|_| json!({ "arguments": arguments }))
        }
        other => json!({ "arguments": other }),
    };
    let Value::Object(args) = parsed else {
        return Err(format!(
            "tool call arguments are not a JSON object: {arguments}"
        ));
    };
    let mut params = Vec::with_capacity(args.len());
    for (k, v) in &args {
        let (is_str, value) = match v {
            Value::String(s) => ("true", s.clone()),
            other => ("false", to_json(other)?),
        };
        params.push(format!(
            "<｜DSML｜parameter name=\"{k}\" string=\"{is_str}\">{value}</｜DSML｜parameter>"
        ));
    }
    Ok(params.join("\n"))
}

fn render_tool_calls(tool_calls: &Value) -> Result<String, String> {
    let calls = tool_calls.as_array().ok_or("tool_calls must be a list")?;
    let mut invokes = Vec::with_capacity(calls.len());
    for tc in calls {
        let f = tc.get("function").ok_or("tool call without `function`")?;
        let name = f.get("name").ok_or("tool call without `name`")?;
        let arguments = f.get("arguments").ok_or("tool call without `arguments`")?;
        invokes.push(format!(
            "<｜DSML｜invoke name=\"{}\">\n{}\n</｜DSML｜invoke>",
            py_str(name),
            encode_arguments(arguments)?
        ));
    }
    Ok(format!(
        "\n\n<｜DSML｜tool_calls>\n{}\n</｜DSML｜tool_calls>",
        invokes.join("\n")
    ))
}

fn render_user_blocks(blocks: &[Value]) -> Result<String, String> {
    let mut parts = Vec::with_capacity(blocks.len());
    for block in blocks {
        let kind = block.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => match block.get("text") {
                None => parts.push(String::new()),
                Some(Value::String(s)) => parts.push(s.clone()),
                Some(other) => return Err(format!("user content must be text, got {other}")),
            },
            Some("tool_result") => {
                let content = match block.get("content") {
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(|b| match b.get("type").and_then(Value::as_str) {
                            Some("text") => b.get("text").map(py_str).unwrap_or_default(),
                            other => format!("[Unsupported {}]", other.unwrap_or("None")),
                        })
                        .collect::<Vec<_>>()
                        .join("\n\n"),
                    Some(v) => py_str(v),
                    None => String::new(),
                };
                parts.push(format!("<tool_result>{content}</tool_result>"));
            }
            other => parts.push(format!("[Unsupported {}]", other.unwrap_or("None"))),
        }
    }
    Ok(parts.join("\n\n"))
}

fn text_content(msg: &Msg, what: &str) -> Result<String, String> {
    match get(msg, "content") {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("{what} content must be text, got {other}")),
    }
}

fn render_message(
    index: usize,
    messages: &[Msg],
    thinking: bool,
    drop_thinking: bool,
    effort: Option<&str>,
) -> Result<String, String> {
    let msg = &messages[index];
    let last_user = last_user_index(messages);
    let content = get(msg, "content");
    let tools = match get(msg, "tools").filter(|t| truthy(t)) {
        Some(t) => Some(functions_of(t)?),
        None => None,
    };
    let response_format = get(msg, "response_format").filter(|v| truthy(v));

    let mut prompt = String::new();
    if index == 0 && thinking && effort == Some("max") {
        prompt.push_str(REASONING_EFFORT_MAX);
    }
    let tools_and_format = |out: &mut String| -> Result<(), String> {
        if let Some(tools) = &tools {
            out.push_str("\n\n");
            out.push_str(&render_tools(tools)?);
        }
        if let Some(rf) = response_format {
            out.push_str("\n\n");
            out.push_str(RESPONSE_FORMAT_HEAD);
            out.push_str(&to_json(rf)?);
        }
        Ok(())
    };
    match role(msg) {
        Some("system") => {
            prompt.push_str(&or_empty(content));
            tools_and_format(&mut prompt)?;
        }
        Some("developer") => {
            if !content.is_some_and(truthy) {
                return Err(format!("developer message {index} has no content"));
            }
            prompt.push_str(USER);
            prompt.push_str(&text_content(msg, "developer")?);
            tools_and_format(&mut prompt)?;
        }
        Some("user") => {
            prompt.push_str(USER);
            match msg.get("content_blocks") {
                Some(Value::Array(blocks)) if !blocks.is_empty() => {
                    prompt.push_str(&render_user_blocks(blocks)?)
                }
                _ => prompt.push_str(&text_content(msg, "user")?),
            }
        }
        Some("latest_reminder") => {
            prompt.push_str(LATEST_REMINDER);
            prompt.push_str(&content.map_or_else(|| "None".to_string(), py_str));
        }
        Some("assistant") => {
            let tool_calls = match get(msg, "tool_calls").filter(|t| truthy(t)) {
                Some(tc) => render_tool_calls(tc)?,
                None => String::new(),
            };
            let prev_has_task = index > 0 && get(&messages[index - 1], "task").is_some();
            if thinking
                && !prev_has_task
                && (!drop_thinking || last_user.is_none_or(|lu| index > lu))
            {
                prompt.push_str(&or_empty(get(msg, "reasoning_content")));
                prompt.push_str(THINK_END);
            }
            prompt.push_str(&or_empty(content));
            prompt.push_str(&tool_calls);
            if !msg.get("wo_eos").is_some_and(truthy) {
                prompt.push_str(EOS);
            }
        }
        Some("tool") => return Err("tool messages must be merged into user messages".into()),
        other => return Err(format!("unknown role {}", other.unwrap_or("(none)"))),
    }

    // What follows decides the transition: another non-assistant turn needs
    // none; otherwise a task token or the assistant's opening.
    if let Some(next) = messages.get(index + 1)
        && !matches!(role(next), Some("assistant" | "latest_reminder"))
    {
        return Ok(prompt);
    }
    if let Some(task) = get(msg, "task") {
        let task = task.as_str().unwrap_or_default();
        let token = TASKS
            .iter()
            .find(|(name, _)| *name == task)
            .map(|(_, t)| *t)
            .ok_or_else(|| format!("invalid task {task:?}"))?;
        if task == "action" {
            prompt.push_str(ASSISTANT);
            prompt.push_str(if thinking { THINK_START } else { THINK_END });
        }
        prompt.push_str(token);
    } else if matches!(role(msg), Some("user" | "developer")) {
        prompt.push_str(ASSISTANT);
        let open_thinking = thinking && (!drop_thinking || last_user.is_none_or(|lu| index >= lu));
        prompt.push_str(if open_thinking {
            THINK_START
        } else {
            THINK_END
        });
    }
    Ok(prompt)
}
