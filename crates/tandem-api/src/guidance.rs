//! `response_format` into the engine's [`Guidance`]: the one place that checks a requested output
//! constraint, so chat, completions and tool calls (a function's parameter schema) share the rules.

use serde_json::Value;
use tandem_engine::Guidance;

use crate::error::ApiError;
use crate::protocol::{JsonSchemaFormat, ResponseFormat};

/// Longest `json_schema.name` OpenAI accepts.
pub const MAX_SCHEMA_NAME: usize = 64;

/// Why a requested output constraint was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuidanceError {
    /// A JSON Schema must be an object (or `true`/`false`).
    #[error("the JSON schema must be an object, got {0}")]
    SchemaNotObject(&'static str),
    /// The format's name breaks OpenAI's rule.
    #[error("json_schema.name must be 1-{MAX_SCHEMA_NAME} letters, digits, '_' or '-', got {0:?}")]
    BadName(String),
    /// A regex or grammar with no text constrains nothing useful.
    #[error("the {0} is empty")]
    Empty(&'static str),
}

impl GuidanceError {
    /// The request field at fault, for the 400's `param`.
    pub fn param(&self) -> &'static str {
        match self {
            GuidanceError::SchemaNotObject(_) => "response_format.json_schema.schema",
            GuidanceError::BadName(_) => "response_format.json_schema.name",
            GuidanceError::Empty("regex") => "response_format.regex",
            GuidanceError::Empty(_) => "response_format.grammar",
        }
    }
}

impl From<GuidanceError> for ApiError {
    fn from(e: GuidanceError) -> Self {
        ApiError::invalid(e.to_string(), Some(e.param()))
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Turns a JSON Schema (a response format's or a function's parameters) into a constraint, refusing
/// what cannot be a schema.
pub fn json_schema_guidance(schema: &Value) -> Result<Guidance, GuidanceError> {
    match schema {
        Value::Object(_) | Value::Bool(_) => Ok(Guidance::JsonSchema(schema.clone())),
        other => Err(GuidanceError::SchemaNotObject(kind_of(other))),
    }
}

fn named_schema(f: &JsonSchemaFormat) -> Result<Guidance, GuidanceError> {
    let name_ok = (1..=MAX_SCHEMA_NAME).contains(&f.name.len())
        && f.name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(GuidanceError::BadName(f.name.clone()));
    }
    match &f.schema {
        Some(schema) => json_schema_guidance(schema),
        None => Ok(Guidance::JsonSchema(Value::Bool(true))),
    }
}

/// The constraint a `response_format` asks for; `text` (or no format) is none.
pub fn response_format_guidance(rf: &ResponseFormat) -> Result<Option<Guidance>, GuidanceError> {
    Ok(match rf {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some(Guidance::JsonObject),
        ResponseFormat::JsonSchema { json_schema } => Some(named_schema(json_schema)?),
        ResponseFormat::Regex { regex } if regex.is_empty() => {
            return Err(GuidanceError::Empty("regex"))
        }
        ResponseFormat::Regex { regex } => Some(Guidance::Regex(regex.clone())),
        ResponseFormat::Grammar { grammar } if grammar.trim().is_empty() => {
            return Err(GuidanceError::Empty("grammar"))
        }
        ResponseFormat::Grammar { grammar } => Some(Guidance::Lark(grammar.clone())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<Guidance>, GuidanceError> {
        response_format_guidance(&serde_json::from_value(v).expect("a response_format"))
    }

    #[test]
    fn openai_formats_map_to_guidance() {
        assert_eq!(parse(json!({"type": "text"})), Ok(None));
        assert_eq!(
            parse(json!({"type": "json_object"})),
            Ok(Some(Guidance::JsonObject))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a"], "additionalProperties": false});
        assert_eq!(
            parse(json!({"type": "json_schema",
                         "json_schema": {"name": "A_1-b", "schema": schema, "strict": true}})),
            Ok(Some(Guidance::JsonSchema(schema)))
        );
        assert_eq!(
            parse(json!({"type": "json_schema", "json_schema": {"name": "any"}})),
            Ok(Some(Guidance::JsonSchema(json!(true))))
        );
    }

    #[test]
    fn extensions_map_to_guidance() {
        assert_eq!(
            parse(json!({"type": "regex", "regex": "[0-9]{3}"})),
            Ok(Some(Guidance::Regex("[0-9]{3}".into())))
        );
        assert_eq!(
            parse(json!({"type": "grammar", "grammar": "start: \"yes\" | \"no\""})),
            Ok(Some(Guidance::Lark("start: \"yes\" | \"no\"".into())))
        );
    }

    #[test]
    fn bad_formats_name_the_field() {
        let e = parse(json!({"type": "json_schema", "json_schema": {"name": "a b"}})).unwrap_err();
        assert_eq!(e.param(), "response_format.json_schema.name");
        let e = parse(json!({"type": "json_schema",
                             "json_schema": {"name": "n", "schema": [1]}}))
        .unwrap_err();
        assert_eq!(e, GuidanceError::SchemaNotObject("an array"));
        assert_eq!(e.param(), "response_format.json_schema.schema");
        let e = parse(json!({"type": "regex", "regex": ""})).unwrap_err();
        assert_eq!(e.param(), "response_format.regex");
        let e = parse(json!({"type": "grammar", "grammar": " "})).unwrap_err();
        assert_eq!(
            ApiError::from(e).param.as_deref(),
            Some("response_format.grammar")
        );
        let long = "x".repeat(MAX_SCHEMA_NAME + 1);
        assert!(parse(json!({"type": "json_schema", "json_schema": {"name": long}})).is_err());
        assert!(serde_json::from_value::<ResponseFormat>(json!({"type": "xml"})).is_err());
    }

    #[test]
    fn guidance_round_trips_through_sampling_params_json() {
        let p = tandem_engine::SamplingParams {
            guidance: Some(Guidance::JsonSchema(json!({"type": "string"}))),
            ..Default::default()
        };
        let wire = serde_json::to_string(&p).unwrap();
        assert_eq!(
            serde_json::from_str::<tandem_engine::SamplingParams>(&wire).unwrap(),
            p
        );
        let mut old: Value =
            serde_json::to_value(tandem_engine::SamplingParams::default()).unwrap();
        old.as_object_mut().unwrap().remove("guidance");
        let back: tandem_engine::SamplingParams = serde_json::from_value(old).unwrap();
        assert_eq!(back.guidance, None);
    }
}
