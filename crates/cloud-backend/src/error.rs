//! The domain error shared by every layer below gRPC. Each variant names a *kind* of failure
//! that the CSI spec gives its own status code; the mapping to `tonic::Code` lives in exactly
//! one place, `csi_identity::status`.

use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed or asks for something this driver never supports.
    #[error("{0}")]
    InvalidArgument(String),
    /// The named volume, snapshot or node does not exist.
    #[error("{0}")]
    NotFound(String),
    /// A different object already uses the name, or the target is in use incompatibly.
    #[error("{0}")]
    AlreadyExists(String),
    /// The system is not in a state the operation needs (volume in use, device carries data).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The capacity asked for cannot be provided by this backend.
    #[error("{0}")]
    OutOfRange(String),
    /// Out of space or quota, or no room in the requested topology.
    #[error("{0}")]
    ResourceExhausted(String),
    /// Another operation on the same volume or name is in progress; retry later.
    #[error("{0}")]
    Busy(String),
    /// The backend does not implement this operation.
    #[error("{0}")]
    Unsupported(String),
    /// A dependency (cloud API, kernel facility) is temporarily unavailable.
    #[error("{0}")]
    Unavailable(String),
    /// A system call or file operation failed; `context` says what we were doing.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// A helper program (mkfs, blkid, resize2fs…) failed.
    #[error("{program} failed ({status}): {stderr}")]
    Command {
        program: String,
        status: String,
        stderr: String,
    },
    /// The cloud refused the credentials or the permission.
    #[error("{0}")]
    PermissionDenied(String),
    /// State on disk contradicts itself; a person has to look.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    /// The same failure again, for answering several waiters of one shared call. Sources are
    /// flattened into the message.
    pub fn duplicate(&self) -> Error {
        let msg = self.to_string();
        match self {
            Error::InvalidArgument(_) => Error::InvalidArgument(msg),
            Error::NotFound(_) => Error::NotFound(msg),
            Error::AlreadyExists(_) => Error::AlreadyExists(msg),
            Error::FailedPrecondition(_) => Error::FailedPrecondition(msg),
            Error::OutOfRange(_) => Error::OutOfRange(msg),
            Error::ResourceExhausted(_) => Error::ResourceExhausted(msg),
            Error::Busy(_) => Error::Busy(msg),
            Error::Unsupported(_) => Error::Unsupported(msg),
            Error::Unavailable(_) => Error::Unavailable(msg),
            Error::PermissionDenied(_) => Error::PermissionDenied(msg),
            Error::Io { .. } | Error::Command { .. } | Error::Internal(_) => Error::Internal(msg),
        }
    }

    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// Adds a human-readable context to `io::Result`s, turning them into domain errors.
pub trait IoContext<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::io(what(), e))
    }
}
