//! The error type of the data layer.

use std::fmt::Write as _;
use std::path::PathBuf;

use thiserror::Error;

/// Why a data set could not be loaded, generated or split.
///
/// Every message is a single line and names the file, line and column involved where
/// there is one, so it can be shown to a user as is.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DataError {
    /// The file could not be opened or read (including a corrupt gzip stream).
    #[error("cannot read `{}`: {}", .path.display(), one_line(&.source.to_string()))]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// The input has no header row at all.
    #[error("`{file}` is empty: expected a header row with a `label` column")]
    EmptyFile {
        /// The file (or source name) being parsed.
        file: String,
    },

    /// The header row has no column named exactly `label`.
    #[error(
        "`{file}` has no `label` column (header: {})",
        abbreviate_header(.header)
    )]
    MissingLabelColumn {
        /// The file (or source name) being parsed.
        file: String,
        /// The column names found in the header row.
        header: Vec<String>,
    },

    /// The site shares only some columns (`--columns`) and the label is not among them:
    /// nothing can train.
    #[error(
        "`{file}`: the columns this site shares (--columns) leave out `label`, which training \
         needs"
    )]
    LabelNotShared {
        /// The file (or source name) being parsed.
        file: String,
    },

    /// The header row names `label` more than once, so the label is ambiguous.
    #[error("`{file}` has {count} columns named `label`; expected exactly one")]
    DuplicateLabelColumn {
        /// The file (or source name) being parsed.
        file: String,
        /// How many columns are named `label`.
        count: usize,
    },

    /// The header row has a `label` column but no feature column.
    #[error("`{file}` has no feature columns besides `label`")]
    NoFeatureColumns {
        /// The file (or source name) being parsed.
        file: String,
    },

    /// The header row is followed by no data rows.
    #[error("`{file}` has a header but no data rows")]
    NoDataRows {
        /// The file (or source name) being parsed.
        file: String,
    },

    /// A data row has a different number of fields than the header.
    #[error("`{file}` line {line}: expected {expected} fields (as in the header), found {found}")]
    FieldCount {
        /// The file (or source name) being parsed.
        file: String,
        /// 1-based line number in the file, the header being line 1.
        line: u64,
        /// Number of fields in the header.
        expected: usize,
        /// Number of fields in this row.
        found: usize,
    },

    /// A feature cell is empty, not a number, or not finite.
    #[error(
        "`{file}` line {line}, column `{}`: {problem} feature value `{}`",
        abbreviate(.column, 40),
        abbreviate(.value, 40)
    )]
    BadFeature {
        /// The file (or source name) being parsed.
        file: String,
        /// 1-based line number in the file, the header being line 1.
        line: u64,
        /// Name of the column, from the header.
        column: String,
        /// The cell text, after trimming whitespace.
        value: String,
        /// What is wrong with it.
        problem: FeatureProblem,
    },

    /// A `label` cell is empty.
    #[error("`{file}` line {line}: empty `label` cell")]
    EmptyLabel {
        /// The file (or source name) being parsed.
        file: String,
        /// 1-based line number in the file, the header being line 1.
        line: u64,
    },

    /// The CSV itself is malformed (for example, not valid UTF-8).
    #[error("`{file}` line {line}: {}", one_line(.message))]
    Malformed {
        /// The file (or source name) being parsed.
        file: String,
        /// 1-based line number in the file where the bad record starts (0 if unknown).
        line: u64,
        /// What the CSV reader reported.
        message: String,
    },

    /// Classification needs at least two classes.
    #[error("`{file}` has {found} distinct label(s); classification needs at least 2")]
    TooFewClasses {
        /// The data set (file, source name or generator) concerned.
        file: String,
        /// Number of distinct labels found.
        found: usize,
    },

    /// A parameter is out of its valid range.
    #[error("invalid {parameter}: {reason}")]
    InvalidParameter {
        /// The parameter, as the user would name it (e.g. `test fraction`).
        parameter: &'static str,
        /// What is wrong, including the value given.
        reason: String,
    },

    /// The requested split cannot be made from this data set.
    #[error("cannot split the data set: {reason}")]
    SplitImpossible {
        /// Why not.
        reason: String,
    },
}

/// What is wrong with a feature cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureProblem {
    /// The cell is empty (or only whitespace).
    Empty,
    /// The cell does not parse as a number.
    NotNumeric,
    /// The cell parses, but to NaN or an infinity (including overflow of `f32`).
    NotFinite,
}

impl std::fmt::Display for FeatureProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FeatureProblem::Empty => "empty",
            FeatureProblem::NotNumeric => "non-numeric",
            FeatureProblem::NotFinite => "non-finite",
        })
    }
}

/// Escapes control characters (quoted CSV fields may hold newlines) so that a message
/// stays on one line.
fn one_line(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// [`one_line`], cut to at most `max` characters so a huge cell cannot flood a log line.
pub(crate) fn abbreviate(s: &str, max: usize) -> String {
    let escaped = one_line(s);
    if escaped.chars().count() <= max {
        escaped
    } else {
        let mut cut: String = escaped.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

/// The first few column names, enough to see what the file holds without printing a
/// header of hundreds of columns.
fn abbreviate_header(header: &[String]) -> String {
    const SHOWN: usize = 8;
    if header.is_empty() {
        return "no columns".to_owned();
    }
    let mut out = String::new();
    for (i, name) in header.iter().take(SHOWN).enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "`{}`", abbreviate(name, 24));
    }
    if header.len() > SHOWN {
        let _ = write!(out, ", … ({} more)", header.len() - SHOWN);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_single_line_even_with_newlines_in_values() {
        let err = DataError::BadFeature {
            file: "a.csv".into(),
            line: 3,
            column: "x\ny".into(),
            value: "1\r\n2".into(),
            problem: FeatureProblem::NotNumeric,
        };
        let msg = err.to_string();
        assert!(!msg.contains('\n') && !msg.contains('\r'), "{msg}");
        assert!(msg.contains("line 3"), "{msg}");
        assert!(msg.contains("non-numeric"), "{msg}");
    }

    #[test]
    fn long_header_is_abbreviated_with_count_of_the_rest() {
        let header: Vec<String> = (0..100).map(|i| format!("c{i}")).collect();
        let msg = DataError::MissingLabelColumn {
            file: "f.csv".into(),
            header,
        }
        .to_string();
        assert!(msg.contains("`c0`") && msg.contains("`c7`"), "{msg}");
        assert!(!msg.contains("`c8`"), "{msg}");
        assert!(msg.contains("92 more"), "{msg}");
    }

    #[test]
    fn huge_values_are_cut() {
        let long = "9".repeat(10_000);
        assert_eq!(abbreviate(&long, 40).chars().count(), 40);
        assert_eq!(abbreviate("short", 40), "short");
    }
}
