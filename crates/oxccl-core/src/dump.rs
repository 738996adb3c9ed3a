//! The flight recorder's dump format, version [`DUMP_VERSION`]: the one set of types that the
//! runtime's recorder (`oxccl::flight`) writes and `oxccl doctor` reads.
//!
//! A dump is one JSON object, [`Dump`], whose first key is the version ([`MARKER`]), so that a
//! dump is found in a log. Fields a reader can live without default, so that a dump of a
//! slightly different version can still be read.
//!
//! ```
//! use oxccl_core::dump::{CallState, Dump, DUMP_VERSION, MARKER};
//! use oxccl_core::schedule::CollectiveKind;
//!
//! let line = r#"[3] {"oxccl_flight_recorder":1,"time_unix_ns":5,"rank":3,"world_size":4,
//!     "comm_id":"1f2e3d4c5b6a7988","entries":[{"comm_id":"1f2e3d4c5b6a7988","seq":42,
//!     "coll":"all_reduce","dtype":"float","state":"running","start_unix_ns":2}]}"#;
//! let at = line.find(MARKER).unwrap();
//! let dump: Dump = serde_json::from_str(&line[at..]).unwrap();
//! assert_eq!((dump.oxccl_flight_recorder, dump.rank), (DUMP_VERSION, 3));
//! let e = &dump.entries[0];
//! assert_eq!((e.coll, e.state), (CollectiveKind::AllReduce, CallState::Running));
//! assert_eq!(e.elapsed_ns(dump.time_unix_ns), Some(3));
//! ```

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::schedule::CollectiveKind;
use crate::{DataType, ReduceOp};

/// Format version of a dump (its `oxccl_flight_recorder` field).
pub const DUMP_VERSION: u32 = 1;

/// How every dump starts; in a log line it may follow a prefix such as `[3] `.
pub const MARKER: &str = "{\"oxccl_flight_recorder\"";

/// One flight-recorder dump: one process, all its communicators.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    /// Format version ([`DUMP_VERSION`]).
    pub oxccl_flight_recorder: u32,
    /// Why it was written: `timeout`, `abort`, `error`, `peer_timeout`, `signal`.
    #[serde(default)]
    pub reason: String,
    /// The error or signal behind it.
    #[serde(default)]
    pub detail: String,
    /// When it was written, in ns since the Unix epoch.
    pub time_unix_ns: u64,
    /// The process.
    pub pid: Option<u32>,
    /// The host's name.
    pub host: Option<String>,
    /// Rank in `comm_id`, the communicator that triggered the dump.
    pub rank: u32,
    /// Ranks of `comm_id`.
    pub world_size: u32,
    /// The communicator that triggered the dump (16 hex digits).
    pub comm_id: String,
    /// The process's live communicators.
    #[serde(default)]
    pub communicators: Vec<CommState>,
    /// The recorded calls, oldest first, all communicators mixed.
    #[serde(default)]
    pub entries: Vec<Entry>,
}

/// One live communicator of a dumping process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommState {
    /// The communicator (16 hex digits).
    pub comm_id: String,
    /// This process's rank in it.
    pub rank: u32,
    /// Its ranks.
    pub world_size: u32,
    /// Sequence number of the last collective started (0: none but the init barrier; send and
    /// recv, numbered per peer and direction, do not count).
    #[serde(default)]
    pub last_started: u64,
    /// Sequence number of the last collective completed.
    #[serde(default)]
    pub last_completed: u64,
}

/// Where a recorded call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CallState {
    /// Started, not finished (at dump time).
    Running,
    /// Finished successfully.
    Completed,
    /// Finished with an error.
    Failed,
}

impl CallState {
    /// `running`, `completed` or `failed`, as dumps spell it.
    pub const fn name(self) -> &'static str {
        match self {
            CallState::Running => "running",
            CallState::Completed => "completed",
            CallState::Failed => "failed",
        }
    }
}

impl fmt::Display for CallState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// One recorded call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Its communicator (16 hex digits).
    pub comm_id: String,
    /// The calling rank.
    #[serde(default)]
    pub rank: u32,
    /// The communicator's ranks.
    #[serde(default)]
    pub world_size: u32,
    /// Collective sequence number; for send/recv the per-(peer, direction) number.
    pub seq: u64,
    /// Which collective.
    pub coll: CollectiveKind,
    /// Element count (per rank where the collective counts so).
    #[serde(default)]
    pub count: u64,
    /// Data type, by its name (`float`).
    #[serde(default, with = "by_name")]
    pub dtype: Option<DataType>,
    /// Reduction operator, by its name (`sum`).
    #[serde(default, with = "by_name")]
    pub op: Option<ReduceOp>,
    /// Root rank of a rooted collective.
    pub root: Option<u32>,
    /// Peer of a send or recv.
    pub peer: Option<u32>,
    /// The algorithm's name (`ring`, as `OXCCL_ALGO` spells it); a `Cow`, so that a recorder
    /// can hold a static name without allocating.
    pub algorithm: Option<Cow<'static, str>>,
    /// The protocol (`slots`, `mailbox`).
    pub protocol: Option<Cow<'static, str>>,
    /// Where the call is.
    pub state: CallState,
    /// When it started (ns since the epoch; 0: unknown).
    #[serde(default)]
    pub start_unix_ns: u64,
    /// When it ended, if it did.
    pub end_unix_ns: Option<u64>,
    /// Steps of this rank's schedule.
    #[serde(default)]
    pub steps: u64,
    /// Steps done.
    #[serde(default)]
    pub steps_done: u64,
    /// Bytes received from peers.
    #[serde(default)]
    pub bytes_in: u64,
    /// What it was waiting for, when it failed waiting (or, in a live answer to
    /// `oxccl status`, what the running call waits for now).
    pub waiting: Option<String>,
    /// The peer it was waiting on.
    pub waiting_on: Option<u32>,
    /// A running call's: since when it waits for `waiting` (ns since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_since_unix_ns: Option<u64>,
    /// Its error.
    pub error: Option<String>,
}

impl Entry {
    /// How long the call had run at `dump_ns` (running) or took (finished); `None` if unknown.
    pub fn elapsed_ns(&self, dump_ns: u64) -> Option<u64> {
        if self.start_unix_ns == 0 {
            return None;
        }
        match self.end_unix_ns {
            Some(end) => Some(end.saturating_sub(self.start_unix_ns)),
            None if self.state == CallState::Running => {
                Some(dump_ns.saturating_sub(self.start_unix_ns))
            }
            None => None,
        }
    }
}

/// An optional value as its name (`Display`) and back (`FromStr`): data types and operators
/// are spelt as nccl-tests names them, not as their variants.
mod by_name {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer, T: Display>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.collect_str(v),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr<Err: Display>,
    {
        Option::<String>::deserialize(d)?
            .map(|s| s.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry {
            comm_id: "0000000000000abc".into(),
            rank: 2,
            world_size: 4,
            seq: 7,
            coll: CollectiveKind::AllToAllV,
            count: 1000,
            dtype: Some(DataType::Bf16),
            op: Some(ReduceOp::Max),
            root: None,
            peer: None,
            algorithm: Some("direct".into()),
            protocol: Some("slots".into()),
            state: CallState::Failed,
            start_unix_ns: 10,
            end_unix_ns: Some(25),
            steps: 12,
            steps_done: 3,
            bytes_in: 4096,
            waiting: Some("waiting for data from rank 1 (channel 0)".into()),
            waiting_on: Some(1),
            waiting_since_unix_ns: None,
            error: Some("timed out".into()),
        }
    }

    #[test]
    fn every_data_type_round_trips_by_its_name() {
        for d in DataType::ALL {
            let e = Entry {
                dtype: Some(d),
                ..entry()
            };
            let json = serde_json::to_string(&e).unwrap();
            assert!(
                json.contains(&format!(r#""dtype":"{}""#, d.name())),
                "{json}"
            );
            assert_eq!(serde_json::from_str::<Entry>(&json).unwrap(), e);
        }
        let json = serde_json::to_string(&Entry {
            dtype: Some(DataType::F8E5M2),
            ..entry()
        })
        .unwrap();
        assert!(json.contains(r#""dtype":"f8e5m2""#), "{json}");
    }

    #[test]
    fn a_dump_round_trips_with_the_names_doctor_reads() {
        let dump = Dump {
            oxccl_flight_recorder: DUMP_VERSION,
            reason: "timeout".into(),
            detail: "timed out".into(),
            time_unix_ns: 30,
            pid: Some(1234),
            host: Some("node7".into()),
            rank: 2,
            world_size: 4,
            comm_id: "0000000000000abc".into(),
            communicators: vec![CommState {
                comm_id: "0000000000000abc".into(),
                rank: 2,
                world_size: 4,
                last_started: 7,
                last_completed: 6,
            }],
            entries: vec![entry()],
        };
        let json = serde_json::to_string(&dump).unwrap();
        assert!(json.starts_with(MARKER), "{json}");
        for field in [
            r#""coll":"all_to_allv""#,
            r#""dtype":"bfloat16""#,
            r#""op":"max""#,
            r#""state":"failed""#,
            r#""root":null"#,
            r#""pid":1234"#,
        ] {
            assert!(json.contains(field), "{field} in {json}");
        }
        assert_eq!(serde_json::from_str::<Dump>(&json).unwrap(), dump);
        assert_eq!(dump.entries[0].elapsed_ns(30), Some(15));
    }

    #[test]
    fn what_a_reader_can_live_without_defaults() {
        let e: Entry = serde_json::from_str(
            r#"{"comm_id":"c","seq":1,"coll":"barrier","state":"running","op":null}"#,
        )
        .unwrap();
        assert_eq!((e.count, e.dtype, e.op, e.rank), (0, None, None, 0));
        assert_eq!(e.elapsed_ns(5), None);
        let d: Dump = serde_json::from_str(
            r#"{"oxccl_flight_recorder":2,"time_unix_ns":1,"rank":0,"world_size":1,"comm_id":"c"}"#,
        )
        .unwrap();
        assert!(d.entries.is_empty() && d.pid.is_none() && d.reason.is_empty());
        // Names are checked.
        let bad = r#"{"comm_id":"c","seq":1,"coll":"barrier","state":"running","dtype":"f99"}"#;
        assert!(serde_json::from_str::<Entry>(bad).is_err());
    }
}
