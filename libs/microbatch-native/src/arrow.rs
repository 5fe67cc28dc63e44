//! Arrow buffers under construction, handed to Python as bytes: the reader's key and
//! value columns and the JSON decoder's declared columns both build them.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

/// A plain slice of numbers as its native-endian bytes (Arrow's layout).
pub fn as_bytes<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: plain integers and floats, no padding, read-only.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values))
    }
}

/// Arrow's bitmap (bit i of byte i / 8): a validity bitmap, or a boolean column's values.
#[derive(Default)]
pub struct Bitmap {
    bytes: Vec<u8>,
    len: usize,
    unset: usize,
}

impl Bitmap {
    pub fn push(&mut self, bit: bool) {
        if self.len.is_multiple_of(8) {
            self.bytes.push(0);
        }
        if bit {
            self.bytes[self.len / 8] |= 1 << (self.len % 8);
        } else {
            self.unset += 1;
        }
        self.len += 1;
    }

    /// As a validity bitmap: (its bytes, or None when no row is null; the null count).
    pub fn validity<'py>(&self, py: Python<'py>) -> (Py<PyAny>, usize) {
        if self.unset == 0 {
            (py.None(), 0)
        } else {
            (
                PyBytes::new(py, &self.bytes).into_any().unbind(),
                self.unset,
            )
        }
    }

    pub fn bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.bytes)
    }
}

/// A binary (or string) column's 32-bit offsets and data.
pub struct Binary {
    pub offsets: Vec<i32>,
    pub data: Vec<u8>,
}

impl Binary {
    pub fn with_capacity(rows: usize) -> Self {
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        Binary {
            offsets,
            data: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Appends a value (None: an empty slot, for a null).
    pub fn push(&mut self, value: Option<&[u8]>) {
        if let Some(bytes) = value {
            self.data.extend_from_slice(bytes);
        }
        self.offsets.push(self.data.len() as i32);
    }
}

/// A nullable binary (or string) column.
pub struct BinaryColumn {
    validity: Bitmap,
    pub values: Binary,
}

impl BinaryColumn {
    pub fn with_capacity(rows: usize) -> Self {
        BinaryColumn {
            validity: Bitmap::default(),
            values: Binary::with_capacity(rows),
        }
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn push(&mut self, value: Option<&[u8]>) {
        self.validity.push(value.is_some());
        self.values.push(value);
    }

    /// (validity or None when nothing is null, null count, offsets, data) as Python bytes.
    pub fn into_py<'py>(self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let (validity, nulls) = self.validity.validity(py);
        (
            validity,
            nulls,
            PyBytes::new(py, as_bytes(&self.values.offsets)),
            PyBytes::new(py, &self.values.data),
        )
            .into_pyobject(py)
    }
}
