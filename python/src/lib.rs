//! `hicache_io._native`: the Python bindings. Arrays arrive through DLPack (`__dlpack__`), torch's
//! own attributes for plain host tensors (a third of DLPack's cost), or numpy's
//! `__array_interface__` for read-only sources; errors become the exception classes
//! sglang raises for the same condition, with its message text; transfers release the GIL.

#![allow(clippy::too_many_arguments)] // sglang's signatures
//!
//! Rooms: `errors` (exception classes), `dlpack` (arrays in), `args` (index lists and layer
//! arguments), `executors` (which executor runs a call), `ops` (every op of the catalogue through
//! one binding), `pools` (the pool classes), `tools` (matrix, check), `local_io` (the local L3
//! store's file I/O), `blocks` (a host tier for an engine's block tensors).

mod args;
mod blocks;
mod dlpack;
mod errors;
mod executors;
mod local_free;
mod local_io;
mod local_pack;
mod local_read;
mod ops;
mod pools;
mod tools;
mod trailers;

use pyo3::prelude::*;

pub(crate) use args::*;
pub(crate) use dlpack::*;
pub(crate) use errors::*;
pub(crate) use executors::*;
pub(crate) use pools::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDevice>()?;
    m.add_class::<PyDevicePool>()?;
    m.add_class::<PyHostPool>()?;
    m.add_class::<blocks::PyBlockTier>()?;
    m.add_function(wrap_pyfunction!(tools::matrix_json, m)?)?;
    m.add_function(wrap_pyfunction!(tools::check_json, m)?)?;
    m.add_function(wrap_pyfunction!(executors::synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(executors::device_accessible_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(executors::host_words, m)?)?;
    m.add_function(wrap_pyfunction!(executors::forget_layer_tables, m)?)?;
    m.add_function(wrap_pyfunction!(ops::call_op, m)?)?;
    m.add_function(wrap_pyfunction!(ops::op_catalogue, m)?)?;
    m.add_function(wrap_pyfunction!(ops::copy_all_layer_kv_cache_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(ops::checksum, m)?)?;
    m.add_function(wrap_pyfunction!(ops::name_tags, m)?)?;
    m.add("TRAILER_MAGIC", local_io::TRAILER_MAGIC)?;
    m.add("TRAILER_BYTES", local_io::TRAILER_BYTES)?;
    m.add("OLD_TRAILER_MAGICS", trailers::OLD_TRAILER_MAGICS.to_vec())?;
    m.add("SEALED_VERDICTS", (trailers::NOT_READ, trailers::VERIFIED, trailers::UNVERIFIED, trailers::CORRUPT))?;
    m.add_function(wrap_pyfunction!(local_io::local_get, m)?)?;
    m.add_function(wrap_pyfunction!(local_io::local_paths, m)?)?;
    m.add_function(wrap_pyfunction!(local_io::local_put, m)?)?;
    m.add_function(wrap_pyfunction!(local_io::local_intact, m)?)?;
    m.add_function(wrap_pyfunction!(local_free::local_walk, m)?)?;
    m.add_function(wrap_pyfunction!(local_free::local_free_left, m)?)?;
    m.add_class::<local_pack::LocalPacks>()?;
    m.add_class::<local_read::ReadHistory>()?;
    m.add("PACK_OBJECT_MAX", local_pack::PACK_OBJECT_MAX)?;
    m.add("PACK_DESCRIPTORS", local_pack::OPEN_MAX)?;
    m.add("LOCAL_FOOTER_BYTES", local_io::FOOTER)?;
    m.add("LOCAL_DAMAGED", local_io::DAMAGED)?;
    m.add("LOCAL_RECYCLE_MIN", local_free::RECYCLE_MIN)?;
    m.add("STORAGE_SEED", hicache_io::integrity::STORAGE_SEED)?;
    m.add("IntegrityError", m.py().get_type::<IntegrityError>())?;
    m.add("DeviceLostError", m.py().get_type::<DeviceLostError>())?;
    Ok(())
}
