//! `cohort bench`: measurements a user can rerun on their own machine.
//!
//! - [`secagg`]: one secure aggregation round at a chosen size, with every party in this
//!   process: client masking, server unmasking, the whole round and the bytes each
//!   client sends.
//! - [`reduce`]: the reducer's hot loops against a memory read probe.
//! - [`read_probe`]: that probe: the best of several ways of reading memory.
//! - [`dashboard`]: the dashboard's pages at the server for a big deployment.

pub mod dashboard;
pub mod read_probe;
pub mod reduce;
pub mod secagg;
