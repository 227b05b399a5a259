//! Logging through tracing-subscriber to stderr, as text or JSON. The level comes from
//! `RUST_LOG` when set, else from the `--log-level` flag.
//!
//! Requests are never logged whole: prost's Debug output would print CSI secrets. RPC spans
//! use `skip_all` and record chosen fields (volume id, paths) only.

use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(Format::Text),
            "json" => Ok(Format::Json),
            other => Err(format!(
                "unknown log format {other:?} (expected text or json)"
            )),
        }
    }
}

pub fn init(format: Format, level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        Format::Text => builder.try_init(),
        Format::Json => builder.json().flatten_event(true).try_init(),
    };
}
