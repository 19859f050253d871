//! Model vectors as safetensors files: the form in which users bring their own models
//! and take the global model away (`safetensors.numpy.load_file`,
//! `safetensors.torch.load_file`).
//!
//! Decoding is strict, because these files come from outside: a user's upload or a
//! user's training program. Only `F32` tensors, a bounded size, finite values, and, when
//! a layout is expected, exactly its names and shapes.

use std::collections::HashMap;
use std::sync::Arc;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

use crate::{Layout, LayoutError, ModelVector, TensorSpec};

/// Most tensors a model file may hold; a header with more is refused before any of it
/// is looked at twice.
pub const MAX_TENSORS: usize = 10_000;

/// Why a safetensors file cannot be used as a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelFileError {
    /// The file is larger than allowed.
    #[error("the file is {found} bytes, more than the {limit} allowed")]
    TooLarge {
        /// The file's size.
        found: usize,
        /// The largest accepted.
        limit: usize,
    },
    /// Not a safetensors file (header, offsets or buffer malformed).
    #[error("not a valid safetensors file: {0}")]
    Malformed(String),
    /// The file holds no tensors.
    #[error("the file holds no tensors")]
    Empty,
    /// More tensors than [`MAX_TENSORS`].
    #[error("the file holds {0} tensors, more than the {MAX_TENSORS} allowed")]
    TooManyTensors(usize),
    /// A tensor is not 32-bit float.
    #[error("tensor `{name}` is {dtype}, but only F32 tensors are supported")]
    Dtype {
        /// The tensor.
        name: String,
        /// Its dtype as the file names it.
        dtype: String,
    },
    /// A tensor holds NaN or an infinity.
    #[error("tensor `{name}` holds a non-finite value ({value}) at index {index}")]
    NonFinite {
        /// The tensor.
        name: String,
        /// Flat index within the tensor.
        index: usize,
        /// The value, as text.
        value: String,
    },
    /// A tensor the expected layout has is missing.
    #[error("tensor `{0}` is missing")]
    Missing(String),
    /// A tensor the expected layout does not have.
    #[error("tensor `{0}` is not part of the model")]
    Unexpected(String),
    /// A tensor has another shape than expected.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The tensor.
        name: String,
        /// The expected shape.
        expected: Vec<usize>,
        /// The file's shape.
        found: Vec<usize>,
    },
    /// The tensors do not form a valid layout (empty name).
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// The largest a file for `layout` can honestly be: its data plus a generous header
/// (names, shapes, offsets and some metadata). A trainer's output past this is refused
/// before it is read.
pub fn max_file_bytes(layout: &Layout) -> usize {
    let header: usize = layout
        .tensors()
        .iter()
        .map(|t| t.name.len() + 24 * t.shape.len() + 96)
        .sum();
    layout.len() * 4 + header + 64 * 1024
}

/// Encodes `vector` as a safetensors file: one `F32` tensor per layout entry, with
/// `metadata` in the header.
pub fn encode(vector: &ModelVector, metadata: HashMap<String, String>) -> Vec<u8> {
    let bytes = crate::wire::encode(vector);
    let mut offset = 0;
    let mut views = Vec::with_capacity(vector.layout().tensors().len());
    for spec in vector.layout().tensors() {
        let len = spec.numel() * 4;
        let view = TensorView::new(Dtype::F32, spec.shape.clone(), &bytes[offset..offset + len])
            .expect("a layout tensor's bytes match its shape");
        views.push((spec.name.clone(), view));
        offset += len;
    }
    let metadata = (!metadata.is_empty()).then_some(metadata);
    safetensors::serialize(views, metadata).expect("valid views serialise")
}

fn parse(bytes: &[u8], max_bytes: usize) -> Result<SafeTensors<'_>, ModelFileError> {
    if bytes.len() > max_bytes {
        return Err(ModelFileError::TooLarge {
            found: bytes.len(),
            limit: max_bytes,
        });
    }
    let parsed =
        SafeTensors::deserialize(bytes).map_err(|e| ModelFileError::Malformed(e.to_string()))?;
    if parsed.is_empty() {
        return Err(ModelFileError::Empty);
    }
    if parsed.len() > MAX_TENSORS {
        return Err(ModelFileError::TooManyTensors(parsed.len()));
    }
    Ok(parsed)
}

/// Appends a tensor's values, checking its dtype and that every value is finite.
fn append_values(
    name: &str,
    view: &TensorView<'_>,
    out: &mut Vec<f32>,
) -> Result<(), ModelFileError> {
    if view.dtype() != Dtype::F32 {
        return Err(ModelFileError::Dtype {
            name: name.to_string(),
            dtype: format!("{:?}", view.dtype()),
        });
    }
    for (index, chunk) in view.data().chunks_exact(4).enumerate() {
        let value = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        if !value.is_finite() {
            return Err(ModelFileError::NonFinite {
                name: name.to_string(),
                index,
                value: value.to_string(),
            });
        }
        out.push(value);
    }
    Ok(())
}

/// Decodes a model of any layout: the tensors in the order they are stored in the file
/// (by data offset), which is the order the new layout keeps.
pub fn decode(bytes: &[u8], max_bytes: usize) -> Result<ModelVector, ModelFileError> {
    let parsed = parse(bytes, max_bytes)?;
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| ModelFileError::Malformed(e.to_string()))?;
    let names = header.offset_keys();
    let mut specs = Vec::with_capacity(names.len());
    let mut values = Vec::new();
    for name in names {
        let view = parsed
            .tensor(&name)
            .map_err(|e| ModelFileError::Malformed(e.to_string()))?;
        append_values(&name, &view, &mut values)?;
        specs.push(TensorSpec::new(name, view.shape().to_vec()));
    }
    let layout = Arc::new(Layout::new(specs)?);
    Ok(ModelVector::new(layout, values)?)
}

/// Decodes a model that must have exactly `layout`'s tensors, names and shapes (in any
/// order in the file); the result is in `layout`'s order.
pub fn decode_as(
    layout: &Arc<Layout>,
    bytes: &[u8],
    max_bytes: usize,
) -> Result<ModelVector, ModelFileError> {
    let parsed = parse(bytes, max_bytes)?;
    let expected: std::collections::HashSet<&str> =
        layout.tensors().iter().map(|t| t.name.as_str()).collect();
    let mut names = parsed.names();
    names.sort_unstable();
    if let Some(extra) = names.iter().find(|n| !expected.contains(*n)) {
        return Err(ModelFileError::Unexpected(extra.to_string()));
    }
    let mut values = Vec::with_capacity(layout.len());
    for spec in layout.tensors() {
        let view = parsed
            .tensor(&spec.name)
            .map_err(|_| ModelFileError::Missing(spec.name.clone()))?;
        if view.shape() != spec.shape.as_slice() {
            return Err(ModelFileError::Shape {
                name: spec.name.clone(),
                expected: spec.shape.clone(),
                found: view.shape().to_vec(),
            });
        }
        append_values(&spec.name, &view, &mut values)?;
    }
    Ok(ModelVector::new(layout.clone(), values)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout() -> Arc<Layout> {
        Arc::new(
            Layout::new(vec![
                TensorSpec::new("fc1.weight", [3, 2]),
                TensorSpec::new("fc1.bias", [3]),
                TensorSpec::new("fc2.weight", [2, 3]),
            ])
            .unwrap(),
        )
    }

    fn vector(values: Vec<f32>) -> ModelVector {
        ModelVector::new(layout(), values).unwrap()
    }

    fn file(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_file_decodes_back_into_the_layout_it_was_written_from() {
        let v = vector((0..15).map(|i| i as f32 - 7.5).collect());
        let bytes = encode(&v, HashMap::from([("round".into(), "2".into())]));
        let back = decode_as(v.layout(), &bytes, max_file_bytes(v.layout())).unwrap();
        assert_eq!(back, v);
        // Without an expected layout, the names, shapes and values are all kept.
        let free = decode(&bytes, usize::MAX).unwrap();
        let mut by_name: Vec<_> = free.layout().tensors().to_vec();
        by_name.sort_by(|a, b| a.name.cmp(&b.name));
        let mut expected = v.layout().tensors().to_vec();
        expected.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(by_name, expected);
        let again = decode_as(v.layout(), &encode(&free, HashMap::new()), usize::MAX).unwrap();
        assert_eq!(again, v);
    }

    #[test]
    fn files_that_do_not_match_the_model_are_refused_with_the_tensor_named() {
        let l = layout();
        let w1 = f32_bytes(&[0.0; 6]);
        let b1 = f32_bytes(&[0.0; 3]);
        let w2 = f32_bytes(&[0.0; 6]);
        let missing = file(&[
            ("fc1.weight", Dtype::F32, vec![3, 2], w1.clone()),
            ("fc1.bias", Dtype::F32, vec![3], b1.clone()),
        ]);
        assert_eq!(
            decode_as(&l, &missing, usize::MAX),
            Err(ModelFileError::Missing("fc2.weight".into()))
        );
        let misnamed = file(&[
            ("fc1.weight", Dtype::F32, vec![3, 2], w1.clone()),
            ("fc1.bias", Dtype::F32, vec![3], b1.clone()),
            ("fc2.w", Dtype::F32, vec![2, 3], w2.clone()),
        ]);
        assert_eq!(
            decode_as(&l, &misnamed, usize::MAX),
            Err(ModelFileError::Unexpected("fc2.w".into()))
        );
        let transposed = file(&[
            ("fc1.weight", Dtype::F32, vec![2, 3], w1.clone()),
            ("fc1.bias", Dtype::F32, vec![3], b1.clone()),
            ("fc2.weight", Dtype::F32, vec![2, 3], w2.clone()),
        ]);
        assert!(matches!(
            decode_as(&l, &transposed, usize::MAX),
            Err(ModelFileError::Shape { name, .. }) if name == "fc1.weight"
        ));
        let halves = file(&[
            ("fc1.weight", Dtype::F16, vec![3, 2], vec![0; 12]),
            ("fc1.bias", Dtype::F32, vec![3], b1.clone()),
            ("fc2.weight", Dtype::F32, vec![2, 3], w2.clone()),
        ]);
        assert!(matches!(
            decode_as(&l, &halves, usize::MAX),
            Err(ModelFileError::Dtype { name, .. }) if name == "fc1.weight"
        ));
        let nan = file(&[
            ("fc1.weight", Dtype::F32, vec![3, 2], w1.clone()),
            (
                "fc1.bias",
                Dtype::F32,
                vec![3],
                f32_bytes(&[0.0, f32::NAN, 0.0]),
            ),
            ("fc2.weight", Dtype::F32, vec![2, 3], w2.clone()),
        ]);
        assert!(matches!(
            decode_as(&l, &nan, usize::MAX),
            Err(ModelFileError::NonFinite { name, index: 1, .. }) if name == "fc1.bias"
        ));
        let good = file(&[
            ("fc2.weight", Dtype::F32, vec![2, 3], w2),
            ("fc1.weight", Dtype::F32, vec![3, 2], w1),
            ("fc1.bias", Dtype::F32, vec![3], b1),
        ]);
        assert!(decode_as(&l, &good, max_file_bytes(&l)).is_ok());
        assert!(matches!(
            decode_as(&l, &good, 10),
            Err(ModelFileError::TooLarge { limit: 10, .. })
        ));
    }

    #[test]
    fn empty_and_malformed_files_are_refused() {
        assert!(matches!(
            decode(b"", usize::MAX),
            Err(ModelFileError::Malformed(_))
        ));
        let empty = safetensors::serialize(Vec::<(String, TensorView<'_>)>::new(), None).unwrap();
        assert_eq!(decode(&empty, usize::MAX), Err(ModelFileError::Empty));
        let mut truncated = encode(&vector(vec![1.0; 15]), HashMap::new());
        truncated.truncate(truncated.len() - 4);
        assert!(matches!(
            decode(&truncated, usize::MAX),
            Err(ModelFileError::Malformed(_))
        ));
    }

    proptest! {
        /// No byte string makes decoding panic: these bytes come from users' programs.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes, usize::MAX);
            let _ = decode_as(&layout(), &bytes, usize::MAX);
        }

        /// A valid header over random values: decoding keeps every finite value exactly.
        #[test]
        fn every_finite_value_survives(values in proptest::collection::vec(-1e30f32..1e30, 15)) {
            let v = vector(values);
            let back = decode_as(v.layout(), &encode(&v, HashMap::new()), usize::MAX).unwrap();
            prop_assert_eq!(back, v);
        }
    }
}
