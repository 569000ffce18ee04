//! A communication profile: per label (the layer and pass that issued the call, set with
//! [`scope`]) and op kind, the calls, the bytes this rank received, the time from post to
//! completion, and the time the posting thread actually waited, so the fraction of the
//! communication that compute hid. Off by default (one branch per call); on with
//! [`LocalGroupOptions::profile`](crate::LocalGroupOptions::profile) or `BURN_TP_PROFILE=1`.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use crate::OpKind;

thread_local! {
    static SCOPE: Cell<&'static str> = const { Cell::new("direct") };
}

/// Labels the calls this thread issues until the guard drops (the previous label comes back).
#[must_use = "the label holds while the guard lives"]
pub fn scope(label: &'static str) -> ScopeGuard {
    ScopeGuard(SCOPE.with(|s| s.replace(label)))
}

/// The current label of this thread's calls.
pub(crate) fn current_scope() -> &'static str {
    SCOPE.with(Cell::get)
}

/// Restores the previous label when dropped.
pub struct ScopeGuard(&'static str);

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        SCOPE.with(|s| s.set(self.0));
    }
}

/// One row of a profile: every call of one op kind under one label, on one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProfileRow {
    /// The label ([`scope`]) the calls were issued under.
    pub label: String,
    /// The op kind.
    pub op: String,
    /// Calls.
    pub calls: u64,
    /// Bytes this rank received.
    pub bytes: u64,
    /// Sum of post -> completion (the data in place on this rank).
    pub comm: Duration,
    /// Sum of the time the posting thread spent inside the wait (blocked, or copying).
    pub waited: Duration,
}

impl ProfileRow {
    /// The fraction of the communication time compute hid: `1 - waited / comm` (0 when the
    /// thread waited for all of it, 1 when not at all).
    pub fn hidden(&self) -> f64 {
        if self.comm.is_zero() {
            return 0.0;
        }
        (1.0 - self.waited.as_secs_f64() / self.comm.as_secs_f64()).clamp(0.0, 1.0)
    }
}

/// The profile of one rank: rows by (label, op).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    /// The rows, sorted by label then op.
    pub rows: Vec<ProfileRow>,
}

impl Profile {
    /// `label,op,calls,bytes,comm_ms,waited_ms,hidden`, one line per row.
    pub fn to_csv(&self) -> String {
        let mut csv = String::from("label,op,calls,bytes,comm_ms,waited_ms,hidden\n");
        for r in &self.rows {
            csv.push_str(&format!(
                "{},{},{},{},{:.3},{:.3},{:.3}\n",
                r.label,
                r.op,
                r.calls,
                r.bytes,
                r.comm.as_secs_f64() * 1e3,
                r.waited.as_secs_f64() * 1e3,
                r.hidden()
            ));
        }
        csv
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<40} {:<22} {:>7} {:>10} {:>10} {:>10} {:>7}",
            "label", "op", "calls", "MiB", "comm ms", "waited ms", "hidden"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<40} {:<22} {:>7} {:>10.1} {:>10.1} {:>10.1} {:>7.2}",
                r.label,
                r.op,
                r.calls,
                r.bytes as f64 / (1 << 20) as f64,
                r.comm.as_secs_f64() * 1e3,
                r.waited.as_secs_f64() * 1e3,
                r.hidden()
            )?;
        }
        Ok(())
    }
}

/// Where one rank's calls are counted (shared by its handles, including split groups).
#[derive(Debug, Default)]
pub(crate) struct ProfileStore(Mutex<BTreeMap<(&'static str, String), ProfileRow>>);

impl ProfileStore {
    pub(crate) fn record(
        &self,
        label: &'static str,
        op: OpKind,
        bytes: usize,
        comm: Duration,
        waited: Duration,
    ) {
        let op = format!("{op:?}");
        let mut rows = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let row = rows
            .entry((label, op.clone()))
            .or_insert_with(|| ProfileRow {
                label: label.to_string(),
                op,
                ..Default::default()
            });
        row.calls += 1;
        row.bytes += bytes as u64;
        row.comm += comm;
        row.waited += waited;
    }

    pub(crate) fn snapshot(&self) -> Profile {
        let rows = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Profile {
            rows: rows.values().cloned().collect(),
        }
    }
}
