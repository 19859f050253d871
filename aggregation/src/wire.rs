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
    /// A streamed body ran past the model's size: it holds more than `expected`
    /// parameters, whatever it holds in all (only [`StreamCheck`] stops before the end).
    #[error(
        "body is longer than the model's {expected} parameters ({} bytes): {received} bytes or more",
        expected * 4
    )]
    TooLong {
        /// Parameters the model has.
        expected: usize,
        /// Bytes received when the body passed the model's size.
        received: usize,
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

/// Checks a body against a layout as it arrives, chunk by chunk, without holding it:
/// the streaming form of [`decode`]'s checks, for uploads that go straight to disk.
///
/// Chunks may split a float anywhere; the checker carries the partial bytes over.
#[derive(Debug, Clone)]
pub struct StreamCheck {
    expected: usize,
    seen_bytes: usize,
    carry: [u8; 4],
    carried: usize,
    first_error: Option<WireError>,
}

impl StreamCheck {
    /// A checker for a body of `parameters` little-endian `f32`s.
    pub fn new(parameters: usize) -> Self {
        Self {
            expected: parameters,
            seen_bytes: 0,
            carry: [0; 4],
            carried: 0,
            first_error: None,
        }
    }

    /// Feeds the next chunk. Returns the first error once one is certain (a non-finite
    /// value, or more bytes than the layout holds); the caller may stop reading then.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Result<(), WireError> {
        if let Some(e) = &self.first_error {
            return Err(e.clone());
        }
        let index_of = |byte: usize| byte / 4;
        let start = self.seen_bytes;
        self.seen_bytes += chunk.len();
        if self.seen_bytes > self.expected * 4 {
            // Counted in bytes: a body one byte too long holds no extra whole float, and
            // "650 parameters, the model has 650" would explain nothing.
            let e = WireError::TooLong {
                expected: self.expected,
                received: self.seen_bytes,
            };
            self.first_error = Some(e.clone());
            return Err(e);
        }
        let mut at = start;
        if self.carried > 0 {
            let take = (4 - self.carried).min(chunk.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&chunk[..take]);
            self.carried += take;
            chunk = &chunk[take..];
            at += take;
            if self.carried < 4 {
                return Ok(());
            }
            self.carried = 0;
            if !f32::from_le_bytes(self.carry).is_finite() {
                return self.fail(index_of(at - 4));
            }
        }
        let whole = chunk.chunks_exact(4);
        let rest = whole.remainder();
        for (i, c) in whole.enumerate() {
            if !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite() {
                return self.fail(index_of(at) + i);
            }
        }
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carried = rest.len();
        Ok(())
    }

    fn fail(&mut self, index: usize) -> Result<(), WireError> {
        let e = WireError::NonFinite { index };
        self.first_error = Some(e.clone());
        Err(e)
    }

    /// Ends the body: it must have held exactly the layout's parameters.
    pub fn finish(self) -> Result<(), WireError> {
        if let Some(e) = self.first_error {
            return Err(e);
        }
        if !self.seen_bytes.is_multiple_of(4) {
            return Err(WireError::Ragged(self.seen_bytes));
        }
        if self.seen_bytes / 4 != self.expected {
            return Err(WireError::WrongDimension {
                expected: self.expected,
                found: self.seen_bytes / 4,
            });
        }
        Ok(())
    }
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

    /// Feeds `body` to a streaming checker in pieces cut at `cuts`.
    fn stream_check(expected: usize, body: &[u8], cuts: &[usize]) -> Result<(), WireError> {
        let mut check = StreamCheck::new(expected);
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
        points.push(0);
        points.push(body.len());
        points.sort_unstable();
        for w in points.windows(2) {
            check.feed(&body[w[0]..w[1]])?;
        }
        check.finish()
    }

    proptest! {
        #[test]
        fn streaming_check_agrees_with_decode_however_the_body_is_cut(
            values in prop::collection::vec(prop_oneof![
                8 => -1e6f32..1e6,
                1 => Just(f32::NAN),
                1 => Just(f32::INFINITY),
            ], 0..40),
            expected in 0usize..40,
            extra in prop::collection::vec(any::<u8>(), 0..3),
            cuts in prop::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut body: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            body.extend_from_slice(&extra);
            let layout = Arc::new(Layout::flat(expected));
            let whole = decode(&layout, &body).map(|_| ());
            let streamed = stream_check(expected, &body, &cuts);
            // Both accept exactly the same bodies; on refusal the streaming check may
            // see a different problem first (it reads in order), but it still refuses.
            prop_assert_eq!(whole.is_ok(), streamed.is_ok(), "{:?} vs {:?}", whole, streamed);
            if let (Err(WireError::NonFinite { index: a }), Err(WireError::NonFinite { index: b })) = (&whole, &streamed) {
                prop_assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn streaming_check_stops_at_the_first_byte_past_the_layout() {
        let mut check = StreamCheck::new(2);
        check.feed(&[0; 8]).unwrap();
        let past = check.feed(&[0]).unwrap_err();
        assert_eq!(
            past,
            WireError::TooLong {
                expected: 2,
                received: 9
            }
        );
        // One byte past the model holds no extra whole float: the message counts bytes.
        assert_eq!(
            past.to_string(),
            "body is longer than the model's 2 parameters (8 bytes): 9 bytes or more"
        );
        assert!(check.finish().is_err());
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
