//! `hicache-io matrix` and `check`, as data.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use hicache_io::Profile;

use crate::*;

// ---- tools -------------------------------------------------------------------------------

/// `hicache-io matrix --json`, as a JSON string.
#[pyfunction]
#[pyo3(signature = (profile = "extended", pools = None, dsa_page_size = 64))]
pub(crate) fn matrix_json(profile: &str, pools: Option<Vec<String>>, dsa_page_size: u64) -> PyResult<String> {
    hicache_io::tools::matrix::check_dsa_page_size(dsa_page_size).py()?;
    let pools = match pools {
        Some(p) => p.iter().map(|s| parse(s)).collect::<PyResult<Vec<_>>>()?,
        None => hicache_io::PoolKind::ALL.to_vec(),
    };
    let m = hicache_io::tools::matrix::matrix(parse(profile)?, &pools, dsa_page_size);
    serde_json::to_string(&m).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// `hicache-io check --json` for one executor, as a JSON string.
#[pyfunction]
#[pyo3(signature = (device, profile = "extended", rounds = 4, seed = 1, io_backend = None))]
pub(crate) fn check_json(
    py: Python<'_>,
    device: &PyDevice,
    profile: &str,
    rounds: u64,
    seed: u64,
    io_backend: Option<&str>,
) -> PyResult<String> {
    let (profile, io) = (parse::<Profile>(profile)?, io_backend.map(io).transpose()?);
    let dev = device.inner.clone();
    let rows = py.detach(|| hicache_io::tools::check::check_device_io(&dev, profile, seed, rounds, io, |_, _| {})).py()?;
    let v: Vec<_> = rows.iter().map(|(c, t)| serde_json::json!({"cell": c, "tally": t})).collect();
    serde_json::to_string(&v).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}
