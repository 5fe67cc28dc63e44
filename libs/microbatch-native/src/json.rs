//! Declared JSON values into Arrow columns: the fast path of
//! `microbatch.runtime.schema.JsonSchema.decode`.
//!
//! A value is *accepted* only when its verdict is certain to be Python's
//! (`JsonSchema.decode_record`, the reference): a JSON object whose declared fields are
//! present (or null, when nullable) and of exactly the declared type. Anything else —
//! not JSON to serde_json, a type mismatch, a missing field, a number serde_json reads
//! differently from Python (`-0`, integers past 64 bits), `NaN` — is *deferred*: Python
//! decides it as before, with its error message. So this path can only be faster, never
//! disagree.

use std::fmt;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};

use crate::arrow::{as_bytes, Binary, Bitmap};

/// Declared kinds, as `schema.py` numbers them for this module.
pub(crate) const STRING: u8 = 0;
pub(crate) const LONG: u8 = 1;
pub(crate) const INT: u8 = 2;
pub(crate) const DOUBLE: u8 = 3;
pub(crate) const BOOLEAN: u8 = 4;

/// One field's value in the value being parsed.
#[derive(Clone, Copy)]
pub(crate) enum Slot {
    Absent,
    Null,
    /// A string's bytes in the row's scratch buffer: (start, end).
    Str(usize, usize),
    Long(i64),
    Double(f64),
    Bool(bool),
}

/// A declared field's values, by kind.
enum Values {
    Str(Binary),
    Long(Vec<i64>),
    Int(Vec<i32>),
    Double(Vec<f64>),
    Bool(Bitmap),
}

/// A declared field's column of accepted values: Arrow's validity bitmap and values.
pub(crate) struct Column {
    pub(crate) nullable: bool,
    validity: Bitmap,
    values: Values,
}

impl Column {
    pub(crate) fn new(kind: u8, nullable: bool) -> Self {
        let values = match kind {
            STRING => Values::Str(Binary::with_capacity(0)),
            LONG => Values::Long(Vec::new()),
            INT => Values::Int(Vec::new()),
            DOUBLE => Values::Double(Vec::new()),
            _ => Values::Bool(Bitmap::default()),
        };
        Column {
            nullable,
            validity: Bitmap::default(),
            values,
        }
    }

    /// Appends an accepted value's slot (absent or null: a null, its value slot empty).
    pub(crate) fn push(&mut self, slot: Slot, scratch: &[u8]) {
        self.validity
            .push(!matches!(slot, Slot::Absent | Slot::Null));
        match (&mut self.values, slot) {
            (Values::Str(v), Slot::Str(a, b)) => v.push(Some(&scratch[a..b])),
            (Values::Str(v), _) => v.push(None),
            (Values::Long(v), Slot::Long(x)) => v.push(x),
            (Values::Long(v), _) => v.push(0),
            (Values::Int(v), Slot::Long(x)) => v.push(x as i32),
            (Values::Int(v), _) => v.push(0),
            (Values::Double(v), Slot::Double(x)) => v.push(x),
            (Values::Double(v), _) => v.push(0.0),
            (Values::Bool(v), slot) => v.push(matches!(slot, Slot::Bool(true))),
        }
    }

    /// (validity or None, null count, values buffer, offsets or None) as Python objects.
    pub(crate) fn into_py<'py>(self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let (validity, nulls) = self.validity.validity(py);
        let (values, offsets) = match &self.values {
            Values::Str(v) => (
                PyBytes::new(py, &v.data),
                PyBytes::new(py, as_bytes(&v.offsets)).into_any().unbind(),
            ),
            Values::Long(v) => (PyBytes::new(py, as_bytes(v)), py.None()),
            Values::Int(v) => (PyBytes::new(py, as_bytes(v)), py.None()),
            Values::Double(v) => (PyBytes::new(py, as_bytes(v)), py.None()),
            Values::Bool(v) => (v.bytes(py), py.None()),
        };
        (validity, nulls, values, offsets).into_pyobject(py)
    }
}

/// Why a value is not accepted here: Python decides it.
#[derive(Debug)]
struct Deferred;

impl fmt::Display for Deferred {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("deferred to Python")
    }
}

/// Parses one value into the row's slots.
struct Row<'s> {
    names: &'s [String],
    kinds: &'s [u8],
    keep: &'s [bool],
    slots: &'s mut [Slot],
    scratch: &'s mut Vec<u8>,
}

impl<'de> DeserializeSeed<'de> for Row<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Row<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(field) = map.next_key_seed(FieldName(self.names))? {
            match field {
                Some(i) => {
                    let seed = Value {
                        kind: self.kinds[i],
                        copy: self.keep[i],
                        scratch: &mut *self.scratch,
                    };
                    self.slots[i] = map.next_value_seed(seed)?;
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// A key: the index of the declared field it names, if any.
struct FieldName<'s>(&'s [String]);

impl<'de> DeserializeSeed<'de> for FieldName<'_> {
    type Value = Option<usize>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for FieldName<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|name| name == v))
    }
}

/// A declared field's value, of exactly its declared kind (or null). A string of a
/// field no column keeps (`copy` false) is checked, not copied.
struct Value<'s> {
    kind: u8,
    copy: bool,
    scratch: &'s mut Vec<u8>,
}

impl<'de> DeserializeSeed<'de> for Value<'_> {
    type Value = Slot;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Slot, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Value<'_> {
    type Value = Slot;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a declared field's value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Slot, E> {
        Ok(Slot::Null)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Slot, E> {
        if self.kind != STRING {
            return Err(E::custom(Deferred));
        }
        if !self.copy {
            return Ok(Slot::Str(0, 0));
        }
        let start = self.scratch.len();
        self.scratch.extend_from_slice(v.as_bytes());
        Ok(Slot::Str(start, self.scratch.len()))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Slot, E> {
        if self.kind == BOOLEAN {
            Ok(Slot::Bool(v))
        } else {
            Err(E::custom(Deferred))
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Slot, E> {
        match self.kind {
            LONG => Ok(Slot::Long(v)),
            INT if i32::try_from(v).is_ok() => Ok(Slot::Long(v)),
            // Python: float(int), correctly rounded, as Rust's `as`.
            DOUBLE => Ok(Slot::Double(v as f64)),
            _ => Err(E::custom(Deferred)),
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Slot, E> {
        match (self.kind, i64::try_from(v)) {
            (LONG | INT, Ok(v)) => self.visit_i64(v),
            (DOUBLE, _) => Ok(Slot::Double(v as f64)),
            _ => Err(E::custom(Deferred)),
        }
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Slot, E> {
        // Only a double takes a number with a fraction or an exponent; serde_json also
        // reads `-0` and integers past 64 bits as f64, which Python reads as int.
        if self.kind == DOUBLE {
            Ok(Slot::Double(v))
        } else {
            Err(E::custom(Deferred))
        }
    }
}

/// Parses one whole value (nothing but whitespace after it); false: deferred.
fn parse_value(value: &[u8], row: Row<'_>) -> bool {
    let mut de = serde_json::Deserializer::from_slice(value);
    row.deserialize(&mut de).is_ok() && de.end().is_ok()
}

/// `values` (Arrow binary: `offsets`, int32 with the array's own offset applied, and
/// `data`) decoded into the declared fields (`names`, `kinds`, `nullable`). Every
/// declared field is checked; only those `keep` marks become columns. Returns
/// (accepted: one byte per value, 1 or 0; the accepted values' columns: per kept field
/// (validity or None, null count, values, offsets or None)).
#[pyfunction]
pub fn decode_json<'py>(
    py: Python<'py>,
    offsets: PyBuffer<i32>,
    data: PyBuffer<u8>,
    names: Vec<String>,
    kinds: Vec<u8>,
    nullable: Vec<bool>,
    keep: Vec<bool>,
) -> PyResult<Bound<'py, PyTuple>> {
    if names.len() != kinds.len() || names.len() != nullable.len() || names.len() != keep.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "decode_json: names, kinds, nullable and keep must have one entry per field",
        ));
    }
    let offsets = offsets.to_vec(py)?;
    // SAFETY: a read-only view of the buffer, alive while `data` is held.
    let data: &[u8] =
        unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, data.item_count()) };
    let rows = offsets.len().saturating_sub(1);
    let mut accepted = vec![0u8; rows];
    // One per declared field; a field not kept has its column's checks but no values.
    let mut columns: Vec<Column> = kinds
        .iter()
        .zip(&nullable)
        .map(|(&k, &n)| Column::new(k, n))
        .collect();
    let mut slots = vec![Slot::Absent; names.len()];
    let mut scratch: Vec<u8> = Vec::new();
    let mut string_bytes = vec![0usize; names.len()];
    for i in 0..rows {
        let (a, b) = (offsets[i] as usize, offsets[i + 1] as usize);
        if a > b || b > data.len() {
            continue; // not an Arrow binary array: every value deferred
        }
        slots.fill(Slot::Absent);
        scratch.clear();
        let row = Row {
            names: &names,
            kinds: &kinds,
            keep: &keep,
            slots: &mut slots,
            scratch: &mut scratch,
        };
        if !parse_value(&data[a..b], row) {
            continue;
        }
        let complete = columns
            .iter()
            .zip(&slots)
            .all(|(c, s)| c.nullable || !matches!(s, Slot::Absent | Slot::Null));
        // A string column past 2 GiB would overflow its 32-bit offsets: defer the rest.
        let fits = slots.iter().zip(&string_bytes).all(|(s, &n)| match s {
            Slot::Str(x, y) => n + (y - x) <= i32::MAX as usize,
            _ => true,
        });
        if !complete || !fits {
            continue;
        }
        for (((column, &slot), n), _) in columns
            .iter_mut()
            .zip(&slots)
            .zip(&mut string_bytes)
            .zip(&keep)
            .filter(|(_, &k)| k)
        {
            if let Slot::Str(x, y) = slot {
                *n += y - x;
            }
            column.push(slot, &scratch);
        }
        accepted[i] = 1;
    }
    let out = PyList::empty(py);
    for (column, _) in columns.into_iter().zip(&keep).filter(|(_, &k)| k) {
        out.append(column.into_py(py)?)?;
    }
    (PyBytes::new(py, &accepted), out).into_pyobject(py)
}
