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
use pyo3::types::{PyBytes, PyList};

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

impl Reader<'_> {
    /// Past one whole MessagePack value (of any type, nested up to `depth`); None when
    /// the bytes end first or nest deeper.
    fn skip(&mut self, depth: u32) -> Option<()> {
        let m = self.byte()?;
        let (n, items) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * (m & 0x0f) as usize),
            0x90..=0x9f => (0, (m & 0x0f) as usize),
            0xa0..=0xbf => ((m & 0x1f) as usize, 0),
            0xc4 | 0xd9 => (self.byte()? as usize, 0),
            0xc5 | 0xda => (u16::from_be_bytes(self.be()?) as usize, 0),
            0xc6 | 0xdb => (u32::from_be_bytes(self.be()?) as usize, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xca | 0xce | 0xd2 => (4, 0),
            0xcb | 0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xc7 => (self.byte()? as usize + 1, 0),
            0xc8 => (u16::from_be_bytes(self.be()?) as usize + 1, 0),
            0xc9 => (u32::from_be_bytes(self.be()?) as usize + 1, 0),
            0xdc => (0, u16::from_be_bytes(self.be()?) as usize),
            0xdd => (0, u32::from_be_bytes(self.be()?) as usize),
            0xde => (0, 2 * u16::from_be_bytes(self.be()?) as usize),
            0xdf => (0, 2 * u32::from_be_bytes(self.be()?) as usize),
            0xc1 => return None, // never used
        };
        self.take(n)?;
        if items > 0 && depth == 0 {
            return None;
        }
        for _ in 0..items {
            self.skip(depth - 1)?;
        }
        Some(())
    }

    /// An array's length after its header; None for another type.
    fn array_len(&mut self) -> Option<usize> {
        let m = self.byte()?;
        Some(match m {
            0x90..=0x9f => (m & 0x0f) as usize,
            0xdc => u16::from_be_bytes(self.be()?) as usize,
            0xdd => u32::from_be_bytes(self.be()?) as usize,
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

/// How deep a held record may nest: a flat row is 1 (a map of scalars).
const MAX_DEPTH: u32 = 64;

/// Split lists: the records' int32 offsets and bytes, their flags, the lists' lengths.
type Split<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
);

/// Lists of records held in state — each payload `prefix` + a MessagePack array of
/// records, or with `flagged` of `[record, bool]` pairs — split into one payload per
/// record (`prefix` + its bytes): the new payloads' int32 offsets and data, each
/// record's flag (0/1; 0 without `flagged`), and each list's length (int64). None when a
/// payload is not such a list (the tagged form, another shape): the caller decodes them
/// in Python.
#[pyfunction]
pub fn split_lists<'py>(
    py: Python<'py>,
    offsets: PyBuffer<i32>,
    data: PyBuffer<u8>,
    prefix: &[u8],
    flagged: bool,
) -> PyResult<Option<Split<'py>>> {
    let offsets = offsets.to_vec(py)?;
    // SAFETY: a read-only view of the buffer, alive while `data` is held.
    let data: &[u8] =
        unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, data.item_count()) };
    let mut starts: Vec<i32> = vec![0];
    let mut out: Vec<u8> = Vec::new();
    let mut flags: Vec<u8> = Vec::new();
    let mut counts: Vec<i64> = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        let Some(payload) = data.get(a..b).and_then(|p| p.strip_prefix(prefix)) else {
            return Ok(None);
        };
        let mut r = Reader {
            bytes: payload,
            at: 0,
        };
        let Some(n) = r.array_len() else {
            return Ok(None);
        };
        for _ in 0..n {
            if flagged && r.array_len() != Some(2) {
                return Ok(None);
            }
            let start = r.at;
            if r.skip(MAX_DEPTH).is_none() {
                return Ok(None);
            }
            out.extend_from_slice(prefix);
            out.extend_from_slice(&payload[start..r.at]);
            let Ok(end) = i32::try_from(out.len()) else {
                return Ok(None); // past 2 GiB: the caller's path
            };
            starts.push(end);
            let flag = if flagged {
                match r.byte() {
                    Some(0xc3) => 1,
                    Some(0xc2) => 0,
                    _ => return Ok(None),
                }
            } else {
                0
            };
            flags.push(flag);
        }
        if r.at != payload.len() {
            return Ok(None);
        }
        counts.push(n as i64);
    }
    let bytes_of = |v: &[u8]| PyBytes::new(py, v);
    let starts: Vec<u8> = starts.iter().flat_map(|x| x.to_ne_bytes()).collect();
    let counts: Vec<u8> = counts.iter().flat_map(|x| x.to_ne_bytes()).collect();
    Ok(Some((
        bytes_of(&starts),
        bytes_of(&out),
        bytes_of(&flags),
        bytes_of(&counts),
    )))
}

/// The inverse of [`split_lists`]: records (`prefix` + one value each, Arrow binary
/// `offsets` and `data`) laid end to end in lists of `counts[i]`, each list `prefix` + a
/// MessagePack array of them — with `flags` (one byte per record, 0/1), of
/// `[record, bool]` pairs. Returns the lists' int32 offsets and data; None when a record
/// lacks the prefix or the lists pass 2 GiB.
#[pyfunction]
#[pyo3(signature = (offsets, data, prefix, counts, flags=None))]
pub fn join_lists<'py>(
    py: Python<'py>,
    offsets: PyBuffer<i32>,
    data: PyBuffer<u8>,
    prefix: &[u8],
    counts: PyBuffer<i64>,
    flags: Option<PyBuffer<u8>>,
) -> PyResult<Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
    let offsets = offsets.to_vec(py)?;
    let counts = counts.to_vec(py)?;
    let flags = match flags {
        Some(f) => Some(f.to_vec(py)?),
        None => None,
    };
    // SAFETY: a read-only view of the buffer, alive while `data` is held.
    let data: &[u8] =
        unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, data.item_count()) };
    let records = offsets.len().saturating_sub(1);
    let total: i64 = counts.iter().sum();
    if counts.iter().any(|&c| c < 0)
        || total as usize != records
        || flags.as_ref().is_some_and(|f| f.len() != records)
    {
        return Err(PyValueError::new_err(
            "join_lists: counts must add up to the records, and flags have one per record",
        ));
    }
    let mut out: Vec<u8> = Vec::with_capacity(data.len() + 8 * counts.len());
    let mut starts: Vec<i32> = Vec::with_capacity(counts.len() + 1);
    starts.push(0);
    let mut i = 0usize;
    for &n in &counts {
        let n = n as usize;
        out.extend_from_slice(prefix);
        match n {
            0..=15 => out.push(0x90 | n as u8),
            16..=0xffff => {
                out.push(0xdc);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                out.push(0xdd);
                out.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
        for _ in 0..n {
            let (a, b) = (offsets[i] as usize, offsets[i + 1] as usize);
            let Some(record) = data.get(a..b).and_then(|r| r.strip_prefix(prefix)) else {
                return Ok(None);
            };
            if let Some(f) = &flags {
                out.push(0x92);
                out.extend_from_slice(record);
                out.push(if f[i] != 0 { 0xc3 } else { 0xc2 });
            } else {
                out.extend_from_slice(record);
            }
            i += 1;
        }
        let Ok(end) = i32::try_from(out.len()) else {
            return Ok(None);
        };
        starts.push(end);
    }
    let starts: Vec<u8> = starts.iter().flat_map(|x| x.to_ne_bytes()).collect();
    Ok(Some((PyBytes::new(py, &starts), PyBytes::new(py, &out))))
}
