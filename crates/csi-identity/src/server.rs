//! Serving a plugin on a Unix socket: the stale-socket dance, mode 0600, gRPC health, and a
//! clean shutdown on SIGTERM or SIGINT. Also the client side used by tests and tools.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

/// Parses a CSI endpoint; only `unix://` sockets are served (kubelet and the sidecars speak
/// gRPC over Unix sockets, and a TCP listener would expose the plugin to the network).
pub fn socket_path(endpoint: &str) -> Result<PathBuf, String> {
    let path = endpoint.strip_prefix("unix://").ok_or_else(|| {
        format!("endpoint {endpoint:?} must start with unix:// (e.g. unix:///csi/csi.sock)")
    })?;
    if !path.starts_with('/') {
        return Err(format!(
            "endpoint {endpoint:?} must name an absolute path (unix:///…)"
        ));
    }
    Ok(PathBuf::from(path))
}

/// Binds the socket. A leftover socket from a crashed predecessor is removed; a socket that
/// still answers belongs to a live instance and is left alone (binding fails instead).
pub async fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if !md.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; refusing to remove it",
                    path.display()
                ),
            ));
        }
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is served by a running process", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    // The socket is created with mode 0600 from the start (umask), so there is no window in
    // which another user could connect.
    // SAFETY: umask only changes this process's file creation mask.
    let old = unsafe { libc::umask(0o177) };
    let listener = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = listener?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

pub fn incoming(listener: UnixListener) -> UnixListenerStream {
    UnixListenerStream::new(listener)
}

/// Resolves when the process receives SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; the plugin will only stop when killed");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
    }
}

/// A gRPC channel over a Unix socket, for tests and tools (`unix:///path` or a bare path).
pub async fn connect(endpoint: &str) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = endpoint
        .strip_prefix("unix://")
        .unwrap_or(endpoint)
        .to_string();
    tonic::transport::Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_must_be_absolute_unix_sockets() {
        assert_eq!(
            socket_path("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert!(socket_path("tcp://0.0.0.0:1").is_err());
        assert!(socket_path("unix://relative.sock").is_err());
    }

    #[tokio::test]
    async fn stale_socket_is_replaced_and_live_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let first = bind(&path).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(
            bind(&path).await.is_err(),
            "a live socket must not be stolen"
        );
        drop(first);
        bind(&path)
            .await
            .expect("a dead socket is stale and gets replaced");
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"not a socket").unwrap();
        assert!(
            bind(&path).await.is_err(),
            "a regular file is never removed"
        );
    }
}
