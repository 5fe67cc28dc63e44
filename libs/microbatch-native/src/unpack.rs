//! Payloads back into declared columns: `prefix` + one MessagePack map per row (what
//! `encode_rows` and Python's state codec write for a flat record) read straight into
//! Arrow buffers, so a join can take its records as columns without a dict per row.
//!
//! All or nothing: a payload is taken only when it is exactly a map of the declared
//! fields — each present once, of the declared type (or nil where nullable), nothing
//! else. One payload that is not (another prefix, a missing or extra field, an int where
//! a double is declared, a binary, an int past 64 bits) and the whole call returns None:
//! the caller decodes the records in Python as before, so this path never disagrees.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::json::{Column, Slot, BOOLEAN, DOUBLE, INT, LONG, STRING};

/// A cursor over one payload's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let out = self.bytes.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(out)
    }

    fn byte(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn be<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    /// A string's bytes after its marker `m` (fixstr, str8/16/32); None for another type.
    fn str_after(&mut self, m: u8) -> Option<&'a [u8]> {
        let n = match m {
            0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 => self.byte()? as usize,
            0xda => u16::from_be_bytes(self.be()?) as usize,
            0xdb => u32::from_be_bytes(self.be()?) as usize,
            _ => return None,
        };
        self.take(n)
    }

    /// An integer after its marker `m`; None for another type or one past i64.
    fn int_after(&mut self, m: u8) -> Option<i64> {
        Some(match m {
            0x00..=0x7f => m as i64,
            0xe0..=0xff => m as i8 as i64,
            0xcc => self.byte()? as i64,
            0xcd => u16::from_be_bytes(self.be()?) as i64,
            0xce => u32::from_be_bytes(self.be()?) as i64,
            0xcf => i64::try_from(u64::from_be_bytes(self.be()?)).ok()?,
            0xd0 => self.byte()? as i8 as i64,
            0xd1 => i16::from_be_bytes(self.be()?) as i64,
            0xd2 => i32::from_be_bytes(self.be()?) as i64,
            0xd3 => i64::from_be_bytes(self.be()?),
            _ => return None,
        })
    }

    /// One declared value of `kind` into `slot` (string bytes into `scratch`).
    fn value(&mut self, kind: u8, scratch: &mut Vec<u8>) -> Option<Slot> {
        let m = self.byte()?;
        if m == 0xc0 {
            return Some(Slot::Null);
        }
        Some(match kind {
            STRING => {
                let bytes = self.str_after(m)?;
                std::str::from_utf8(bytes).ok()?;
                let start = scratch.len();
                scratch.extend_from_slice(bytes);
                Slot::Str(start, scratch.len())
            }
            LONG => Slot::Long(self.int_after(m)?),
            INT => Slot::Long(i32::try_from(self.int_after(m)?).ok()? as i64),
            DOUBLE => match m {
                0xcb => Slot::Double(f64::from_be_bytes(self.be()?)),
                0xca => Slot::Double(f32::from_be_bytes(self.be()?) as f64),
                _ => return None,
            },
            BOOLEAN => match m {
                0xc2 => Slot::Bool(false),
                0xc3 => Slot::Bool(true),
                _ => return None,
            },
            _ => return None,
        })
    }
}

/// One payload's fields into `slots` (one per declared name); None unless it is exactly
/// `prefix` + a map of every declared field, each once, of its kind or nil if nullable.
fn read_row(
    payload: &[u8],
    prefix: &[u8],
    names: &[Vec<u8>],
    columns: &[(u8, bool)],
    slots: &mut [Slot],
    scratch: &mut Vec<u8>,
) -> Option<()> {
    let mut r = Reader {
        bytes: payload.strip_prefix(prefix)?,
        at: 0,
    };
    let m = r.byte()?;
    let n = match m {
        0x80..=0x8f => (m & 0x0f) as usize,
        0xde => u16::from_be_bytes(r.be()?) as usize,
        0xdf => u32::from_be_bytes(r.be()?) as usize,
        _ => return None,
    };
    if n != names.len() {
        return None;
    }
    slots.fill(Slot::Absent);
    for _ in 0..n {
        let m = r.byte()?;
        let name = r.str_after(m)?;
        let j = names.iter().position(|x| x.as_slice() == name)?;
        if !matches!(slots[j], Slot::Absent) {
            return None; // the same field twice
        }
        let (kind, nullable) = columns[j];
        let slot = r.value(kind, scratch)?;
        if matches!(slot, Slot::Null) && !nullable {
            return None;
        }
        slots[j] = slot;
    }
    (r.at == r.bytes.len()).then_some(())
}

/// `payloads` (Arrow binary: `offsets`, int32 with the array's own offset applied, and
/// `data`) as the declared columns (`names`, `kinds` numbered as `decode_json` numbers
/// them, `nullable`): per field (validity or None, null count, values, offsets or None).
/// None when any payload is not exactly such a map behind `prefix` (see the module doc).
#[pyfunction]
pub fn decode_rows<'py>(
    py: Python<'py>,
    offsets: PyBuffer<i32>,
    data: PyBuffer<u8>,
    prefix: &[u8],
    names: Vec<String>,
    kinds: Vec<u8>,
    nullable: Vec<bool>,
) -> PyResult<Option<Bound<'py, PyList>>> {
    if names.len() != kinds.len() || names.len() != nullable.len() {
        return Err(PyValueError::new_err(
            "decode_rows: names, kinds and nullable must have one entry per field",
        ));
    }
    if kinds.iter().any(|&k| k > BOOLEAN) {
        return Err(PyValueError::new_err(
            "decode_rows: a kind is not one of 0-4",
        ));
    }
    let offsets = offsets.to_vec(py)?;
    // SAFETY: a read-only view of the buffer, alive while `data` is held.
    let data: &[u8] =
        unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, data.item_count()) };
    let keys: Vec<Vec<u8>> = names.iter().map(|n| n.as_bytes().to_vec()).collect();
    let declared: Vec<(u8, bool)> = kinds
        .iter()
        .copied()
        .zip(nullable.iter().copied())
        .collect();
    let mut columns: Vec<Column> = declared.iter().map(|&(k, n)| Column::new(k, n)).collect();
    let mut slots = vec![Slot::Absent; names.len()];
    let mut scratch: Vec<u8> = Vec::new();
    let mut string_bytes = 0usize;
    for w in offsets.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        let Some(payload) = data.get(a..b) else {
            return Ok(None);
        };
        scratch.clear();
        if read_row(payload, prefix, &keys, &declared, &mut slots, &mut scratch).is_none() {
            return Ok(None);
        }
        // A string column past 2 GiB would overflow its 32-bit offsets.
        string_bytes += scratch.len();
        if string_bytes > i32::MAX as usize {
            return Ok(None);
        }
        for (column, &slot) in columns.iter_mut().zip(&slots) {
            column.push(slot, &scratch);
        }
    }
    let out = PyList::empty(py);
    for column in columns {
        out.append(column.into_py(py)?)?;
    }
    Ok(Some(out))
}
