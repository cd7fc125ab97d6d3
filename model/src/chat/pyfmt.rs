//! Python's text forms of template values.
//!
//! Chat templates were written for Jinja2, where a value is a Python object:
//! `{{ x }}` prints `str(x)` (`None`, `True`, `['a', 1]`, `{'k': 'v'}`), and
//! transformers' `tojson` is `json.dumps(x, ensure_ascii=False, ...)` with
//! Python's separators (`", "`, `": "`) and float formatting. Prompts must
//! match byte for byte, so these are reproduced here rather than using
//! minijinja's own (JSON-like) forms.

use std::fmt::Write;

use minijinja::value::{Serde, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// A JSON value as a template value (maps keep their key order).
pub fn from_json(v: &serde_json::Value) -> Value {
    Value::from(Serde(v))
}

/// `str(value)` as Python prints it. Undefined prints as nothing (Jinja2's
/// default `Undefined`).
pub fn py_str(value: &Value) -> Result<String, Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(String::new()),
        ValueKind::String => Ok(value.as_str().unwrap_or_default().to_string()),
        _ => {
            let mut out = String::new();
            py_repr(value, &mut out)?;
            Ok(out)
        }
    }
}

/// `repr(value)`: what Python shows for a value inside a list or dict.
pub fn py_repr(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number(value)),
        ValueKind::String => string_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut n = 0;
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out)?;
                n += 1;
            }
            if tuple && n == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out)?;
                out.push_str(": ");
                py_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

fn number(value: &Value) -> String {
    if value.is_integer() {
        value.to_string()
    } else {
        match f64::try_from(value.clone()) {
            Ok(f) => float_repr(f),
            Err(_) => value.to_string(),
        }
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional
/// for exponents in [-4, 16), otherwise `d.ddde+XX`.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    // `{:e}` gives Rust's shortest round-trip digits, e.g. "-1.5e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if (point as usize) >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{int}.{frac}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`;
/// non-printable characters escaped.
fn string_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !is_printable(c) => {
                let n = c as u32;
                let _ = if n < 0x100 {
                    write!(out, "\\x{n:02x}")
                } else if n < 0x10000 {
                    write!(out, "\\u{n:04x}")
                } else {
                    write!(out, "\\U{n:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// An approximation of Python's `str.isprintable` covering the characters
/// that occur in practice: controls, non-space separators and the common
/// format characters (zero-width and direction marks, BOM).
fn is_printable(c: char) -> bool {
    let n = c as u32;
    !(n < 0x20
        || (0x7f..=0xa0).contains(&n)
        || n == 0xad
        || (0x2000..=0x200f).contains(&n)
        || (0x2028..=0x202f).contains(&n)
        || (0x205f..=0x206f).contains(&n)
        || n == 0x3000
        || n == 0xfeff
        || (0xd800..=0xdfff).contains(&n)
        || (0xe000..=0xf8ff).contains(&n))
}

/// Options of `json.dumps` that transformers' `tojson` filter exposes.
#[derive(Debug, Clone)]
pub struct JsonOptions {
    pub ensure_ascii: bool,
    /// Python's `indent`: `None` for one line, else the per-level prefix.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl JsonOptions {
    /// `json.dumps` defaults for the given indent: `", "` between items on
    /// one line, `","` when indenting (the newline separates).
    pub fn new(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " };
        JsonOptions {
            ensure_ascii: false,
            indent,
            item_separator: item_separator.to_string(),
            key_separator: ": ".to_string(),
            sort_keys: false,
        }
    }
}

/// `json.dumps(value, ...)`.
pub fn dumps(value: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let mut out = String::new();
    dump(value, opts, 0, &mut out)?;
    Ok(out)
}

fn newline(opts: &JsonOptions, depth: usize, out: &mut String) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn dump(value: &Value, opts: &JsonOptions, depth: usize, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(value)),
        ValueKind::String => json_string(value.as_str().unwrap_or_default(), opts, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline(opts, depth + 1, out);
                dump(item, opts, depth + 1, out)?;
            }
            newline(opts, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline(opts, depth + 1, out);
                // Python turns non-string keys into their JSON text.
                let key_text = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => dumps(key, opts)?,
                };
                json_string(&key_text, opts, out);
                out.push_str(&opts.key_separator);
                dump(&value.get_item(key)?, opts, depth + 1, out)?;
            }
            newline(opts, depth, out);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

fn json_string(s: &str, opts: &JsonOptions, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if opts.ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (3.5, "3.5"),
            (-2.25, "-2.25"),
            (100.0, "100.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (-1.25e-7, "-1.25e-07"),
            (123456.789, "123456.789"),
            (0.0, "0.0"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn repr_matches_python() {
        let v = from_json(&serde_json::json!({
            "a": [1, 2.5, null, true, "it's"],
            "b": {"q": "say \"hi\"\n", "z": "\u{200b}"}
        }));
        let mut out = String::new();
        py_repr(&v, &mut out).unwrap();
        assert_eq!(
            out,
            r#"{'a': [1, 2.5, None, True, "it's"], 'b': {'q': 'say "hi"\n', 'z': '\u200b'}}"#
        );
    }

    #[test]
    fn dumps_matches_python_json() {
        let v = from_json(&serde_json::json!({
            "name": "北京", "n": [1, 2.0, {}], "e": [], "ctl": "\u{1}\t"
        }));
        assert_eq!(
            dumps(&v, &JsonOptions::new(None)).unwrap(),
            r#"{"name": "北京", "n": [1, 2.0, {}], "e": [], "ctl": "\u0001\t"}"#
        );
        let mut ascii = JsonOptions::new(Some("  ".to_string()));
        ascii.ensure_ascii = true;
        assert_eq!(
            dumps(&from_json(&serde_json::json!({"k": ["é😀"]})), &ascii).unwrap(),
            "{\n  \"k\": [\n    \"\\u00e9\\ud83d\\ude00\"\n  ]\n}"
        );
    }
}
