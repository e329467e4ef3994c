//! How the gateway's own answers speak to their clients' SDKs: the retry hint headers they obey
//! (`retry_hint_headers`) and the API's own error envelope (`error_body`). Plain data, checked
//! at load; [`crate::problem`] renders each answer with them.

use std::sync::Arc;

use http::{HeaderName, HeaderValue};

/// The hint header every answer carries unless a config says otherwise: the Stainless SDKs'
/// convention (`x-should-retry: true|false`, obeyed over the status).
pub const DEFAULT_HINT: HeaderName = HeaderName::from_static("x-should-retry");

/// Longest accepted template: it is rendered into every refusal of its routes.
const MAX_TEMPLATE: usize = 8 * 1024;

/// A route's (or `[defaults]`') way of answering for itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answers {
    /// `retry_hint_headers`: each set to `true` or `false` on every problem with a hint.
    hints: Vec<HeaderName>,
    /// `error_body`: `None` answers `application/problem+json` (RFC 9457).
    error_body: Option<Arc<ErrorBody>>,
    /// Both as built in: worked out once, as it is asked on every request.
    builtin: bool,
}

impl Answers {
    /// The built-in: `x-should-retry`, problem+json.
    pub fn builtin() -> Answers {
        Answers {
            hints: vec![DEFAULT_HINT],
            error_body: None,
            builtin: true,
        }
    }

    /// Whether answers look as [`crate::problem::Problem::into_response`] makes them, so that
    /// nothing needs redoing on the request path.
    pub fn is_builtin(&self) -> bool {
        self.builtin
    }

    pub fn hints(&self) -> &[HeaderName] {
        &self.hints
    }

    pub fn error_body(&self) -> Option<&ErrorBody> {
        self.error_body.as_deref()
    }

    pub fn with_hints(&mut self, hints: Vec<HeaderName>) {
        self.hints = hints;
        self.builtin = self.is_as_built();
    }

    pub fn with_error_body(&mut self, body: Option<Arc<ErrorBody>>) {
        self.error_body = body;
        self.builtin = self.is_as_built();
    }

    fn is_as_built(&self) -> bool {
        self.error_body.is_none() && matches!(self.hints.as_slice(), [one] if *one == DEFAULT_HINT)
    }
}

/// What a template can say about a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// The short name: `key-reused`.
    Code,
    /// The `type` URI.
    Type,
    Title,
    Detail,
    /// The HTTP status, digits.
    Status,
}

impl Field {
    const NAMES: [(&'static str, Field); 5] = [
        ("code", Field::Code),
        ("type", Field::Type),
        ("title", Field::Title),
        ("detail", Field::Detail),
        ("status", Field::Status),
    ];
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Field(Field),
}

/// One problem's values, as a template inserts them.
pub struct Fields<'a> {
    pub code: &'a str,
    pub type_uri: &'a str,
    pub title: &'a str,
    pub detail: &'a str,
    pub status: u16,
}

/// `error_body`: the media type and the parsed template of every refusal's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorBody {
    pub content_type: HeaderValue,
    pieces: Vec<Piece>,
}

impl ErrorBody {
    /// Parses a template: `{code}`, `{type}`, `{title}`, `{detail}`, `{status}` are
    /// placeholders; any other `{` + letters/underscores + `}` is refused as an unknown one, and
    /// other braces (JSON's own) are text. Refused unless a sample rendered with values full of
    /// quotes, backslashes and control characters is valid JSON, so no problem can make it
    /// invalid. The error says why, without echoing the template.
    pub fn parse(content_type: &str, template: &str) -> Result<ErrorBody, String> {
        let content_type = HeaderValue::from_str(content_type)
            .ok()
            .filter(|v| content_type.contains('/') && !v.is_empty())
            .ok_or_else(|| {
                "content_type must be a media type such as \"application/json\"".to_string()
            })?;
        if template.len() > MAX_TEMPLATE {
            return Err(format!("the template is over {MAX_TEMPLATE} bytes"));
        }
        let pieces = pieces(template)?;
        if !pieces.iter().any(|p| matches!(p, Piece::Field(_))) {
            return Err(
                "the template has no placeholder: every refusal would read the same".into(),
            );
        }
        let body = ErrorBody {
            content_type,
            pieces,
        };
        // Every text value starts with a quote: a template that puts a placeholder after a
        // backslash or a partial `\u` escape (which a letter could complete) renders invalid.
        let sample = body.render(&Fields {
            code: "\"key-reused",
            type_uri: "\"https://idemgate.dev/problems/key-reused",
            title: "\"A title\" \\ with\tescapes",
            detail: "\"A detail\" with a backslash \\, a newline\n and </script> é",
            status: 409,
        });
        serde_json::from_slice::<serde_json::Value>(&sample).map_err(|e| {
            format!("the template does not render valid JSON ({e}); write text placeholders inside quotes, e.g. \"message\": \"{{detail}}\", and {{status}} as a number")
        })?;
        Ok(body)
    }

    /// The body for one problem: each value JSON-escaped (no quotes added), the status as digits.
    pub fn render(&self, fields: &Fields) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        for piece in &self.pieces {
            match piece {
                Piece::Text(text) => out.extend_from_slice(text.as_bytes()),
                Piece::Field(Field::Status) => {
                    out.extend_from_slice(fields.status.to_string().as_bytes())
                }
                Piece::Field(field) => {
                    let value = match field {
                        Field::Code => fields.code,
                        Field::Type => fields.type_uri,
                        Field::Title => fields.title,
                        _ => fields.detail,
                    };
                    escaped(&mut out, value);
                }
            }
        }
        out
    }
}

/// `value` as the inside of a JSON string.
fn escaped(out: &mut Vec<u8>, value: &str) {
    // serde_json writes a quoted string; the quotes are the template's to place.
    let quoted = serde_json::to_vec(value).unwrap_or_else(|_| b"\"\"".to_vec());
    out.extend_from_slice(&quoted[1..quoted.len() - 1]);
}

/// Splits a template into text and placeholders.
fn pieces(template: &str) -> Result<Vec<Piece>, String> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let name_len = after
            .bytes()
            .take_while(|b| b.is_ascii_alphabetic() || *b == b'_')
            .count();
        if name_len == 0 || !after[name_len..].starts_with('}') {
            // JSON's own brace.
            text.push_str(&rest[..=open]);
            rest = after;
            continue;
        }
        let name = &after[..name_len];
        let Some(&(_, field)) = Field::NAMES.iter().find(|(n, _)| *n == name) else {
            return Err(format!(
                "{{{name}}} is not a placeholder; the placeholders are {{code}}, {{type}}, {{title}}, {{detail}} and {{status}}"
            ));
        };
        text.push_str(&rest[..open]);
        if !text.is_empty() {
            pieces.push(Piece::Text(std::mem::take(&mut text)));
        }
        pieces.push(Piece::Field(field));
        rest = &after[name_len + 1..];
    }
    text.push_str(rest);
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRIPE: &str =
        r#"{"error": {"type": "idempotency_error", "code": "{code}", "message": "{detail}"}}"#;

    fn fields() -> Fields<'static> {
        Fields {
            code: "in-flight",
            type_uri: "https://idemgate.dev/problems/in-flight",
            title: "T",
            detail: "say \"hi\"\n",
            status: 409,
        }
    }

    #[test]
    fn a_template_renders_each_value_escaped_in_place() {
        let body = ErrorBody::parse("application/json", STRIPE).unwrap();
        let out = body.render(&fields());
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["error"]["type"], "idempotency_error");
        assert_eq!(v["error"]["code"], "in-flight");
        assert_eq!(v["error"]["message"], "say \"hi\"\n");
        let numbered =
            ErrorBody::parse("application/json", r#"{"status": {status}, "t": "{type}"}"#).unwrap();
        assert_eq!(
            numbered.render(&fields()),
            br#"{"status": 409, "t": "https://idemgate.dev/problems/in-flight"}"#
        );
    }

    #[test]
    fn templates_that_could_render_invalid_json_are_refused() {
        for (template, why) in [
            (r#"{"m": "{message}"}"#, "is not a placeholder"),
            (r#"{"m": {detail}}"#, "valid JSON"),
            (r#"{"m": "{detail}""#, "valid JSON"),
            (r#"{"m": "x"}"#, "no placeholder"),
            (r#"{"code": "{code}", "x": "{_}"}"#, "is not a placeholder"),
            (r#"{"m": "\u000{title}"}"#, "valid JSON"),
            (r#"{"m": "\{detail}"}"#, "valid JSON"),
        ] {
            let err = ErrorBody::parse("application/json", template).unwrap_err();
            assert!(err.contains(why), "{template}: {err}");
        }
        assert!(ErrorBody::parse("json", STRIPE).is_err());
        assert!(ErrorBody::parse("application/json\n", STRIPE).is_err());
        let big = format!(
            "{{\"c\": \"{{code}}\", \"p\": \"{}\"}}",
            "x".repeat(MAX_TEMPLATE)
        );
        assert!(ErrorBody::parse("application/json", &big).is_err());
    }

    #[test]
    fn json_braces_and_empty_objects_are_text() {
        let body =
            ErrorBody::parse("application/json", r#"{"a": {}, "b": [{"r": "{code}"}]}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body.render(&fields())).unwrap();
        assert_eq!(v["b"][0]["r"], "in-flight");
        assert!(v["a"].as_object().unwrap().is_empty());
    }

    #[test]
    fn only_the_default_hint_and_problem_json_is_builtin() {
        assert!(Answers::builtin().is_builtin());
        let mut none = Answers::builtin();
        none.with_hints(vec![]);
        assert!(!none.is_builtin());
        let mut two = Answers::builtin();
        two.with_hints(vec![
            DEFAULT_HINT,
            HeaderName::from_static("stripe-should-retry"),
        ]);
        assert!(!two.is_builtin());
        let mut shaped = Answers::builtin();
        let body = Arc::new(ErrorBody::parse("application/json", STRIPE).unwrap());
        shaped.with_error_body(Some(body));
        assert!(!shaped.is_builtin());
    }
}
