//! The Cohort coordinator: the round engine that schedules federated rounds and combines
//! client updates, and simulation mode, which drives that same engine with many virtual
//! clients in one process.
//!
//! - [`engine`]: rounds as a state machine (select, collect, aggregate, publish), free of
//!   transport and storage so the simulator and the server share it.
//! - [`simulate`]: `cohort simulate`, from settings to `metrics.csv`, `summary.json` and
//!   plots.
//! - [`seeds`]: reproducible, independent random streams derived from one seed.
//! - [`demo`]: `cohort demo`, the whole system on one machine.
//! - [`blobs`]: durable files for uploads and models.
//! - [`store`]: the system of record (SQLite embedded, PostgreSQL in production).
//! - [`server`]: `cohort serve`, the HTTP API over TLS.
//! - [`dashboard`]: the admin web dashboard `cohort serve` shows at `/`.
//! - [`bench`]: `cohort bench`, measurements a user can rerun.
//! - [`privacy_cli`]: `cohort privacy`, the privacy accountant on the command line.
//! - [`fault`]: named crash points for the fault-injection tests.

pub mod bench;
pub mod blobs;
pub mod compress_cli;
pub mod demo;
pub mod engine;
pub mod fault;
pub mod flat_settings;
pub mod huge_pages;
pub mod privacy_cli;
pub mod seeds;
pub mod server;
pub mod simulate;
pub mod store;
pub mod tracking;
