//! The minijinja environment, set up like transformers'
//! `_compile_jinja_template` (transformers 5.17,
//! `utils/chat_template_utils.py`): `trim_blocks` and `lstrip_blocks` on,
//! loop controls, no autoescaping, globals `raise_exception` and
//! `strftime_now`, a `tojson` filter that is Python's `json.dumps` with
//! `ensure_ascii=False`, and the `{% generation %}` tag (which only marks
//! assistant text for masks; here it renders its body unchanged).
//!
//! Jinja2 templates call Python methods on values (`.strip()`, `.items()`,
//! `.get()`, ...): minijinja-contrib's pycompat callback provides them. Values
//! print the way Python prints them (see [`super::pyfmt`]).

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior};

use super::pyfmt::{self, JsonOptions};

/// Compiled template variants sharing one environment.
pub struct Templates {
    env: Environment<'static>,
    /// (name, source as the checkpoint wrote it)
    sources: Vec<(String, String)>,
}

impl Templates {
    pub fn compile(variants: Vec<(String, String)>) -> Result<Templates, Error> {
        let mut env = Environment::new();
        configure(&mut env)?;
        for (name, source) in &variants {
            env.add_template_owned(name.clone(), rewrite_generation_tags(source))?;
        }
        Ok(Templates {
            env,
            sources: variants,
        })
    }

    pub fn names(&self) -> Vec<&str> {
        self.sources.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// transformers' `get_chat_template`: `tool_use` when tools are given and
    /// it exists, else `default`.
    pub fn pick(&self, with_tools: bool) -> Result<&str, String> {
        let has = |n: &str| self.sources.iter().any(|(x, _)| x == n);
        if with_tools && has("tool_use") {
            Ok("tool_use")
        } else if has("default") {
            Ok("default")
        } else {
            Err(format!(
                "the model has several chat templates and none is named `default` (available: {})",
                self.names().join(", ")
            ))
        }
    }

    pub fn source(&self, name: &str) -> Option<&str> {
        self.sources
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.as_str())
    }

    pub fn render(&self, name: &str, ctx: &serde_json::Value) -> Result<String, Error> {
        let template = self.env.get_template(name)?;
        template.render(pyfmt::from_json(ctx))
    }
}

fn configure(env: &mut Environment<'static>) -> Result<(), Error> {
    let syntax = env
        .syntax()
        .to_builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()?;
    env.set_syntax(syntax);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        let text = pyfmt::py_str(value)?;
        out.write_str(&text)
            .map_err(|e| Error::new(ErrorKind::WriteFailure, "write failed").with_source(e))
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: &Value| pyfmt::py_str(v).map(Value::from));
    // Jinja2's tests follow Python: None is not iterable (minijinja iterates
    // it as empty), a bool is a number, a dict and a str are sequences.
    env.add_test("iterable", |v: &Value| {
        !matches!(
            v.kind(),
            ValueKind::None | ValueKind::Bool | ValueKind::Number
        ) && v.try_iter().is_ok()
    });
    env.add_test("sequence", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::Undefined | ValueKind::String | ValueKind::Seq | ValueKind::Map
        )
    });
    env.add_test("number", |v: &Value| {
        matches!(v.kind(), ValueKind::Number | ValueKind::Bool)
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    Ok(())
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`.
fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let pick = |pos: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        Ok(kw.or(pos).filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?;
    let indent = pick(indent, "indent")?;
    // minijinja functions take at most five arguments: the rarely used
    // `separators` and `sort_keys` are keyword-only here.
    let separators = pick(None, "separators")?;
    let sort_keys = pick(None, "sort_keys")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_integer() => {
            let n = v.as_i64().unwrap_or(0).max(0) as usize;
            Some(" ".repeat(n))
        }
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        },
    };
    let mut opts = JsonOptions::new(indent);
    opts.ensure_ascii = ensure_ascii.is_some_and(|v| v.is_true());
    opts.sort_keys = sort_keys.is_some_and(|v| v.is_true());
    if let Some(seps) = separators {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_separator = item.as_str().unwrap_or_default().to_string();
                opts.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be two strings",
                ));
            }
        }
    }
    // Safe: the JSON is template output, not HTML, and must not be escaped.
    Ok(Value::from_safe_string(pyfmt::dumps(value, &opts)?))
}

/// The template's own error; its message reaches the user unchanged.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `datetime.now().strftime(format)` in local time.
fn strftime_now(format: String) -> Result<Value, Error> {
    let now = jiff::Zoned::now();
    jiff::fmt::strtime::format(format.as_str(), &now)
        .map(Value::from)
        .map_err(|e| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("strftime_now({format:?}): {e}"),
            )
        })
}

/// Rewrites transformers' `{% generation %}` / `{% endgeneration %}` block
/// tags (an extension minijinja does not have) into an always-true `if`, so
/// whitespace control and output stay the same.
fn rewrite_generation_tags(source: &str) -> String {
    if !source.contains("generation") {
        return source.to_string();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let left = if inner.starts_with('-') { "-" } else { "" };
        let right = if inner.ends_with('-') { "-" } else { "" };
        let word = inner.trim_matches('-').trim();
        match word {
            "generation" => out.push_str(&format!("{{%{left} if true {right}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{left} endif {right}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: serde_json::Value) -> Result<String, Error> {
        let t = Templates::compile(vec![("default".into(), src.into())])?;
        t.render("default", &ctx)
    }

    #[test]
    fn generation_tags_render_their_body() {
        let out = render(
            "{% for m in messages %}{%- generation -%} {{ m }} {%- endgeneration -%}|{% endfor %}",
            serde_json::json!({"messages": ["a", "b"]}),
        )
        .unwrap();
        assert_eq!(out, "a|b|");
    }

    #[test]
    fn values_print_like_python() {
        let out = render(
            "{{ x }} {{ y }} {{ z }} {{ l }} {{ d }} {{ u }}|{{ 1.5e16 }}",
            serde_json::json!({"x": null, "y": true, "z": 2.0, "l": [1, "a"], "d": {"k": false}}),
        )
        .unwrap();
        assert_eq!(out, "None True 2.0 [1, 'a'] {'k': False} |1.5e+16");
    }

    #[test]
    fn tojson_takes_python_arguments() {
        let ctx = serde_json::json!({"v": {"b": 1, "a": ["é", 2.5]}});
        assert_eq!(
            render("{{ v | tojson }}", ctx.clone()).unwrap(),
            r#"{"b": 1, "a": ["é", 2.5]}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2, sort_keys=true) }}", ctx.clone()).unwrap(),
            "{\n  \"a\": [\n    \"é\",\n    2.5\n  ],\n  \"b\": 1\n}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(ensure_ascii=true, separators=(',', ':')) }}",
                ctx
            )
            .unwrap(),
            r#"{"b":1,"a":["\u00e9",2.5]}"#
        );
    }

    #[test]
    fn whitespace_control_is_jinja2s() {
        let src = "<s>\n  {% if true %}\n    x\n  {% endif %}\n</s>\n";
        assert_eq!(
            render(src, serde_json::json!({})).unwrap(),
            "<s>\n    x\n</s>"
        );
    }

    #[test]
    fn python_methods_work() {
        let out = render(
            "{{ ' a b '.strip().split(' ') }} {{ d.get('k', 'none') }} {% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %} {{ 'abc'.startswith('ab') }}",
            serde_json::json!({"d": {"z": 1}}),
        )
        .unwrap();
        assert_eq!(out, "['a', 'b'] none z=1 True");
    }

    #[test]
    fn type_tests_follow_python() {
        // Expected output recorded from transformers' Jinja2 environment.
        let out = render(
            "{% for v in vals %}{{ v is iterable }},{{ v is sequence }},{{ v is number }};{% endfor %}{{ u is iterable }},{{ u is sequence }}",
            serde_json::json!({"vals": [null, true, 1, 2.5, "ab", [1], {"a": 1}]}),
        )
        .unwrap();
        assert_eq!(
            out,
            "False,False,False;False,False,True;False,False,True;False,False,True;True,True,False;True,True,False;True,True,False;True,True"
        );
    }

    #[test]
    fn strftime_now_formats_today() {
        let out = render("{{ strftime_now('%Y') }}", serde_json::json!({})).unwrap();
        assert_eq!(out.len(), 4);
        assert!(out.starts_with("20"), "{out}");
    }
}
