//! Personalised federated learning: each client keeps a model of its own while the
//! clients still learn together.
//!
//! - `fedper:LAYERS` (Arivazhagan et al. 2019): the named layers are the client's own.
//!   It trains the whole model from the global shared layers and its own personal ones,
//!   and uploads only the shared layers.
//! - `fedrep:LAYERS` (Collins et al. 2021): the same split, trained in turn: the personal
//!   layers for the task's local epochs with the shared ones frozen, then the shared
//!   layers for one epoch with the personal ones frozen.
//! - `ditto:LAMBDA` (Li et al. 2021): the global model trains as in FedAvg; each client
//!   also keeps a whole personal model, trained each round for the same epochs with a
//!   proximal pull of strength LAMBDA towards the global model it received.
//! - `finetune:EPOCHS`: the global model trains as in FedAvg; a client's personal model
//!   is the global model fine-tuned on its own data for EPOCHS epochs.
//!
//! Personal layers never leave the client: an upload carries the global model's values
//! in their place (the coordinator's own, so they do not move), and the state a client
//! keeps between rounds is its personal layers (FedPer, FedRep) or its personal model
//! (Ditto). A built-in model names its layers `layers.0`, `layers.1`, ... (both tensors
//! of layer `i`); any model may name tensors (`fc2.weight`).

use std::fmt;
use std::str::FromStr;

use cohort_aggregation::{Layout, ModelVector};

use crate::train::{LocalModel, LocalUpdate, TrainConfig, TrainError};

/// A personalisation scheme.
#[derive(Debug, Clone, PartialEq)]
pub enum Personalisation {
    /// FedPer: the named layers are personal, trained together with the shared ones.
    FedPer {
        /// Layer or tensor names.
        layers: Vec<String>,
    },
    /// FedRep: the named layers are personal, trained first, then the shared ones.
    FedRep {
        /// Layer or tensor names.
        layers: Vec<String>,
    },
    /// Ditto: a whole personal model pulled towards the global one with strength
    /// `lambda`.
    Ditto {
        /// The proximal strength, above 0.
        lambda: f32,
    },
    /// Fine-tuning: the global model, trained `epochs` more epochs on the client's data.
    FineTune {
        /// 1 to 1000.
        epochs: u32,
    },
}

/// Why a scheme's name does not parse, or does not fit a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PersonalisationError {
    /// Not one of the schemes.
    #[error(
        "unknown personalisation `{0}`: use fedper:LAYERS, fedrep:LAYERS, ditto:LAMBDA or finetune:EPOCHS"
    )]
    Unknown(String),
    /// A scheme's value is out of range or missing.
    #[error("personalisation {0}")]
    Value(String),
    /// A named layer or tensor is not in the model.
    #[error("personalisation: the model has no layer or tensor `{name}` (it has {known})")]
    NoSuchLayer {
        /// The name given.
        name: String,
        /// The model's layers and tensors.
        known: String,
    },
    /// Every parameter would be personal: nothing would be learnt together.
    #[error("personalisation: {0} names every tensor of the model, so nothing would be shared")]
    NothingShared(String),
}

impl FromStr for Personalisation {
    type Err = PersonalisationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (name, value) = s
            .split_once(':')
            .ok_or_else(|| PersonalisationError::Unknown(s.to_string()))?;
        let layers = || -> Result<Vec<String>, PersonalisationError> {
            let list: Vec<String> = value
                .split(',')
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect();
            if list.is_empty() {
                return Err(PersonalisationError::Value(format!(
                    "{name}:LAYERS needs at least one layer or tensor name (e.g. {name}:layers.1)"
                )));
            }
            Ok(list)
        };
        match name {
            "fedper" => Ok(Self::FedPer { layers: layers()? }),
            "fedrep" => Ok(Self::FedRep { layers: layers()? }),
            "ditto" => match value.parse::<f32>() {
                Ok(lambda) if lambda.is_finite() && lambda > 0.0 && lambda <= 1e4 => {
                    Ok(Self::Ditto { lambda })
                }
                _ => Err(PersonalisationError::Value(format!(
                    "ditto:{value}: LAMBDA must be a number above 0 and at most 10000"
                ))),
            },
            "finetune" => match value.parse::<u32>() {
                Ok(epochs) if (1..=1000).contains(&epochs) => Ok(Self::FineTune { epochs }),
                _ => Err(PersonalisationError::Value(format!(
                    "finetune:{value}: EPOCHS must be a whole number from 1 to 1000"
                ))),
            },
            _ => Err(PersonalisationError::Unknown(s.to_string())),
        }
    }
}

impl fmt::Display for Personalisation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::FedPer { layers } => write!(f, "fedper:{}", layers.join(",")),
            Self::FedRep { layers } => write!(f, "fedrep:{}", layers.join(",")),
            Self::Ditto { lambda } => write!(f, "ditto:{lambda}"),
            Self::FineTune { epochs } => write!(f, "finetune:{epochs}"),
        }
    }
}

impl serde::Serialize for Personalisation {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Personalisation {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// The tensors a name covers: the tensor itself, or every tensor of layer `name`
/// (`layers.1` covers `layers.1.weight` and `layers.1.bias`).
fn covered<'a>(layout: &'a Layout, name: &'a str) -> impl Iterator<Item = usize> + 'a {
    layout
        .tensors()
        .iter()
        .enumerate()
        .filter_map(move |(i, t)| {
            let layer = t
                .name
                .strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('.'));
            (t.name == name || layer).then_some(i)
        })
}

impl Personalisation {
    /// Which parameters of `layout` are personal (never uploaded): the named layers' for
    /// FedPer and FedRep, none for Ditto and fine-tuning (their personal model is a whole
    /// second model). Refuses a name the model does not have, and a split that leaves
    /// nothing shared.
    pub fn personal_mask(&self, layout: &Layout) -> Result<Vec<bool>, PersonalisationError> {
        let mut mask = vec![false; layout.len()];
        let (Self::FedPer { layers } | Self::FedRep { layers }) = self else {
            return Ok(mask);
        };
        let mut offsets = Vec::with_capacity(layout.tensors().len());
        let mut at = 0;
        for t in layout.tensors() {
            offsets.push(at..at + t.numel());
            at += t.numel();
        }
        for name in layers {
            let tensors: Vec<usize> = covered(layout, name).collect();
            if tensors.is_empty() {
                let mut known: Vec<String> = layout
                    .tensors()
                    .iter()
                    .filter_map(|t| t.name.rsplit_once('.').map(|(l, _)| l.to_string()))
                    .collect();
                known.dedup();
                known.extend(layout.tensors().iter().map(|t| t.name.clone()));
                return Err(PersonalisationError::NoSuchLayer {
                    name: name.clone(),
                    known: known.join(", "),
                });
            }
            for t in tensors {
                mask[offsets[t].clone()].fill(true);
            }
        }
        if mask.iter().all(|p| *p) {
            return Err(PersonalisationError::NothingShared(self.to_string()));
        }
        Ok(mask)
    }

    /// Whether the client keeps state between rounds (FedPer, FedRep: its personal
    /// layers; Ditto: its personal model).
    pub fn keeps_state(&self) -> bool {
        !matches!(self, Self::FineTune { .. })
    }
}

/// A client's personal part, as kept between rounds: the whole vector of its personal
/// model (for FedPer and FedRep only the personal positions matter).
pub type PersonalState = Vec<f32>;

/// What one personalised training task gives: the upload (the global model's values in
/// the personal positions) and the client's new personal state.
#[derive(Debug, Clone, PartialEq)]
pub struct PersonalisedUpdate {
    /// What goes to the coordinator.
    pub upload: LocalUpdate,
    /// What the client keeps (`None` for fine-tuning, which keeps nothing).
    pub state: Option<PersonalState>,
}

/// `global` with the personal positions taken from `state` (the global's own where the
/// client has none yet).
fn with_personal(global: &ModelVector, mask: &[bool], state: Option<&[f32]>) -> ModelVector {
    let values = match state {
        Some(state) if state.len() == global.len() => global
            .values()
            .iter()
            .zip(state)
            .zip(mask)
            .map(|((g, s), personal)| if *personal { *s } else { *g })
            .collect(),
        _ => global.values().to_vec(),
    };
    ModelVector::new(global.layout().clone(), values).expect("the global's own layout")
}

/// Ditto's personal model: the client's `state`, or the `global` model before its first
/// round (or after the model changed shape).
fn own_model(global: &ModelVector, state: Option<&[f32]>) -> ModelVector {
    match state {
        Some(s) if s.len() == global.len() => {
            ModelVector::new(global.layout().clone(), s.to_vec()).expect("the global's own layout")
        }
        _ => global.clone(),
    }
}

/// `trained` with the personal positions put back to `global`'s: what may be uploaded.
fn shared_only(trained: &ModelVector, global: &ModelVector, mask: &[bool]) -> ModelVector {
    let values = trained
        .values()
        .iter()
        .zip(global.values())
        .zip(mask)
        .map(|((t, g), personal)| if *personal { *g } else { *t })
        .collect();
    ModelVector::new(global.layout().clone(), values).expect("the global's own layout")
}

/// [`Personalisation::personal_mask`] of `global`'s layout, as a training error.
fn mask_of(scheme: &Personalisation, global: &ModelVector) -> Result<Vec<bool>, TrainError> {
    scheme
        .personal_mask(global.layout())
        .map_err(|e| TrainError::InvalidConfig(e.to_string()))
}

/// One local training run, as personalisation needs it: from `start`, with an optional
/// proximal pull (anchor, strength) and an optional mask of the parameters that may
/// move, for `config`'s epochs, seeded by the last argument. The built-in models do this
/// with [`LocalModel::train_from`]; the agent does it with whatever trainer the client
/// runs.
pub trait TrainFrom {
    /// Why a run failed (a scheme that does not fit the model is a [`TrainError`]).
    type Error: From<TrainError>;

    /// Trains once; see the trait.
    fn train_from(
        &self,
        start: &ModelVector,
        pull: Option<(&[f32], f32)>,
        trainable: Option<&[bool]>,
        config: &TrainConfig,
        seed: u64,
    ) -> Result<LocalUpdate, Self::Error>;
}

impl TrainFrom for LocalModel {
    type Error = TrainError;

    fn train_from(
        &self,
        start: &ModelVector,
        pull: Option<(&[f32], f32)>,
        trainable: Option<&[bool]>,
        config: &TrainConfig,
        seed: u64,
    ) -> Result<LocalUpdate, TrainError> {
        LocalModel::train_from(self, start, pull, trainable, config, seed)
    }
}

/// The model a run's proximal term pulls towards when it is not `start` (Ditto's
/// personal model pulled to the global one); FedProx's pull towards the model a run
/// starts from is any trainer's own, and gives `None`.
pub fn foreign_anchor<'a>(
    start: &ModelVector,
    pull: Option<(&'a [f32], f32)>,
) -> Option<&'a [f32]> {
    pull.map(|(anchor, _)| anchor)
        .filter(|anchor| *anchor != start.values())
}

/// `config` with `pull`'s strength as its proximal `mu` (none without a pull): how a
/// trainer that reads its settings from a task is told of the pull.
pub fn pulled_config(config: &TrainConfig, pull: Option<(&[f32], f32)>) -> TrainConfig {
    TrainConfig {
        proximal_mu: pull.map(|(_, mu)| mu),
        ..config.clone()
    }
}

/// Runs one training task of `scheme` on `model` from the `global` model received,
/// with the client's `state` from earlier rounds (`None` the first time).
pub fn train<M: TrainFrom>(
    scheme: &Personalisation,
    model: &M,
    global: &ModelVector,
    state: Option<&[f32]>,
    config: &TrainConfig,
    seed: u64,
) -> Result<PersonalisedUpdate, M::Error> {
    let mask = mask_of(scheme, global)?;
    let fedavg = |config: &TrainConfig| {
        let pull = config.proximal_mu.map(|mu| (global.values(), mu));
        model.train_from(global, pull, None, config, seed)
    };
    match scheme {
        Personalisation::FedPer { .. } => {
            let start = with_personal(global, &mask, state);
            let trained = model.train_from(&start, None, None, config, seed)?;
            let kept = trained.params.values().to_vec();
            let upload = LocalUpdate {
                params: shared_only(&trained.params, global, &mask),
                ..trained
            };
            Ok(PersonalisedUpdate {
                upload,
                state: Some(kept),
            })
        }
        Personalisation::FedRep { .. } => {
            let start = with_personal(global, &mask, state);
            let head = model.train_from(&start, None, Some(&mask), config, seed)?;
            let body_mask: Vec<bool> = mask.iter().map(|p| !p).collect();
            let one_epoch = TrainConfig {
                local_epochs: 1,
                ..config.clone()
            };
            let body = model.train_from(
                &head.params,
                None,
                Some(&body_mask),
                &one_epoch,
                seed ^ 0xb0d1,
            )?;
            let kept = body.params.values().to_vec();
            let upload = LocalUpdate {
                params: shared_only(&body.params, global, &mask),
                steps: head.steps + body.steps,
                ..body
            };
            Ok(PersonalisedUpdate {
                upload,
                state: Some(kept),
            })
        }
        Personalisation::Ditto { lambda } => {
            let upload = fedavg(config)?;
            let start = own_model(global, state);
            let personal = model.train_from(
                &start,
                Some((global.values(), *lambda)),
                None,
                config,
                seed ^ 0xd1770,
            )?;
            Ok(PersonalisedUpdate {
                upload,
                state: Some(personal.params.values().to_vec()),
            })
        }
        Personalisation::FineTune { .. } => Ok(PersonalisedUpdate {
            upload: fedavg(config)?,
            state: None,
        }),
    }
}

/// The client's personalised model now: the `global` model with its personal layers
/// (FedPer, FedRep), its personal model (Ditto; the global model before its first
/// round), or the global model fine-tuned on its data (fine-tuning).
pub fn personal_model<M: TrainFrom>(
    scheme: &Personalisation,
    model: &M,
    global: &ModelVector,
    state: Option<&[f32]>,
    config: &TrainConfig,
    seed: u64,
) -> Result<ModelVector, M::Error> {
    let mask = mask_of(scheme, global)?;
    match scheme {
        Personalisation::FedPer { .. } | Personalisation::FedRep { .. } => {
            Ok(with_personal(global, &mask, state))
        }
        Personalisation::Ditto { .. } => Ok(own_model(global, state)),
        Personalisation::FineTune { epochs } => {
            let tune = TrainConfig {
                local_epochs: *epochs,
                proximal_mu: None,
                ..config.clone()
            };
            Ok(model.train_from(global, None, None, &tune, seed)?.params)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelKind, ModelSpec};
    use ndarray::Array2;

    fn mlp() -> ModelSpec {
        ModelSpec::new(&ModelKind::Mlp { hidden: vec![8] }, 4, 3).unwrap()
    }

    #[test]
    fn names_round_trip_and_bad_ones_name_the_setting() {
        for s in [
            "fedper:layers.1",
            "fedrep:layers.0,layers.1",
            "ditto:0.5",
            "finetune:3",
        ] {
            assert_eq!(s.parse::<Personalisation>().unwrap().to_string(), s);
        }
        for (bad, says) in [
            ("fedper:", "at least one layer"),
            ("ditto:0", "LAMBDA must be a number above 0"),
            ("finetune:0", "EPOCHS must be a whole number"),
            ("local", "unknown personalisation `local`"),
        ] {
            let e = bad.parse::<Personalisation>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn layers_cover_their_tensors_and_unknown_names_are_refused() {
        let spec = mlp();
        let layout = spec.layout();
        let head: Personalisation = "fedper:layers.1".parse().unwrap();
        let mask = head.personal_mask(layout).unwrap();
        // layers.1 is the 8 -> 3 output layer: 24 weights and 3 biases, at the end.
        assert_eq!(mask.iter().filter(|p| **p).count(), 27);
        assert!(mask[mask.len() - 27..].iter().all(|p| *p));
        let bias: Personalisation = "fedrep:layers.1.bias".parse().unwrap();
        assert_eq!(
            bias.personal_mask(layout)
                .unwrap()
                .iter()
                .filter(|p| **p)
                .count(),
            3
        );
        let e = "fedper:fc2"
            .parse::<Personalisation>()
            .unwrap()
            .personal_mask(layout)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("no layer or tensor `fc2` (it has layers.0, layers.1"),
            "{e}"
        );
        // Naming every layer leaves nothing to learn together.
        let all = "fedper:layers.0,layers.1"
            .parse::<Personalisation>()
            .unwrap();
        assert!(matches!(
            all.personal_mask(layout),
            Err(PersonalisationError::NothingShared(_))
        ));
    }

    /// The personal layers never reach an upload: each upload holds the global's values
    /// there, whatever the client trained, in every round.
    #[test]
    fn personal_layers_never_leave_the_client() {
        let spec = mlp();
        let x = Array2::from_shape_fn((40, 4), |(i, j)| ((i * 7 + j * 3) % 11) as f32 / 5.0);
        let y: Vec<u32> = (0..40).map(|i| (i % 3) as u32).collect();
        let model = LocalModel::from_parts(spec.clone(), x, y).unwrap();
        for scheme in ["fedper:layers.1", "fedrep:layers.1"] {
            let scheme: Personalisation = scheme.parse().unwrap();
            let mask = scheme.personal_mask(spec.layout()).unwrap();
            let mut global = spec.init(1);
            let mut state: Option<Vec<f32>> = None;
            for round in 0..3u64 {
                let out = train(
                    &scheme,
                    &model,
                    &global,
                    state.as_deref(),
                    &TrainConfig::default(),
                    round,
                )
                .unwrap();
                let kept = out.state.unwrap();
                for (i, personal) in mask.iter().enumerate() {
                    if *personal {
                        assert_eq!(
                            out.upload.params.values()[i],
                            global.values()[i],
                            "{scheme}"
                        );
                    }
                }
                // The client did train its personal layers.
                assert!((0..mask.len()).any(|i| mask[i] && kept[i] != global.values()[i]));
                state = Some(kept);
                global = out.upload.params.clone();
            }
        }
    }

    #[test]
    fn fedrep_trains_the_head_then_the_body() {
        let spec = mlp();
        let x = Array2::from_shape_fn((30, 4), |(i, j)| ((i + j) % 5) as f32);
        let y: Vec<u32> = (0..30).map(|i| (i % 3) as u32).collect();
        let model = LocalModel::from_parts(spec.clone(), x, y).unwrap();
        let scheme: Personalisation = "fedrep:layers.1".parse().unwrap();
        let global = spec.init(2);
        let config = TrainConfig::default();
        let out = train(&scheme, &model, &global, None, &config, 0).unwrap();
        // Local epochs of head steps and one epoch of body steps.
        let per_epoch = 30usize.div_ceil(config.batch_size);
        assert_eq!(
            out.upload.steps,
            (config.local_epochs as usize + 1) * per_epoch
        );
    }
}
