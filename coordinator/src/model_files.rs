//! Model vectors as files a user can load elsewhere: safetensors, with the tensor names
//! and shapes of the layout, loadable by `safetensors.torch.load_file` into a PyTorch
//! state dict.

use std::collections::HashMap;

use cohort_aggregation::ModelVector;
use safetensors::tensor::{Dtype, TensorView};

/// Encodes `vector` as a safetensors file (`F32` tensors, one per layout entry).
pub fn to_safetensors(vector: &ModelVector, metadata: HashMap<String, String>) -> Vec<u8> {
    let bytes = cohort_aggregation::wire::encode(vector);
    let mut offset = 0;
    let mut views = Vec::with_capacity(vector.layout().tensors().len());
    for spec in vector.layout().tensors() {
        let len = spec.numel() * 4;
        let view = TensorView::new(Dtype::F32, spec.shape.clone(), &bytes[offset..offset + len])
            .expect("a layout tensor's bytes match its shape");
        views.push((spec.name.clone(), view));
        offset += len;
    }
    safetensors::serialize(views, Some(metadata)).expect("valid views serialise")
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_aggregation::{Layout, TensorSpec};
    use safetensors::SafeTensors;
    use std::sync::Arc;

    #[test]
    fn safetensors_keeps_names_shapes_and_values() {
        let layout = Arc::new(
            Layout::new(vec![
                TensorSpec::new("layers.0.weight", [2, 3]),
                TensorSpec::new("layers.0.bias", [2]),
            ])
            .unwrap(),
        );
        let values: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect();
        let v = ModelVector::new(layout, values).unwrap();
        let file = to_safetensors(&v, HashMap::from([("round".into(), "3".into())]));
        let parsed = SafeTensors::deserialize(&file).unwrap();
        let w = parsed.tensor("layers.0.weight").unwrap();
        assert_eq!(w.shape(), &[2, 3]);
        assert_eq!(w.dtype(), Dtype::F32);
        let b = parsed.tensor("layers.0.bias").unwrap();
        let bias: Vec<f32> = b
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(bias, vec![3.0, 3.5]);
    }
}
