//! tonic drops a handler's future when the caller's deadline passes or it disconnects, which
//! would cut a mkfs, a copy or a cloud wait in half. Mutating RPCs therefore run in a task of
//! their own that owns the per-volume lock guard: the work finishes, the lock is released
//! afterwards, a retry arriving meanwhile gets ABORTED, and the first retry after completion
//! finds the finished result (every RPC is idempotent).

use std::future::Future;
use tonic::Status;

pub async fn run_to_completion<T, F>(work: F) -> Result<T, Status>
where
    T: Send + 'static,
    F: Future<Output = Result<T, Status>> + Send + 'static,
{
    match tokio::spawn(work).await {
        Ok(result) => result,
        Err(e) => Err(Status::internal(format!("operation task failed: {e}"))),
    }
}
