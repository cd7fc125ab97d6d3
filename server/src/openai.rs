//! The OpenAI request bodies colibri accepts, written by hand to be lenient
//! where clients differ (unknown fields are ignored, `stop` may be a string
//! or a list, content may be a string or parts) and strict where a value
//! would change the output silently (wrong types, out-of-range numbers,
//! unsupported `n`, absurd stop lists are all 400s naming the field).

use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// Most stop strings one request may give, and their longest length.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 1024;
pub const MAX_TOP_LOGPROBS: u32 = 20;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Sampling and length fields shared by both endpoints.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
}

/// Chat-only fields (the shared ones are read separately as [`Common`], so
/// errors can name the exact field).
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Value>,
    /// vLLM/SGLang's way to pass template switches (`enable_thinking`, …).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Legacy completions: how many alternatives per token (0..=5).
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
}

/// Parses a JSON body: invalid UTF-8 and syntax errors are 400s.
pub fn parse_value(body: &[u8]) -> Result<Value, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid UTF-8: {e}")))?;
    let v: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    Ok(v)
}

/// Reads `T` out of a parsed body, naming the offending field on a type
/// error.
pub fn from_value<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path.is_empty() || path == "." {
            ApiError::bad_request(format!("invalid request: {inner}"))
        } else {
            ApiError::bad_param(&path, format!("invalid value for `{path}`: {inner}"))
        }
    })
}

/// A body's shared fields and its endpoint-specific ones.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<(Common, T), ApiError> {
    let v = parse_value(body)?;
    Ok((from_value(&v)?, from_value(&v)?))
}

/// Validated generation settings of a request.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_tokens: Option<usize>,
    pub sampling: colibri_model::sampling::SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

fn range(param: &str, v: Option<f32>, lo: f32, hi: f32, default: f32) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x),
        Some(x) => Err(ApiError::bad_param(
            param,
            format!("`{param}` must be between {lo} and {hi}, got {x}"),
        )),
    }
}

impl Common {
    pub fn settings(&self) -> Result<Settings, ApiError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::bad_param(
                "n",
                format!("only n = 1 is supported, got {n}"),
            ));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::bad_param(
                "logit_bias",
                "logit_bias is not supported",
            ));
        }
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(0), _) | (None, Some(0)) => {
                return Err(ApiError::bad_param(
                    "max_tokens",
                    "max_tokens must be at least 1",
                ));
            }
            (Some(m), _) | (None, Some(m)) => Some(m as usize),
            (None, None) => None,
        };
        let top_k = match self.top_k {
            None => 0,
            Some(k) if k <= 0 => 0, // -1 / 0: off, as vLLM and llama.cpp read it
            Some(k) => k as usize,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_param(
                "stop",
                format!(
                    "at most {MAX_STOP_STRINGS} stop sequences are allowed, got {}",
                    stop.len()
                ),
            ));
        }
        if let Some(s) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::bad_param(
                "stop",
                format!(
                    "stop sequences may be at most {MAX_STOP_BYTES} bytes, got {}",
                    s.len()
                ),
            ));
        }
        let sampling = colibri_model::sampling::SamplingParams {
            temperature: range("temperature", self.temperature, 0.0, 2.0, 1.0)?,
            top_k,
            top_p: match self.top_p {
                Some(0.0) => {
                    return Err(ApiError::bad_param(
                        "top_p",
                        "`top_p` must be greater than 0",
                    ));
                }
                p => range("top_p", p, 0.0, 1.0, 1.0)?,
            },
            min_p: range("min_p", self.min_p, 0.0, 1.0, 0.0)?,
            repetition_penalty: match self.repetition_penalty {
                Some(p) if !(p.is_finite() && p > 0.0 && p <= 10.0) => {
                    return Err(ApiError::bad_param(
                        "repetition_penalty",
                        "`repetition_penalty` must be in (0, 10]",
                    ));
                }
                p => p.unwrap_or(1.0),
            },
            frequency_penalty: range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, 0.0)?,
            presence_penalty: range("presence_penalty", self.presence_penalty, -2.0, 2.0, 0.0)?,
            seed: self.seed.map(|s| s as u64),
        };
        Ok(Settings {
            max_tokens,
            sampling,
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

/// Checks the roles and contents of chat messages and brings them to the
/// shape chat templates expect: text content-part arrays become one string,
/// `developer` becomes `system`.
pub fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "`messages` must not be empty",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            let obj = m
                .as_object()
                .ok_or_else(|| ApiError::bad_param(&param, format!("`{param}` must be an object")))?;
            let role = obj
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad_param(&param, format!("`{param}.role` must be a string")))?;
            let role = match role {
                "system" | "user" | "assistant" | "tool" => role,
                "developer" => "system",
                other => {
                    return Err(ApiError::bad_param(
                        &format!("{param}.role"),
                        format!("unknown role `{other}` (system, developer, user, assistant, tool)"),
                    ));
                }
            };
            let mut out = obj.clone();
            out.insert("role".into(), Value::String(role.into()));
            let content = match obj.get("content") {
                None | Some(Value::Null) => {
                    if role == "assistant" && obj.contains_key("tool_calls") {
                        Value::Null
                    } else {
                        Value::String(String::new())
                    }
                }
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(Value::Array(parts)) => {
                    let mut texts = Vec::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => texts.push(t.to_string()),
                            (Some(other), _) if other != "text" => {
                                return Err(ApiError::bad_param(
                                    &format!("{param}.content[{j}]"),
                                    format!("content parts of type `{other}` are not supported (text only)"),
                                ));
                            }
                            _ => {
                                return Err(ApiError::bad_param(
                                    &format!("{param}.content[{j}]"),
                                    "a content part needs `type: text` and a string `text`",
                                ));
                            }
                        }
                    }
                    Value::String(texts.join("\n"))
                }
                Some(_) => {
                    return Err(ApiError::bad_param(
                        &format!("{param}.content"),
                        "`content` must be a string, an array of content parts or null",
                    ));
                }
            };
            out.insert("content".into(), content);
            Ok(Value::Object(out))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_ignored_and_wrong_types_name_the_field() {
        let (c, r): (Common, ChatRequest) = parse(
            br#"{"messages":[{"role":"user","content":"hi"}],"frobnicate":1,"temperature":0.5}"#,
        )
        .unwrap();
        assert_eq!(c.temperature, Some(0.5));
        assert_eq!(r.messages.len(), 1);
        let e = parse::<ChatRequest>(br#"{"messages":[],"temperature":"hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = parse::<ChatRequest>(br#"{"messages":[],"max_tokens":-5}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = parse::<ChatRequest>(br#"{"messages":[{"role":1}], "stop": [1]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        assert!(
            parse::<ChatRequest>(b"\xff\xfe")
                .unwrap_err()
                .message
                .contains("UTF-8")
        );
        assert!(parse::<ChatRequest>(b"{not json").is_err());
        assert!(parse::<ChatRequest>(b"[1]").is_err());
    }

    #[test]
    fn settings_are_validated() {
        let c = |j: &str| parse::<ChatRequest>(j.as_bytes()).unwrap().0.settings();
        assert!(c(r#"{"messages":[],"n":2}"#).is_err());
        assert!(c(r#"{"messages":[],"temperature":3}"#).is_err());
        assert!(c(r#"{"messages":[],"top_p":0}"#).is_err());
        assert!(c(r#"{"messages":[],"max_tokens":0}"#).is_err());
        let many: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
        assert!(
            c(&format!(
                r#"{{"messages":[],"stop":{}}}"#,
                serde_json::to_string(&many).unwrap()
            ))
            .is_err()
        );
        let s = c(
            r#"{"messages":[],"stop":"END","seed":-3,"max_completion_tokens":7,"max_tokens":99}"#,
        )
        .unwrap();
        assert_eq!(s.stop, vec!["END"]);
        assert_eq!(s.max_tokens, Some(7));
        assert_eq!(s.sampling.seed, Some((-3i64) as u64));
    }

    #[test]
    fn messages_are_normalized() {
        let m: Vec<Value> = serde_json::from_str(
            r#"[{"role":"developer","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null,"tool_calls":[]}]"#,
        )
        .unwrap();
        let n = normalize_messages(&m).unwrap();
        assert_eq!(n[0]["role"], "system");
        assert_eq!(n[1]["content"], "a\nb");
        assert!(n[2]["content"].is_null());
        assert!(normalize_messages(&[serde_json::json!({"role":"wizard","content":"x"})]).is_err());
        assert!(
            normalize_messages(&[
                serde_json::json!({"role":"user","content":[{"type":"image_url"}]})
            ])
            .is_err()
        );
        assert!(normalize_messages(&[]).is_err());
    }
}
