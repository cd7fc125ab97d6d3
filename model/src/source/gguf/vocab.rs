//! The vocabulary (`tokenizer.ggml.*`) and chat template
//! (`tokenizer.chat_template`) a GGUF file carries.

use super::{GgufFile, GgufValue};
use crate::error::Result;

/// What `tokenizer.ggml.*` says about the tokenizer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE), `llama` (SentencePiece), …
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer name (`qwen2`, `deepseek-v3`, …).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// llama.cpp token types (1 normal, 2 unknown, 3 control, 4 user
    /// defined, 5 unused, 6 byte); empty when absent.
    pub token_types: Vec<i32>,
    pub scores: Vec<f32>,
    /// BPE merges as `"left right"`; empty when absent.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub eot_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub chat_template: Option<String>,
}

fn array<'a, T>(
    file: &'a GgufFile,
    key: &str,
    conv: impl Fn(&'a GgufValue) -> Option<T>,
) -> Result<Vec<T>> {
    match file.get(key) {
        None => Ok(Vec::new()),
        Some(v) => {
            let a = v
                .as_array()
                .ok_or_else(|| file.err(format!("metadata `{key}`: expected an array")))?;
            a.values
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    conv(x).ok_or_else(|| {
                        file.err(format!("metadata `{key}`[{i}]: unexpected value {x:?}"))
                    })
                })
                .collect()
        }
    }
}

pub(super) fn read(file: &GgufFile) -> Result<GgufVocab> {
    let id = |k: &str| -> Result<Option<u32>> { Ok(file.opt_u64(k)?.map(|v| v as u32)) };
    let vocab = GgufVocab {
        model: file
            .opt_str("tokenizer.ggml.model")?
            .ok_or_else(|| file.err("metadata `tokenizer.ggml.model` is missing: no vocabulary"))?
            .to_string(),
        pre: file.opt_str("tokenizer.ggml.pre")?.map(str::to_string),
        tokens: array(file, "tokenizer.ggml.tokens", |v| {
            v.as_str().map(str::to_string)
        })?,
        token_types: array(file, "tokenizer.ggml.token_type", |v| match v {
            GgufValue::I32(x) => Some(*x),
            other => other.as_u64().map(|x| x as i32),
        })?,
        scores: array(file, "tokenizer.ggml.scores", |v| {
            v.as_f64().map(|x| x as f32)
        })?,
        merges: array(file, "tokenizer.ggml.merges", |v| {
            v.as_str().map(str::to_string)
        })?,
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: id("tokenizer.ggml.eos_token_id")?,
        eot_token_id: id("tokenizer.ggml.eot_token_id")?,
        pad_token_id: id("tokenizer.ggml.padding_token_id")?,
        unknown_token_id: id("tokenizer.ggml.unknown_token_id")?,
        add_bos_token: file.opt_bool("tokenizer.ggml.add_bos_token")?,
        add_eos_token: file.opt_bool("tokenizer.ggml.add_eos_token")?,
        chat_template: file.opt_str("tokenizer.chat_template")?.map(str::to_string),
    };
    if vocab.tokens.is_empty() {
        return Err(file.err("metadata `tokenizer.ggml.tokens` is missing or empty"));
    }
    let n = vocab.tokens.len();
    if !vocab.token_types.is_empty() && vocab.token_types.len() != n {
        return Err(file.err(format!(
            "tokenizer.ggml.token_type has {} entries for {n} tokens",
            vocab.token_types.len()
        )));
    }
    for (k, v) in [
        ("bos", vocab.bos_token_id),
        ("eos", vocab.eos_token_id),
        ("eot", vocab.eot_token_id),
        ("padding", vocab.pad_token_id),
    ] {
        if let Some(v) = v
            && v as usize >= n
        {
            return Err(file.err(format!(
                "tokenizer.ggml.{k}_token_id {v} is outside the {n} tokens"
            )));
        }
    }
    Ok(vocab)
}
