//! Reading `multipart/form-data` bodies (RFC 7578): what a plain HTML form with a file
//! input sends, so that uploading a model file needs no script.
//!
//! The session guard has the whole body in memory already (it reads it, within the
//! server's body limit, to check the CSRF token before any handler runs), so this only
//! splits a complete body into its parts; nothing is streamed.

use axum::body::Bytes;

/// Most parts one form may have: the upload form has three.
const MAX_PARTS: usize = 16;
/// Most bytes of one part's headers.
const MAX_HEADER_BYTES: usize = 8 * 1024;

/// One field of a submitted form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The field's name.
    pub name: String,
    /// For a file input: the file's name as the browser gave it (possibly empty).
    pub filename: Option<String>,
    /// The value: the file's bytes, or a text field's UTF-8.
    pub data: Bytes,
}

/// The boundary of a `multipart/form-data` content type, or `None` for any other type.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut params = content_type.split(';');
    let kind = params.next()?.trim();
    if !kind.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.find_map(|p| {
        let (key, value) = p.trim().split_once('=')?;
        if !key.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let value = value.trim().trim_matches('"');
        // RFC 2046: 1 to 70 characters.
        (!value.is_empty() && value.len() <= 70).then(|| value.to_string())
    })
}

/// The first `needle` in `hay` at or after `from`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    let first = *needle.first()?;
    let mut at = from;
    while at + needle.len() <= hay.len() {
        let offset = hay[at..=hay.len() - needle.len()]
            .iter()
            .position(|b| *b == first)?;
        at += offset;
        if hay[at..at + needle.len()] == *needle {
            return Some(at);
        }
        at += 1;
    }
    None
}

/// A parameter of a `Content-Disposition` value (`name="file"`), unquoted.
fn disposition_param(value: &str, wanted: &str) -> Option<String> {
    // Quoted values may hold `;`: split by hand, honouring the quotes.
    let mut rest = value.split_once(';')?.1;
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return None;
        }
        let (key, after) = rest.split_once('=')?;
        let key = key.trim();
        let (param, tail) = if let Some(quoted) = after.strip_prefix('"') {
            let end = quoted.find('"')?;
            (&quoted[..end], &quoted[end + 1..])
        } else {
            after.split_once(';').unwrap_or((after, ""))
        };
        if key.eq_ignore_ascii_case(wanted) {
            return Some(param.trim().to_string());
        }
        rest = tail.trim_start().strip_prefix(';').unwrap_or(tail);
    }
}

/// Splits a complete `multipart/form-data` body into its parts. Anything malformed is
/// an error that says what.
pub fn parse(body: &Bytes, boundary: &str) -> Result<Vec<Part>, String> {
    let dash = format!("--{boundary}");
    let delimiter = format!("\r\n--{boundary}");
    // The first boundary opens the body (a preamble before it is allowed and ignored).
    let mut at = if body.starts_with(dash.as_bytes()) {
        dash.len()
    } else {
        find(body, delimiter.as_bytes(), 0).ok_or("no multipart boundary in the body")?
            + delimiter.len()
    };
    let mut parts = Vec::new();
    loop {
        if body[at..].starts_with(b"--") {
            return Ok(parts);
        }
        // Transport padding may follow a boundary before its line break.
        while matches!(body.get(at), Some(b' ' | b'\t')) {
            at += 1;
        }
        if !body[at..].starts_with(b"\r\n") {
            return Err("malformed multipart boundary line".into());
        }
        at += 2;
        if parts.len() == MAX_PARTS {
            return Err(format!("more than {MAX_PARTS} form fields"));
        }
        let header_end = find(body, b"\r\n\r\n", at)
            .filter(|end| end - at <= MAX_HEADER_BYTES)
            .ok_or("malformed multipart part headers")?;
        let headers = std::str::from_utf8(&body[at..header_end])
            .map_err(|_| "multipart part headers are not UTF-8")?;
        let disposition = headers
            .split("\r\n")
            .filter_map(|line| line.split_once(':'))
            .find(|(key, _)| key.trim().eq_ignore_ascii_case("content-disposition"))
            .map(|(_, value)| value.trim())
            .ok_or("a multipart part has no Content-Disposition")?;
        let name =
            disposition_param(disposition, "name").ok_or("a multipart part has no field name")?;
        let filename = disposition_param(disposition, "filename");
        let start = header_end + 4;
        let end = find(body, delimiter.as_bytes(), start)
            .ok_or("the multipart body ends before its closing boundary")?;
        parts.push(Part {
            name,
            filename,
            data: body.slice(start..end),
        });
        at = end + delimiter.len();
    }
}

/// The first part named `name`.
pub fn part<'a>(parts: &'a [Part], name: &str) -> Option<&'a Part> {
    parts.iter().find(|p| p.name == name)
}

/// The text of the first part named `name`; empty when absent or not UTF-8.
pub fn text<'a>(parts: &'a [Part], name: &str) -> &'a str {
    part(parts, name)
        .and_then(|p| std::str::from_utf8(&p.data).ok())
        .unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(boundary: &str, file: &[u8]) -> Bytes {
        let mut b = Vec::new();
        b.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"csrf\"\r\n\r\nabc\r\n\
                 --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"m;1.safetensors\"\r\n\
                 Content-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        b.extend_from_slice(file);
        b.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        Bytes::from(b)
    }

    #[test]
    fn the_boundary_comes_from_the_content_type() {
        assert_eq!(
            boundary("multipart/form-data; boundary=----WebKitFormBoundaryX1").as_deref(),
            Some("----WebKitFormBoundaryX1")
        );
        assert_eq!(
            boundary("Multipart/Form-Data; charset=utf-8; boundary=\"a b\"").as_deref(),
            Some("a b")
        );
        assert_eq!(boundary("application/x-www-form-urlencoded"), None);
        assert_eq!(boundary("multipart/form-data"), None);
    }

    #[test]
    fn parts_hold_binary_data_exactly() {
        // Bytes that look like line breaks and dashes, but not the whole delimiter.
        let file: Vec<u8> = b"\r\n--XY\r\n\0\xff--X\r\n".to_vec();
        let parts = parse(&body("XYZ", &file), "XYZ").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(text(&parts, "csrf"), "abc");
        let f = part(&parts, "file").unwrap();
        assert_eq!(f.filename.as_deref(), Some("m;1.safetensors"));
        assert_eq!(&f.data[..], &file[..]);
        assert_eq!(text(&parts, "missing"), "");
    }

    #[test]
    fn malformed_bodies_are_refused() {
        let good = body("XYZ", b"data");
        // Cut anywhere before the closing boundary.
        for cut in [0, 10, 60, good.len() - 10] {
            assert!(parse(&good.slice(..cut), "XYZ").is_err(), "cut at {cut}");
        }
        assert!(parse(&good, "OTHER").is_err());
        let no_name =
            Bytes::from_static(b"--B\r\nContent-Disposition: form-data\r\n\r\nx\r\n--B--\r\n");
        assert!(parse(&no_name, "B").unwrap_err().contains("name"));
        let many =
            "--B\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx\r\n".repeat(17) + "--B--";
        assert!(
            parse(&Bytes::from(many), "B")
                .unwrap_err()
                .contains("more than")
        );
    }
}
