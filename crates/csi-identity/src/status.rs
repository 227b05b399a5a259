//! Domain errors → gRPC status codes. This is the only place in ferrovol where that mapping is
//! decided; every service calls [`to_status`].

use cloud_backend::Error;
use tonic::{Code, Status};

pub fn to_status(err: Error) -> Status {
    let code = match &err {
        Error::InvalidArgument(_) => Code::InvalidArgument,
        Error::NotFound(_) => Code::NotFound,
        Error::AlreadyExists(_) => Code::AlreadyExists,
        Error::FailedPrecondition(_) => Code::FailedPrecondition,
        Error::OutOfRange(_) => Code::OutOfRange,
        Error::ResourceExhausted(_) => Code::ResourceExhausted,
        Error::Busy(_) => Code::Aborted,
        Error::Unsupported(_) => Code::Unimplemented,
        Error::Unavailable(_) => Code::Unavailable,
        Error::PermissionDenied(_) => Code::PermissionDenied,
        Error::Io { .. } | Error::Command { .. } | Error::Internal(_) => Code::Internal,
    };
    if code == Code::Internal {
        tracing::error!(error = %err, "internal error");
    }
    Status::new(code, err.to_string())
}

/// Shorthand for the many argument checks at the top of each RPC.
pub fn invalid(msg: impl Into<String>) -> Status {
    to_status(Error::InvalidArgument(msg.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_is_aborted_and_messages_survive() {
        let s = to_status(Error::Busy(
            "another operation on vol-1 is in progress".into(),
        ));
        assert_eq!(s.code(), Code::Aborted);
        assert!(s.message().contains("vol-1"));
        let io = Error::io(
            "opening /x",
            std::io::Error::from_raw_os_error(libc::EACCES),
        );
        assert_eq!(to_status(io).code(), Code::Internal);
    }
}
