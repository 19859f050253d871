//! The wire form of a model vector: its parameters as little-endian `f32`, nothing else.
//! Both ends know the layout from the experiment, so a body is checked against it rather
//! than trusted to describe itself.

use std::sync::Arc;

use crate::model_vector::{Layout, ModelVector};

/// Why a body is not a valid vector of the expected layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The body's length is not a whole number of `f32`s.
    #[error("body of {0} bytes is not a whole number of 4-byte floats")]
    Ragged(usize),
    /// The body holds a different number of parameters than the model.
    #[error("body holds {found} parameters, the model has {expected}")]
    WrongDimension {
        /// Parameters the model has.
        expected: usize,
        /// Parameters in the body.
        found: usize,
    },
    /// A parameter is NaN or infinite.
    #[error("parameter {index} is not finite")]
    NonFinite {
        /// Position of the first bad parameter.
        index: usize,
    },
}

/// Encodes `vector`'s parameters as little-endian `f32`.
pub fn encode(vector: &ModelVector) -> Vec<u8> {
    let mut out = Vec::with_capacity(vector.len() * 4);
    for v in vector.values() {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Decodes a body into a vector of `layout`, refusing a wrong size or a non-finite value.
pub fn decode(layout: &Arc<Layout>, bytes: &[u8]) -> Result<ModelVector, WireError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(WireError::Ragged(bytes.len()));
    }
    let found = bytes.len() / 4;
    if found != layout.len() {
        return Err(WireError::WrongDimension {
            expected: layout.len(),
            found,
        });
    }
    let mut values = Vec::with_capacity(found);
    for (index, chunk) in bytes.chunks_exact(4).enumerate() {
        let v = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        if !v.is_finite() {
            return Err(WireError::NonFinite { index });
        }
        values.push(v);
    }
    Ok(ModelVector::new(layout.clone(), values).expect("length checked against the layout"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn encode_then_decode_is_the_identity(values in prop::collection::vec(-1e30f32..1e30, 0..64)) {
            let v = ModelVector::from_flat(values);
            let back = decode(v.layout(), &encode(&v)).unwrap();
            prop_assert_eq!(back, v);
        }
    }

    #[test]
    fn wrong_sizes_and_non_finite_values_are_refused() {
        let layout = Arc::new(Layout::flat(2));
        assert_eq!(decode(&layout, &[0; 7]), Err(WireError::Ragged(7)));
        assert_eq!(
            decode(&layout, &[0; 12]),
            Err(WireError::WrongDimension {
                expected: 2,
                found: 3
            })
        );
        let mut body = encode(&ModelVector::from_flat(vec![1.0, 2.0]));
        body[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
        assert_eq!(
            decode(&layout, &body),
            Err(WireError::NonFinite { index: 1 })
        );
    }
}
