//! Errors: the exception classes sglang raises for the same condition, with its message text.

use pyo3::exceptions::{PyIndexError, PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use hicache_io::TransferError;

// ---- errors ------------------------------------------------------------------------------

pyo3::create_exception!(
    _native,
    DeviceLostError,
    PyRuntimeError,
    "The executor's device is lost: this call and every later one on it (and on its pools) raise \
     this; open a new `Device` (wgpu: the same adapter works again)."
);

pyo3::create_exception!(
    _native,
    IntegrityError,
    PyRuntimeError,
    "A load read host items whose bytes do not match the checksums their backups recorded; the \
     call's other items landed. `items`: `(layer, component, host_index, device_index, expected, \
     found)` per failed item."
);

/// sglang's pools raise `ValueError`; sgl-kernel's `TORCH_CHECK`s raise `RuntimeError`.
pub(crate) fn py_err(e: TransferError) -> PyErr {
    use TransferError as E;
    let msg = e.to_string();
    if let E::Integrity { items, .. } = &e {
        let items: Vec<(u64, u8, u64, u64, u64, u64)> =
            items.iter().map(|m| (m.layer, m.component, m.host_index, m.device_index, m.expected, m.found)).collect();
        let err = IntegrityError::new_err(msg);
        Python::attach(|py| {
            let _ = err.value(py).setattr("items", items);
        });
        return err;
    }
    if let E::DeviceLost { .. } = &e {
        return DeviceLostError::new_err(msg);
    }
    match e {
        E::LengthMismatch { .. }
        | E::ItemNotWordAligned { .. }
        | E::PageSizeNotPositive
        | E::DirectCountNotPageMultiple { .. }
        | E::NumLayersMismatch { .. }
        | E::LayerListMismatch { .. }
        | E::Unavailable { .. }
        | E::Executor { .. }
        | E::Partial { .. }
        | E::BadArgument { .. } => PyRuntimeError::new_err(msg),
        E::IndexOutOfRange { .. } | E::LayerOutOfRange { .. } | E::LayerNotLoaded { .. } | E::NoSuchBuffer { .. } => {
            PyIndexError::new_err(msg)
        }
        E::DeviceIndexCheck { source, .. } if matches!(*source, E::IndexOutOfRange { .. }) => PyIndexError::new_err(msg),
        E::DeviceIndexCheck { source, .. } if matches!(*source, E::LayerTableChanged { .. }) => PyRuntimeError::new_err(msg),
        E::OutOfMemory { .. } => PyMemoryError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}

pub(crate) trait IntoPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for hicache_io::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(py_err)
    }
}
