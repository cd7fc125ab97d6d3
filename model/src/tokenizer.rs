//! Text ↔ token ids, exactly as Hugging Face `transformers` does it.
//!
//! A [`Tokenizer`] wraps the pure-Rust `tokenizers` crate (the same engine
//! transformers' fast tokenizers run) loaded from a checkpoint's
//! `tokenizer.json`, plus what transformers reads from `tokenizer_config.json`:
//! the named special tokens, `clean_up_tokenization_spaces`, and the chat
//! template (also from `chat_template.jinja` / `chat_template.json`, which take
//! priority as in transformers 5).
//!
//! Encoding is the `tokenizers` crate's encoding of tokenizer.json plus what
//! transformers 5 changes on load: it adds tokenizer_config.json's
//! `added_tokens_decoder` entries and missing special tokens (see
//! `add_config_tokens`). It ignores `add_bos_token` / `add_eos_token`
//! whenever a tokenizer.json exists (the post-processor inside it decides),
//! so those are ignored here too. The recorded references in
//! `tests/fixtures/tokenizers/` check this for every supported family.
//!
//! [`StreamDecoder`] turns a stream of generated ids into text deltas that are
//! final: it never emits half of a multi-byte character, and the deltas plus
//! [`StreamDecoder::flush`] concatenate to [`Tokenizer::decode`] of all ids.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::chat::ChatTemplate;
use crate::error::{ModelError, Result};

/// The named special tokens transformers always exposes (its
/// `SPECIAL_TOKENS_ATTRIBUTES`), in its order.
const NAMED_SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A loaded tokenizer: `tokenizer.json` plus the parts of
/// `tokenizer_config.json` that change what the model sees.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The tokenizer.json path, for error messages.
    path: PathBuf,
    /// Special-token variables as transformers' `special_tokens_map` gives
    /// them to chat templates: name → token string.
    special_tokens: Map<String, Value>,
    /// transformers 5 applies `clean_up_tokenization_spaces` only to non-BPE
    /// models (it corrupts BPE output), so both facts are kept.
    clean_up_spaces: bool,
    is_bpe: bool,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.special_tokens)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads the tokenizer of a checkpoint directory. `Ok(None)` when the
    /// directory has no `tokenizer.json`: the caller then works on token ids
    /// and must tell the user that text input needs a tokenizer.
    ///
    /// Reads, when present, `tokenizer_config.json`, `chat_template.jinja`,
    /// `additional_chat_templates/*.jinja` and `chat_template.json`, and
    /// `config.json`'s `model_type` (to recognise DeepSeek-V4, which ships a
    /// Python encoder instead of a Jinja template).
    pub fn from_dir(dir: &Path) -> Result<Option<Tokenizer>> {
        let tokenizer_json = dir.join("tokenizer.json");
        if !tokenizer_json.is_file() {
            return Ok(None);
        }
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            Some(read_json(&config_path)?)
        } else {
            None
        };
        let templates = TemplateFiles::discover(dir, config.as_ref(), &config_path)?;
        let model_type = read_model_type(&dir.join("config.json"));
        Self::build(&tokenizer_json, config, templates, model_type.as_deref()).map(Some)
    }

    /// Loads from explicit files: useful when a directory pairs files from
    /// elsewhere (e.g. GLM-5 configs with GLM-4.7's tokenizer.json). The chat
    /// template file, when given, overrides the config's `chat_template`; a
    /// `.json` file is read as HF's `chat_template.json`.
    pub fn from_files(
        tokenizer_json: &Path,
        tokenizer_config: Option<&Path>,
        chat_template: Option<&Path>,
    ) -> Result<Tokenizer> {
        let config = tokenizer_config.map(read_json).transpose()?;
        let templates = match chat_template {
            Some(path) if path.extension().is_some_and(|e| e == "json") => {
                TemplateFiles::from_chat_template_json(path)?
            }
            Some(path) => TemplateFiles {
                variants: vec![("default".to_string(), read_text(path)?)],
                origin: file_label(path),
            },
            None => TemplateFiles::from_config(config.as_ref(), tokenizer_config)?,
        };
        Self::build(tokenizer_json, config, templates, None)
    }

    fn build(
        tokenizer_json: &Path,
        config: Option<Value>,
        templates: TemplateFiles,
        model_type: Option<&str>,
    ) -> Result<Tokenizer> {
        let mut inner = tokenizers::Tokenizer::from_file(tokenizer_json).map_err(|e| {
            ModelError::Tokenizer(format!("{}: cannot load: {e}", tokenizer_json.display()))
        })?;
        let config = config.unwrap_or(Value::Object(Map::new()));
        let special_tokens = special_tokens_map(&config);
        add_config_tokens(&mut inner, &config, &special_tokens).map_err(|e| {
            ModelError::Tokenizer(format!(
                "{}: adding tokenizer_config.json's tokens: {e}",
                tokenizer_json.display()
            ))
        })?;
        let clean_up_spaces = config
            .get("clean_up_tokenization_spaces")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let is_bpe = matches!(inner.get_model(), tokenizers::ModelWrapper::BPE(_));
        let mut tok = Tokenizer {
            inner,
            path: tokenizer_json.to_path_buf(),
            special_tokens,
            clean_up_spaces,
            is_bpe,
            chat_template: None,
        };
        tok.chat_template = if !templates.variants.is_empty() {
            Some(ChatTemplate::from_variants(
                templates.variants,
                &templates.origin,
                tok.special_tokens.clone(),
            )?)
        } else if model_type == Some("deepseek_v4") || tok.looks_like_deepseek_v4() {
            Some(ChatTemplate::deepseek_v4(tok.special_tokens.clone()))
        } else {
            None
        };
        Ok(tok)
    }

    /// DeepSeek-V4 checkpoints ship `encoding_dsv4.py` instead of a template;
    /// without config.json the tokenizer is recognised by the special tokens
    /// only that encoding uses.
    fn looks_like_deepseek_v4(&self) -> bool {
        [
            "｜DSML｜",
            "<｜latest_reminder｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
        ]
        .iter()
        .all(|t| self.inner.token_to_id(t).is_some())
    }

    /// Token ids of `text`, as `transformers.AutoTokenizer(...).encode(text,
    /// add_special_tokens=...)` gives them.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| self.error(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, as transformers' `decode(ids, skip_special_tokens=...)`.
    /// Unlike transformers (which silently drops them), ids outside the
    /// vocabulary are an error: they mean the caller or the model is wrong.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.check_ids(ids)?;
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.error(format!("decode: {e}")))?;
        Ok(if self.clean_up_spaces && !self.is_bpe {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            Some(&id) => Err(ModelError::TokenOutOfRange {
                id,
                vocab: self.vocab_size(),
            }),
            None => Ok(()),
        }
    }

    /// An incremental decoder for streamed generation.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(skip_special_tokens)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.special_token("bos_token")
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.special_token("eos_token")
    }

    /// A named special token from tokenizer_config.json (`pad_token`,
    /// `unk_token`, model-specific `*_token` entries, ...).
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.get(name).and_then(Value::as_str)
    }

    /// The special-token variables chat templates see (name → token).
    pub fn special_tokens(&self) -> &Map<String, Value> {
        &self.special_tokens
    }

    /// Ids that end generation: tokenizer_config's `eos_token` (string or
    /// AddedToken dict). Empty when it is unset or not in the vocabulary.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token()
            .and_then(|t| self.token_to_id(t))
            .into_iter()
            .collect()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The tokenizer.json this tokenizer was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, msg: String) -> ModelError {
        ModelError::Tokenizer(format!("{}: {msg}", self.path.display()))
    }
}

/// transformers' `clean_up_tokenization`: removes the spaces a WordPiece
/// decoder leaves before punctuation and contractions.
fn clean_up_tokenization(text: &str) -> String {
    const PAIRS: [(&str, &str); 10] = [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ];
    PAIRS
        .iter()
        .fold(text.to_string(), |s, (from, to)| s.replace(from, to))
}

/// The string of a special token entry: a plain string or an AddedToken dict
/// (`{"__type": "AddedToken", "content": ...}`).
fn token_content(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// transformers 5's `special_tokens_map`: the named tokens, then the
/// model-specific ones (an `extra_special_tokens` dict, or any other
/// `*_token` key holding a token), which templates can also use.
fn special_tokens_map(config: &Value) -> Map<String, Value> {
    let mut map = Map::new();
    let Some(obj) = config.as_object() else {
        return map;
    };
    for name in NAMED_SPECIAL_TOKENS {
        if let Some(t) = obj.get(name).and_then(token_content) {
            map.insert(name.to_string(), Value::String(t.to_string()));
        }
    }
    for (key, v) in obj {
        if key.ends_with("_token")
            && !NAMED_SPECIAL_TOKENS.contains(&key.as_str())
            && let Some(t) = token_content(v)
        {
            map.insert(key.clone(), Value::String(t.to_string()));
        }
    }
    for key in ["extra_special_tokens", "model_specific_special_tokens"] {
        if let Some(named) = obj.get(key).and_then(Value::as_object) {
            for (name, v) in named {
                if let Some(t) = token_content(v) {
                    map.insert(name.clone(), Value::String(t.to_string()));
                }
            }
        }
    }
    map
}

/// What transformers 5's `TokenizersBackend.__init__` adds to the
/// tokenizer.json vocabulary: every entry of tokenizer_config.json's
/// `added_tokens_decoder` (whose flags, e.g. `lstrip`, then override
/// tokenizer.json's), and any named or extra special token that is not an
/// added token yet. Identical entries are no-ops inside `tokenizers`.
fn add_config_tokens(
    inner: &mut tokenizers::Tokenizer,
    config: &Value,
    special_tokens: &Map<String, Value>,
) -> std::result::Result<(), String> {
    use tokenizers::AddedToken;

    let mut to_add: Vec<AddedToken> = Vec::new();
    if let Some(decoder) = config
        .get("added_tokens_decoder")
        .and_then(Value::as_object)
    {
        let mut entries = Vec::with_capacity(decoder.len());
        for (id, tok) in decoder {
            let id: u64 = id
                .parse()
                .map_err(|_| format!("added_tokens_decoder key `{id}` is not an id"))?;
            let content = tok
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("added_tokens_decoder[{id}] has no string `content`"))?;
            entries.push((id, added_token(content, tok)));
        }
        entries.sort_by_key(|(id, _)| *id);
        to_add.extend(entries.into_iter().map(|(_, t)| t));
    }

    let mut known: std::collections::HashSet<String> = inner
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .collect();
    known.extend(to_add.iter().map(|t| t.content.clone()));
    // Named (and model-specific) tokens: the AddedToken form when the config
    // gives one, marked special; a plain string becomes a special token.
    let obj = config.as_object();
    for (name, content) in special_tokens {
        let Some(content) = content.as_str() else {
            continue;
        };
        if known.insert(content.to_string()) {
            let mut token = match obj.and_then(|o| o.get(name)) {
                Some(v @ Value::Object(_)) => added_token(content, v),
                _ => AddedToken::from(content.to_string(), true),
            };
            token.special = true;
            to_add.push(token);
        }
    }
    // transformers 5 reads `extra_special_tokens` (a list), falling back to
    // the older `additional_special_tokens`.
    let extra = obj.and_then(|o| {
        o.get("extra_special_tokens")
            .filter(|v| v.is_array())
            .or_else(|| {
                o.get("extra_special_tokens")
                    .is_none()
                    .then(|| o.get("additional_special_tokens"))
                    .flatten()
            })
    });
    for v in extra.and_then(Value::as_array).into_iter().flatten() {
        let Some(content) = token_content(v) else {
            continue;
        };
        if known.insert(content.to_string()) {
            to_add.push(match v {
                Value::Object(_) => added_token(content, v),
                _ => AddedToken::from(content.to_string(), true),
            });
        }
    }
    if !to_add.is_empty() {
        inner.add_tokens(to_add).map_err(|e| e.to_string())?;
    }

    // transformers' Qwen2Tokenizer then re-adds every special token (named
    // and extra) as a plain special AddedToken, which resets flags such as
    // lstrip/rstrip that tokenizer_config.json may have set on them.
    let class = obj
        .and_then(|o| o.get("tokenizer_class"))
        .and_then(Value::as_str)
        .unwrap_or_default();
    if class.trim_end_matches("Fast") == "Qwen2Tokenizer" {
        let mut seen = std::collections::HashSet::new();
        let all_special: Vec<AddedToken> = special_tokens
            .values()
            .filter_map(Value::as_str)
            .chain(
                extra
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(token_content),
            )
            .filter(|t| seen.insert(t.to_string()))
            .map(|t| AddedToken::from(t.to_string(), true))
            .collect();
        inner.add_tokens(all_special).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Python's `AddedToken(**entry)`: flags default to false, `normalized` to
/// `not special`.
fn added_token(content: &str, entry: &Value) -> tokenizers::AddedToken {
    let flag = |k: &str| entry.get(k).and_then(Value::as_bool);
    let special = flag("special").unwrap_or(false);
    tokenizers::AddedToken {
        content: content.to_string(),
        single_word: flag("single_word").unwrap_or(false),
        lstrip: flag("lstrip").unwrap_or(false),
        rstrip: flag("rstrip").unwrap_or(false),
        normalized: flag("normalized").unwrap_or(!special),
        special,
    }
}

/// The chat template sources of a checkpoint, by name, and the file they
/// came from (for error messages).
struct TemplateFiles {
    variants: Vec<(String, String)>,
    origin: String,
}

impl TemplateFiles {
    /// transformers 5's priority: `chat_template.jinja` (+
    /// `additional_chat_templates/`) replaces the config's templates; HF
    /// processors' `chat_template.json` comes next; then tokenizer_config.
    fn discover(dir: &Path, config: Option<&Value>, config_path: &Path) -> Result<TemplateFiles> {
        let mut variants = Vec::new();
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            variants.push(("default".to_string(), read_text(&jinja)?));
        }
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let entries =
                std::fs::read_dir(&extra_dir).map_err(|e| ModelError::io(&extra_dir, e))?;
            let mut extra = Vec::new();
            for entry in entries {
                let path = entry.map_err(|e| ModelError::io(&extra_dir, e))?.path();
                if path.extension().is_some_and(|e| e == "jinja")
                    && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
                {
                    extra.push((stem.to_string(), read_text(&path)?));
                }
            }
            extra.sort();
            variants.extend(extra);
        }
        if !variants.is_empty() {
            return Ok(TemplateFiles {
                variants,
                origin: file_label(&jinja),
            });
        }
        let json = dir.join("chat_template.json");
        if json.is_file() {
            return Self::from_chat_template_json(&json);
        }
        Self::from_config(config, Some(config_path))
    }

    fn from_chat_template_json(path: &Path) -> Result<TemplateFiles> {
        let v = read_json(path)?;
        let t = v.get("chat_template").ok_or_else(|| {
            ModelError::ChatTemplate(format!("{}: no `chat_template` key", path.display()))
        })?;
        Ok(TemplateFiles {
            variants: template_variants(t, path)?,
            origin: file_label(path),
        })
    }

    fn from_config(config: Option<&Value>, path: Option<&Path>) -> Result<TemplateFiles> {
        let label = path.map_or_else(|| "tokenizer_config.json".to_string(), file_label);
        let variants = match config.and_then(|c| c.get("chat_template")) {
            None | Some(Value::Null) => Vec::new(),
            Some(t) => template_variants(t, Path::new(&label))?,
        };
        Ok(TemplateFiles {
            variants,
            origin: label,
        })
    }
}

/// A `chat_template` entry: one template string, or HF's list of
/// `{"name": ..., "template": ...}`.
fn template_variants(v: &Value, path: &Path) -> Result<Vec<(String, String)>> {
    let bad = |what: &str| {
        ModelError::ChatTemplate(format!("{}: `chat_template` {what}", path.display()))
    };
    match v {
        Value::String(s) => Ok(vec![("default".to_string(), s.clone())]),
        Value::Array(list) => list
            .iter()
            .map(|item| {
                let name = item.get("name").and_then(Value::as_str);
                let template = item.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some(n), Some(t)) => Ok((n.to_string(), t.to_string())),
                    _ => Err(bad("list entries need string `name` and `template`")),
                }
            })
            .collect(),
        _ => Err(bad("must be a string or a list of {name, template}")),
    }
}

fn file_label(path: &Path) -> String {
    path.display().to_string()
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))
}

fn read_json(path: &Path) -> Result<Value> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// `model_type` from config.json, if there is a readable one. A broken
/// config.json is reported by the config loader, not here.
fn read_model_type(path: &Path) -> Option<String> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    v.get("model_type")?.as_str().map(str::to_string)
}

/// Incremental detokenization for streaming.
///
/// Decoding token by token breaks multi-byte characters that byte-level BPE
/// spreads over several tokens, and some decoders need the previous token
/// to place a space. So the decoder keeps a small window: the ids since the
/// last emission plus the one step before it as context, and emits the part
/// of the window's text that is past the already-emitted prefix once it no
/// longer ends in U+FFFD (an incomplete character). Everything before the
/// window ended on a complete character, so the deltas concatenate to the
/// full decode.
///
/// It holds no reference to the tokenizer, so it can live in a long-running
/// task next to an `Arc<Tokenizer>`; each call takes the tokenizer.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    skip_special_tokens: bool,
    /// Ids from `prefix` on; `ids[..read]` has already been emitted.
    ids: Vec<u32>,
    read: usize,
}

impl StreamDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        StreamDecoder {
            skip_special_tokens,
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Feeds one id; returns the text that became final (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        tokenizer.check_ids(&[id])?;
        self.ids.push(id);
        let emitted = tokenizer.decode(&self.ids[..self.read], self.skip_special_tokens)?;
        let text = tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        if text.len() <= emitted.len() || text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(delta) = text.strip_prefix(emitted.as_str()) else {
            // The decoder rewrote already-emitted text (not the case for
            // byte-level BPE); wait and let flush() settle it.
            return Ok(String::new());
        };
        let delta = delta.to_string();
        // The new window starts at the last emitted step, kept as context.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(delta)
    }

    /// Returns whatever is still held back (an incomplete character decodes
    /// to U+FFFD here, as in the full decode) and resets the decoder.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let emitted = tokenizer.decode(&self.ids[..self.read], self.skip_special_tokens)?;
        let text = tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        self.ids.clear();
        self.read = 0;
        Ok(match text.strip_prefix(emitted.as_str()) {
            Some(rest) => rest.to_string(),
            None => text,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_up_matches_transformers() {
        // transformers.PreTrainedTokenizerBase.clean_up_tokenization on the
        // same input gives this.
        assert_eq!(
            clean_up_tokenization("Hello , world ! I 'm sure it 's fine . Do n't ?"),
            "Hello, world! I'm sure it's fine. Don't?"
        );
    }

    #[test]
    fn special_tokens_map_takes_strings_and_added_token_dicts() {
        let config = serde_json::json!({
            "bos_token": null,
            "eos_token": {"__type": "AddedToken", "content": "</s>"},
            "pad_token": "<pad>",
            "image_token": "<img>",
            "add_bos_token": true,
            "extra_special_tokens": {"audio_token": "<aud>"}
        });
        let map = special_tokens_map(&config);
        let keys: Vec<&str> = map.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            ["eos_token", "pad_token", "image_token", "audio_token"]
        );
        assert_eq!(map["eos_token"], "</s>");
    }
}
