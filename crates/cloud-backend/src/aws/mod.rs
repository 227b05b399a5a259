//! The `aws` backend: Amazon EBS through aws-sdk-ec2.
//!
//! - Idempotent by name: every volume carries a `CSIVolumeName` tag (and snapshots a
//!   `CSIVolumeSnapshotName` tag) and a cluster tag; CreateVolume looks the name up first and
//!   passes a ClientToken derived from it, so a retry never makes a second volume — also
//!   against emulators that ignore the token, and after the token has expired.
//! - Lookups and waits go through a batcher that coalesces concurrent DescribeVolumes and
//!   DescribeInstances calls into shared ones (up to the API's per-call limits).
//! - Expand and modify of one volume coalesce into a single ModifyVolume (EBS allows one
//!   modification per volume every six hours).
//! - Every EC2 error code becomes a domain error in one place, [`ec2_error`].
//!
//! The node side finds attached volumes through their NVMe links and checks the device's
//! serial; it never calls EC2.

mod batch;
mod coalesce;
mod controller;
mod node;
pub mod params;

pub use controller::{AwsBackend, client_token};
pub use node::{AwsNode, AwsNodeConfig, InstanceMetadata, instance_limits, instance_metadata};

use crate::error::{Error, Result};
use crate::metrics;
use aws_sdk_ec2::error::ProvideErrorMetadata;
use std::time::{Duration, Instant};

/// Tag naming the CSI volume a volume was created for (idempotency key).
pub const VOLUME_NAME_TAG: &str = "CSIVolumeName";
/// Tag naming the CSI snapshot a snapshot was created for.
pub const SNAPSHOT_NAME_TAG: &str = "CSIVolumeSnapshotName";
/// Tag marking what this driver instance manages; lists are filtered by it.
pub const CLUSTER_TAG: &str = "ferrovol.dev/cluster";
/// The standard Kubernetes zone label, used as the topology key.
pub const ZONE_KEY: &str = "topology.kubernetes.io/zone";

#[derive(Debug, Clone)]
pub struct AwsConfig {
    /// Overrides the EC2 endpoint (tests, private clouds, emulators).
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    /// Value of the cluster tag on everything this driver creates.
    pub cluster_id: String,
    /// Zone for volumes whose request names none.
    pub default_zone: Option<String>,
    /// Coalesce concurrent Describe* calls.
    pub batching: bool,
    /// How long a batch waits for company before it is sent.
    pub batch_window: Duration,
    /// How long expand/modify requests wait to be merged into one ModifyVolume. EBS accepts one
    /// modification per volume every six hours, so a second call that misses the window fails
    /// for hours; aws-ebs-csi-driver waits 2 s for the same reason.
    pub modify_window: Duration,
    /// First delay of the polling backoff (CreateVolume, attach, detach waits).
    pub poll_initial: Duration,
    /// An attachment stuck in `attaching` longer than this is detached and retried.
    pub attach_stuck_after: Duration,
    /// Attempts per EC2 call (the SDK's adaptive retry: throttling and 5xx).
    pub max_attempts: u32,
}

impl Default for AwsConfig {
    fn default() -> Self {
        AwsConfig {
            endpoint_url: None,
            region: None,
            cluster_id: "ferrovol".into(),
            default_zone: None,
            batching: true,
            batch_window: Duration::from_millis(50),
            modify_window: Duration::from_secs(2),
            poll_initial: Duration::from_millis(500),
            attach_stuck_after: Duration::from_secs(90),
            max_attempts: 10,
        }
    }
}

/// Builds the EC2 client from the environment (credentials chain, region), with adaptive
/// retries for throttling and server errors, and the endpoint override.
pub async fn ec2_client(cfg: &AwsConfig) -> aws_sdk_ec2::Client {
    use aws_config::retry::RetryConfig;
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .retry_config(
            RetryConfig::adaptive()
                .with_max_attempts(cfg.max_attempts)
                .with_initial_backoff(Duration::from_millis(200)),
        )
        .timeout_config(
            aws_config::timeout::TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(5))
                .operation_attempt_timeout(Duration::from_secs(30))
                .build(),
        );
    if let Some(region) = &cfg.region {
        loader = loader.region(aws_config::Region::new(region.clone()));
    }
    let shared = loader.load().await;
    let mut builder = aws_sdk_ec2::config::Builder::from(&shared);
    if let Some(url) = &cfg.endpoint_url {
        builder = builder.endpoint_url(url);
    }
    aws_sdk_ec2::Client::from_conf(builder.build())
}

/// A per-call override that turns the SDK's retries off. CreateVolume and CreateSnapshot use it:
/// a retry after a lost answer would make a second volume wherever the ClientToken is not
/// honoured (emulators; CreateSnapshot has no token at all), so those calls go out once per
/// attempt and the driver retries them itself, looking the name up in between.
pub(crate) fn without_sdk_retries() -> aws_sdk_ec2::config::Builder {
    aws_sdk_ec2::config::Builder::default().retry_config(aws_config::retry::RetryConfig::disabled())
}

/// Attempts of a create whose failure may be transient (throttling, 5xx, a lost answer).
pub(crate) const CREATE_ATTEMPTS: u32 = 6;

/// The pause before create attempt `attempt` (1-based): exponential from 250 ms, capped at 8 s,
/// with up to 50% jitter so that throttled callers do not come back in step.
pub(crate) fn create_backoff(attempt: u32) -> Duration {
    let base = Duration::from_millis(250) * 2u32.saturating_pow(attempt.saturating_sub(1));
    let base = base.min(Duration::from_secs(8));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    base + base.mul_f64(f64::from(nanos % 1000) / 2000.0)
}

/// Runs one EC2 call, recording its duration, errors and throttles, and maps its error.
pub(crate) async fn call<T, E, R>(
    op: &'static str,
    fut: impl std::future::Future<Output = std::result::Result<T, aws_sdk_ec2::error::SdkError<E, R>>>,
) -> Result<T>
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    let reg = metrics::global();
    reg.inc(
        "ferrovol_cloud_api_requests_total",
        vec![("operation", op.into())],
    );
    let start = Instant::now();
    let res = fut.await;
    reg.observe(
        "ferrovol_cloud_api_request_duration_seconds",
        vec![("operation", op.into())],
        start.elapsed().as_secs_f64(),
    );
    res.map_err(|e| {
        let code = e.code().unwrap_or("transport").to_string();
        if is_throttle(&code) {
            reg.inc(
                "ferrovol_cloud_api_request_throttles_total",
                vec![("operation", op.into())],
            );
        }
        reg.inc(
            "ferrovol_cloud_api_request_errors_total",
            vec![("operation", op.into()), ("code", code)],
        );
        ec2_error(
            op,
            e.code(),
            e.message(),
            &aws_sdk_ec2::error::DisplayErrorContext(&e).to_string(),
        )
    })
}

fn is_throttle(code: &str) -> bool {
    matches!(
        code,
        "RequestLimitExceeded" | "Throttling" | "ThrottlingException" | "RequestThrottled"
    )
}

/// EC2 error codes → domain errors: the one place this mapping is decided.
pub fn ec2_error(op: &str, code: Option<&str>, message: Option<&str>, detail: &str) -> Error {
    let msg = |what: &str| format!("EC2 {op}: {what}: {}", message.unwrap_or(detail));
    let Some(code) = code else {
        return Error::Unavailable(format!("EC2 {op} did not answer: {detail}"));
    };
    let m = msg(code);
    match code {
        // Parameters that name something missing are the caller's mistake, not a missing volume.
        "InvalidZone.NotFound"
        | "InvalidKMSKey.NotFound"
        | "InvalidParameterValue"
        | "InvalidParameter"
        | "InvalidParameterCombination"
        | "MissingParameter"
        | "UnknownVolumeType" => Error::InvalidArgument(m),
        c if c.ends_with(".NotFound") || c.ends_with(".Malformed") => Error::NotFound(m),
        "VolumeInUse"
        | "IncorrectState"
        | "IncorrectInstanceState"
        | "InvalidVolume.ZoneMismatch"
        | "OperationNotPermitted" => Error::FailedPrecondition(m),
        "VolumeLimitExceeded"
        | "AttachmentLimitExceeded"
        | "SnapshotLimitExceeded"
        | "MaxIOPSLimitExceeded"
        | "InsufficientVolumeCapacity"
        | "ResourceLimitExceeded"
        | "VolumeModificationRateExceeded" => Error::ResourceExhausted(m),
        "IdempotentParameterMismatch" => Error::AlreadyExists(m),
        "UnauthorizedOperation" | "AuthFailure" | "Blocked" | "OptInRequired" => {
            Error::PermissionDenied(m)
        }
        c if is_throttle(c) => Error::Unavailable(m),
        "ServiceUnavailable" | "InternalError" | "Unavailable" | "InsufficientInstanceCapacity" => {
            Error::Unavailable(m)
        }
        _ => Error::Internal(m),
    }
}

/// EBS volume ids: `vol-` and 8 or 17 hex digits. Anything else never names a volume.
pub fn is_volume_id(id: &str) -> bool {
    hex_id(id, "vol-")
}

pub fn is_snapshot_id(id: &str) -> bool {
    hex_id(id, "snap-")
}

pub fn is_instance_id(id: &str) -> bool {
    hex_id(id, "i-")
}

fn hex_id(id: &str, prefix: &str) -> bool {
    id.strip_prefix(prefix).is_some_and(|h| {
        (h.len() == 8 || h.len() == 17)
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_map_to_domain_errors() {
        let e = |c: &str| ec2_error("Op", Some(c), Some("m"), "d");
        assert!(matches!(e("InvalidVolume.NotFound"), Error::NotFound(_)));
        assert!(matches!(
            e("InvalidInstanceID.NotFound"),
            Error::NotFound(_)
        ));
        assert!(matches!(e("VolumeInUse"), Error::FailedPrecondition(_)));
        assert!(matches!(e("IncorrectState"), Error::FailedPrecondition(_)));
        assert!(matches!(
            e("VolumeLimitExceeded"),
            Error::ResourceExhausted(_)
        ));
        assert!(matches!(
            e("AttachmentLimitExceeded"),
            Error::ResourceExhausted(_)
        ));
        assert!(matches!(
            e("InvalidParameterValue"),
            Error::InvalidArgument(_)
        ));
        assert!(matches!(
            e("IdempotentParameterMismatch"),
            Error::AlreadyExists(_)
        ));
        assert!(matches!(e("RequestLimitExceeded"), Error::Unavailable(_)));
        assert!(matches!(
            e("UnauthorizedOperation"),
            Error::PermissionDenied(_)
        ));
        assert!(matches!(e("SomethingNew"), Error::Internal(_)));
        assert!(matches!(
            ec2_error("Op", None, None, "connection refused"),
            Error::Unavailable(_)
        ));
        assert!(e("VolumeInUse").to_string().contains("EC2 Op"));
    }

    #[test]
    fn ids_are_allow_listed() {
        assert!(is_volume_id("vol-0123456789abcdef0"));
        assert!(is_volume_id("vol-01234567"));
        assert!(!is_volume_id("vol-0123456789abcdef"));
        assert!(!is_volume_id("vol-../../etc"));
        assert!(!is_volume_id("fake-vol-id"));
        assert!(is_instance_id("i-0123456789abcdef0"));
        assert!(is_snapshot_id("snap-0123456789abcdef0"));
    }
}
