//! Flat model parameters with named tensor shapes.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// One named tensor inside a [`ModelVector`], e.g. `layers.0.weight` of shape `[64, 32]`.
///
/// Names and row-major shapes follow PyTorch's state-dict convention, so a vector maps
/// one to one onto a safetensors file or a `state_dict()`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TensorSpec {
    /// Tensor name, unique within a layout.
    #[cfg_attr(feature = "openapi", schema(example = "layers.0.weight"))]
    pub name: String,
    /// Dimensions, row-major.
    #[cfg_attr(feature = "openapi", schema(example = json!([64, 10])))]
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A tensor called `name` with dimensions `shape`.
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>) -> Self {
        Self {
            name: name.into(),
            shape: shape.into(),
        }
    }

    /// Number of scalar parameters in this tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Why a layout or a vector is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Two tensors share a name.
    #[error("tensor name `{0}` appears more than once")]
    DuplicateName(String),
    /// A tensor has an empty name.
    #[error("tensor names must not be empty")]
    EmptyName,
    /// The values do not fill the declared tensors exactly.
    #[error("layout declares {expected} parameters but {found} values were given")]
    LengthMismatch {
        /// Parameters the layout declares.
        expected: usize,
        /// Values supplied.
        found: usize,
    },
}

/// The ordered list of tensors that a flat parameter vector is made of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<TensorSpec>", into = "Vec<TensorSpec>")]
pub struct Layout {
    tensors: Vec<TensorSpec>,
    len: usize,
}

impl Layout {
    /// Checks that names are unique and non-empty.
    pub fn new(tensors: Vec<TensorSpec>) -> Result<Self, LayoutError> {
        let mut seen = std::collections::HashSet::new();
        for t in &tensors {
            if t.name.is_empty() {
                return Err(LayoutError::EmptyName);
            }
            if !seen.insert(t.name.as_str()) {
                return Err(LayoutError::DuplicateName(t.name.clone()));
            }
        }
        let len = tensors.iter().map(TensorSpec::numel).sum();
        Ok(Self { tensors, len })
    }

    /// A layout of one unnamed-shape tensor called `params`, for plain vectors.
    pub fn flat(len: usize) -> Self {
        Self {
            tensors: vec![TensorSpec::new("params", [len])],
            len,
        }
    }

    /// The tensors, in storage order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Total number of scalar parameters.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the layout holds no parameters.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The `(offset, spec)` of the tensor called `name`.
    pub fn find(&self, name: &str) -> Option<(usize, &TensorSpec)> {
        let mut offset = 0;
        for t in &self.tensors {
            if t.name == name {
                return Some((offset, t));
            }
            offset += t.numel();
        }
        None
    }
}

impl TryFrom<Vec<TensorSpec>> for Layout {
    type Error = LayoutError;

    fn try_from(tensors: Vec<TensorSpec>) -> Result<Self, Self::Error> {
        Layout::new(tensors)
    }
}

impl From<Layout> for Vec<TensorSpec> {
    fn from(layout: Layout) -> Self {
        layout.tensors
    }
}

/// Flat `f32` model parameters plus the named shapes they are made of.
///
/// The layout is shared (`Arc`), so cloning a vector copies the numbers, not the names,
/// and comparing layouts of updates from the same model is a pointer check first.
#[derive(Clone, PartialEq)]
pub struct ModelVector {
    layout: Arc<Layout>,
    values: Vec<f32>,
}

impl fmt::Debug for ModelVector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelVector")
            .field("tensors", &self.layout.tensors)
            .field("len", &self.values.len())
            .finish()
    }
}

impl ModelVector {
    /// Wraps `values` in `layout`; fails unless the lengths agree.
    pub fn new(layout: Arc<Layout>, values: Vec<f32>) -> Result<Self, LayoutError> {
        if layout.len() != values.len() {
            return Err(LayoutError::LengthMismatch {
                expected: layout.len(),
                found: values.len(),
            });
        }
        Ok(Self { layout, values })
    }

    /// A vector of zeros in `layout`.
    pub fn zeros(layout: Arc<Layout>) -> Self {
        let values = vec![0.0; layout.len()];
        Self { layout, values }
    }

    /// A vector with a single tensor called `params`.
    pub fn from_flat(values: Vec<f32>) -> Self {
        Self {
            layout: Arc::new(Layout::flat(values.len())),
            values,
        }
    }

    /// The shared layout.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// All parameters, in layout order.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// All parameters, mutable. The length cannot change, so the layout stays valid.
    pub fn values_mut(&mut self) -> &mut [f32] {
        &mut self.values
    }

    /// Takes the parameters out.
    pub fn into_values(self) -> Vec<f32> {
        self.values
    }

    /// Number of scalar parameters.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// True when there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The values of the tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&[f32]> {
        let (offset, spec) = self.layout.find(name)?;
        Some(&self.values[offset..offset + spec.numel()])
    }

    /// True when `other` has the same tensors in the same order.
    pub fn same_layout(&self, other: &ModelVector) -> bool {
        Arc::ptr_eq(&self.layout, &other.layout) || self.layout == other.layout
    }

    /// True when every parameter is finite (no NaN, no infinity).
    pub fn is_finite(&self) -> bool {
        self.values.iter().all(|v| v.is_finite())
    }

    /// Euclidean norm, accumulated in `f64`.
    pub fn l2_norm(&self) -> f64 {
        self.values
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_rejects_duplicate_and_empty_names() {
        let dup = Layout::new(vec![TensorSpec::new("w", [2]), TensorSpec::new("w", [3])]);
        assert_eq!(dup, Err(LayoutError::DuplicateName("w".into())));
        assert_eq!(
            Layout::new(vec![TensorSpec::new("", [1])]),
            Err(LayoutError::EmptyName)
        );
    }

    #[test]
    fn vector_length_must_match_layout() {
        let layout = Arc::new(
            Layout::new(vec![
                TensorSpec::new("w", [2, 3]),
                TensorSpec::new("b", [2]),
            ])
            .unwrap(),
        );
        assert_eq!(layout.len(), 8);
        let err = ModelVector::new(layout.clone(), vec![0.0; 7]).unwrap_err();
        assert_eq!(
            err,
            LayoutError::LengthMismatch {
                expected: 8,
                found: 7
            }
        );
        let v = ModelVector::new(layout, (0..8).map(|i| i as f32).collect()).unwrap();
        assert_eq!(v.tensor("b"), Some(&[6.0, 7.0][..]));
        assert_eq!(v.tensor("w").map(<[f32]>::len), Some(6));
        assert_eq!(v.tensor("missing"), None);
    }
}
