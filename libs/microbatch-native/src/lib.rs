//! microbatch's native Kafka range reader: librdkafka's messages straight into Arrow
//! buffers, with no Python object per record.
//!
//! `microbatch.kafka.native_reader` drives it and wraps the buffers as a `KAFKA_SCHEMA`
//! batch; the contract (exactly the committed records of `[start, end)`, how the loop
//! knows a range is done across offsets without records, which errors end it) is
//! `microbatch.kafka.confluent_reader`'s, documented there. Python's confluent-kafka
//! spends ~2 µs of CPU per record on its `Message` objects; librdkafka itself ~0.4.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use rdkafka_sys as rd;

mod arrow;
mod json;
mod msgpack;
mod unpack;

use arrow::{as_bytes, BinaryColumn};

create_exception!(
    microbatch_native,
    ReadError,
    PyException,
    "A range could not be read: args are (kind, message, offset)."
);

/// librdkafka's error codes the loop tells apart (`rdkafka.h`).
const PARTITION_EOF: i32 = -191;
const AUTO_OFFSET_RESET: i32 = -140;
const FATAL: i32 = -150;
const UNKNOWN_TOPIC: i32 = -188;
const UNKNOWN_PARTITION: i32 = -190;
const UNKNOWN_TOPIC_OR_PART: i32 = 3;
const TOPIC_AUTHORIZATION_FAILED: i32 = 29;
const AUTHENTICATION: i32 = -169;
const SASL_AUTHENTICATION_FAILED: i32 = 58;

/// Errors librdkafka reports through its error callback (not tied to a message).
type ClientErrors = Mutex<Vec<(i32, String)>>;

unsafe extern "C" fn collect_error(
    _rk: *mut rd::rd_kafka_t,
    err: c_int,
    reason: *const c_char,
    opaque: *mut c_void,
) {
    let errors = unsafe { &*(opaque as *const ClientErrors) };
    let text = if reason.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(reason) }
            .to_string_lossy()
            .into_owned()
    };
    if let Ok(mut list) = errors.lock() {
        list.push((err, text));
    }
}

fn error_name(code: i32) -> String {
    // SAFETY: rd_kafka_err2str takes any int and returns a static string.
    let text = unsafe {
        CStr::from_ptr(rd::rd_kafka_err2str(std::mem::transmute::<
            i32,
            rd::rd_kafka_resp_err_t,
        >(code)))
    };
    text.to_string_lossy().into_owned()
}

unsafe fn slice<'a>(data: *const c_void, len: usize) -> Option<&'a [u8]> {
    if data.is_null() {
        None
    } else {
        Some(unsafe { std::slice::from_raw_parts(data as *const u8, len) })
    }
}

/// One batch's columns: keys, values, offsets and (unless source-only) timestamps and
/// headers as `list<struct<key: string, value: binary>>`.
struct Columns {
    keys: BinaryColumn,
    values: BinaryColumn,
    offsets: Vec<i64>,
    timestamps: Vec<i64>,
    header_offsets: Vec<i32>,
    header_keys: BinaryColumn,
    header_values: BinaryColumn,
}

impl Columns {
    fn new(rows: usize, source_only: bool) -> Self {
        let extra = if source_only { 0 } else { rows };
        let mut header_offsets = Vec::with_capacity(extra + 1);
        header_offsets.push(0);
        Columns {
            keys: BinaryColumn::with_capacity(rows),
            values: BinaryColumn::with_capacity(rows),
            offsets: Vec::with_capacity(rows),
            timestamps: Vec::with_capacity(extra),
            header_offsets,
            header_keys: BinaryColumn::with_capacity(0),
            header_values: BinaryColumn::with_capacity(0),
        }
    }

    /// Whether a message's key or value would take the keys' or the values' bytes past
    /// `limit` (at most what the 32-bit offsets of `binary` address).
    fn would_overflow(&self, key_len: usize, value_len: usize, limit: usize) -> bool {
        self.keys.values.data.len() + key_len > limit
            || self.values.values.data.len() + value_len > limit
    }

    unsafe fn push(&mut self, msg: *mut rd::rd_kafka_message_t, source_only: bool) {
        let m = unsafe { &*msg };
        self.keys.push(unsafe { slice(m.key, m.key_len) });
        self.values.push(unsafe { slice(m.payload, m.len) });
        self.offsets.push(m.offset);
        if source_only {
            return;
        }
        let mut kind = rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        self.timestamps
            .push(unsafe { rd::rd_kafka_message_timestamp(msg, &mut kind) });
        let mut headers: *mut rd::rd_kafka_headers_t = ptr::null_mut();
        if unsafe { rd::rd_kafka_message_headers(msg, &mut headers) } as i32 == 0 {
            let mut idx = 0;
            loop {
                let (mut name, mut value, mut size) = (ptr::null(), ptr::null(), 0usize);
                let err = unsafe {
                    rd::rd_kafka_header_get_all(headers, idx, &mut name, &mut value, &mut size)
                };
                if err as i32 != 0 {
                    break;
                }
                let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
                self.header_keys.push(Some(name.as_bytes()));
                self.header_values.push(unsafe { slice(value, size) });
                idx += 1;
            }
        }
        self.header_offsets.push(self.header_keys.len() as i32);
    }

    fn into_py<'py>(self, py: Python<'py>, source_only: bool) -> PyResult<Bound<'py, PyTuple>> {
        let rows = self.offsets.len();
        let (timestamps, headers) = if source_only {
            (py.None(), py.None())
        } else {
            let headers = (
                PyBytes::new(py, as_bytes(&self.header_offsets)),
                self.header_keys.into_py(py)?,
                self.header_values.into_py(py)?,
            );
            (
                PyBytes::new(py, as_bytes(&self.timestamps))
                    .into_any()
                    .unbind(),
                headers.into_pyobject(py)?.into_any().unbind(),
            )
        };
        (
            rows,
            self.keys.into_py(py)?,
            self.values.into_py(py)?,
            PyBytes::new(py, as_bytes(&self.offsets)),
            timestamps,
            headers,
        )
            .into_pyobject(py)
    }
}

/// Why a read stopped: (kind, message, offset) for `ReadError`.
type Stop = (&'static str, String, i64);

struct Consumer {
    rk: *mut rd::rd_kafka_t,
    errors: Box<ClientErrors>,
    carried: *mut rd::rd_kafka_message_t,
}

// SAFETY: librdkafka handles may be used from any thread; the reader touches them only
// through `&mut self` (pyo3 borrows a pyclass mutably one caller at a time).
unsafe impl Send for Consumer {}
unsafe impl Sync for Consumer {}

impl Consumer {
    /// Leaves the partition and frees the client (again: nothing).
    fn close(&mut self) {
        unsafe {
            if !self.carried.is_null() {
                rd::rd_kafka_message_destroy(self.carried);
                self.carried = ptr::null_mut();
            }
            if !self.rk.is_null() {
                rd::rd_kafka_consumer_close(self.rk);
                rd::rd_kafka_destroy(self.rk);
                self.rk = ptr::null_mut();
            }
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.close();
    }
}

/// Reads one partition's `[start, end)` of committed records, a batch at a time.
#[pyclass(module = "microbatch_native")]
struct RangeReader {
    consumer: Consumer,
    end: i64,
    seen: i64,
    batch_rows: usize,
    batch_bytes: usize,
    poll_timeout: Duration,
    wait_ms: c_int,
    source_only: bool,
    last_progress: Instant,
    progress_mark: i64,
}

#[pymethods]
impl RangeReader {
    /// `config`: librdkafka settings as strings, fixed ones included; the consumer is
    /// assigned `topic`/`partition` at `start`. A batch ends at `batch_rows` records, or
    /// before a record that would take its keys or values past `batch_bytes`.
    #[new]
    #[pyo3(signature = (config, topic, partition, start, end, batch_rows, batch_bytes, poll_timeout_s, wait_ms, source_only))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        config: Vec<(String, String)>,
        topic: &str,
        partition: i32,
        start: i64,
        end: i64,
        batch_rows: usize,
        batch_bytes: usize,
        poll_timeout_s: f64,
        wait_ms: i32,
        source_only: bool,
    ) -> PyResult<Self> {
        let fail = |message: String| ReadError::new_err(("config", message, start));
        let errors: Box<ClientErrors> = Box::new(Mutex::new(Vec::new()));
        let mut errstr = [0 as c_char; 512];
        unsafe {
            let conf = rd::rd_kafka_conf_new();
            for (name, value) in &config {
                let (n, v) = (CString::new(name.as_str())?, CString::new(value.as_str())?);
                let ok = rd::rd_kafka_conf_set(
                    conf,
                    n.as_ptr(),
                    v.as_ptr(),
                    errstr.as_mut_ptr(),
                    errstr.len(),
                );
                if ok as i32 != 0 {
                    rd::rd_kafka_conf_destroy(conf);
                    return Err(fail(
                        CStr::from_ptr(errstr.as_ptr())
                            .to_string_lossy()
                            .into_owned(),
                    ));
                }
            }
            rd::rd_kafka_conf_set_error_cb(conf, Some(collect_error));
            rd::rd_kafka_conf_set_opaque(conf, &*errors as *const ClientErrors as *mut c_void);
            let rk = rd::rd_kafka_new(
                rd::rd_kafka_type_t::RD_KAFKA_CONSUMER,
                conf,
                errstr.as_mut_ptr(),
                errstr.len(),
            );
            if rk.is_null() {
                rd::rd_kafka_conf_destroy(conf);
                return Err(fail(
                    CStr::from_ptr(errstr.as_ptr())
                        .to_string_lossy()
                        .into_owned(),
                ));
            }
            let consumer = Consumer {
                rk,
                errors,
                carried: ptr::null_mut(),
            };
            rd::rd_kafka_poll_set_consumer(rk);
            let list = rd::rd_kafka_topic_partition_list_new(1);
            let t = CString::new(topic)?;
            let tp = rd::rd_kafka_topic_partition_list_add(list, t.as_ptr(), partition);
            (*tp).offset = start;
            let err = rd::rd_kafka_assign(rk, list);
            rd::rd_kafka_topic_partition_list_destroy(list);
            if err as i32 != 0 {
                return Err(fail(format!(
                    "cannot assign the partition: {}",
                    error_name(err as i32)
                )));
            }
            Ok(RangeReader {
                consumer,
                end,
                seen: start,
                batch_rows: batch_rows.max(1),
                batch_bytes: batch_bytes.min(i32::MAX as usize),
                poll_timeout: Duration::from_secs_f64(poll_timeout_s),
                wait_ms,
                source_only,
                last_progress: Instant::now(),
                progress_mark: start,
            })
        }
    }

    /// The next batch's buffers, or None once the range is read. The GIL is released
    /// while librdkafka is polled.
    fn next_batch<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        if self.consumer.rk.is_null() || (self.seen >= self.end && self.consumer.carried.is_null())
        {
            return Ok(None);
        }
        let columns = py
            .detach(|| self.fill())
            .map_err(|(kind, message, offset)| ReadError::new_err((kind, message, offset)))?;
        if columns.offsets.is_empty() {
            return Ok(None);
        }
        Ok(Some(columns.into_py(py, self.source_only)?))
    }

    /// Closes the consumer now rather than when the reader is collected.
    fn close(&mut self, py: Python<'_>) {
        py.detach(|| self.consumer.close());
    }

    /// The next offset not yet accounted for.
    #[getter]
    fn seen(&self) -> i64 {
        self.seen
    }
}

impl RangeReader {
    fn fill(&mut self) -> Result<Columns, Stop> {
        let mut columns = Columns::new(
            self.batch_rows
                .min((self.end - self.seen).max(0) as usize + 1),
            self.source_only,
        );
        if !self.consumer.carried.is_null() {
            unsafe { columns.push(self.consumer.carried, self.source_only) };
            unsafe { rd::rd_kafka_message_destroy(self.consumer.carried) };
            self.consumer.carried = ptr::null_mut();
        }
        while columns.offsets.len() < self.batch_rows && self.seen < self.end {
            let msg = unsafe { rd::rd_kafka_consumer_poll(self.consumer.rk, self.wait_ms) };
            if msg.is_null() {
                self.check_client()?;
                continue;
            }
            // Read as an int: librdkafka may return codes newer than the bindings' enum.
            let code = unsafe { *(ptr::addr_of!((*msg).err) as *const i32) };
            if code == 0 {
                let (offset, key_len, value_len) =
                    unsafe { ((*msg).offset, (*msg).key_len, (*msg).len) };
                if offset >= self.end {
                    self.seen = self.end;
                } else if !columns.offsets.is_empty()
                    && columns.would_overflow(key_len, value_len, self.batch_bytes)
                {
                    self.seen = offset + 1;
                    self.consumer.carried = msg;
                    return Ok(columns);
                } else {
                    unsafe { columns.push(msg, self.source_only) };
                    self.seen = offset + 1;
                }
                unsafe { rd::rd_kafka_message_destroy(msg) };
                continue;
            }
            let offset = unsafe { (*msg).offset };
            let text = unsafe {
                slice((*msg).payload, (*msg).len)
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default()
            };
            unsafe { rd::rd_kafka_message_destroy(msg) };
            match code {
                PARTITION_EOF => self.seen = self.seen.max(offset),
                AUTO_OFFSET_RESET => return Err(("deleted", text, self.seen)),
                FATAL
                | UNKNOWN_TOPIC
                | UNKNOWN_PARTITION
                | UNKNOWN_TOPIC_OR_PART
                | TOPIC_AUTHORIZATION_FAILED => {
                    let text = if text.is_empty() {
                        error_name(code)
                    } else {
                        text
                    };
                    return Err(("fatal", text, self.seen));
                }
                _ => {} // transient (a lost connection): librdkafka retries it
            }
            self.check_client()?;
        }
        Ok(columns)
    }

    /// After a poll that brought no record: fail on an authentication error, or when the
    /// range made no progress for the poll timeout.
    fn check_client(&mut self) -> Result<(), Stop> {
        let errors = self
            .consumer
            .errors
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default();
        if let Some((_, reason)) = errors
            .iter()
            .find(|(c, _)| *c == AUTHENTICATION || *c == SASL_AUTHENTICATION_FAILED)
        {
            return Err(("auth", reason.clone(), self.seen));
        }
        let now = Instant::now();
        if self.seen > self.progress_mark {
            self.progress_mark = self.seen;
            self.last_progress = now;
        } else if now.duration_since(self.last_progress) > self.poll_timeout {
            let last = errors.last().map(|(_, r)| r.clone()).unwrap_or_default();
            return Err(("stalled", last, self.seen));
        }
        Ok(())
    }
}

/// The librdkafka version this module was built with.
#[pyfunction]
fn librdkafka_version() -> String {
    unsafe { CStr::from_ptr(rd::rd_kafka_version_str()) }
        .to_string_lossy()
        .into_owned()
}

#[pymodule]
fn microbatch_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RangeReader>()?;
    m.add_function(wrap_pyfunction!(librdkafka_version, m)?)?;
    m.add_function(wrap_pyfunction!(json::decode_json, m)?)?;
    m.add_function(wrap_pyfunction!(msgpack::encode_rows, m)?)?;
    m.add_function(wrap_pyfunction!(unpack::decode_rows, m)?)?;
    m.add_function(wrap_pyfunction!(unpack::split_lists, m)?)?;
    m.add_function(wrap_pyfunction!(unpack::join_lists, m)?)?;
    m.add("ReadError", m.py().get_type::<ReadError>())?;
    Ok(())
}
