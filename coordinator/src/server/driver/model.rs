//! The model an experiment trains, resolved from its spec (a built-in model or the
//! tensors of an uploaded file), and an uploaded model file's values in a model's order.

use std::sync::Arc;

use cohort_aggregation::{Layout, ModelVector, TensorSpec};
use cohort_edge::model::ModelSpec;
use uuid::Uuid;

use super::DriverError;
use crate::server::AppState;
use crate::store::ModelFile;

/// The model an experiment trains, resolved from its spec.
#[derive(Debug, Clone, PartialEq)]
pub enum ExperimentModel {
    /// A built-in model: the coordinator can initialise and evaluate it.
    BuiltIn(ModelSpec),
    /// A model from a file: only its tensors are known.
    File {
        /// The uploaded file it started from.
        id: Uuid,
        /// Its tensors.
        layout: Arc<Layout>,
    },
}

impl ExperimentModel {
    /// The tensors every update must have.
    pub fn layout(&self) -> &Arc<Layout> {
        match self {
            ExperimentModel::BuiltIn(spec) => spec.layout(),
            ExperimentModel::File { layout, .. } => layout,
        }
    }

    /// Scalar parameters.
    pub fn num_params(&self) -> usize {
        self.layout().len()
    }

    /// The built-in model, when it is one.
    pub fn built_in(&self) -> Option<&ModelSpec> {
        match self {
            ExperimentModel::BuiltIn(spec) => Some(spec),
            ExperimentModel::File { .. } => None,
        }
    }

    /// The tensors to send with each task: for a file model, which the client cannot
    /// derive from a model name.
    pub fn task_tensors(&self) -> Option<Vec<TensorSpec>> {
        match self {
            ExperimentModel::BuiltIn(_) => None,
            ExperimentModel::File { layout, .. } => Some(layout.tensors().to_vec()),
        }
    }
}

/// `values` (in `from`'s tensor order) rearranged into `to`'s order; the two must hold
/// the same names and shapes.
pub fn reorder(from: &ModelVector, to: &Arc<Layout>) -> Result<ModelVector, String> {
    if from.layout().as_ref() == to.as_ref() {
        return ModelVector::new(to.clone(), from.values().to_vec()).map_err(|e| e.to_string());
    }
    let mut values = Vec::with_capacity(to.len());
    for spec in to.tensors() {
        let (offset, found) = from
            .layout()
            .find(&spec.name)
            .ok_or_else(|| format!("tensor `{}` is missing", spec.name))?;
        if found.shape != spec.shape {
            return Err(format!(
                "tensor `{}` has shape {:?}, expected {:?}",
                spec.name, found.shape, spec.shape
            ));
        }
        values.extend_from_slice(&from.values()[offset..offset + spec.numel()]);
    }
    if from.layout().tensors().len() != to.tensors().len() {
        return Err("the file holds tensors the model does not have".into());
    }
    ModelVector::new(to.clone(), values).map_err(|e| e.to_string())
}

/// Blob of an uploaded model file's values.
pub(crate) fn model_file_blob(id: Uuid) -> String {
    format!("model-files/{id}.bin")
}

/// Loads a model file's values, in its stored tensor order.
pub(crate) async fn load_model_file(
    state: &AppState,
    file: &ModelFile,
) -> Result<ModelVector, DriverError> {
    let bad = |e: &dyn std::fmt::Display| {
        DriverError::Aggregation(format!("model file {}: {e}", file.id))
    };
    let layout = Arc::new(Layout::new(file.tensors.clone()).map_err(|e| bad(&e))?);
    let blobs = state.blobs.clone();
    let path = file.blob_path.clone();
    let bytes = tokio::task::spawn_blocking(move || blobs.get(&path))
        .await
        .map_err(|e| bad(&e))??;
    cohort_aggregation::wire::decode(&layout, &bytes).map_err(|e| bad(&e))
}

/// A stored model (its wire bytes, published at `round`) as the safetensors file users
/// download: PyTorch state-dict names and shapes, the experiment and round in its
/// metadata. The API, the dashboard and the experiment trackers hand out this one file.
pub(crate) fn model_file(
    exp: &crate::store::Experiment,
    round: i64,
    bytes: &[u8],
) -> Result<Vec<u8>, DriverError> {
    let (_, model) = super::experiment_model(exp)?;
    let vector = cohort_aggregation::wire::decode(model.layout(), bytes)
        .map_err(|e| DriverError::Aggregation(e.to_string()))?;
    let metadata = std::collections::HashMap::from([
        ("experiment".to_string(), exp.id.to_string()),
        ("round".to_string(), round.to_string()),
    ]);
    Ok(cohort_aggregation::model_file::encode(&vector, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_core::SpecModel;

    #[test]
    fn spec_model_names_round_trip_and_file_is_one_of_them() {
        for text in ["file", "logreg", "mlp:32,16"] {
            let m: SpecModel = text.parse().unwrap();
            assert_eq!(m.to_string(), text);
        }
        assert_eq!("FILE".parse::<SpecModel>().unwrap(), SpecModel::File);
        let e = "cnn".parse::<SpecModel>().unwrap_err().to_string();
        assert!(e.contains("file"), "{e}");
    }

    #[test]
    fn reorder_maps_tensors_by_name_and_refuses_a_different_model() {
        let a = Arc::new(
            Layout::new(vec![
                TensorSpec::new("b", [2]),
                TensorSpec::new("w", [1, 2]),
            ])
            .unwrap(),
        );
        let b = Arc::new(
            Layout::new(vec![
                TensorSpec::new("w", [1, 2]),
                TensorSpec::new("b", [2]),
            ])
            .unwrap(),
        );
        let v = ModelVector::new(a, vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(reorder(&v, &b).unwrap().values(), &[3.0, 4.0, 1.0, 2.0]);
        let c = Arc::new(
            Layout::new(vec![
                TensorSpec::new("w", [2, 1]),
                TensorSpec::new("b", [2]),
            ])
            .unwrap(),
        );
        assert!(reorder(&v, &c).unwrap_err().contains("shape"));
    }
}
