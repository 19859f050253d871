//! Where a run's metrics go besides Cohort's own files: experiment trackers that
//! organisations already run.
//!
//! - [`tensorboard`]: TensorBoard event files (`cohort simulate --tensorboard DIR`).

pub mod tensorboard;
