//! `cohort._rust`: the compiled core under the `cohort` Python package.
//!
//! Everything here wraps the Rust crates: the round engine and its worker pool
//! (`simulate`), the partitioners and shipped data (`partition`, `load_dataset`), the
//! model file format (`save_model`, `load_model`) and the edge agent (`run_edge`). The
//! public, documented API is the pure-Python package around it; this module is private
//! and may change with any release.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use numpy::{IntoPyArray, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use cohort_aggregation::ModelVector;
use cohort_coordinator::simulate::python::{PythonCode, PythonPopulation, PythonSettings};
use cohort_coordinator::simulate::{
    RoundRecord, SimulationConfig, SimulationError, simulate_population,
};

mod edge;

/// Raises `cohort.<name>` (defined in Python, so users catch one class whatever raised
/// it) with `message`.
pub(crate) fn cohort_error(py: Python<'_>, name: &str, message: String) -> PyErr {
    let class = py.import("cohort._types").and_then(|m| m.getattr(name));
    match class.and_then(|c| c.call1((message.clone(),))) {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

fn simulation_error(py: Python<'_>, e: SimulationError) -> PyErr {
    match e {
        SimulationError::Interrupted => PyKeyboardInterrupt::new_err("simulation interrupted"),
        SimulationError::Config(_) | SimulationError::Partition(_) => {
            cohort_error(py, "ConfigError", e.to_string())
        }
        other => cohort_error(py, "TrainError", other.to_string()),
    }
}

/// The global model as a dict of NumPy arrays, in the model's order.
pub(crate) fn model_to_dict<'py>(
    py: Python<'py>,
    model: &ModelVector,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    let mut offset = 0;
    for t in model.layout().tensors() {
        let n = t.numel();
        let flat = model.values()[offset..offset + n].to_vec().into_pyarray(py);
        dict.set_item(&t.name, flat.reshape(t.shape.clone())?)?;
        offset += n;
    }
    Ok(dict)
}

fn record_to_dict<'py>(py: Python<'py>, r: &RoundRecord) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("round", r.round)?;
    d.set_item("test_accuracy", r.test_accuracy)?;
    d.set_item("test_loss", r.test_loss)?;
    d.set_item("participants", r.participants)?;
    d.set_item("dropped", r.dropped)?;
    d.set_item("selected", r.selected)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("train_loss", r.train_loss)?;
    d.set_item("samples", r.samples)?;
    d.set_item("status", r.status.as_str())?;
    d.set_item("sim_seconds", r.sim_seconds)?;
    d.set_item("epsilon", r.epsilon)?;
    d.set_item("epsilon_coordinator", r.epsilon_coordinator)?;
    d.set_item("bytes_up", r.bytes_up)?;
    d.set_item("bytes_down", r.bytes_down)?;
    d.set_item("client_accuracy_mean", r.client_accuracy_mean)?;
    d.set_item("client_accuracy_p10", r.client_accuracy_p10)?;
    d.set_item("personal_accuracy_mean", r.personal_accuracy_mean)?;
    d.set_item("personal_accuracy_p10", r.personal_accuracy_p10)?;
    Ok(d)
}

/// Prints a round as `cohort simulate` does.
fn report_round(r: &RoundRecord, rounds: u32) {
    let mut line = format!(
        "round {}/{rounds} accuracy {:.4} loss {:.4} participants {} dropped {}",
        r.round, r.test_accuracy, r.test_loss, r.participants, r.dropped
    );
    if let Some(e) = r.epsilon {
        line.push_str(&format!(" epsilon {e:.3}"));
    }
    if !r.status.published() {
        line.push_str(&format!(" ({})", r.status.as_str()));
    }
    eprintln!("{line} {:.3}s", r.seconds);
}

/// Runs a simulation whose clients are Python workers. `config_json` holds
/// `SimulationConfig`'s keys; the result is a dict with `summary` (JSON text), `out`,
/// `rounds`, `failures` and `weights`.
#[pyfunction]
#[pyo3(signature = (config_json, python, payload, workers, devices, task_timeout, clients, hyperparameters_json, progress))]
#[allow(clippy::too_many_arguments)]
fn simulate<'py>(
    py: Python<'py>,
    config_json: &str,
    python: &str,
    payload: &str,
    workers: usize,
    devices: Vec<String>,
    task_timeout: Option<f64>,
    clients: usize,
    hyperparameters_json: &str,
    progress: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg: SimulationConfig = serde_json::from_str(config_json)
        .map_err(|e| cohort_error(py, "ConfigError", config_message(&e.to_string())))?;
    let hyperparameters: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(hyperparameters_json)
            .map_err(|e| PyValueError::new_err(format!("hyperparameters: {e}")))?;
    let task_timeout = match task_timeout {
        Some(t) if !(t.is_finite() && t > 0.0) => {
            return Err(cohort_error(
                py,
                "ConfigError",
                format!("task_timeout must be a positive number of seconds, got {t}"),
            ));
        }
        Some(t) => Some(Duration::from_secs_f64(t)),
        None => None,
    };
    let settings = PythonSettings {
        python: python.into(),
        code: PythonCode::Payload(payload.into()),
        workers,
        devices,
        task_timeout,
        clients,
        hyperparameters,
        env: Vec::new(),
        // `COHORT_WORKER_TRANSPORT=pipes` sends tensors over the workers' pipes (the
        // fallback where shared memory is unavailable), for tests and troubleshooting.
        shared_memory: std::env::var("COHORT_WORKER_TRANSPORT").as_deref() != Ok("pipes"),
        clients_split: cohort_coordinator::simulate::python::ClientSplit::of(&cfg),
    };
    settings
        .validate()
        .map_err(|e| cohort_error(py, "ConfigError", e.to_string()))?;
    cfg.validate()
        .map_err(|e| cohort_error(py, "ConfigError", e.to_string()))?;
    let cancel = Arc::new(AtomicBool::new(false));
    let rounds = cfg.rounds;
    let (tx, rx) = std::sync::mpsc::channel();
    // Receivers are not `Sync`; a mutex lets the GIL-free closure borrow it.
    let rx = std::sync::Mutex::new(rx);
    let run = {
        let cancel = cancel.clone();
        std::thread::Builder::new()
            .name("cohort-simulate".into())
            .spawn(move || {
                let outcome = PythonPopulation::start(settings, cancel).and_then(|pop| {
                    simulate_population(&cfg, &pop, |r| {
                        if progress {
                            report_round(r, rounds);
                        }
                    })
                });
                let _ = tx.send(outcome);
            })
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the run: {e}")))?
    };
    // The run goes on in its own thread, the GIL released; this thread wakes up to
    // notice Ctrl-C, which stops the workers and leaves no output behind.
    let outcome = loop {
        match py.detach(|| {
            rx.lock()
                .unwrap_or_else(|p| p.into_inner())
                .recv_timeout(Duration::from_millis(50))
        }) {
            Ok(outcome) => break outcome,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Err(interrupt) = py.check_signals() {
                    cancel.store(true, Ordering::Relaxed);
                    let _ = py.detach(|| run.join());
                    return Err(interrupt);
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(PyRuntimeError::new_err("the simulation thread panicked"));
            }
        }
    };
    let _ = py.detach(|| run.join());
    let (summary, out, result) = outcome.map_err(|e| simulation_error(py, e))?;
    let d = PyDict::new(py);
    d.set_item(
        "summary",
        serde_json::to_string(&summary).expect("summaries serialise"),
    )?;
    d.set_item("out", out.display().to_string())?;
    let rounds = PyList::empty(py);
    for r in &result.rounds {
        rounds.append(record_to_dict(py, r)?)?;
    }
    d.set_item("rounds", rounds)?;
    let failures = PyList::empty(py);
    for f in &result.failures {
        let fd = PyDict::new(py);
        fd.set_item("client", f.client)?;
        fd.set_item("round", f.round)?;
        fd.set_item("reason", &f.reason)?;
        failures.append(fd)?;
    }
    d.set_item("failures", failures)?;
    d.set_item("weights", model_to_dict(py, &result.final_model)?)?;
    Ok(d)
}

/// Checks a simulation configuration (`simulate`'s `config_json`) without running it.
#[pyfunction]
fn check_config(py: Python<'_>, config_json: &str) -> PyResult<()> {
    let cfg: SimulationConfig = serde_json::from_str(config_json)
        .map_err(|e| cohort_error(py, "ConfigError", config_message(&e.to_string())))?;
    cfg.validate()
        .map_err(|e| cohort_error(py, "ConfigError", e.to_string()))
}

/// serde's "unknown field `x`, expected one of ..." in the Python spelling.
fn config_message(serde: &str) -> String {
    serde.replace('-', "_")
}

/// Splits `labels` over `clients` with one of Cohort's partition schemes; returns one
/// index array per client.
#[pyfunction]
#[pyo3(signature = (labels, clients, scheme, seed))]
fn partition<'py>(
    py: Python<'py>,
    labels: PyReadonlyArray1<'py, i64>,
    clients: usize,
    scheme: &str,
    seed: u64,
) -> PyResult<Bound<'py, PyList>> {
    let labels = labels.as_slice()?;
    if let Some(bad) = labels
        .iter()
        .find(|&&l| !(0..=i64::from(u32::MAX)).contains(&l))
    {
        return Err(cohort_error(
            py,
            "ConfigError",
            format!("labels must be class indices >= 0, found {bad}"),
        ));
    }
    let labels: Vec<u32> = labels.iter().map(|&l| l as u32).collect();
    let classes = labels.iter().max().map_or(0, |&m| m as usize + 1);
    let scheme: cohort_edge::partition::PartitionScheme =
        scheme
            .parse()
            .map_err(|e: cohort_edge::partition::PartitionError| {
                cohort_error(py, "ConfigError", e.to_string())
            })?;
    let parts = cohort_edge::partition::partition(&labels, classes, None, clients, &scheme, seed)
        .map_err(|e| cohort_error(py, "ConfigError", e.to_string()))?;
    let out = PyList::empty(py);
    for p in parts {
        let idx: Vec<i64> = p.into_iter().map(|i| i as i64).collect();
        out.append(idx.into_pyarray(py))?;
    }
    Ok(out)
}

/// A shipped data set as `(features float32 [n, d], labels int64 [n], class names)`.
#[pyfunction]
fn load_dataset<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
    let ds = match name {
        "digits" => cohort_edge::data::digits(),
        "breast_cancer" | "breast-cancer" => cohort_edge::data::breast_cancer(),
        "mnist10k" => cohort_edge::data::mnist10k(),
        other => {
            return Err(cohort_error(
                py,
                "ConfigError",
                format!("unknown data set `{other}`: digits, breast_cancer or mnist10k"),
            ));
        }
    };
    let (n, d) = ds.features.dim();
    let features = ds
        .features
        .into_raw_vec_and_offset()
        .0
        .into_pyarray(py)
        .reshape([n, d])?;
    let labels: Vec<i64> = ds.labels.iter().map(|&l| i64::from(l)).collect();
    pyo3::types::PyTuple::new(
        py,
        [
            features.into_any(),
            labels.into_pyarray(py).into_any(),
            PyList::new(py, ds.classes)?.into_any(),
        ],
    )
}

/// Encodes named float32 arrays (name, shape, flat values) as a safetensors model file.
#[pyfunction]
fn save_model<'py>(
    py: Python<'py>,
    tensors: Vec<(String, Vec<usize>, PyReadonlyArray1<'py, f32>)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut specs = Vec::with_capacity(tensors.len());
    let mut values = Vec::new();
    for (name, shape, data) in &tensors {
        let slice = data.as_slice()?;
        if slice.len() != shape.iter().product::<usize>() {
            return Err(PyValueError::new_err(format!(
                "tensor `{name}`: {} values for shape {shape:?}",
                slice.len()
            )));
        }
        specs.push(cohort_aggregation::TensorSpec::new(
            name.clone(),
            shape.clone(),
        ));
        values.extend_from_slice(slice);
    }
    let layout =
        cohort_aggregation::Layout::new(specs).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let model = ModelVector::new(Arc::new(layout), values)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let bytes = cohort_aggregation::model_file::encode(&model, Default::default());
    Ok(PyBytes::new(py, &bytes))
}

/// Decodes a safetensors model file into a dict of float32 arrays.
#[pyfunction]
fn load_model<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let model = cohort_aggregation::model_file::decode(data, data.len())
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    model_to_dict(py, &model)
}

/// The compiled module.
#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Benchmarks record it: a development build's own crates run at opt-level 1.
    m.add(
        "BUILD_PROFILE",
        if cfg!(debug_assertions) {
            "dev"
        } else {
            "release"
        },
    )?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_function(wrap_pyfunction!(partition, m)?)?;
    m.add_function(wrap_pyfunction!(load_dataset, m)?)?;
    m.add_function(wrap_pyfunction!(save_model, m)?)?;
    m.add_function(wrap_pyfunction!(load_model, m)?)?;
    edge::register(m)?;
    Ok(())
}
