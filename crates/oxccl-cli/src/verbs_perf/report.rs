//! Statistics and output in perftest's format (`ib_write_lat`, `ib_write_bw`), or JSON lines.

use std::io::Write;
use std::time::Instant;

use serde::Serialize;

use super::error::{Error, Result};

/// Latency columns, exactly as perftest prints them.
pub const LAT_COLUMNS: [&str; 9] = [
    "#bytes",
    "#iterations",
    "t_min[usec]",
    "t_max[usec]",
    "t_typical[usec]",
    "t_avg[usec]",
    "t_stdev[usec]",
    "99% percentile[usec]",
    "99.9% percentile[usec]",
];

/// Bandwidth columns, exactly as perftest prints them (GB = 1e9 bytes).
pub const BW_COLUMNS: [&str; 5] = [
    "#bytes",
    "#iterations",
    "BW peak[GB/sec]",
    "BW average[GB/sec]",
    "MsgRate[Mpps]",
];

/// Extra columns of `--cpu`.
pub const CPU_COLUMNS: [&str; 2] = ["CPU_init[s/GB]", "CPU_target[s/GB]"];

/// One latency row. JSON field names follow the columns.
#[derive(Clone, Debug, Serialize)]
pub struct LatRow {
    /// Test name.
    pub test: &'static str,
    /// Provider name (null for raw baselines).
    pub provider: Option<String>,
    /// `#bytes`.
    pub bytes: usize,
    /// `#iterations`.
    pub iterations: u64,
    /// `t_min[usec]`.
    pub t_min_usec: f64,
    /// `t_max[usec]`.
    pub t_max_usec: f64,
    /// `t_typical[usec]`: the median.
    pub t_typical_usec: f64,
    /// `t_avg[usec]`.
    pub t_avg_usec: f64,
    /// `t_stdev[usec]`.
    pub t_stdev_usec: f64,
    /// `99% percentile[usec]`.
    pub p99_usec: f64,
    /// `99.9% percentile[usec]`.
    pub p99_9_usec: f64,
    /// `CPU_init[s/GB]` (with `--cpu`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_init_s_per_gb: Option<f64>,
    /// `CPU_target[s/GB]` (with `--cpu`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_target_s_per_gb: Option<f64>,
}

/// One bandwidth row. JSON field names follow the columns.
#[derive(Clone, Debug, Serialize)]
pub struct BwRow {
    /// Test name.
    pub test: &'static str,
    /// Provider name (null for raw baselines).
    pub provider: Option<String>,
    /// `#bytes`.
    pub bytes: usize,
    /// `#iterations`.
    pub iterations: u64,
    /// `BW peak[GB/sec]`: the best window of at least a tenth of the operations and a twentieth
    /// of the run's time.
    pub bw_peak_gb_per_sec: f64,
    /// `BW average[GB/sec]`: over the whole measured run.
    pub bw_average_gb_per_sec: f64,
    /// `MsgRate[Mpps]`: millions of messages per second, over the whole run.
    pub msg_rate_mpps: f64,
    /// `CPU_init[s/GB]` (with `--cpu`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_init_s_per_gb: Option<f64>,
    /// `CPU_target[s/GB]` (with `--cpu`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_target_s_per_gb: Option<f64>,
}

/// Latency statistics of per-operation times in nanoseconds; `scale` converts a sample to the
/// reported latency (0.5 for ping-pong half round trips).
pub fn lat_row(
    test: &'static str,
    provider: Option<String>,
    bytes: usize,
    samples: &mut [u64],
    scale: f64,
) -> LatRow {
    samples.sort_unstable();
    let n = samples.len().max(1);
    let us = |ns: u64| ns as f64 * scale / 1e3;
    let pick = |p: f64| {
        // Nearest rank.
        let rank = ((p * n as f64).ceil() as usize).clamp(1, n);
        samples.get(rank - 1).copied().unwrap_or(0)
    };
    let avg = samples.iter().map(|&s| us(s)).sum::<f64>() / n as f64;
    let var = samples.iter().map(|&s| (us(s) - avg).powi(2)).sum::<f64>() / n as f64;
    LatRow {
        test,
        provider,
        bytes,
        iterations: samples.len() as u64,
        t_min_usec: us(samples.first().copied().unwrap_or(0)),
        t_max_usec: us(samples.last().copied().unwrap_or(0)),
        t_typical_usec: us(pick(0.5)),
        t_avg_usec: avg,
        t_stdev_usec: var.sqrt(),
        p99_usec: us(pick(0.99)),
        p99_9_usec: us(pick(0.999)),
        cpu_init_s_per_gb: None,
        cpu_target_s_per_gb: None,
    }
}

/// Progress marks of a bandwidth run: how many operations had completed at which instant.
pub struct Marks {
    start: Instant,
    marks: Vec<(u64, Instant)>,
}

impl Marks {
    /// Marks for a run of about `ops` operations, marked every `every` operations.
    pub fn new(ops: u64, every: u64) -> Self {
        Marks {
            start: Instant::now(),
            marks: Vec::with_capacity((ops / every.max(1)) as usize + 16),
        }
    }

    /// Restarts the clock (the run begins now).
    pub fn start(&mut self) {
        self.marks.clear();
        self.start = Instant::now();
    }

    /// `done` operations have completed by now.
    #[inline]
    pub fn mark(&mut self, done: u64) {
        self.marks.push((done, Instant::now()));
    }

    /// The bandwidth row of `ops` operations of `bytes` each.
    pub fn bw_row(
        &self,
        test: &'static str,
        provider: Option<String>,
        bytes: usize,
        ops: u64,
    ) -> BwRow {
        let end = self.marks.last().map(|m| m.1).unwrap_or(self.start);
        let secs = (end - self.start).as_secs_f64().max(1e-9);
        let avg = ops as f64 * bytes as f64 / secs / 1e9;
        // Peak: the best window between two marks that covers at least a tenth of the operations
        // and a twentieth of the run. The second bound matters where completions arrive in
        // clumps (the tcp provider's cumulative acknowledgements, a waiter woken late): two marks
        // a few microseconds apart must not make a window of their own.
        let min_ops = ops.div_ceil(10).max(1);
        let min_dt = secs / 20.0;
        let points: Vec<(u64, Instant)> = std::iter::once((0, self.start))
            .chain(self.marks.iter().copied())
            .collect();
        let mut peak: f64 = 0.0;
        let mut j = 0;
        for (i, &(d0, t0)) in points.iter().enumerate() {
            j = j.max(i + 1);
            while j < points.len()
                && (points[j].0 < d0 + min_ops || (points[j].1 - t0).as_secs_f64() < min_dt)
            {
                j += 1;
            }
            let Some(&(d1, t1)) = points.get(j) else {
                break;
            };
            let dt = (t1 - t0).as_secs_f64();
            if d1 > d0 && dt > 0.0 {
                peak = peak.max((d1 - d0) as f64 * bytes as f64 / dt / 1e9);
            }
        }
        if peak < avg {
            peak = avg;
        }
        BwRow {
            test,
            provider,
            bytes,
            iterations: ops,
            bw_peak_gb_per_sec: peak,
            bw_average_gb_per_sec: avg,
            msg_rate_mpps: ops as f64 / secs / 1e6,
            cpu_init_s_per_gb: None,
            cpu_target_s_per_gb: None,
        }
    }
}

/// CPU seconds per GB moved, or `None` for no bytes.
pub fn cpu_per_gb(cpu_secs: f64, bytes: f64) -> Option<f64> {
    (bytes > 0.0).then(|| cpu_secs / (bytes / 1e9))
}

/// Where rows go: perftest-style text with a header, or one JSON object per line.
pub struct Printer {
    json: bool,
    cpu: bool,
    out: std::io::Stdout,
}

impl Printer {
    /// A printer for stdout.
    pub fn new(json: bool, cpu: bool) -> Self {
        Printer {
            json,
            cpu,
            out: std::io::stdout(),
        }
    }

    /// Writes one line and flushes (rows appear as they are measured).
    fn line(&mut self, s: &str) -> Result<()> {
        let mut out = self.out.lock();
        writeln!(out, "{s}")
            .and_then(|()| out.flush())
            .map_err(Error::stdout)
    }

    /// The perftest-like header: a title and `key: value` lines, then the column names.
    pub fn header(&mut self, title: &str, facts: &[(&str, String)], lat: bool) -> Result<()> {
        if self.json {
            return Ok(());
        }
        let rule = "-".repeat(95);
        let mut s = format!("{rule}\n{:^95}\n", title);
        for (k, v) in facts {
            s.push_str(&format!(" {k:<16}: {v}\n"));
        }
        s.push_str(&rule);
        s.push('\n');
        let mut cols: Vec<&str> = if lat {
            LAT_COLUMNS.to_vec()
        } else {
            BW_COLUMNS.to_vec()
        };
        if self.cpu {
            cols.extend(CPU_COLUMNS);
        }
        s.push(' ');
        s.push_str(&cols.join("   "));
        self.line(&s)
    }

    /// Prints a latency row.
    pub fn lat(&mut self, r: &LatRow) -> Result<()> {
        if self.json {
            return self.json_line(r);
        }
        let mut s = format!(
            " {:<7} {:<13} {:<14.3} {:<14.3} {:<18.3} {:<14.3} {:<16.3} {:<23.3} {:<25.3}",
            r.bytes,
            r.iterations,
            r.t_min_usec,
            r.t_max_usec,
            r.t_typical_usec,
            r.t_avg_usec,
            r.t_stdev_usec,
            r.p99_usec,
            r.p99_9_usec,
        );
        if self.cpu {
            s.push_str(&cpu_cols(r.cpu_init_s_per_gb, r.cpu_target_s_per_gb));
        }
        self.line(s.trim_end())
    }

    /// Prints a bandwidth row.
    pub fn bw(&mut self, r: &BwRow) -> Result<()> {
        if self.json {
            return self.json_line(r);
        }
        let mut s = format!(
            " {:<7} {:<13} {:<18.3} {:<21.3} {:<16.6}",
            r.bytes, r.iterations, r.bw_peak_gb_per_sec, r.bw_average_gb_per_sec, r.msg_rate_mpps,
        );
        if self.cpu {
            s.push_str(&cpu_cols(r.cpu_init_s_per_gb, r.cpu_target_s_per_gb));
        }
        self.line(s.trim_end())
    }

    /// Closes the table.
    pub fn footer(&mut self) -> Result<()> {
        if self.json {
            return Ok(());
        }
        self.line(&"-".repeat(95))
    }

    /// Writes one row as a JSON object.
    fn json_line<T: Serialize>(&mut self, row: &T) -> Result<()> {
        let s = serde_json::to_string(row)
            .map_err(|e| Error::new(format!("encoding a JSON row: {e}")))?;
        self.line(&s)
    }
}

/// The `--cpu` columns of a row.
fn cpu_cols(init: Option<f64>, target: Option<f64>) -> String {
    let f = |v: Option<f64>| v.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into());
    format!("   {:<17} {}", f(init), f(target))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn latency_statistics() {
        let mut s: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let r = lat_row("t", None, 8, &mut s, 0.5);
        assert_eq!(r.iterations, 1000);
        assert!((r.t_min_usec - 0.5).abs() < 1e-9);
        assert!((r.t_max_usec - 500.0).abs() < 1e-9);
        assert!((r.t_typical_usec - 250.0).abs() < 1e-9);
        assert!((r.p99_usec - 495.0).abs() < 1e-9);
        assert!((r.p99_9_usec - 499.5).abs() < 1e-9);
        assert!((r.t_avg_usec - 250.25).abs() < 1e-9);
    }

    #[test]
    fn bandwidth_peak_is_best_window() {
        let mut m = Marks::new(100, 10);
        let t0 = m.start;
        // 10 windows of 10 ops of 1000 bytes; window 3 is twice as fast.
        let mut t = t0;
        for w in 1..=10u64 {
            t += Duration::from_micros(if w == 3 { 5 } else { 10 });
            m.marks.push((w * 10, t));
        }
        let r = m.bw_row("t", None, 1000, 100);
        assert!((r.bw_peak_gb_per_sec - 2.0).abs() < 1e-6, "{r:?}");
        assert!((r.bw_average_gb_per_sec - 100_000.0 / 95e-6 / 1e9).abs() < 1e-6);
    }

    #[test]
    fn bandwidth_peak_ignores_clumped_marks() {
        // 100 ops in 100 us, marked every 10, except that marks 50 and 60 come 10 ns apart.
        let mut m = Marks::new(100, 10);
        let t0 = m.start;
        for w in 1..=10u64 {
            let us = if w == 6 { 50.01 } else { (w * 10) as f64 };
            m.marks
                .push((w * 10, t0 + Duration::from_secs_f64(us / 1e6)));
        }
        let r = m.bw_row("t", None, 1000, 100);
        assert!(r.bw_peak_gb_per_sec < 2.1, "{r:?}");
        assert!((r.bw_average_gb_per_sec - 1.0).abs() < 1e-6, "{r:?}");
    }
}
