//! TensorBoard event files, written directly: TensorBoard reads a directory of files
//! named `events.out.tfevents.*`, each a sequence of TFRecords holding serialised
//! `Event` protocol buffers. The subset written here (a file version, scalar summaries
//! and one text summary) is a few fields, so this module encodes them by hand rather
//! than pull a protobuf toolchain in; `coordinator/tests/tensorboard_cli.rs` checks the
//! files with TensorBoard's own reader.
//!
//! A TFRecord is `length: u64 LE`, `masked_crc32c(length bytes): u32 LE`, the data, and
//! `masked_crc32c(data): u32 LE`, where `masked(c) = ((c >> 15) | (c << 17)) +
//! 0xa282ead8`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{Record, RunRef, SinkError};

const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    CRC32C
        .checksum(data)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// Appends `value` as a protobuf varint.
fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Appends field `field` of wire type 2 (bytes, strings, messages).
fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// An `Event` with its wall time and step, and `body` (its other fields, encoded).
fn event(wall_time: f64, step: i64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 20);
    out.push(1 << 3 | 1); // wall_time: double
    out.extend_from_slice(&wall_time.to_le_bytes());
    varint(&mut out, 2 << 3); // step: int64
    varint(&mut out, step as u64);
    out.extend_from_slice(body);
    out
}

/// A `Summary.Value` holding a scalar (`simple_value`).
fn scalar_value(tag: &str, value: f32) -> Vec<u8> {
    let mut v = Vec::with_capacity(tag.len() + 8);
    bytes_field(&mut v, 1, tag.as_bytes());
    v.push(2 << 3 | 5); // simple_value: float
    v.extend_from_slice(&value.to_le_bytes());
    v
}

/// A `Summary.Value` holding a string tensor for TensorBoard's text plugin.
fn text_value(tag: &str, text: &str) -> Vec<u8> {
    let mut plugin = Vec::new();
    bytes_field(&mut plugin, 1, b"text"); // PluginData.plugin_name
    let mut metadata = Vec::new();
    bytes_field(&mut metadata, 1, &plugin); // SummaryMetadata.plugin_data
    let mut tensor = Vec::new();
    varint(&mut tensor, 1 << 3); // TensorProto.dtype
    varint(&mut tensor, 7); // DT_STRING
    bytes_field(&mut tensor, 2, &[]); // tensor_shape: a scalar
    bytes_field(&mut tensor, 8, text.as_bytes()); // string_val
    let mut v = Vec::new();
    bytes_field(&mut v, 1, tag.as_bytes());
    bytes_field(&mut v, 8, &tensor); // Value.tensor
    bytes_field(&mut v, 9, &metadata); // Value.metadata
    v
}

/// One run's event file.
#[derive(Debug)]
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Starts a new event file in `dir` (created if needed), named as TensorBoard's own
    /// writers name theirs, and writes the file-version event.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "cohort".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            now.as_secs(),
            std::process::id(),
            now.subsec_nanos()
        ));
        let mut writer = Self {
            file: BufWriter::new(File::create(&path)?),
            path,
        };
        let mut body = Vec::new();
        bytes_field(&mut body, 3, b"brain.Event:2");
        writer.record(&event(wall_time(), 0, &body))?;
        writer.flush()?;
        Ok(writer)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc(&len).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc(data).to_le_bytes())
    }

    /// Writes the finite ones of `scalars` (tag, value) at `step`, in one event.
    pub fn scalars(&mut self, step: i64, scalars: &[(&str, f64)]) -> std::io::Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars.iter().filter(|(_, v)| v.is_finite()) {
            bytes_field(&mut summary, 1, &scalar_value(tag, *value as f32));
        }
        if summary.is_empty() {
            return Ok(());
        }
        let mut body = Vec::new();
        bytes_field(&mut body, 5, &summary); // Event.summary
        self.record(&event(wall_time(), step, &body))
    }

    /// Writes `text` (Markdown) under `tag` at `step`, for TensorBoard's text tab.
    pub fn text(&mut self, step: i64, tag: &str, text: &str) -> std::io::Result<()> {
        let mut summary = Vec::new();
        bytes_field(&mut summary, 1, &text_value(tag, text));
        let mut body = Vec::new();
        bytes_field(&mut body, 5, &summary);
        self.record(&event(wall_time(), step, &body))
    }

    /// Pushes what is written to the file, so TensorBoard sees each round as it ends.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// `--tensorboard DIR` for served experiments: each run in `DIR/<run name>/`, one event
/// file per process (replicas each write their own; TensorBoard merges a directory's
/// files), with the run's settings and end in the text tab and its final model beside
/// the events.
#[derive(Debug)]
pub struct TensorBoardSink {
    dir: PathBuf,
    writers: HashMap<String, EventWriter>,
}

impl TensorBoardSink {
    /// Runs go into sub-directories of `dir` (created when the first record comes).
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            writers: HashMap::new(),
        }
    }

    fn run_dir(&self, run: &RunRef) -> PathBuf {
        self.dir.join(file_name(&run.name))
    }

    fn writer(&mut self, run: &RunRef) -> std::io::Result<&mut EventWriter> {
        if !self.writers.contains_key(&run.key) {
            let writer = EventWriter::create(&self.run_dir(run))?;
            self.writers.insert(run.key.clone(), writer);
        }
        Ok(self.writers.get_mut(&run.key).expect("inserted above"))
    }

    /// Writes `record`; a failed write is tried again later (a full or unmounted disk
    /// may come back).
    pub async fn send(&mut self, record: &Record) -> Result<(), SinkError> {
        let dir = self.dir.clone();
        let io = |e: std::io::Error| SinkError::Transient(format!("{}: {e}", dir.display()));
        match record {
            Record::Start(run) => {
                let mut text = String::from("| parameter | value |\n|---|---|\n");
                for (k, v) in run.params.iter() {
                    text.push_str(&format!("| `{k}` | `{}` |\n", v.replace('|', "\\|")));
                }
                let w = self.writer(run).map_err(io)?;
                w.text(0, "settings", &text)
                    .and_then(|()| w.flush())
                    .map_err(io)
            }
            Record::Metrics {
                run, step, values, ..
            } => {
                let scalars: Vec<(&str, f64)> =
                    values.iter().map(|(k, v)| (k.as_str(), *v)).collect();
                let w = self.writer(run).map_err(io)?;
                w.scalars(*step, &scalars)
                    .and_then(|()| w.flush())
                    .map_err(io)
            }
            Record::Artifact { run, name, bytes } => {
                let dir = self.run_dir(run);
                let path = dir.join(file_name(name));
                let bytes = bytes.clone();
                tokio::task::spawn_blocking(move || {
                    std::fs::create_dir_all(&dir)?;
                    // Whole or absent: a reader never finds half a model.
                    let partial = path.with_extension("partial");
                    std::fs::write(&partial, &*bytes)?;
                    std::fs::rename(&partial, &path)
                })
                .await
                .map_err(|e| SinkError::Transient(e.to_string()))?
                .map_err(io)
            }
            Record::End { run, status, .. } => {
                let w = self.writer(run).map_err(io)?;
                w.text(0, "status", status.as_str())
                    .and_then(|()| w.flush())
                    .map_err(io)
            }
        }
    }
}

/// `name` as one path component: anything but letters, digits, `-`, `_` and `.`
/// becomes `_`, and a name of dots only cannot climb out of the directory.
fn file_name(name: &str) -> String {
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if safe.is_empty() || safe.chars().all(|c| c == '.') {
        format!("_{safe}")
    } else {
        safe
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CRC is Castagnoli's (the check value of "123456789" is 0xE3069283), masked
    /// as TFRecord masks it.
    #[test]
    fn records_carry_masked_crc32c() {
        assert_eq!(CRC32C.checksum(b"123456789"), 0xE306_9283);
        // ((c >> 15) | (c << 17)) + 0xa282ead8, worked out by hand.
        assert_eq!(masked_crc(b"123456789"), 0xC78A_B0E5);
    }

    /// Every record of a written file frames its data with the right length and CRCs,
    /// and the first is the file version.
    #[test]
    fn a_file_is_well_framed_records() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(1, &[("accuracy/test", 0.5), ("loss/test", f64::NAN)])
            .unwrap();
        w.text(0, "config", "`lr` = 0.1").unwrap();
        w.flush().unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut at = 0;
        let mut records = Vec::new();
        while at < bytes.len() {
            let len = &bytes[at..at + 8];
            let n = u64::from_le_bytes(len.try_into().unwrap()) as usize;
            assert_eq!(bytes[at + 8..at + 12], masked_crc(len).to_le_bytes());
            let data = &bytes[at + 12..at + 12 + n];
            assert_eq!(
                bytes[at + 12 + n..at + 16 + n],
                masked_crc(data).to_le_bytes()
            );
            records.push(data.to_vec());
            at += 16 + n;
        }
        assert_eq!(records.len(), 3);
        assert!(records[0].windows(13).any(|w| w == b"brain.Event:2"));
        // The NaN loss is left out; the accuracy is there as a float.
        assert!(records[1].windows(13).any(|w| w == b"accuracy/test"));
        assert!(!records[1].windows(9).any(|w| w == b"loss/test"));
        assert!(records[1].windows(4).any(|w| w == 0.5f32.to_le_bytes()));
    }

    #[test]
    fn run_names_stay_inside_the_directory() {
        assert_eq!(file_name("digits run/1"), "digits_run_1");
        assert_eq!(file_name(".."), "_..");
        assert_eq!(file_name(""), "_");
    }

    #[test]
    fn varints_are_protobufs() {
        let mut out = Vec::new();
        varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
    }
}
