//! HF-compatible chat template rendering with minijinja.

use std::io::{self, Write};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::ser::{Formatter, Serializer};

use crate::error::ModelError;

/// The template's name inside its private environment.
const NAME: &str = "chat";

/// HF-compatible chat template rendering with minijinja.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn tmpl_err(e: Error) -> ModelError {
    // minijinja's alternate format includes the template line that failed.
    ModelError::Template(format!("{e:#}"))
}

impl ChatTemplate {
    /// Compiles `source` with the globals and filters HF's `apply_chat_template` provides.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ModelError> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks; templates are written for that.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Python string/dict methods (.strip(), .startswith(), .items(), ...) that HF templates call.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(tmpl_err)?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// messages: OpenAI-style [{"role":..,"content":..}, ...] as JSON values; tools optional.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ModelError> {
        self.render_with(
            messages,
            add_generation_prompt,
            tools,
            &serde_json::Map::new(),
        )
    }

    /// [`render`](Self::render) with caller-chosen extra variables (a request's
    /// `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); a name in [`RESERVED_VARIABLES`] is
    /// refused rather than allowed to replace what the server itself sets.
    pub fn render_with(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ModelError> {
        if let Some(key) = extra
            .keys()
            .find(|k| RESERVED_VARIABLES.contains(&k.as_str()))
        {
            return Err(ModelError::Template(format!(
                "the template variable `{key}` is set by the server and cannot be overridden"
            )));
        }
        let tmpl = self.env.get_template(NAME).map_err(tmpl_err)?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            tools => tools.map(Value::from_serialize),
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            ..Value::from_serialize(extra)
        };
        tmpl.render(ctx).map_err(tmpl_err)
    }
}

/// The variables [`ChatTemplate::render_with`] sets itself, which extra variables may not replace.
pub const RESERVED_VARIABLES: &[&str] = &[
    "messages",
    "add_generation_prompt",
    "tools",
    "bos_token",
    "eos_token",
];

/// `raise_exception(msg)`: templates use it to reject unsupported conversations.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: Llama 3 templates stamp the current date.
fn strftime_now(fmt: String) -> String {
    chrono::Local::now().format(&fmt).to_string()
}

/// Python `json.dumps` separators: `", "` and `": "` when compact, `","` + newline when indented.
struct PyFormatter {
    indent: Option<Vec<u8>>,
    depth: usize,
    /// Whether the innermost open container has an element (empty ones print as `[]`/`{}`).
    has_value: bool,
}

impl PyFormatter {
    fn newline<W: ?Sized + Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(ind) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.depth {
                w.write_all(ind)?;
            }
        }
        Ok(())
    }

    /// Opens an array or object with `bracket`, one level deeper and with no value yet.
    fn open<W: ?Sized + Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    /// Closes an array or object with `bracket`, on its own line when it held a value.
    fn close<W: ?Sized + Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }

    /// Starts an array element or object key: Python's separator unless it is the first, then the line break.
    fn item<W: ?Sized + Write>(&self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
}

impl Formatter for PyFormatter {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// `tojson` as transformers defines it (`json.dumps(x, ensure_ascii=False, indent=indent)`), so tool
/// schemas render byte-identical to Python; minijinja's own filter HTML-escapes and packs separators.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_usize() {
            Some(n) => Some(vec![b' '; n]),
            None => Some(v.as_str().unwrap_or("").as_bytes().to_vec()),
        },
    };
    let mut out = Vec::new();
    let mut ser = Serializer::with_formatter(
        &mut out,
        PyFormatter {
            indent,
            depth: 0,
            has_value: false,
        },
    );
    serde::Serialize::serialize(&value, &mut ser)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let s = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    Ok(Value::from_safe_string(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The chat template embedded in SmolLM2-135M-Instruct's GGUF.
    pub(crate) const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_smollm2_template_like_transformers() {
        let t = ChatTemplate::new(
            SMOLLM2,
            Some("<|im_start|>".into()),
            Some("<|im_end|>".into()),
        )
        .unwrap();
        let out = t
            .render(&[json!({"role": "user", "content": "hi"})], true, None)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t
            .render(
                &[
                    json!({"role": "system", "content": "Be brief."}),
                    json!({"role": "user", "content": "hi"}),
                ],
                false,
                None,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        );
    }

    #[test]
    fn provides_hf_globals_and_python_methods() {
        let src = "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\
            {{ bos_token }}{{ messages[0]['content'].strip().upper() }}|{{ tools | tojson }}|{{ eos_token }}|\
            {{ strftime_now('%Y') | length }}";
        let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).unwrap();
        let tools = json!([{"name": "f", "params": {"a <b>": [1, 2], "e": {}}}]);
        let out = t
            .render(
                &[json!({"role": "user", "content": "  hey "})],
                false,
                Some(&tools),
            )
            .unwrap();
        assert_eq!(
            out,
            "<s>HEY|[{\"name\": \"f\", \"params\": {\"a <b>\": [1, 2], \"e\": {}}}]|</s>|4"
        );
        let err = t
            .render(&[json!({"role": "bad", "content": ""})], false, None)
            .unwrap_err();
        assert!(err.to_string().contains("no bad roles"), "{err}");
    }

    #[test]
    fn tojson_indent_matches_python() {
        let t = ChatTemplate::new("{{ x | tojson(indent=2) }}", None, None).unwrap();
        let env_out = t
            .env
            .get_template(NAME)
            .unwrap()
            .render(minijinja::context! { x => json!({"a": [1, {}], "b": "é"}) })
            .unwrap();
        // python: json.dumps({"a": [1, {}], "b": "é"}, ensure_ascii=False, indent=2)
        assert_eq!(
            env_out,
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": \"é\"\n}"
        );
    }

    #[test]
    fn extra_variables_reach_the_template_and_reserved_ones_are_refused() {
        let src = "{% if enable_thinking is defined and enable_thinking is false %}off{% else %}on{% endif %}|{{ messages | length }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let msgs = [json!({"role": "user", "content": "x"})];
        assert_eq!(t.render(&msgs, true, None).unwrap(), "on|1");
        let mut extra = serde_json::Map::new();
        extra.insert("enable_thinking".into(), json!(false));
        assert_eq!(t.render_with(&msgs, true, None, &extra).unwrap(), "off|1");
        for key in RESERVED_VARIABLES {
            let mut extra = serde_json::Map::new();
            extra.insert((*key).to_owned(), json!([]));
            let err = t.render_with(&msgs, true, None, &extra).unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
    }

    #[test]
    fn syntax_errors_are_template_errors() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", None, None),
            Err(ModelError::Template(_))
        ));
    }
}
