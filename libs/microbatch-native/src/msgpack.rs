//! The rows of an Arrow table as MessagePack maps, the bytes Python's
//! `msgpack.Packer(use_bin_type=True)` gives for `table.to_pylist()`'s dicts: a window's
//! output rows become the payloads of the next exchange without a Python object per row.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::arrow::{as_bytes, Binary};

const INT64: u8 = 0;
const UINT64: u8 = 1;
const FLOAT64: u8 = 2;
const BOOL: u8 = 3;
const STRING: u8 = 4;
const BINARY: u8 = 5;
const NULL: u8 = 6;

/// One column's buffers as Arrow lays them out, from its array's `offset`.
struct Column<'a> {
    kind: u8,
    offset: usize,
    validity: Option<&'a [u8]>,
    values: &'a [u8],
    offsets: &'a [i32],
}

fn bit(bits: &[u8], i: usize) -> bool {
    bits[i / 8] & (1 << (i % 8)) != 0
}

impl Column<'_> {
    /// Appends row `row`'s value; false when a buffer is too short for it (not Arrow).
    fn pack(&self, row: usize, out: &mut Vec<u8>) -> Option<()> {
        let i = self.offset + row;
        if let Some(bits) = self.validity {
            if !bit(bits.get(..i / 8 + 1)?, i) {
                out.push(0xc0);
                return Some(());
            }
        }
        match self.kind {
            INT64 => pack_int(i64::from_ne_bytes(fixed(self.values, i)?), out),
            UINT64 => pack_uint(u64::from_ne_bytes(fixed(self.values, i)?), out),
            FLOAT64 => {
                out.push(0xcb);
                out.extend_from_slice(&f64::from_ne_bytes(fixed(self.values, i)?).to_be_bytes());
            }
            BOOL => out.push(if bit(self.values.get(..i / 8 + 1)?, i) {
                0xc3
            } else {
                0xc2
            }),
            STRING | BINARY => {
                let (a, b) = (*self.offsets.get(i)?, *self.offsets.get(i + 1)?);
                let bytes = self.values.get(a as usize..b as usize)?;
                if self.kind == STRING {
                    pack_str(bytes, out);
                } else {
                    pack_bin(bytes, out);
                }
            }
            _ => out.push(0xc0),
        }
        Some(())
    }
}

fn fixed(values: &[u8], i: usize) -> Option<[u8; 8]> {
    values.get(8 * i..8 * i + 8)?.try_into().ok()
}

/// msgpack-python's choice for an int: the shortest form, unsigned ones for positives.
fn pack_int(v: i64, out: &mut Vec<u8>) {
    if v >= 0 {
        return pack_uint(v as u64, out);
    }
    if v >= -32 {
        out.push(v as i8 as u8);
    } else if v >= -128 {
        out.extend_from_slice(&[0xd0, v as i8 as u8]);
    } else if v >= -32768 {
        out.push(0xd1);
        out.extend_from_slice(&(v as i16).to_be_bytes());
    } else if v >= -(1 << 31) {
        out.push(0xd2);
        out.extend_from_slice(&(v as i32).to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn pack_uint(v: u64, out: &mut Vec<u8>) {
    if v < 128 {
        out.push(v as u8);
    } else if v < 1 << 8 {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v < 1 << 16 {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v < 1 << 32 {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn pack_str(bytes: &[u8], out: &mut Vec<u8>) {
    if bytes.len() < 32 {
        out.push(0xa0 | bytes.len() as u8);
    } else {
        pack_length(bytes.len(), Some(0xd9), 0xda, 0xdb, out);
    }
    out.extend_from_slice(bytes);
}

fn pack_bin(bytes: &[u8], out: &mut Vec<u8>) {
    pack_length(bytes.len(), Some(0xc4), 0xc5, 0xc6, out);
    out.extend_from_slice(bytes);
}

fn pack_map_header(n: usize, out: &mut Vec<u8>) {
    if n < 16 {
        out.push(0x80 | n as u8);
    } else {
        pack_length(n, None, 0xde, 0xdf, out);
    }
}

/// A length in the shortest of a type's 8-bit (if it has one), 16- and 32-bit forms.
fn pack_length(n: usize, marker8: Option<u8>, marker16: u8, marker32: u8, out: &mut Vec<u8>) {
    match marker8 {
        Some(marker) if n < 1 << 8 => out.extend_from_slice(&[marker, n as u8]),
        _ if n < 1 << 16 => {
            out.push(marker16);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(marker32);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

/// A read-only view of a buffer's bytes, alive while the buffer is held.
fn view<T: pyo3::buffer::Element>(buffer: &PyBuffer<T>) -> &[T] {
    // SAFETY: the buffer is C-contiguous (PyBuffer::get checks the element format and we
    // take whole arrays from pyarrow), read-only here, and outlives the returned slice.
    unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const T, buffer.item_count()) }
}

/// `rows` rows of the columns (`names`; per column its `kinds` code, the array's
/// `offsets` into its buffers, and `buffers`: (validity or None, values, value offsets or
/// None)) as `prefix` + one MessagePack map per row. Returns (offsets, data) of an Arrow
/// binary array; a ValueError when a column's buffers are shorter than its rows.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn encode_rows<'py>(
    py: Python<'py>,
    rows: usize,
    names: Vec<String>,
    kinds: Vec<u8>,
    offsets: Vec<usize>,
    buffers: Vec<(
        Option<PyBuffer<u8>>,
        Option<PyBuffer<u8>>,
        Option<PyBuffer<i32>>,
    )>,
    prefix: &[u8],
) -> PyResult<Bound<'py, PyTuple>> {
    let columns: Vec<Column> = buffers
        .iter()
        .zip(&kinds)
        .zip(&offsets)
        .map(
            |(((validity, values, value_offsets), &kind), &offset)| Column {
                kind,
                offset,
                validity: validity.as_ref().map(view),
                values: values.as_ref().map(view).unwrap_or(&[]),
                offsets: value_offsets.as_ref().map(view).unwrap_or(&[]),
            },
        )
        .collect();
    if columns.len() != names.len() || columns.iter().any(|c| c.kind > NULL) {
        return Err(PyValueError::new_err(
            "one kind and three buffers per named column",
        ));
    }
    let mut header = Vec::new();
    pack_map_header(names.len(), &mut header);
    let keys: Vec<Vec<u8>> = names
        .iter()
        .map(|name| {
            let mut key = Vec::new();
            pack_str(name.as_bytes(), &mut key);
            key
        })
        .collect();
    let mut out = Binary::with_capacity(rows);
    for row in 0..rows {
        out.data.extend_from_slice(prefix);
        out.data.extend_from_slice(&header);
        for (j, (key, column)) in keys.iter().zip(&columns).enumerate() {
            out.data.extend_from_slice(key);
            if column.pack(row, &mut out.data).is_none() {
                return Err(PyValueError::new_err(format!(
                    "column {:?}: its buffers end before row {row}",
                    names[j]
                )));
            }
        }
        if out.data.len() > i32::MAX as usize {
            return Err(PyValueError::new_err(
                "the payloads pass 2 GiB: encode fewer rows",
            ));
        }
        out.offsets.push(out.data.len() as i32);
    }
    (
        PyBytes::new(py, as_bytes(&out.offsets)),
        PyBytes::new(py, &out.data),
    )
        .into_pyobject(py)
}
