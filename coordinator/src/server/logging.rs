//! `cohort serve`'s log: human-readable lines or one JSON object a line, on standard
//! error, with colour only where a person is looking (a terminal, and no `NO_COLOR`).
//! A log file or a collector then reads plain text, never escape codes.

use std::io::IsTerminal;

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line an event (the default).
    #[default]
    Text,
    /// One JSON object a line (`timestamp`, `level`, `fields.message`, the event's
    /// fields, `target`), for collectors.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("`{other}` is not a log format: use text or json")),
        }
    }
}

/// Whether text lines get colour: only on a terminal, and never with `NO_COLOR` set
/// (<https://no-color.org>).
pub fn colour(stderr_is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Starts logging to standard error in `format`, filtered by `RUST_LOG` (default
/// `info`). Keeps a subscriber an embedding program already set.
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // Fails only when a subscriber is already set (an embedding program's); keep theirs.
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(colour(
                std::io::stderr().is_terminal(),
                std::env::var_os("NO_COLOR").as_deref(),
            ))
            .try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_colour_is_for_terminals_without_no_color() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!(" text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert!(
            "yaml"
                .parse::<LogFormat>()
                .unwrap_err()
                .contains("text or json")
        );
        assert!(colour(true, None));
        assert!(!colour(false, None));
        assert!(!colour(true, Some(std::ffi::OsStr::new("1"))));
        assert!(colour(true, Some(std::ffi::OsStr::new(""))));
    }
}
