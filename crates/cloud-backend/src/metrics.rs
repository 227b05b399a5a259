//! A small Prometheus registry: counters and histograms with labels, rendered in the text
//! exposition format. Small enough to own, and it keeps a metrics library (and its build time)
//! out of the driver. The plugins serve it on `--metrics-address` when asked.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Mutex, OnceLock};

const BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

type Labels = Vec<(&'static str, String)>;

#[derive(Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Default)]
pub struct Registry {
    counters: Mutex<BTreeMap<(&'static str, Labels), u64>>,
    histograms: Mutex<BTreeMap<(&'static str, Labels), Histogram>>,
    gauges: Mutex<BTreeMap<(&'static str, Labels), f64>>,
}

pub fn global() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(Registry::default)
}

fn help(name: &str) -> &'static str {
    match name {
        "ferrovol_cloud_api_request_duration_seconds" => {
            "Duration of cloud API requests, by operation (after SDK retries)."
        }
        "ferrovol_cloud_api_request_errors_total" => {
            "Cloud API requests that failed, by operation and error code."
        }
        "ferrovol_cloud_api_request_throttles_total" => {
            "Cloud API requests throttled (RequestLimitExceeded), by operation."
        }
        "ferrovol_cloud_api_requests_total" => "Cloud API requests sent, by operation.",
        "ferrovol_cloud_healthy" => {
            "1 when the last background check of the cloud API succeeded, else 0."
        }
        "ferrovol_csi_operation_duration_seconds" => {
            "Duration of CSI RPCs, by method and gRPC code."
        }
        _ => "ferrovol metric.",
    }
}

impl Registry {
    pub fn inc(&self, name: &'static str, labels: Labels) {
        *self
            .counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((name, labels))
            .or_default() += 1;
    }

    pub fn set(&self, name: &'static str, labels: Labels, v: f64) {
        self.gauges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((name, labels), v);
    }

    pub fn observe(&self, name: &'static str, labels: Labels, seconds: f64) {
        let mut h = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
        let entry = h.entry((name, labels)).or_default();
        if entry.counts.is_empty() {
            entry.counts = vec![0; BUCKETS.len()];
        }
        for (i, b) in BUCKETS.iter().enumerate() {
            if seconds <= *b {
                entry.counts[i] += 1;
            }
        }
        entry.sum += seconds;
        entry.count += 1;
    }

    /// The value of a counter, for tests and the benchmark.
    pub fn counter(&self, name: &str, label: (&str, &str)) -> u64 {
        self.counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|((n, l), _)| {
                *n == name && l.iter().any(|(k, v)| *k == label.0 && v == label.1)
            })
            .map(|(_, v)| *v)
            .sum()
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let fmt_labels = |l: &Labels, extra: Option<(&str, String)>| -> String {
            let mut parts: Vec<String> = l
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
                .collect();
            if let Some((k, v)) = extra {
                parts.push(format!("{k}=\"{v}\""));
            }
            if parts.is_empty() {
                String::new()
            } else {
                format!("{{{}}}", parts.join(","))
            }
        };
        let mut last = "";
        for ((name, labels), v) in self
            .counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            if *name != last {
                let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} counter", help(name));
                last = name;
            }
            let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels, None));
        }
        for ((name, labels), v) in self.gauges.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            if *name != last {
                let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} gauge", help(name));
                last = name;
            }
            let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels, None));
        }
        for ((name, labels), h) in self
            .histograms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            if *name != last {
                let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} histogram", help(name));
                last = name;
            }
            for (i, b) in BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}_bucket{} {}",
                    fmt_labels(labels, Some(("le", b.to_string()))),
                    h.counts[i]
                );
            }
            let _ = writeln!(
                out,
                "{name}_bucket{} {}",
                fmt_labels(labels, Some(("le", "+Inf".into()))),
                h.count
            );
            let _ = writeln!(out, "{name}_sum{} {}", fmt_labels(labels, None), h.sum);
            let _ = writeln!(out, "{name}_count{} {}", fmt_labels(labels, None), h.count);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_text_format() {
        let r = Registry::default();
        r.inc(
            "ferrovol_cloud_api_requests_total",
            vec![("operation", "CreateVolume".into())],
        );
        r.inc(
            "ferrovol_cloud_api_requests_total",
            vec![("operation", "CreateVolume".into())],
        );
        r.observe(
            "ferrovol_cloud_api_request_duration_seconds",
            vec![("operation", "CreateVolume".into())],
            0.02,
        );
        let text = r.render();
        assert!(
            text.contains("ferrovol_cloud_api_requests_total{operation=\"CreateVolume\"} 2"),
            "{text}"
        );
        assert!(text.contains("# TYPE ferrovol_cloud_api_request_duration_seconds histogram"));
        assert!(text.contains("ferrovol_cloud_api_request_duration_seconds_bucket{operation=\"CreateVolume\",le=\"0.025\"} 1"));
        assert!(text.contains("ferrovol_cloud_api_request_duration_seconds_bucket{operation=\"CreateVolume\",le=\"0.01\"} 0"));
        assert_eq!(
            r.counter(
                "ferrovol_cloud_api_requests_total",
                ("operation", "CreateVolume")
            ),
            2
        );
    }
}
