//! Checks on client input. Each failure is a message for INVALID_ARGUMENT that
//! names the field and what was wrong with it.

use crate::domain::{DEFAULT_TENANT, MAX_ERROR_MESSAGE_BYTES, MAX_VARIABLES_BYTES};

/// A job type, worker name or error code must not be blank.
pub fn non_blank(field: &str, value: &str) -> Result<(), String> {
    if value.trim().is_empty() {
        Err(format!("{field} must not be blank"))
    } else {
        Ok(())
    }
}

/// A text field must not be longer than `max` bytes.
pub fn at_most(field: &str, value: &str, max: usize) -> Result<(), String> {
    if value.len() > max {
        Err(format!(
            "{field} is {} bytes, more than the limit of {max} bytes",
            value.len()
        ))
    } else {
        Ok(())
    }
}

/// An error message as a job keeps it: cut to [`MAX_ERROR_MESSAGE_BYTES`] at a
/// character boundary, with a note of its full length, when longer.
pub fn error_message(message: &str) -> String {
    if message.len() <= MAX_ERROR_MESSAGE_BYTES {
        return message.to_string();
    }
    let note = format!(" [... cut: the message was {} bytes]", message.len());
    let mut end = MAX_ERROR_MESSAGE_BYTES.saturating_sub(note.len());
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{note}", &message[..end])
}

/// A document that stands for no variables: empty, blank, or the JSON `null` (as
/// Zeebe reads it; clients send it for a missing map).
fn is_empty_doc(doc: &str) -> bool {
    let doc = doc.trim();
    doc.is_empty() || doc == "null"
}

/// A document of variables or custom headers: empty (or `null`) means `{}`, otherwise
/// it must be a JSON object no larger than 4 MiB. Returns the text to store.
pub fn json_object(field: &str, doc: &str) -> Result<String, String> {
    if is_empty_doc(doc) {
        return Ok("{}".to_string());
    }
    if doc.len() > MAX_VARIABLES_BYTES {
        return Err(format!(
            "{field} is {} bytes, more than the limit of {MAX_VARIABLES_BYTES} bytes",
            doc.len()
        ));
    }
    match serde_json::from_str::<serde_json::Value>(doc) {
        Ok(serde_json::Value::Object(_)) => Ok(doc.to_string()),
        Ok(other) => Err(format!(
            "{field} must be a JSON object, but is a JSON {}",
            json_kind(&other)
        )),
        // serde_json stops at 128 levels of nesting, to keep its stack bounded.
        Err(e) if e.to_string().starts_with("recursion limit exceeded") => Err(format!(
            "{field} nest objects or arrays more than 127 levels deep ({e})"
        )),
        Err(e) => Err(format!("{field} is not valid JSON: {e}")),
    }
}

/// Like [`json_object`], but an empty (or `null`) document means "no change" (`None`).
pub fn optional_json_object(field: &str, doc: &str) -> Result<Option<String>, String> {
    if is_empty_doc(doc) {
        Ok(None)
    } else {
        json_object(field, doc).map(Some)
    }
}

/// Custom headers must be a JSON object whose values are all strings.
pub fn custom_headers(doc: &str) -> Result<String, String> {
    let text = json_object("customHeaders", doc)?;
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(&text) {
        if let Some((k, _)) = map.iter().find(|(_, v)| !v.is_string()) {
            return Err(format!("customHeaders value of '{k}' must be a string"));
        }
    }
    Ok(text)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// A tenant id: 1 to 31 characters of letters, digits, `.`, `-`, `_`; `<default>` is
/// always accepted. An empty id means `<default>`.
pub fn tenant_id(id: &str) -> Result<String, String> {
    if id.is_empty() || id == DEFAULT_TENANT {
        return Ok(DEFAULT_TENANT.to_string());
    }
    if id.trim().is_empty() {
        return Err("tenant id must not be blank".to_string());
    }
    if id.chars().count() > 31 {
        return Err(format!("tenant id '{id}' is longer than 31 characters"));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
    {
        return Err(format!(
            "tenant id '{id}' contains '{c}'; only letters, digits, '.', '-' and '_' are allowed"
        ));
    }
    Ok(id.to_string())
}

/// A list of tenant ids from a worker; an empty list means `<default>`. Duplicates are
/// dropped and the list sorted, so equal sets compare equal.
pub fn tenant_ids(ids: &[String]) -> Result<Vec<String>, String> {
    if ids.is_empty() {
        return Ok(vec![DEFAULT_TENANT.to_string()]);
    }
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        if id.is_empty() {
            return Err("tenant id must not be blank".to_string());
        }
        out.push(tenant_id(id)?);
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// A duration in ms that must be at least 1.
pub fn positive_ms(field: &str, ms: i64) -> Result<i64, String> {
    if ms < 1 {
        Err(format!("{field} must be at least 1 ms, got {ms}"))
    } else {
        Ok(ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_error_messages_are_cut_at_a_character_boundary_and_say_so() {
        assert_eq!(error_message("boom"), "boom");
        let fits = "x".repeat(MAX_ERROR_MESSAGE_BYTES);
        assert_eq!(error_message(&fits), fits);
        // Two-byte characters: no cut may split one.
        let long = "é".repeat(MAX_ERROR_MESSAGE_BYTES);
        let cut = error_message(&long);
        assert!(cut.len() <= MAX_ERROR_MESSAGE_BYTES, "{}", cut.len());
        assert!(cut.len() > MAX_ERROR_MESSAGE_BYTES - 64, "{}", cut.len());
        assert!(cut.starts_with("éé"));
        assert!(
            cut.ends_with(&format!(" [... cut: the message was {} bytes]", long.len())),
            "{}",
            &cut[cut.len() - 60..]
        );
    }

    #[test]
    fn text_fields_have_a_limit() {
        assert_eq!(at_most("worker", "w", 1), Ok(()));
        assert_eq!(
            at_most("worker", "ww", 1),
            Err("worker is 2 bytes, more than the limit of 1 bytes".to_string())
        );
    }

    #[test]
    fn json_objects() {
        assert_eq!(json_object("variables", "").as_deref(), Ok("{}"));
        assert_eq!(
            json_object("variables", "{\"a\":1}").as_deref(),
            Ok("{\"a\":1}")
        );
        let e = json_object("variables", "[1]").unwrap_err();
        assert!(
            e.contains("variables must be a JSON object, but is a JSON array"),
            "{e}"
        );
        let e = json_object("variables", "{nope").unwrap_err();
        assert!(e.contains("not valid JSON"), "{e}");
        let big = format!("{{\"a\":\"{}\"}}", "x".repeat(MAX_VARIABLES_BYTES));
        assert!(json_object("variables", &big)
            .unwrap_err()
            .contains("limit"));
        assert_eq!(optional_json_object("variables", " ").unwrap(), None);
        // Zeebe reads the JSON null as no variables.
        assert_eq!(optional_json_object("variables", " null ").unwrap(), None);
        assert_eq!(json_object("variables", "null").as_deref(), Ok("{}"));
        let e = json_object("variables", "nul").unwrap_err();
        assert!(e.contains("not valid JSON"), "{e}");
        // Valid JSON nested deeper than serde_json's limit is named as such.
        let deep = |n: usize| format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n));
        assert!(json_object("variables", &deep(127)).is_ok());
        let e = json_object("variables", &deep(128)).unwrap_err();
        assert!(e.contains("more than 127 levels deep"), "{e}");
    }

    #[test]
    fn custom_headers_are_string_maps() {
        assert!(custom_headers("{\"a\":\"b\"}").is_ok());
        assert!(custom_headers("{\"a\":1}").unwrap_err().contains("'a'"));
    }

    #[test]
    fn tenants() {
        assert_eq!(tenant_id("").unwrap(), DEFAULT_TENANT);
        assert_eq!(tenant_id("<default>").unwrap(), DEFAULT_TENANT);
        assert_eq!(tenant_id("acme-1.x_y").unwrap(), "acme-1.x_y");
        assert!(tenant_id(" ").is_err());
        assert!(tenant_id(&"a".repeat(32)).unwrap_err().contains("31"));
        assert!(tenant_id("a b").unwrap_err().contains("' '"));
        assert_eq!(tenant_ids(&[]).unwrap(), vec![DEFAULT_TENANT.to_string()]);
        assert_eq!(
            tenant_ids(&["b".into(), "a".into(), "b".into()]).unwrap(),
            vec!["a".to_string(), "b".to_string()]
        );
        assert!(tenant_ids(&["".into()]).is_err());
    }

    #[test]
    fn durations_and_names() {
        assert!(positive_ms("timeout", 0).is_err());
        assert_eq!(positive_ms("timeout", 5), Ok(5));
        assert!(non_blank("type", "  ").is_err());
        assert!(non_blank("type", "a").is_ok());
    }
}
