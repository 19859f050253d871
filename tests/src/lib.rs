//! Cross-crate end-to-end tests live in `tests/`; this library is empty on purpose.
