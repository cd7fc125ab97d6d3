//! Chat templates: a conversation (OpenAI-style messages) to the prompt text
//! the model was trained on.
//!
//! Most checkpoints ship a Jinja template, rendered here with `minijinja`
//! configured like transformers' `apply_chat_template` (module `jinja`): same
//! whitespace rules, the same globals (`raise_exception`, `strftime_now`), a
//! `tojson` that writes what Python's `json.dumps` writes, Python-style
//! string methods, and Python's way of printing `None`, booleans, lists and
//! dicts. DeepSeek-V4 ships a Python encoder instead; module `dsv4` is its Rust
//! equivalent.
//!
//! Template variables, as transformers passes them: the special tokens from
//! tokenizer_config.json (`bos_token`, `eos_token`, ...), then the caller's
//! extra keyword variables (which may override them), then `messages`,
//! `tools` (none when absent), `documents` (from `extra["documents"]`, else
//! none) and `add_generation_prompt`.

mod dsv4;
mod jinja;
mod pyfmt;

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// How to render a conversation.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Open an assistant turn at the end of the prompt.
    pub add_generation_prompt: bool,
    /// OpenAI-style tool definitions (a JSON array), or `None`.
    pub tools: Option<Value>,
    /// Extra template variables (`enable_thinking`, `thinking`,
    /// `reasoning_effort`, `documents`, ...).
    pub extra: Map<String, Value>,
}

/// Keys the renderer sets itself; an `extra` variable with one of these names
/// is a caller bug (transformers raises "got multiple values" for them).
const RESERVED: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

/// A model's chat template, ready to render.
pub struct ChatTemplate {
    kind: Kind,
    /// Where it came from (a file name), for error messages.
    origin: String,
    special_tokens: Map<String, Value>,
}

enum Kind {
    Jinja(Box<jinja::Templates>),
    DeepSeekV4,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("variants", &self.variant_names())
            .finish()
    }
}

impl ChatTemplate {
    /// One Jinja template. `origin` names its file in errors.
    pub fn from_jinja(
        source: &str,
        origin: &str,
        special_tokens: Map<String, Value>,
    ) -> Result<ChatTemplate> {
        Self::from_variants(
            vec![("default".to_string(), source.to_string())],
            origin,
            special_tokens,
        )
    }

    /// Named Jinja templates (tokenizer_config's list of `{name, template}`):
    /// `default` is used, or `tool_use` when tools are given and it exists.
    pub fn from_variants(
        variants: Vec<(String, String)>,
        origin: &str,
        special_tokens: Map<String, Value>,
    ) -> Result<ChatTemplate> {
        if variants.is_empty() {
            return Err(ModelError::ChatTemplate(format!(
                "{origin}: no template given"
            )));
        }
        let templates = jinja::Templates::compile(variants)
            .map_err(|e| ModelError::ChatTemplate(format!("{origin}: {}", describe(&e))))?;
        Ok(ChatTemplate {
            kind: Kind::Jinja(Box::new(templates)),
            origin: origin.to_string(),
            special_tokens,
        })
    }

    /// The built-in DeepSeek-V4 encoder (the checkpoint's `encoding_dsv4.py`
    /// in Rust).
    pub fn deepseek_v4(special_tokens: Map<String, Value>) -> ChatTemplate {
        ChatTemplate {
            kind: Kind::DeepSeekV4,
            origin: "built-in DeepSeek-V4 encoding".to_string(),
            special_tokens,
        }
    }

    /// True for a built-in encoder rather than the checkpoint's own Jinja.
    pub fn is_builtin(&self) -> bool {
        matches!(self.kind, Kind::DeepSeekV4)
    }

    /// Names of the Jinja variants (`["default"]` for a single template;
    /// empty for a built-in encoder).
    pub fn variant_names(&self) -> Vec<&str> {
        match &self.kind {
            Kind::Jinja(t) => t.names(),
            Kind::DeepSeekV4 => Vec::new(),
        }
    }

    /// The Jinja source that `render` would use for these options.
    pub fn source(&self, with_tools: bool) -> Option<&str> {
        match &self.kind {
            Kind::Jinja(t) => t.pick(with_tools).ok().and_then(|n| t.source(n)),
            Kind::DeepSeekV4 => None,
        }
    }

    /// Renders `messages` (a JSON array of message objects) to prompt text.
    pub fn render(&self, messages: &Value, opts: &RenderOptions) -> Result<String> {
        let err = |msg: String| ModelError::ChatTemplate(format!("{}: {msg}", self.origin));
        let list = messages
            .as_array()
            .ok_or_else(|| err("messages must be a JSON array".to_string()))?;
        if list.is_empty() {
            return Err(err(
                "cannot apply a chat template to an empty conversation".to_string()
            ));
        }
        if let Some(key) = RESERVED.iter().find(|k| opts.extra.contains_key(**k)) {
            return Err(err(format!(
                "`{key}` cannot be an extra variable: it is set from the request itself"
            )));
        }
        match &self.kind {
            Kind::DeepSeekV4 => dsv4::encode(list, opts).map_err(err),
            Kind::Jinja(templates) => {
                let name = templates.pick(opts.tools.is_some()).map_err(err)?;
                let mut ctx = self.special_tokens.clone();
                for (k, v) in &opts.extra {
                    ctx.insert(k.clone(), v.clone());
                }
                ctx.insert("messages".into(), messages.clone());
                ctx.insert("tools".into(), opts.tools.clone().unwrap_or(Value::Null));
                ctx.entry("documents").or_insert(Value::Null);
                ctx.insert(
                    "add_generation_prompt".into(),
                    Value::Bool(opts.add_generation_prompt),
                );
                templates
                    .render(name, &Value::Object(ctx))
                    .map_err(|e| err(describe(&e)))
            }
        }
    }
}

/// A minijinja error with its cause chain, the template line and, for
/// `raise_exception`, the template's own message.
fn describe(e: &minijinja::Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}
