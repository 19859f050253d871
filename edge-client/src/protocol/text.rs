//! The one rule for the short texts people give things (an experiment's name, an
//! enrolment token's label, a model file's name): UTF-8 (the API's JSON and query
//! strings already are), not blank, at most a number of characters (not bytes), and no
//! control characters. A control character has no place in a label, and NUL cannot even
//! be stored by PostgreSQL's text type, so both backends refuse the same inputs. And the
//! looser rule for free text (a client's report of why its task failed). Here, in the
//! protocol's crate, so that the edge client makes what it sends fit the rule the
//! coordinator checks (`cohort_core::text` re-exports it).

/// Most characters a name or label may have.
pub const MAX_LABEL_CHARS: usize = 200;

/// The rule as the OpenAPI document states it (an ECMA-262 pattern, with `minLength` 1
/// and `maxLength` [`MAX_LABEL_CHARS`]): some character that is neither a space nor a
/// control character, and no control character. `\s` there counts U+FEFF as a space,
/// so [`check_label`] does too: the document and the server refuse the same texts.
pub const LABEL_PATTERN: &str = r"^[^\u0000-\u001F\u007F-\u009F]*[^\s\u0000-\u001F\u007F-\u009F][^\u0000-\u001F\u007F-\u009F]*$";

/// The rule for free text (a client's account of why its task failed) as the document
/// states it: like [`LABEL_PATTERN`], but tabs and line breaks are allowed, since such a
/// text is often a trainer's error output.
pub const FREE_TEXT_PATTERN: &str = r"^[^\u0000-\u0008\u000B\u000C\u000E-\u001F\u007F-\u009F]*[^\s\u0000-\u001F\u007F-\u009F][^\u0000-\u0008\u000B\u000C\u000E-\u001F\u007F-\u009F]*$";

/// Whether `value` is blank: spaces only (U+FEFF counted as one, as ECMA `\s` does).
pub fn is_blank(value: &str) -> bool {
    value.chars().all(|c| c.is_whitespace() || c == '\u{feff}')
}

/// Whether free text may not hold `c`: a control character other than a tab or a line
/// break.
pub fn refused_in_free_text(c: char) -> bool {
    c.is_control() && !matches!(c, '\t' | '\n' | '\r')
}

/// Checks free text (any length; the caller cuts it): not blank and no control
/// characters but tabs and line breaks. NUL, which PostgreSQL's text cannot hold, is
/// refused on both backends alike.
pub fn check_free_text(field: &str, value: &str) -> Result<(), String> {
    if is_blank(value) {
        return Err(format!("{field} must not be blank"));
    }
    if let Some(c) = value.chars().find(|&c| refused_in_free_text(c)) {
        return Err(format!(
            "{field} must not hold control characters other than tabs and line breaks \
             (found U+{:04X})",
            u32::from(c)
        ));
    }
    Ok(())
}

/// Checks a name or label; `Err` says what is wrong, naming `field`.
pub fn check_label(field: &str, value: &str) -> Result<(), String> {
    if is_blank(value) {
        return Err(format!("{field} must not be blank"));
    }
    let chars = value.chars().count();
    if chars > MAX_LABEL_CHARS {
        return Err(format!(
            "{field} must be at most {MAX_LABEL_CHARS} characters, got {chars}"
        ));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(format!(
            "{field} must not hold control characters (found U+{:04X})",
            u32::from(c)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_counted_in_characters_and_hold_no_control_characters() {
        assert!(check_label("name", "digits, round 1").is_ok());
        // 200 characters of two bytes each: within the limit, which is in characters.
        assert!(check_label("name", &"é".repeat(200)).is_ok());
        assert!(check_label("name", &"é".repeat(201)).is_err());
        assert!(check_label("name", "  ").is_err());
        let nul = check_label("label", "a\0b").unwrap_err();
        assert!(nul.contains("U+0000") && nul.starts_with("label"), "{nul}");
        assert!(check_label("label", "tab\there").is_err());
        assert!(check_label("label", "line\nbreak").is_err());
    }
}
