//! Loading labelled tabular data from CSV files, plain or gzip-compressed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use ndarray::Array2;

use super::Dataset;
use super::error::{DataError, FeatureProblem};

/// The name of the column that holds the class of each row.
pub const LABEL_COLUMN: &str = "label";

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Loads a labelled data set from a CSV file, plain or gzip-compressed.
///
/// Gzip is recognised by its magic bytes, not by the file name, so a compressed file
/// without a `.gz` extension (or a plain one with it) loads correctly. See
/// [`parse_csv`] for the expected layout.
///
/// # Errors
/// [`DataError::Io`] naming `path` if the file cannot be opened, read or decompressed,
/// and any error of [`parse_csv`].
pub fn load_csv(path: &Path) -> Result<Dataset, DataError> {
    load_csv_only(path, None)
}

/// [`load_csv`], keeping only the columns in `shared` (the label among them) when it is
/// given: the others' fields are skipped as the file is read, never parsed or kept, so
/// no part of the data set holds them (`cohort-edge --columns`).
///
/// # Errors
/// Those of [`load_csv`], and [`DataError::LabelNotShared`] when `shared` leaves out the
/// label.
pub fn load_csv_only(path: &Path, shared: Option<&BTreeSet<String>>) -> Result<Dataset, DataError> {
    let io_err = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io_err)?;

    // Peek at the first two bytes, then glue them back in front of the rest.
    let mut magic = [0u8; 2];
    let mut got = 0;
    while got < magic.len() {
        match file.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
    }
    let head = io::Cursor::new(magic[..got].to_vec());
    let stream = head.chain(file);

    let name = path.display().to_string();
    let result = if magic[..got] == GZIP_MAGIC {
        // Multi-member so that concatenated gzip files (`cat a.gz b.gz`) read whole.
        parse_csv_only(flate2::read::MultiGzDecoder::new(stream), &name, shared)
    } else {
        parse_csv_only(stream, &name, shared)
    };
    // parse_csv only knows the source name; restore the real path for I/O errors.
    result.map_err(|e| match e {
        DataError::Io { source, .. } => io_err(source),
        other => other,
    })
}

/// Parses a labelled data set from CSV text read from `reader`.
///
/// Layout: a header row, one column named exactly `label` (in any position), every other
/// column a numeric feature. Whitespace around fields is trimmed, fields may be quoted,
/// empty lines are skipped and a trailing newline is fine. Feature values must parse
/// as finite `f32`.
///
/// Labels: if every label is an integer, the classes are the distinct integers in
/// numeric order (so `10` sorts after `9`), named by their decimal text; otherwise the
/// distinct label strings in lexicographic order. `labels[i]` indexes `classes`.
/// `groups` is `None`: CSV data is pooled, not federated.
///
/// `source_name` is used only in error messages.
///
/// # Errors
/// A [`DataError`] naming `source_name`, the 1-based line (the header is line 1) and the
/// column, for: no header ([`DataError::EmptyFile`]), no or several `label` columns,
/// no feature column, a row with the wrong number of fields, an empty / non-numeric /
/// non-finite feature, an empty label, malformed CSV, no data rows, or fewer than two
/// classes.
pub fn parse_csv(reader: impl Read, source_name: &str) -> Result<Dataset, DataError> {
    parse_csv_only(reader, source_name, None)
}

/// [`parse_csv`], keeping only the columns in `shared` when it is given (see
/// [`load_csv_only`]).
///
/// # Errors
/// Those of [`parse_csv`], and [`DataError::LabelNotShared`].
pub fn parse_csv_only(
    reader: impl Read,
    source_name: &str,
    shared: Option<&BTreeSet<String>>,
) -> Result<Dataset, DataError> {
    let file = || source_name.to_owned();
    let mut rdr = ::csv::ReaderBuilder::new()
        .has_headers(false)
        // Row lengths are checked here so the error can name file, line and counts.
        .flexible(true)
        .trim(::csv::Trim::All)
        .from_reader(LineTracker::new(reader));

    let mut record = ::csv::StringRecord::new();
    let read = |rdr: &mut ::csv::Reader<LineTracker<_>>, record: &mut ::csv::StringRecord| {
        rdr.read_record(record).map_err(|e| {
            let line = e.position().map_or(0, |p| rdr.get_mut().line_at(p.byte()));
            csv_error(e, source_name, line)
        })
    };

    if !read(&mut rdr, &mut record)? {
        return Err(DataError::EmptyFile { file: file() });
    }
    let header: Vec<String> = record.iter().map(str::to_owned).collect();
    let Columns {
        label: label_col,
        read: read_column,
        features: feature_names,
    } = columns(header.clone(), shared, source_name)?;

    let mut values: Vec<f32> = Vec::new();
    let mut raw_labels: Vec<String> = Vec::new();
    while read(&mut rdr, &mut record)? {
        let line = record
            .position()
            .map_or(0, |p| rdr.get_mut().line_at(p.byte()));
        // A whitespace-only line trims to a single empty field; treat it as empty.
        if record.len() == 1 && record[0].is_empty() {
            continue;
        }
        if record.len() != header.len() {
            return Err(DataError::FieldCount {
                file: file(),
                line,
                expected: header.len(),
                found: record.len(),
            });
        }
        for (col, cell) in record.iter().enumerate() {
            if col == label_col {
                if cell.is_empty() {
                    return Err(DataError::EmptyLabel { file: file(), line });
                }
                raw_labels.push(cell.to_owned());
            } else if read_column[col] {
                values.push(
                    parse_feature(cell).map_err(|problem| DataError::BadFeature {
                        file: file(),
                        line,
                        column: header[col].clone(),
                        value: cell.to_owned(),
                        problem,
                    })?,
                );
            }
        }
    }
    if raw_labels.is_empty() {
        return Err(DataError::NoDataRows { file: file() });
    }

    let (classes, labels) = encode_labels(&raw_labels);
    if classes.len() < 2 {
        return Err(DataError::TooFewClasses {
            file: file(),
            found: classes.len(),
        });
    }
    let features =
        Array2::from_shape_vec((labels.len(), feature_names.len()), values).map_err(|e| {
            DataError::Malformed {
                file: file(),
                line: 0,
                message: format!("internal shape mismatch: {e}"),
            }
        })?;
    Ok(Dataset {
        features,
        labels,
        classes,
        feature_names,
        groups: None,
    })
}

/// What a header says: where the label is, which columns are features that are read,
/// and their names.
struct Columns {
    label: usize,
    read: Vec<bool>,
    features: Vec<String>,
}

/// Finds the label and the feature columns in `header`, keeping only the `shared` ones
/// when given.
fn columns(
    header: Vec<String>,
    shared: Option<&BTreeSet<String>>,
    source_name: &str,
) -> Result<Columns, DataError> {
    let file = || source_name.to_owned();
    let label_positions: Vec<usize> = header
        .iter()
        .enumerate()
        .filter(|(_, name)| name.as_str() == LABEL_COLUMN)
        .map(|(i, _)| i)
        .collect();
    let label = match label_positions.as_slice() {
        [] => {
            return Err(DataError::MissingLabelColumn {
                file: file(),
                header,
            });
        }
        [one] => *one,
        many => {
            return Err(DataError::DuplicateLabelColumn {
                file: file(),
                count: many.len(),
            });
        }
    };
    if shared.is_some_and(|keep| !keep.contains(LABEL_COLUMN)) {
        return Err(DataError::LabelNotShared { file: file() });
    }
    let read: Vec<bool> = header
        .iter()
        .enumerate()
        .map(|(i, name)| i != label && shared.is_none_or(|keep| keep.contains(name)))
        .collect();
    let features: Vec<String> = header
        .iter()
        .zip(&read)
        .filter(|(_, read)| **read)
        .map(|(name, _)| name.clone())
        .collect();
    if features.is_empty() {
        return Err(DataError::NoFeatureColumns { file: file() });
    }
    Ok(Columns {
        label,
        read,
        features,
    })
}

/// Passes bytes through while noting where lines start, so errors can name the line a
/// user sees in an editor.
///
/// The csv crate's own line numbers drift: they count from the end of the previous
/// record, so skipped blank lines before a record are attributed to it, and a CRLF
/// terminator counts as a line break followed by an empty line.
struct LineTracker<R> {
    inner: R,
    offset: u64,
    /// Lines not yet passed: (byte offset of the line start, holds no content so far).
    lines: VecDeque<(u64, bool)>,
    /// Lines dropped from the front of `lines`.
    dropped: u64,
    prev_cr: bool,
}

impl<R: Read> LineTracker<R> {
    fn new(inner: R) -> Self {
        LineTracker {
            inner,
            offset: 0,
            lines: VecDeque::from([(0, true)]),
            dropped: 0,
            prev_cr: false,
        }
    }

    /// 1-based line of the first content of a record the csv reader reports at byte
    /// offset `start` (just after the previous record's terminator). Queries must come
    /// in non-decreasing order of `start`, as records do.
    fn line_at(&mut self, start: u64) -> u64 {
        // Lines wholly before this record are never asked about again.
        while self.lines.len() > 1 && self.lines[1].0 <= start {
            self.lines.pop_front();
            self.dropped += 1;
        }
        let first = self
            .lines
            .iter()
            .position(|&(line_start, blank)| line_start >= start && !blank)
            .unwrap_or(0);
        self.dropped + first as u64 + 1
    }
}

impl<R: Read> Read for LineTracker<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        for &byte in &buf[..n] {
            if self.prev_cr && byte != b'\n' {
                // A lone CR (classic Mac line end) ended the previous line.
                self.lines.push_back((self.offset, true));
            }
            self.prev_cr = byte == b'\r';
            match byte {
                b'\n' => self.lines.push_back((self.offset + 1, true)),
                b'\r' => {}
                _ => {
                    if let Some(last) = self.lines.back_mut() {
                        last.1 = false;
                    }
                }
            }
            self.offset += 1;
        }
        Ok(n)
    }
}

fn parse_feature(cell: &str) -> Result<f32, FeatureProblem> {
    if cell.is_empty() {
        return Err(FeatureProblem::Empty);
    }
    let v: f32 = cell.parse().map_err(|_| FeatureProblem::NotNumeric)?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(FeatureProblem::NotFinite)
    }
}

/// Maps label text to class indices; see [`parse_csv`] for the ordering rule.
fn encode_labels(raw: &[String]) -> (Vec<String>, Vec<u32>) {
    let ints: Option<Vec<i64>> = raw.iter().map(|s| s.parse::<i64>().ok()).collect();
    match ints {
        Some(ints) => {
            let distinct: BTreeSet<i64> = ints.iter().copied().collect();
            let index: BTreeMap<i64, u32> =
                distinct.iter().zip(0u32..).map(|(&v, i)| (v, i)).collect();
            let classes = distinct.iter().map(i64::to_string).collect();
            let labels = ints.iter().map(|v| index[v]).collect();
            (classes, labels)
        }
        None => {
            let distinct: BTreeSet<&str> = raw.iter().map(String::as_str).collect();
            let index: BTreeMap<&str, u32> =
                distinct.iter().zip(0u32..).map(|(&v, i)| (v, i)).collect();
            let classes = distinct.iter().map(|s| (*s).to_owned()).collect();
            let labels = raw.iter().map(|s| index[s.as_str()]).collect();
            (classes, labels)
        }
    }
}

fn csv_error(err: ::csv::Error, source_name: &str, line: u64) -> DataError {
    match err.into_kind() {
        ::csv::ErrorKind::Io(source) => DataError::Io {
            path: source_name.into(),
            source,
        },
        ::csv::ErrorKind::Utf8 { err, .. } => DataError::Malformed {
            file: source_name.to_owned(),
            line,
            message: format!("field {} is not valid UTF-8", err.field() + 1),
        },
        other => DataError::Malformed {
            file: source_name.to_owned(),
            line,
            message: format!("{other:?}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn parse(text: &str) -> Result<Dataset, DataError> {
        parse_csv(text.as_bytes(), "t.csv")
    }

    /// `--columns`: a column the site does not share is skipped unread (here it would
    /// not even parse), the rest keep their order; leaving out the label is refused.
    #[test]
    fn only_shared_columns_are_read() {
        let text = "a,secret,label,b\n1,Ann,x,2\n3,Bob,y,4\n";
        let shared: BTreeSet<String> = ["a", "b", "label"].map(String::from).into();
        let ds = parse_csv_only(text.as_bytes(), "t.csv", Some(&shared)).unwrap();
        assert_eq!(ds.feature_names, vec!["a", "b"]);
        assert_eq!(ds.features, ndarray::array![[1.0, 2.0], [3.0, 4.0]]);
        assert!(parse(text).is_err(), "the full file does not parse");
        let no_label: BTreeSet<String> = ["a", "b"].map(String::from).into();
        assert!(matches!(
            parse_csv_only(text.as_bytes(), "t.csv", Some(&no_label)),
            Err(DataError::LabelNotShared { .. })
        ));
        // An experiment that names its columns gets them in its order.
        let picked = ds.columns(&["b".into(), "a".into()]).unwrap();
        assert_eq!(picked.features, ndarray::array![[2.0, 1.0], [4.0, 3.0]]);
        let missing = ds.columns(&["secret".into()]).unwrap_err();
        assert!(missing.contains("`secret`"), "{missing}");
    }

    #[test]
    fn label_column_may_be_anywhere_and_features_keep_order() {
        let ds = parse("a,label,b\n1,x,2\n3,y,4\n").unwrap();
        assert_eq!(ds.feature_names, vec!["a", "b"]);
        assert_eq!(ds.features, ndarray::array![[1.0, 2.0], [3.0, 4.0]]);
        assert_eq!(ds.classes, vec!["x", "y"]);
        assert_eq!(ds.labels, vec![0, 1]);
        assert!(ds.groups.is_none());
    }

    #[test]
    fn integer_labels_sort_numerically_not_lexicographically() {
        let ds = parse("f,label\n0,10\n0,9\n0,-1\n0,09\n").unwrap();
        assert_eq!(ds.classes, vec!["-1", "9", "10"]);
        assert_eq!(ds.labels, vec![2, 1, 0, 1]);
    }

    #[test]
    fn mixed_labels_fall_back_to_string_order() {
        let ds = parse("f,label\n0,10\n0,9\n0,b\n").unwrap();
        assert_eq!(ds.classes, vec!["10", "9", "b"]);
        assert_eq!(ds.labels, vec![0, 1, 2]);
    }

    #[test]
    fn whitespace_quotes_blank_lines_and_bom_are_tolerated() {
        let ds = parse("\u{feff} x , label \n\n 1.5 ,\"a\"\n   \n\" 2\",b\n\n").unwrap();
        assert_eq!(ds.feature_names, vec!["x"]);
        assert_eq!(ds.features, ndarray::array![[1.5], [2.0]]);
        assert_eq!(ds.classes, vec!["a", "b"]);
    }

    #[test]
    fn missing_label_column_names_file_and_header() {
        let err = parse("a,b,Label\n1,2,3\n").unwrap_err();
        assert!(matches!(err, DataError::MissingLabelColumn { .. }));
        let msg = err.to_string();
        assert!(msg.contains("t.csv") && msg.contains("`Label`"), "{msg}");
    }

    #[test]
    fn bad_feature_reports_line_column_and_value() {
        let err = parse("a,b,label\n1,2,0\n1,oops,1\n").unwrap_err();
        match &err {
            DataError::BadFeature {
                line,
                column,
                value,
                problem,
                ..
            } => {
                assert_eq!(*line, 3);
                assert_eq!(column, "b");
                assert_eq!(value, "oops");
                assert_eq!(*problem, FeatureProblem::NotNumeric);
            }
            other => panic!("unexpected {other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("t.csv")
                && msg.contains("line 3")
                && msg.contains("`b`")
                && msg.contains("`oops`"),
            "{msg}"
        );
    }

    #[test]
    fn line_numbers_count_skipped_blank_lines() {
        let err = parse("a,label\n\n1,0\n\nnan,1\n").unwrap_err();
        assert!(
            matches!(
                err,
                DataError::BadFeature {
                    line: 5,
                    problem: FeatureProblem::NotFinite,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn line_numbers_are_right_for_crlf_lone_cr_and_multiline_quotes() {
        let cases = [
            ("a,label\r\n\r\n1,0\r\n\r\n\r\nx,1\r\n", 6),
            ("a,label\r1,0\r\rx,1\r", 4),
            ("a,label\n1,\"multi\nline\n\nlabel\"\n\n  \nx,1\n", 8),
            ("\n\na,label\n1,0\nx,1", 5),
        ];
        for (text, want) in cases {
            match parse(text).unwrap_err() {
                DataError::BadFeature { line, .. } => assert_eq!(line, want, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
        let err = parse("a,b,label\r\n1,2,0\r\n\r\n1,2\r\n").unwrap_err();
        assert!(
            matches!(err, DataError::FieldCount { line: 4, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn empty_and_non_finite_features_are_rejected() {
        for (text, want) in [
            ("a,label\n,0\n1,1\n", FeatureProblem::Empty),
            ("a,label\ninf,0\n1,1\n", FeatureProblem::NotFinite),
            ("a,label\n1e40,0\n1,1\n", FeatureProblem::NotFinite),
            ("a,label\nNaN,0\n1,1\n", FeatureProblem::NotFinite),
        ] {
            let err = parse(text).unwrap_err();
            assert!(
                matches!(err, DataError::BadFeature { problem, line: 2, .. } if problem == want),
                "{text:?}: {err:?}"
            );
        }
    }

    #[test]
    fn wrong_field_count_reports_expected_and_found() {
        let err = parse("a,b,label\n1,2,0\n1,2\n").unwrap_err();
        assert!(
            matches!(
                err,
                DataError::FieldCount {
                    line: 3,
                    expected: 3,
                    found: 2,
                    ..
                }
            ),
            "{err:?}"
        );
        let err = parse("a,b,label\n1,2,0,\n").unwrap_err();
        assert!(
            matches!(err, DataError::FieldCount { found: 4, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn empty_label_is_an_error() {
        let err = parse("a,label\n1,0\n2,\n").unwrap_err();
        assert!(
            matches!(err, DataError::EmptyLabel { line: 3, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn empty_inputs_and_single_class_are_errors() {
        assert!(matches!(
            parse("").unwrap_err(),
            DataError::EmptyFile { .. }
        ));
        assert!(matches!(
            parse("\n\n").unwrap_err(),
            DataError::EmptyFile { .. }
        ));
        assert!(matches!(
            parse("a,label\n").unwrap_err(),
            DataError::NoDataRows { .. }
        ));
        assert!(matches!(
            parse("label\n1\n2\n").unwrap_err(),
            DataError::NoFeatureColumns { .. }
        ));
        assert!(matches!(
            parse("a,label,label\n1,2,3\n").unwrap_err(),
            DataError::DuplicateLabelColumn { count: 2, .. }
        ));
        assert!(matches!(
            parse("a,label\n1,0\n2,0\n").unwrap_err(),
            DataError::TooFewClasses { found: 1, .. }
        ));
    }

    #[test]
    fn invalid_utf8_is_a_clear_error() {
        let err = parse_csv(&b"a,label\n1,\xff\xfe\n"[..], "t.csv").unwrap_err();
        assert!(
            matches!(err, DataError::Malformed { line: 2, .. }),
            "{err:?}"
        );
        assert!(!err.to_string().contains('\n'));
    }

    #[test]
    fn gzip_is_detected_by_magic_bytes_not_extension() {
        let dir = tempfile::tempdir().unwrap();
        let text = "a,label\n1,0\n2,1\n";

        let gz_named_plain = dir.path().join("data.csv");
        let mut enc = flate2::write::GzEncoder::new(
            File::create(&gz_named_plain).unwrap(),
            flate2::Compression::default(),
        );
        enc.write_all(text.as_bytes()).unwrap();
        enc.finish().unwrap();

        let plain_named_gz = dir.path().join("data.csv.gz");
        std::fs::write(&plain_named_gz, text).unwrap();

        let a = load_csv(&gz_named_plain).unwrap();
        let b = load_csv(&plain_named_gz).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 2);
    }

    #[test]
    fn io_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.csv");
        let err = load_csv(&missing).unwrap_err();
        assert!(matches!(err, DataError::Io { .. }));
        assert!(err.to_string().contains("nope.csv"), "{err}");

        // A truncated gzip stream surfaces as an I/O error on the real path.
        let broken = dir.path().join("broken.csv.gz");
        std::fs::write(&broken, [0x1f, 0x8b, 0x08, 0x00, 0x01]).unwrap();
        let err = load_csv(&broken).unwrap_err();
        assert!(
            matches!(err, DataError::Io { ref path, .. } if path == &broken),
            "{err:?}"
        );
    }

    #[test]
    fn tiny_files_shorter_than_the_magic_are_handled() {
        let dir = tempfile::tempdir().unwrap();
        let one = dir.path().join("one.csv");
        std::fs::write(&one, "a").unwrap();
        assert!(matches!(
            load_csv(&one).unwrap_err(),
            DataError::MissingLabelColumn { .. }
        ));
        let empty = dir.path().join("empty.csv");
        std::fs::write(&empty, "").unwrap();
        assert!(matches!(
            load_csv(&empty).unwrap_err(),
            DataError::EmptyFile { .. }
        ));
    }
}
